"""`cachecraft bench serve`: the same open-loop Poisson RAG trace replayed against our server per
mode (and vLLM with prefix caching as the peer, in the best of its plausible configurations:
`peer_tuning`) at rising rates until each system saturates, then in bursts (every request of
a run sent at once, vLLM's `--request-rate inf`), then at fractions of each system's own
capacity: maximum throughput, computed prompt tokens/s, TTFT / e2e latency against offered
load, with confidence intervals, and whether every answer equals a full prefill's. Owns the
orchestration and the report; our server is started by the factory the caller passes (the
CLI passes `cachecraft_bench.own_server.server_process`: `cachecraft serve` in a child).

Each system serves one request stream, as a deployment does: its head warms the caches
(unmeasured), then each run replays the next part of the stream (`split_stream`, `Parts`).
Caches stay warm across the runs (one cache namespace, one vLLM cache salt per system), so
every run measures steady-state serving; every system sees the same parts in the same order.

Every point of a curve (a system at a rate) is `repeats` runs over parts of their own: its
throughput is their median, its latencies percentiles of all their requests, each with a
bootstrap CI (`serve_stats`). The systems take turns, run by run: this machine's speed drifts
by 20-30% over minutes, and turns put every pair of runs compared seconds apart.

Why the burst: a Poisson run past capacity still spends its first seconds waiting for
arrivals, so requests / makespan is bounded by the offered rate as well as by the system. The
burst has no arrival floor: its throughput is the system's capacity, the median of `bursts`
rounds (throughput ratios and their CIs are over these rounds, paired by round). Latencies are
compared at the highest rate every system sustains (`common_rate`) and at the same fractions of
each system's own capacity (`capacity_fractions`): a common rate is light load for a fast
system and the knee of a slow one.

The environment tuning (OpenMP waiting, allocator) is the same for every system: ours for all
(`env_tuning="ours"`) or none for any (`"none"`, the default: each library's own defaults).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from cachecraft.errors import CachecraftError
from cachecraft_bench import answer_check
from cachecraft_bench.item import WorkloadItem
from cachecraft_bench.loadgen import RequestResult, replay, summarize
from cachecraft_bench.peer_tuning import search
from cachecraft_bench.peer_vllm import PeerConfig
from cachecraft_bench.ramp import (  # noqa: F401 (re-exported: the bench's vocabulary)
    BURST,
    KEEP_UP,
    Ramp,
    Runs,
    median_run,
    offered_rate,
    rate_key,
    refine_rate,
    saturated,
    sustained_rate,
    sustains,
)
from cachecraft_bench.serve_parts import Parts, split_stream
from cachecraft_bench.serve_stats import aggregate_runs
from cachecraft_bench.serve_summary import summarize_bench
from cachecraft_bench.trace import rag_trace, vllm_trace

logger = logging.getLogger(__name__)

Progress = Callable[[str, str], None]
"""`progress(system, message)`: one line of news per warm-up and per run (the CLI prints it)."""

ServerFactory = Callable[[str], AbstractContextManager[str]]
"""`start_server(mode)` -> a context manager yielding the base URL of a fresh server."""

PeerFactory = Callable[[PeerConfig], AbstractContextManager[Any]]
"""`peer_server(config)` -> a context manager yielding a started vLLM (`VllmServer`-like)."""

DEFAULT_MODES = ("prefix", "cachecraft")
DEFAULT_RATES = (0.5, 1.0)
DEFAULT_MAX_RUNS = 5
"""Points per system: the ladder, then doubling, until saturation or this many (0.5 .. 8
req/s with the default ladder; on a quiet 2-core machine the fastest system kept up at 2.4)."""
DEFAULT_REPEATS = 3
"""Runs per point of a curve (its CI is over them)."""
DEFAULT_BURSTS = 5
"""Bursts per system; its capacity is their median, the throughput ratios' CIs over them."""
DEFAULT_REFINE = 2
"""Points after the ramp, on every system, between the highest rate every system sustained and
the next (`refine_rate`): two leave the common rate within 2 ** 0.25 = 1.19x of the true one."""
DEFAULT_FRACTIONS = (0.5, 0.8)
"""Fractions of each system's own capacity at which latencies are compared too."""
PEERS = ("vllm",)
ENV_TUNINGS = ("none", "ours")

RunAt = Callable[[list[WorkloadItem], float], dict[str, Any]]
"""`run_at(items, rate)`: one run of a started, warmed-up system (rate inf: the burst)."""


def _run_line(rate: float, summary: Mapping[str, Any]) -> str:
    offered = "burst (all at once)" if math.isinf(rate) else f"{rate_key(rate)} req/s offered"
    return (
        f"{offered}: {summary.get('num_completed')} done, "
        f"{summary.get('throughput_rps', 0.0):.3f} req/s, TTFT p50 {summary.get('ttft_ms_p50')} ms, "
        f"e2e p50 {summary.get('e2e_ms_p50')} ms, computed {summary.get('computed_tokens_per_s')} "
        f"tok/s, rejected/errors {summary.get('num_rejected')}/{summary.get('num_errors')}"
    )


def _warm_up(base_url: str, trace: list[Any]) -> None:
    """Replay the warm-up requests one after another (unmeasured): one-off start-up costs stay
    out of the first rate, and the caches hold what a running deployment would."""
    for req in trace:
        res = replay([req], base_url, request_timeout_s=600.0)[0]
        if not res.is_ok:
            logger.warning("warm-up request failed on %s: %s", base_url, res.error or res.status)


def _server_context(start_server: ServerFactory | Mapping[str, str], mode: str) -> Any:
    if isinstance(start_server, Mapping):
        return contextlib.nullcontext(start_server[mode])
    return start_server(mode)


def _run_summary(results: list[RequestResult], trace: Sequence[Any]) -> dict[str, Any]:
    """`loadgen.summarize` plus the offered rate, computed and work tokens per second over
    the makespan, and every completed request's latencies (`e2e_ms`, `ttft_ms`: a point pools
    them across its repeated runs)."""
    summary = summarize(results)
    summary["offered_rps"] = offered_rate(trace)
    span = summary.get("makespan_s")
    for key in ("computed_tokens", "work_tokens"):
        done = summary.get(key)
        summary[f"{key}_per_s"] = round(done / span, 1) if done and span else None
    ok = [r for r in results if r.is_ok]
    summary["e2e_ms"] = [round(1000 * (r.e2e_s or 0.0), 2) for r in ok]
    summary["ttft_ms"] = [round(1000 * r.ttft_s, 2) for r in ok if r.ttft_s is not None]
    return summary


def _point(
    systems: Mapping[str, RunAt], todo: Mapping[str, float], parts: Sequence[list[WorkloadItem]]
) -> dict[str, dict[str, Any]]:
    """Each system of `todo` at its rate once per part, in turns part by part; one point
    (`aggregate_runs`) per system."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in todo}
    for items in parts:
        for name, rate in todo.items():
            runs[name].append(systems[name](items, rate))
    return {name: aggregate_runs(r) for name, r in runs.items()}


def _take_turns(
    systems: Mapping[str, RunAt],
    runs: list[list[WorkloadItem]],
    rates: Sequence[float],
    opts: dict[str, Any],
) -> dict[str, Runs]:
    """Every system's ramp, point by point in turns (each point on every system still
    ramping); then up to opts["refine"] points on every system at `refine_rate`; then
    opts["bursts"] rounds of bursts on every system in turn; then a point per system at each
    of opts["fractions"] of its own capacity (the median burst, else its best point), kept
    under "fractions". Which part of the stream each run replays: `Parts`."""
    parts = Parts.of(opts)
    ramps = {name: Ramp(rates, opts["max_runs"], opts["latency_bound"]) for name in systems}
    while True:
        turn = {name: rate for name, ramp in ramps.items() if (rate := ramp.next_rate())}
        if not turn:
            break
        i = len(ramps[next(iter(turn))].runs)  # every system still ramping is at point i
        points = _point(systems, turn, [runs[k] for k in parts.ramp(i)])
        for name, point in points.items():
            ramps[name].record(turn[name], point)
    out: dict[str, Runs] = {name: ramp.runs for name, ramp in ramps.items()}
    for i in range(opts.get("refine", 0)):
        rate = refine_rate(out, opts["latency_bound"])
        if rate is None:
            break
        points = _point(
            systems, dict.fromkeys(systems, rate), [runs[k] for k in parts.refine_point(i)]
        )
        for name, point in points.items():
            out[name][rate_key(rate)] = point
    for i in range(opts["bursts"]):
        for name, run_at in systems.items():
            out[name].setdefault(BURST, []).append(run_at(runs[parts.burst(i)], math.inf))
    for f_index, fraction in enumerate(opts.get("fractions", ())):
        todo = {}
        for name in systems:
            capacity = _capacity(out[name])
            if capacity:
                todo[name] = round(fraction * capacity, 4)
        points = _point(systems, todo, [runs[k] for k in parts.fraction(f_index)])
        for name, point in points.items():
            out[name].setdefault("fractions", {})[f"{fraction:g}"] = point
    return out


def _capacity(runs: Runs) -> float | None:
    """A system's capacity: its median burst's throughput, else its best point's."""
    if runs.get(BURST):
        return float(median_run(runs[BURST])["throughput_rps"]) or None
    points = [s["throughput_rps"] for k, s in runs.items() if k not in (BURST, "fractions")]
    return max(points, default=0.0) or None


@contextlib.contextmanager
def _ours(
    start_server: ServerFactory | Mapping[str, str],
    mode: str,
    warm_items: list[WorkloadItem],
    seed: int,
    opts: dict[str, Any],
) -> Iterator[RunAt]:
    """Our server in `mode`, started and warmed up, as a `RunAt`. Each run's answers go to
    opts["answers"][mode]; the first of our servers also replays requests in `full` mode for
    the answer check (opts["replay_full"])."""
    namespace = f"bench-{mode}-{seed}"  # one cache per system and stream, warm across runs
    with _server_context(start_server, mode) as base_url:
        kw = {"namespace": namespace, "ignore_eos": opts["ignore_eos"], "client": opts["client"]}
        opts["progress"](mode, f"warming up with {len(warm_items)} requests")
        _warm_up(base_url, rag_trace(warm_items, None, seed, mode, opts["max_tokens"], **kw))
        answers = opts["answers"].setdefault(mode, [])

        def run_at(items: list[WorkloadItem], rate: float) -> dict[str, Any]:
            trace = rag_trace(items, rate, seed, mode, opts["max_tokens"], **kw)
            results = replay(trace, base_url, request_timeout_s=opts["request_timeout_s"])
            answers.extend((r.id, r.text) for r in results if r.is_ok)
            summary = _run_summary(results, trace)
            logger.info("%s @ %s rps: %s", mode, rate_key(rate), summary)
            opts["progress"](mode, _run_line(rate, summary))
            return summary

        def replay_full(items: list[WorkloadItem]) -> dict[str, str]:
            """Each item's answer from a full prefill, one request at a time (greedy)."""
            full_kw = kw | {"namespace": f"bench-full-check-{seed}"}
            trace = rag_trace(items, None, seed, "full", opts["max_tokens"], **full_kw)
            return {
                r.id: r.text
                for req in trace
                for r in replay([req], base_url, request_timeout_s=opts["request_timeout_s"])
                if r.is_ok
            }

        opts.setdefault("replay_full", replay_full)
        yield run_at


def _vllm_trial(
    make: PeerFactory, warm_items: list[WorkloadItem], items: list[WorkloadItem], opts: dict
) -> Callable[[PeerConfig], dict[str, Any]]:
    """A trial for `peer_tuning.search`: vLLM in a configuration, warmed up as every system
    is, then one burst of `items`: its throughput is the configuration's capacity."""

    def trial(config: PeerConfig) -> dict[str, Any]:
        with make(config) as srv, _vllm_runner(srv, warm_items, opts, "trial") as run_at:
            burst = run_at(items, math.inf)
        if not burst["num_completed"]:
            raise CachecraftError(f"vLLM in {config.label()} completed no request")
        return {
            "capacity_rps": burst["throughput_rps"],
            "e2e_ms_p50": burst["e2e_ms_p50"],
            "startup_s": getattr(srv, "startup_s", None),
        }

    return trial


@contextlib.contextmanager
def _vllm_runner(
    srv: Any, warm_items: list[WorkloadItem], opts: dict, salt: str
) -> Iterator[RunAt]:
    """A started vLLM, warmed up, as a `RunAt` (its answers to opts["answers"]["vllm"] unless
    this is a trial)."""
    from transformers import AutoTokenizer

    from cachecraft_bench.peer_vllm import prefix_cache_stats

    tokenizer = AutoTokenizer.from_pretrained(srv.model_dir)
    kw = {
        "tokenizer": tokenizer,
        "model": srv.model_name,
        "ignore_eos": opts["ignore_eos"],
        "client": opts["client"],
        "max_tokens": opts["max_tokens"],
        "cache_salt": f"bench-vllm-{salt}",  # one cache per stream, warm across runs
    }
    seed = opts["seed"]
    opts["progress"]("vllm", f"warming up with {len(warm_items)} requests")
    _warm_up(srv.base_url, vllm_trace(warm_items, None, seed, **kw))
    answers = opts["answers"].setdefault("vllm", []) if salt != "trial" else []

    def run_at(items: list[WorkloadItem], rate: float) -> dict[str, Any]:
        before = prefix_cache_stats(srv.base_url)
        trace = vllm_trace(items, rate, seed, **kw)
        results = replay(trace, srv.base_url, request_timeout_s=opts["request_timeout_s"])
        after = prefix_cache_stats(srv.base_url)
        answers.extend((r.id, r.text) for r in results if r.is_ok)
        summary = _run_summary(results, trace)
        summary["prefix_cache"] = {k: int(after[k] - before[k]) for k in after}
        logger.info("vllm @ %s rps: %s", rate_key(rate), summary)
        opts["progress"]("vllm", _run_line(rate, summary))
        return summary

    yield run_at


@contextlib.contextmanager
def _vllm(
    warm_items: list[WorkloadItem],
    trial_items: list[WorkloadItem],
    opts: dict[str, Any],
    peer_server: PeerFactory | None,
    peer_info: dict[str, Any],
) -> Iterator[RunAt]:
    """vLLM with prefix caching in the best configuration `peer_tuning.search` found (or
    the only one given), started and warmed up, as a `RunAt`; fills `peer_info`."""
    import torch

    from cachecraft_bench.peer_vllm import VllmServer

    threads = torch.get_num_threads()  # our child server takes the same default; vLLM as many

    def make(config: PeerConfig) -> AbstractContextManager[Any]:
        if peer_server is not None:
            return peer_server(config)
        return VllmServer(
            opts.get("model_dir"),
            opts["peer_python"],
            num_threads=threads,
            dtype=opts["dtype"],
            config=config,
            tuned=opts["env_tuning"] == "ours",
        )

    trial = _vllm_trial(make, warm_items, trial_items, opts)
    best, tried = search(trial, opts["peer_configs"], lambda m: opts["progress"]("vllm", m))
    with make(best) as srv, _vllm_runner(srv, warm_items, opts, str(opts["seed"])) as run_at:
        peer_info.update(
            name="vllm",
            startup_s=getattr(srv, "startup_s", None),
            config=best.as_dict(),
            config_label=best.label(),
            configs_tried=tried,
        )
        yield run_at


def run_serve_bench(
    start_server: ServerFactory | Mapping[str, str],
    peer: str | None = None,
    rates: Sequence[float] = DEFAULT_RATES,
    num_requests: int = 8,
    seed: int = 0,
    modes: Sequence[str] = DEFAULT_MODES,
    items: Sequence[WorkloadItem] | None = None,
    max_tokens: int = 8,
    ignore_eos: bool = True,
    latency_bound: float = 3.0,
    request_timeout_s: float = 600.0,
    peer_python: str | None = None,
    peer_server: PeerFactory | None = None,
    max_runs: int = DEFAULT_MAX_RUNS,
    warmup: int = 0,
    progress: Progress | None = None,
    bursts: int = DEFAULT_BURSTS,
    dtype: str = "float32",
    client: str = "documents",
    refine: int = DEFAULT_REFINE,
    repeats: int = DEFAULT_REPEATS,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    peer_configs: Sequence[PeerConfig] | None = None,
    check_answers: bool = True,
    env_tuning: str = "none",
) -> dict[str, Any]:
    """Replay one request stream (synthetic Zipf workload unless `items`) per system (each
    mode, then the peer, all started at once): its first `warmup` requests one by one,
    unmeasured, then points of `repeats` runs of `num_requests` Poisson requests at rising
    rates until the system saturates (`Ramp`), `refine` points narrowing the highest rate all
    sustain, `bursts` runs sent at once per system, and a point at each of `fractions` of each
    system's capacity; the systems take turns run by run (`_take_turns`). Then, with
    `check_answers`, every distinct measured request once more in `full` mode on our first
    server: each system's answers against those (`answer_agreement_vs_full`).

    `start_server` is a factory (a fresh server per mode) or a {mode: base URL} mapping;
    `peer_server(config)` replaces the vLLM launcher (tests). `peer_configs`: vLLM's
    configurations to try (None: `peer_tuning`'s search; one: that one, untried).
    `env_tuning`: the OpenMP and allocator tuning every system gets ("none" or "ours"; our
    servers get it through `server_factory`'s environment, the CLI's `own_server`).
    `ignore_eos` makes every system generate exactly `max_tokens`. `client`: how our servers
    get each request's passages (`trace.CLIENTS`); vLLM gets the same prompt tokens. The
    result's keys: `serve_summary.summarize_bench`."""
    if not rates or any(r <= 0 for r in rates):
        raise CachecraftError(f"rates must be positive, got {list(rates)}")
    if max_runs < 1 or repeats < 1:
        raise CachecraftError(f"max_runs and repeats must be >= 1, got {max_runs}, {repeats}")
    if peer is not None and peer not in PEERS:
        raise CachecraftError(f"unknown peer {peer!r}; choose one of {', '.join(PEERS)}")
    if env_tuning not in ENV_TUNINGS:
        raise CachecraftError(f"env_tuning is one of {', '.join(ENV_TUNINGS)}, got {env_tuning!r}")
    if num_requests < 1 or warmup < 0 or refine < 0 or bursts < 0:
        raise CachecraftError(
            "need requests >= 1, warmup >= 0, refine >= 0 and bursts >= 0, "
            f"got {num_requests}, {warmup}, {refine}, {bursts}"
        )
    if any(not 0 < f <= 1 for f in fractions):
        raise CachecraftError(f"capacity fractions must be in (0, 1], got {list(fractions)}")
    t0 = time.perf_counter()
    opts = {
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "request_timeout_s": request_timeout_s,
        "peer_python": peer_python or ".peer-venv/bin/python",
        "max_runs": max_runs,
        "latency_bound": latency_bound,
        "bursts": bursts,
        "refine": refine,
        "repeats": repeats,
        "fractions": tuple(fractions),
        "dtype": dtype,
        "client": client,
        "seed": seed,
        "peer_configs": peer_configs,
        "env_tuning": env_tuning,
        "progress": progress or (lambda system, message: None),
        "answers": {},
    }
    num_parts = Parts.of(opts).total
    if items is None:
        from cachecraft_bench.synthetic import synthetic

        items = synthetic(warmup + num_parts * num_requests, seed=seed)
    items = list(items)
    if not items:
        raise CachecraftError("the serving bench needs at least one request")
    warm_items, runs = split_stream(items, warmup, num_requests, num_parts)
    peer_info: dict[str, Any] = {}
    agreement = None
    with contextlib.ExitStack() as started:
        systems = {
            m: started.enter_context(_ours(start_server, m, warm_items, seed, opts)) for m in modes
        }
        if peer == "vllm":
            # the trial's burst replays the first burst's requests (any part would do)
            trial_items = runs[Parts.of(opts).burst(0) if bursts else 0]
            systems["vllm"] = started.enter_context(
                _vllm(warm_items, trial_items, opts, peer_server, peer_info)
            )
        per_system = _take_turns(systems, runs, rates, opts)
        if check_answers and "replay_full" in opts:
            agreement = answer_check.check_answers(
                opts["answers"],
                opts["replay_full"],
                [it for run in runs for it in run],
                opts.get("model_dir"),
                lambda m: opts["progress"]("full", m),
            )
    config = {
        "modes": list(modes),
        "peer": peer,
        "num_requests": num_requests,
        "warmup": len(warm_items),
        "seed": seed,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "latency_bound": latency_bound,
        "max_runs": max_runs,
        "bursts": bursts,
        "refine": refine,
        "repeats": repeats,
        "capacity_fractions": list(fractions),
        "dtype": dtype,
        "client": client,
        "env_tuning": env_tuning,
    }
    result = summarize_bench(per_system, config, rates, latency_bound)
    if peer_info:
        result["peer"] = peer_info
    if agreement is not None:
        result["answer_agreement_vs_full"] = agreement
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result
