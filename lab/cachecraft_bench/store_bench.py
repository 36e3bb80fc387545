"""Store benchmark: a Zipf chunk trace with a flood of novel one-off chunks in the middle, run
through the real TieredStore (memory tier, tiny fake tensors) for each eviction policy.

Owns the trace, the simulated CFO model and the figures (hit rate, prompt tokens computed per
phase); never touches a model. `time_loads` is the hook for the TTFT-by-tier measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

from cachecraft.api import Variant, VariantMeta, make_store
from cachecraft.store.base import ChunkStore
from cachecraft.store.config import StoreConfig

PHASES = ("before", "flood", "after")
BYTES_PER_TOKEN = 4  # fake K+V: 1 layer x 1 head x head_dim 1 x fp16 x 2


@dataclass(frozen=True, slots=True)
class TraceConfig:
    num_chunks: int = 1000
    hot_fraction: float = 0.05
    hot_mass: float = 0.60
    hot_mass_per: Literal["request", "chunk"] = "request"
    """'request': a request holds at least one top-`hot_fraction` chunk with probability
    `hot_mass` (the paper's "top 5% of chunks serve 60% of requests"); 'chunk': that share of
    all chunk draws goes to the top chunks (a far more skewed trace)."""
    chunks_per_request: int = 5
    min_tokens: int = 128
    max_tokens: int = 512
    requests_per_phase: int = 1000
    flood_novel_fraction: float = 0.8
    """During the flood, each chunk slot is a never-seen-again chunk with this probability."""
    capacity_fraction: float = 0.2
    seed: int = 0


@dataclass(slots=True)
class PhaseResult:
    lookups: int = 0
    hits: int = 0
    tokens_total: int = 0
    tokens_computed: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "hit_rate": round(self.hit_rate, 4),
            "tokens_computed": self.tokens_computed,
            "tokens_total": self.tokens_total,
        }


@dataclass(slots=True)
class PolicyResult:
    phases: dict[str, PhaseResult] = field(
        default_factory=lambda: {p: PhaseResult() for p in PHASES}
    )

    def as_dict(self) -> dict[str, object]:
        lookups = sum(p.lookups for p in self.phases.values())
        hits = sum(p.hits for p in self.phases.values())
        return {
            "hit_rate": round(hits / lookups, 4) if lookups else 0.0,
            "tokens_computed": sum(p.tokens_computed for p in self.phases.values()),
            "tokens_total": sum(p.tokens_total for p in self.phases.values()),
            "phases": {name: p.as_dict() for name, p in self.phases.items()},
        }


def zipf_exponent(n: int, top: int, mass: float) -> float:
    """Exponent s such that the top `top` of n Zipf(s) ranks hold `mass` of the probability."""
    lo, hi = 0.0, 4.0
    for _ in range(60):
        s = (lo + hi) / 2
        w = [r**-s for r in range(1, n + 1)]
        if sum(w[:top]) / sum(w) < mass:
            lo = s
        else:
            hi = s
    return (lo + hi) / 2


def make_trace(cfg: TraceConfig) -> list[tuple[str, list[str]]]:
    """(phase, chunk keys) per request; chunk keys are distinct within a request."""
    rng = random.Random(cfg.seed)
    mass = cfg.hot_mass
    if cfg.hot_mass_per == "request":  # P(no hot chunk among k draws) = (1 - q)^k
        mass = 1.0 - (1.0 - cfg.hot_mass) ** (1.0 / cfg.chunks_per_request)
    top = max(1, round(cfg.hot_fraction * cfg.num_chunks))
    s = zipf_exponent(cfg.num_chunks, top, mass)
    weights = [r**-s for r in range(1, cfg.num_chunks + 1)]
    keys = [f"c{r}" for r in range(cfg.num_chunks)]
    trace: list[tuple[str, list[str]]] = []
    novel = 0
    for phase in PHASES:
        for _ in range(cfg.requests_per_phase):
            chosen: list[str] = []
            while len(chosen) < cfg.chunks_per_request:
                if phase == "flood" and rng.random() < cfg.flood_novel_fraction:
                    chosen.append(f"n{novel}")
                    novel += 1
                    continue
                key = rng.choices(keys, weights)[0]
                if key not in chosen:
                    chosen.append(key)
            trace.append((phase, chosen))
    return trace


def _fake_variant(chunk_key: str, num_tokens: int) -> Variant:
    meta = VariantMeta(
        chunk_key=chunk_key,
        prefix_key="bench",
        s_old=(),
        s_old_sizes=(),
        num_tokens=num_tokens,
        num_layers=1,
        inter=(),
        intra=(0.5,),
        token_scores=(0.0,) * num_tokens,
        cci=0.6,
    )
    kv = torch.zeros((1, 1, num_tokens, 1), dtype=torch.float16)
    return Variant(meta, kv, kv.clone())  # separate tensors: the disk tier saves both


def run_policy(
    trace: list[tuple[str, list[str]]],
    tokens: dict[str, int],
    cfo: dict[str, float],
    store_config: StoreConfig,
    tier_stats: dict[str, object] | None = None,
) -> PolicyResult:
    """Replay `trace` through a fresh store; `tier_stats`, when given, receives its final
    StoreStats (hits per tier, admitted, bytes per tier) as a dict."""
    store = make_store(store_config)
    result = PolicyResult()
    for phase, chunks in trace:
        res = result.phases[phase]
        for key in chunks:
            n = tokens[key]
            res.lookups += 1
            res.tokens_total += n
            metas = store.variants(key)
            if metas and store.load(metas[0].variant_id) is not None:
                store.record_hit(metas[0].variant_id, cfo[key])
                res.hits += 1
                res.tokens_computed += math.ceil(cfo[key] * n)
            else:
                store.record_miss(key)
                res.tokens_computed += n
                store.offer(_fake_variant(key, n))
    if tier_stats is not None:
        st = store.stats()
        tier_stats.update(
            hits=dict(st.hits), admitted=st.admitted, nbytes=dict(st.nbytes),
            rejected=dict(st.rejected),
        )  # fmt: skip
    store.close()
    return result


def run_first_sight(cfg: TraceConfig | None = None) -> dict[str, object]:
    """Admission when disk has room: the value policy with memory at the trace's capacity and a
    disk tier that holds every chunk, admitting on the first sighting (doorkeeper 1) or the
    second (doorkeeper 2). Hit rates, tokens computed, where hits were served from and bytes
    written to disk, per arm (issue 11, point 5)."""
    import tempfile

    cfg = cfg or TraceConfig()
    rng = random.Random(cfg.seed + 1)
    trace = make_trace(cfg)
    all_keys = sorted({k for _, chunks in trace for k in chunks})
    tokens = {k: rng.randint(cfg.min_tokens, cfg.max_tokens) for k in all_keys}
    cfo = {k: round(rng.uniform(0.1, 0.6), 3) for k in all_keys}
    working_set = sum(n for k, n in tokens.items() if k.startswith("c")) * BYTES_PER_TOKEN
    room = 4 * sum(tokens.values()) * BYTES_PER_TOKEN + (1 << 20)  # every chunk fits on disk
    out: dict[str, object] = {}
    for threshold in (2, 1):
        with tempfile.TemporaryDirectory(prefix="cachecraft-first-sight-") as where:
            store_cfg = StoreConfig(
                memory_bytes=int(cfg.capacity_fraction * working_set),
                cache_dir=where,
                disk_bytes=room,
                policy="value",
                doorkeeper_threshold=threshold,
            )
            tiers: dict[str, object] = {}
            row = run_policy(trace, tokens, cfo, store_cfg, tiers).as_dict()
            out[f"doorkeeper={threshold}"] = {**row, "store": tiers}
    return out


POLICY_RUNS: dict[str, dict[str, object]] = {
    "value": {"policy": "value", "doorkeeper_threshold": 2},
    "lru": {"policy": "lru", "doorkeeper_threshold": 1},
    "lfu": {"policy": "lfu", "doorkeeper_threshold": 1},
    "lru+doorkeeper": {"policy": "lru", "doorkeeper_threshold": 2},
}


def run_store_bench(
    cfg: TraceConfig | None = None, policies: Iterable[str] = tuple(POLICY_RUNS)
) -> dict[str, object]:
    """Run the trace per policy. `value` uses its doorkeeper (the design); `lru`/`lfu` are the
    plain baselines (admit everything); `lru+doorkeeper` separates the doorkeeper's share."""
    cfg = cfg or TraceConfig()
    rng = random.Random(cfg.seed + 1)
    trace = make_trace(cfg)
    all_keys = {k for _, chunks in trace for k in chunks}
    tokens = {k: rng.randint(cfg.min_tokens, cfg.max_tokens) for k in sorted(all_keys)}
    cfo = {k: round(rng.uniform(0.1, 0.6), 3) for k in sorted(all_keys)}
    # the working set: every recurring (non-flood) chunk the trace touches
    working_set = sum(n for k, n in tokens.items() if k.startswith("c")) * BYTES_PER_TOKEN
    capacity = int(cfg.capacity_fraction * working_set)
    out: dict[str, object] = {
        "trace": {
            "requests": len(trace),
            "working_set_bytes": working_set,
            "capacity_bytes": capacity,
        }
    }
    results: dict[str, dict[str, object]] = {}
    for name in policies:
        store_cfg = StoreConfig(memory_bytes=capacity, **POLICY_RUNS[name])  # type: ignore[arg-type]
        results[name] = run_policy(trace, tokens, cfo, store_cfg).as_dict()
    out["policies"] = results
    if "value" in results and "lru" in results:
        saved = {
            n: int(r["tokens_total"]) - int(r["tokens_computed"])  # type: ignore[call-overload]
            for n, r in results.items()
        }
        out["savings_ratio_value_vs_lru"] = round(saved["value"] / max(1, saved["lru"]), 3)
    return out


def time_loads(store: ChunkStore, variant_ids: Iterable[str], repeats: int = 3) -> dict[str, float]:
    """Median seconds of `store.load` per variant id (hook for TTFT by tier); missing ids are
    left out."""
    out: dict[str, float] = {}
    for vid in variant_ids:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            got = store.load(vid)
            times.append(time.perf_counter() - t0)
            if got is None:
                break
        else:
            out[vid] = sorted(times)[len(times) // 2]
    return out


def add_bench_store_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("store", help="eviction policies under a Zipf trace + flood")
    parser.add_argument("--json", action="store_true", help="print the result dict as JSON")
    parser.add_argument("--requests-per-phase", type=int, default=TraceConfig().requests_per_phase)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hot-mass-per", choices=("request", "chunk"), default="request")
    parser.add_argument(
        "--no-ttft",
        dest="ttft",
        action="store_false",
        help="skip the time-to-first-token part (it loads the bundled model)",
    )
    parser.add_argument("--ttft-repeats", type=int, default=5)
    parser.add_argument(
        "--first-sight",
        action="store_true",
        help="also compare admitting on first vs second sight when disk has room for all",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="Redis for the TTFT part (default: start the pinned wheel's valkey-server)",
    )
    parser.set_defaults(func=main_store_bench)
    return parser


def main_store_bench(args: argparse.Namespace) -> int:
    cfg = TraceConfig(
        requests_per_phase=args.requests_per_phase, seed=args.seed, hot_mass_per=args.hot_mass_per
    )
    result = run_store_bench(cfg)
    if args.first_sight:
        result["first_sight"] = run_first_sight(cfg)
    if args.ttft:
        result["ttft_ms"] = _tier_ttft(args)
    if args.json:
        print(json.dumps(result, indent=2))  # CLI output, not library logging
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="chunk-cache store: policies under a Zipf trace with a novel flood")
    table.add_column("policy")
    table.add_column("hit rate", justify="right")
    table.add_column("tokens computed", justify="right")
    for phase in PHASES:
        table.add_column(f"{phase}: hit / computed", justify="right")
    for name, r in result["policies"].items():  # type: ignore[union-attr]
        cells = [f"{p['hit_rate']:.3f} / {p['tokens_computed']}" for p in r["phases"].values()]
        table.add_row(name, f"{r['hit_rate']:.3f}", str(r["tokens_computed"]), *cells)
    console = Console()
    console.print(table)
    console.print(f"savings ratio value vs lru: {result.get('savings_ratio_value_vs_lru')}")
    for arm, row in result.get("first_sight", {}).items():  # type: ignore[union-attr]
        console.print(
            f"{arm} (disk has room): hit rate {row['hit_rate']:.3f}, tokens computed "
            f"{row['tokens_computed']}, hits by tier {row['store']['hits']}, "
            f"admitted {row['store']['admitted']}"
        )
    for tier, row in result.get("ttft_ms", {}).items():
        console.print(f"TTFT {tier}: {row}")
    return 0


def _tier_ttft(args: argparse.Namespace) -> dict[str, object]:
    """TTFT per tier on the first request of the sample workload (bundled model)."""
    from pathlib import Path

    from cachecraft.api import RedisServer, load_model
    from cachecraft_bench.tier_ttft import run_tier_ttft
    from cachecraft_bench.workloads import load_workload_file

    sample = Path(__file__).resolve().parents[2] / "examples" / "wiki_qa_sample.jsonl"
    request = load_workload_file(sample)[0].request
    server = None
    url = args.redis_url
    if url is None:
        server = RedisServer().start()
        url = server.url
    try:
        return run_tier_ttft(load_model(), request, args.ttft_repeats, url)
    finally:
        if server is not None:
            server.stop()
