"""Quality benchmark: every arm (a mode, an ablation or a sweep point) answers the same requests
in the same order from its own empty chunk store, compared request by request with `full`.

Logits are compared as soon as an arm has answered and then dropped (vocabularies are large).
Aggregation into the report schema lives in `quality_summary.py`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from cachecraft.api import (
    LLM,
    Answer,
    EngineConfig,
    LoadedModel,
    MemoryStore,
    ReuseStrategy,
    SamplingParams,
    make_store,
)
from cachecraft.config import ReuseConfig
from cachecraft.errors import BadRequestError
from cachecraft.store.base import ChunkStore
from cachecraft.store.config import StoreConfig
from cachecraft_bench.flops import ModelShape
from cachecraft_bench.item import WorkloadItem
from cachecraft_bench.matching import (
    Budgets,
    Source,
    answer_at_flops,
    answer_flops,
    cost_beyond_rows,
    token_budgets,
)
from cachecraft_bench.metrics import (
    contains_answer,
    exact_match,
    kl_divergence,
    rouge_l,
    token_f1,
)
from cachecraft_bench.modes import LAB_MODES
from cachecraft_bench.quality_summary import summarize_results
from cachecraft_bench.strategies import arm_settings

log = logging.getLogger(__name__)

DEFAULT_STORE_BYTES = 1 << 30
ONE_AT_A_TIME = EngineConfig(max_running=1)
"""Every arm answers one request at a time: a KV pool of one slot (the default pool has 16,
all grown to the longest prompt seen, per arm: runs of 9 arms filled the 24 GiB machine)."""
MATCHED_MODES: tuple[str, ...] = ("random", "cacheblend", "epic", "prophet")
"""Modes that take cachecraft's per-request recompute budgets under `match_budget`."""

SWEEP_GRID: dict[str, tuple[str, str, tuple[float, ...]]] = {
    "cachecraft": ("alpha", "alpha", (0.1, 0.25, 0.5, 1.0, 2.0)),
    "cachecraft-paper": ("alpha", "alpha", (0.1, 0.25, 0.5, 1.0, 2.0)),
    "prophet": ("prophet_ratio", "ratio", (0.05, 0.1, 0.2, 0.3, 0.5)),
    "cacheblend": ("cacheblend_ratio", "ratio", (0.05, 0.15, 0.3, 0.5)),
    "epic": ("epic_k", "k", (8, 16, 32, 64)),
}
"""mode -> (setting: a ReuseConfig field or the strategy's parameter, short name, values).
`random` sweeps with cachecraft's alphas, at the budgets of the cachecraft point of the same
alpha."""

ABLATIONS: dict[str, dict[str, Any]] = {
    # settings (llm.split_settings: the strategy's parameters, ReuseConfig, the arm's store)
    "cachecraft-need": {"probe_split": "need"},
    "cachecraft-no-check": {"probe_check": 0.0},
    "cachecraft-check-deviation": {"probe_check_score": "deviation"},
    "cachecraft-check-product": {"probe_check_power": 1.0},
    "cachecraft-check-sqrt": {"probe_check_power": 0.5},
    "cachecraft-check-all": {"probe_check": 1000.0},
    "cachecraft-check-layer1": {"probe_check_layer": 1},
    "cachecraft-chunk": {"probe_split": "chunk"},
    "cachecraft-blend": {"probe_blend": 1.0},
    "cachecraft-late-layers": {"probe_first_layer": 10},
    "cachecraft-short-probe": {"probe_depth": 1 / 3},
    "cachecraft-half-probe": {"probe_depth": 0.5},
    "cachecraft-full-probe": {"probe_depth": 1.0},
    "cachecraft-no-sink": {"probe_sink": 0},
    "cachecraft-every-row": {"probe_last_row": 0.0},
    "cachecraft-last-row": {"probe_last_row": 1.0},
    "cachecraft-always-probe": {"probe_max_cost": None},
    "cachecraft-probe-at-budget": {"probe_max_cost": 1.0},
    "cachecraft-skip-at-budget": {"probe_trim": False, "probe_skip_share": 0.0},
    "cachecraft-no-trim": {"probe_trim": False},
    "cachecraft-trim-save": {"probe_skip_share": 0.0},
    "cachecraft-refresh": {"refresh_error": 0.75},
    "cachecraft-no-inherit": {"inherit_error": False},
    "cachecraft-beta-paper": {"beta_rule": "paper"},
    "cachecraft-no-order": {"use_order_penalty": False},
    "cachecraft-one-variant": {"max_variants_per_chunk": 1},
    "cachecraft-empty-paper": {"empty_s_old": "paper"},
    "cachecraft-stats-all": {"stats_stride": 1},
    "cacheblend-global": {"cacheblend_global": True},
}
"""Arm name -> settings changed. cachecraft-*: one choice of the default changed each;
cacheblend-global: CacheBlend picking its top tokens across chunks (at cachecraft's budget).
A matched mode or ablation named with the suffix FLOPS_SUFFIX ("epic-flops",
"cacheblend-global-flops") takes cachecraft's budgets at equal FLOPs by position instead of
equal token-layers."""
FLOPS_SUFFIX = "-flops"


@dataclass(frozen=True, slots=True)
class Arm:
    """One benchmark column: `strategy` (named `mode`, with the arm's parameters) run with
    `config` over its own store.

    budget_from: the cachecraft arm whose per-request budgets this arm takes (None: its own).
    match: "tokens": as many token-layers as that arm (its probe's rows and its check's
    stopped candidates included); "flops": as many FLOPs by position, within
    `matching.MATCH_TOLERANCE` (`matching.py`).
    sweep: (mode, parameter value) when the arm is a sweep point.
    """

    name: str
    mode: str
    strategy: ReuseStrategy
    config: ReuseConfig
    budget_from: str | None = None
    sweep: tuple[str, float] | None = None
    match: Literal["tokens", "flops"] = "tokens"
    max_variants_per_chunk: int = StoreConfig().max_variants_per_chunk
    """The arm's store setting (StoreConfig.max_variants_per_chunk)."""


@dataclass(slots=True)
class _ArmRun:
    arm: Arm
    llm: LLM
    records: list[dict[str, Any]] = field(default_factory=list)


def mode_of(name: str) -> str:
    """The mode behind an arm name: "epic", "cachecraft-global", "random@alpha=0.5" -> its mode."""
    for mode in sorted(LAB_MODES, key=len, reverse=True):
        if name == mode or name.startswith((f"{mode}-", f"{mode}@")):
            return mode
    raise BadRequestError(
        f"unknown mode {name!r}; choose from {', '.join(LAB_MODES)} or an ablation "
        f"({', '.join(ABLATIONS)})"
    )


def _sweep_arms(
    modes: Sequence[str],
    base: ReuseConfig,
    grid: Mapping[str, Sequence[float]],
    match_budget: bool,
    seed: int,
) -> list[Arm]:
    arms = []
    for mode, values in grid.items():
        if mode == "random":  # follows cachecraft's alphas (below)
            continue
        if mode not in SWEEP_GRID:
            known = ", ".join([*SWEEP_GRID, "random"])
            raise BadRequestError(f"no sweep for mode {mode!r}; sweepable: {known}")
        if mode not in modes:
            continue
        fld, short, _ = SWEEP_GRID[mode]
        for v in values:
            value = int(v) if fld == "epic_k" else float(v)
            strategy, cfg, _ = arm_settings(mode, {fld: value}, base, seed)
            name = f"{mode}@{short}={v:g}"
            arms.append(Arm(name, mode, strategy, cfg, None, (mode, float(v))))
    if "random" in modes and "cachecraft" in modes:
        for a in grid.get("cachecraft", ()):
            src = f"cachecraft@alpha={a:g}" if match_budget else None
            strategy, cfg, _ = arm_settings("random", {"alpha": float(a)}, base, seed)
            point = ("random", float(a))
            arms.append(Arm(f"random@alpha={a:g}", "random", strategy, cfg, src, point))
    return arms


def build_arms(
    modes: Sequence[str],
    base: ReuseConfig | None = None,
    *,
    configs: Mapping[str, Mapping[str, Any]] | None = None,
    match_budget: bool = True,
    ablations: bool = False,
    sweep: bool | Mapping[str, Sequence[float]] = False,
    include_base: bool = True,
    seed: int = 0,
) -> list[Arm]:
    """The arms to run, `full` first, then every cachecraft arm, then the rest.

    modes: mode or arm names (ablation names and "mode-anything" names with a `configs` entry
    are accepted). configs: arm name -> its settings changed (ReuseConfig fields, its
    strategy's parameters, its store's max_variants_per_chunk), instead of an ablation's.
    Under `match_budget`, random/cacheblend/epic take the budgets of the arm "cachecraft",
    which is added when missing. sweep: True for SWEEP_GRID, or mode -> values.
    include_base=False keeps only `full` and the sweep points (calibration). seed: the
    random baseline's.
    """
    base = base or ReuseConfig()
    configs = dict(configs or {})
    names = list(dict.fromkeys(["full", *modes, *(ABLATIONS if ablations else ())]))
    picked = [mode_of(n) for n in names]
    needs_source = any(m in MATCHED_MODES for m in picked)
    if match_budget and include_base and needs_source and "cachecraft" not in names:
        log.info("adding arm 'cachecraft': random/cacheblend/epic take its budgets")
        names.append("cachecraft")
    arms: list[Arm] = []
    if include_base:
        for name in names:
            mode = mode_of(name)
            flops = name.endswith(FLOPS_SUFFIX) and mode in MATCHED_MODES and match_budget
            plain = name.removesuffix(FLOPS_SUFFIX) if flops else name
            changes = configs.get(name, ABLATIONS.get(plain, {}))
            strategy, cfg, store_fields = arm_settings(mode, changes, base, seed)
            src = "cachecraft" if match_budget and mode in MATCHED_MODES else None
            match = "flops" if flops else "tokens"
            arms.append(Arm(name, mode, strategy, cfg, src, match=match, **store_fields))
    else:
        strategy, cfg, _ = arm_settings("full", configs.get("full", {}), base, seed)
        arms.append(Arm("full", "full", strategy, cfg))
    if sweep:
        grid = {m: v[2] for m, v in SWEEP_GRID.items()} if sweep is True else dict(sweep)
        arms += _sweep_arms([mode_of(n) for n in names], base, grid, match_budget, seed)
    arms.sort(key=lambda a: (a.mode != "full", a.mode != "cachecraft"))  # stable
    seen = {a.name for a in arms}
    if len(seen) != len(arms):
        raise BadRequestError("an arm name appears twice")
    for a in arms:
        if a.budget_from is not None and a.budget_from not in seen:
            raise BadRequestError(f"arm {a.name} takes budgets from {a.budget_from}, not run")
    return arms


def _compare(item: WorkloadItem, ref: Answer, got: Answer, shape: ModelShape) -> dict[str, Any]:
    """One arm's numbers on one request; `ref` is the full-recompute answer."""
    assert ref.forced_logits is not None and got.forced_logits is not None
    report = got.report
    # probe_fraction: the probe's cost in full-depth rows (rows x share of layers run)
    agree = ref.forced_logits.argmax(-1) == got.forced_logits.argmax(-1)
    chunks = report.chunks
    hit_tokens = sum(c.num_tokens for c in chunks if c.is_hit)
    hit_done = sum(c.tokens_recomputed for c in chunks if c.is_hit)
    return {
        "id": item.id,
        "text": got.text,
        "computed_fraction": report.computed_fraction,
        "token_layers_fraction": report.layer_fraction + report.probe_fraction,
        "flops_fraction": answer_flops(got, shape),
        "reused_recompute_fraction": hit_done / hit_tokens if hit_tokens else None,
        "probe_fraction": report.probe_fraction,
        "ttft_ms": report.ttft_ms,
        "chunk_hit_rate": sum(c.is_hit for c in chunks) / len(chunks) if chunks else None,
        "rouge_l": rouge_l(got.text, ref.text),
        "first_token_kl": kl_divergence(ref.first_logits, got.first_logits),
        "tf_kl": kl_divergence(ref.forced_logits, got.forced_logits),
        "tf_agreement": float(agree.float().mean()),
        "f1": token_f1(got.text, item.answers) if item.answers else None,
        "em": exact_match(got.text, item.answers) if item.answers else None,
        "contains": contains_answer(got.text, item.answers) if item.answers else None,
        "chunks": [
            {"reason": c.reason, "tokens": c.num_tokens, "recomputed": c.tokens_recomputed}
            for c in chunks
        ],  # the plan per chunk, for request-level study (summaries leave it out)
    }


def _attempt(
    llm: LLM,
    item: WorkloadItem,
    sampling: SamplingParams,
    strategy: ReuseStrategy,
    forced: list[int] | None,
    budgets: Budgets | None,
    commit: bool,
) -> Answer:
    return llm.answer(
        item.request, sampling, strategy, budgets=budgets, forced=forced, commit=commit
    )


def _run_request(
    runs: list[_ArmRun],
    item: WorkloadItem,
    sampling: SamplingParams,
    shape: ModelShape,
    measure: bool,
) -> None:
    """All arms on one request; measure False means warm-up (fill the caches only)."""
    full, *others = runs
    ref = full.llm.answer(item.request, sampling, "full", force_answer=measure)
    sources: dict[str, Source] = {}  # cachecraft arm -> what the arms matched to it take
    for run in others:
        arm = run.arm
        forced = ref.token_ids if measure else None

        attempt = partial(_attempt, run.llm, item, sampling, arm.strategy, forced)

        trials = 1
        source = sources.get(arm.budget_from) if arm.budget_from else None
        if source is None:
            got = attempt(None, True)
        else:
            given = token_budgets(arm.mode, arm.strategy, source, shape.num_layers)
            if measure and arm.match == "flops":
                got, trials = answer_at_flops(attempt, arm.mode, given, source, shape)
            else:
                got = attempt(given, True)
        if arm.mode == "cachecraft":
            extra = cost_beyond_rows(got, shape.num_layers)
            sources[arm.name] = Source(got, extra, answer_flops(got, shape))
        if measure:
            run.records.append({**_compare(item, ref, got, shape), "answers_tried": trials})
        del got
    if measure:
        full.records.append(_compare(item, ref, ref, shape))


def _arm_store(arm: Arm, index: int, nbytes: int, config: StoreConfig | None) -> ChunkStore:
    if config is None:
        return MemoryStore(nbytes, arm.max_variants_per_chunk)
    where = str(Path(config.cache_dir) / f"arm{index}") if config.cache_dir else None
    cap = arm.max_variants_per_chunk
    return make_store(replace(config, cache_dir=where, max_variants_per_chunk=cap))


def _shared_warmup(
    loaded: LoadedModel,
    items: Sequence[WorkloadItem],
    runs: Sequence[_ArmRun],
    store_bytes: int,
    bar: tqdm,
) -> None:
    """Compute every chunk of `items` in full in its context once and offer the variants to
    every run; once per statistics stride among the runs (it changes what the metadata hold)."""
    strides = sorted({run.arm.config.stats_stride for run in runs})
    for n, stride in enumerate(strides):
        seed = LLM(
            loaded,
            store=MemoryStore(store_bytes, StoreConfig().max_variants_per_chunk),
            config=ReuseConfig(stats_stride=stride),
            engine=ONE_AT_A_TIME,
        )
        for item in items:
            bar.set_postfix_str("shared warm-up")
            seed.warm(item.request)
            if n == 0:
                bar.update()
        for run in runs:
            if run.arm.config.stats_stride != stride:
                continue
            for variant_id in seed.store.variant_ids():
                variant = seed.store.load(variant_id)
                if variant is not None:
                    run.llm.store.offer(variant)


def run_arms(
    loaded: LoadedModel,
    items: Sequence[WorkloadItem],
    arms: Sequence[Arm],
    *,
    warmup: int = 20,
    max_tokens: int = 32,
    store_bytes: int = DEFAULT_STORE_BYTES,
    progress: bool = True,
    shared_warmup: bool = False,
    store_config: StoreConfig | None = None,
) -> dict[str, tuple[list[dict[str, Any]], ChunkStore]]:
    """Run `arms` (full first) over `items`; the first `warmup` requests only fill the caches.
    Returns arm name -> (per-request records, its store).

    shared_warmup: instead of every arm answering the warm-up requests itself, compute them
    once with every chunk in full in its real context and give each arm the same variants
    (arms then start from the same warm caches; warm-up costs one arm instead of all).
    store_config: give each arm a tiered store like this one (its cache_dir gets one
    sub-directory per arm) instead of an in-memory store, e.g. disk-only with int8 K/V.
    """
    if not arms or arms[0].mode != "full":
        raise BadRequestError("the first arm must be 'full' (the reference)")
    if warmup < 0 or max_tokens < 1:
        raise BadRequestError("warmup must be >= 0 and max_tokens >= 1")
    if len(items) <= warmup:
        raise BadRequestError(
            f"{len(items)} requests with warmup {warmup} leaves nothing to measure"
        )
    runs = []
    for i, arm in enumerate(arms):
        store = _arm_store(arm, i, store_bytes, store_config)
        llm = LLM(loaded, store=store, config=arm.config, engine=ONE_AT_A_TIME)
        runs.append(_ArmRun(arm, llm))
    shape = ModelShape.from_config(loaded.hf_config)
    warm = SamplingParams(max_tokens=1)
    sampling = SamplingParams(max_tokens=max_tokens)
    bar = tqdm(total=len(items), desc="bench quality", file=sys.stderr, disable=not progress)
    with torch.inference_mode(), bar:
        if shared_warmup and warmup:
            _shared_warmup(loaded, items[:warmup], runs[1:], store_bytes, bar)
        for i, item in enumerate(items):
            if shared_warmup and i < warmup:
                continue
            bar.set_postfix_str("warm-up" if i < warmup else item.id[:24])
            if i < warmup:
                _run_request(runs, item, warm, shape, measure=False)
            else:
                _run_request(runs, item, sampling, shape, measure=True)
            bar.update()
    return {r.arm.name: (r.records, r.llm.store) for r in runs}


def run_quality(
    loaded: LoadedModel,
    items: Sequence[WorkloadItem],
    modes: Sequence[str] = LAB_MODES,
    *,
    warmup: int = 20,
    match_budget: bool = True,
    max_tokens: int = 32,
    configs: Mapping[str, Mapping[str, Any]] | None = None,
    base: ReuseConfig | None = None,
    ablations: bool = False,
    sweep: bool | Mapping[str, Sequence[float]] = False,
    include_base: bool = True,
    progress: bool = True,
    workload: str = "workload",
    store_bytes: int = DEFAULT_STORE_BYTES,
    shared_warmup: bool = False,
    store_config: StoreConfig | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Benchmark `modes` (see `build_arms`) on `items`; returns the report-schema dict
    (bench/report.py) with per-request records under workloads[workload]["requests"].

    base: the ReuseConfig of every arm; configs: arm name -> its own settings changed.
    Every arm starts from an empty store; the first `warmup` requests are left out.
    """
    base = base or ReuseConfig()
    arms = build_arms(
        modes,
        base,
        configs=configs,
        match_budget=match_budget,
        ablations=ablations,
        sweep=sweep,
        include_base=include_base,
        seed=seed,
    )
    log.info("bench quality: %d arms, %d requests (%d warm-up)", len(arms), len(items), warmup)
    out = run_arms(
        loaded,
        items,
        arms,
        warmup=warmup,
        max_tokens=max_tokens,
        store_bytes=store_bytes,
        progress=progress,
        shared_warmup=shared_warmup,
        store_config=store_config,
    )
    config = {
        "model": loaded.name,
        "workload": workload,
        "arms": [a.name for a in arms],
        "requests": len(items),
        "warmup": warmup,
        "shared_warmup": shared_warmup,
        "store": asdict(store_config) if store_config else "memory",
        "store_bytes": store_bytes,
        "match_budget": match_budget,
        "max_tokens": max_tokens,
        "reuse": asdict(base),
        "seed": seed,
    }
    return {"config": config, "workloads": {workload: summarize_results(arms, out)}}


def run_sweep(
    loaded: LoadedModel,
    items: Sequence[WorkloadItem],
    grid: Mapping[str, Sequence[float]] | None = None,
    **kw: Any,
) -> dict[str, list[dict[str, Any]]]:
    """Only the sweep points (plus `full`): mode -> [{"param", "computed_fraction", "tf_kl",
    "rouge_l", ...}] for the modes of `grid` (default SWEEP_GRID; random follows cachecraft)."""
    grid = dict(grid) if grid is not None else {m: v[2] for m, v in SWEEP_GRID.items()}
    modes = [*grid, "random"] if "cachecraft" in grid else list(grid)
    res = run_quality(loaded, items, modes, sweep=grid, include_base=False, **kw)
    return next(iter(res["workloads"].values()))["sweep"]
