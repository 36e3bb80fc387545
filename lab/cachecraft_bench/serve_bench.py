"""`cachecraft bench serve`: the same open-loop Poisson RAG trace replayed against our server per
mode (and vLLM with prefix caching as the peer) at rising rates until each system saturates,
then in bursts (every request of a run sent at once, vLLM's `--request-rate inf`):
maximum throughput, computed prompt tokens/s, and TTFT / e2e latency at the highest rate every
system sustains. Owns the orchestration and the report; our server is started by the factory
the caller passes (the CLI passes `cachecraft_bench.own_server.server_process`: `cachecraft serve`
in a child process).

Each system serves one request stream, as a deployment does: its head warms the caches
(unmeasured), then each run of the ramp replays the next `num_requests` requests of the stream
at its rate. Caches stay warm across the runs (one cache namespace, one vLLM cache salt per
system), so every run measures steady-state serving, not a cold start; every system sees the
same stream in the same order.

The systems take turns: all of them are started and warmed up first, then each rate of the
ramp runs on every system still ramping, one after another, and then the bursts, round by round.
This machine's speed drifts by 20-30% over minutes; one system ramping after another had
compared the drift as much as the systems, while turns put every pair of runs compared
seconds to a minute apart.

Why the burst: a Poisson run past capacity still spends its first seconds waiting for
arrivals, so requests / makespan is bounded by the offered rate as well as by the system, and
a faster system loses more of its margin to that floor (on the 16-request wiki-qa runs the
last arrival of a 2.4 req/s run comes at ~6.7 s of a 15-19 s makespan). The burst has no
arrival floor: its throughput is the system's capacity. Every system's bursts replay the same
requests (the stream's parts after the last ramp run any system may make), in turns, and its
capacity is their median: one burst of 16 requests swung by up to 20% between runs of the same
code (vLLM's 1.98-2.38 req/s in three runs of session 36), more than the margins compared.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from cachecraft.errors import CachecraftError
from cachecraft_bench.item import WorkloadItem
from cachecraft_bench.loadgen import replay, summarize
from cachecraft_bench.trace import rag_trace, vllm_trace

logger = logging.getLogger(__name__)

Progress = Callable[[str, str], None]
"""`progress(system, message)`: one line of news per warm-up and per run (the CLI prints it)."""

ServerFactory = Callable[[str], AbstractContextManager[str]]
"""`start_server(mode)` -> a context manager yielding the base URL of a fresh server."""

DEFAULT_MODES = ("prefix", "cachecraft")
DEFAULT_RATES = (0.15, 0.3)
DEFAULT_MAX_RUNS = 7
"""Runs per system: the ladder, then doubling, until saturation or this many (0.15 .. 9.6
req/s with the default ladder: on a quiet 2-core machine cachecraft and vLLM still kept up at
2.4 req/s, and runs past saturation are short, since the ramp stops at the first)."""
PEERS = ("vllm",)


def rate_key(rate: float) -> str:
    """JSON key of a rate: 0.5 -> "0.5"."""
    return f"{rate:g}"


def sustained_rate(
    per_rate: Mapping[str, Mapping[str, Mapping[str, Any]]],
    rates: Sequence[float],
    mode: str,
    latency_bound: float = 3.0,
) -> float | None:
    """The highest rate at which `mode` completed everything (nothing rejected or failed) with
    p50 e2e latency within `latency_bound` x its p50 at the lowest rate; None if none did.
    Rates `mode` did not run (its ramp stopped below them) are skipped."""
    ordered = [r for r in sorted(rates) if mode in per_rate.get(rate_key(r), {})]
    if not ordered:
        return None
    base = per_rate[rate_key(ordered[0])][mode].get("e2e_ms_p50")
    best = None
    for rate in ordered:
        if _sustains(per_rate[rate_key(rate)][mode], base, latency_bound):
            best = rate
    return best


KEEP_UP = 0.85
"""A run keeps up when its throughput is at least this share of the rate its trace offered
(unsaturated, 16 requests whose service time is about the mean gap reach ~0.94)."""


def _sustains(summary: Mapping[str, Any], base_e2e: float | None, latency_bound: float) -> bool:
    """Everything completed, p50 e2e within `latency_bound` x the base run's, and the
    throughput kept up with the offered rate (a run saturated from the start has a long queue
    but no slower base to compare with)."""
    e2e = summary.get("e2e_ms_p50")
    if summary["num_rejected"] or summary["num_errors"] or e2e is None or base_e2e is None:
        return False
    offered = summary.get("offered_rps")
    if offered and summary.get("throughput_rps", 0.0) < KEEP_UP * offered:
        return False
    return bool(e2e <= latency_bound * base_e2e)


def _offered(trace: Sequence[Any]) -> float | None:
    """The rate a trace actually offers: (n - 1) / last arrival (Poisson gaps vary)."""
    span = trace[-1].arrival_s if trace else 0.0
    return round((len(trace) - 1) / span, 4) if len(trace) > 1 and span > 0 else None


def _saturated(summary: Mapping[str, Any], base_e2e: float | None, latency_bound: float) -> bool:
    """The ramp stops here: requests failed, throughput fell behind the offered rate (the
    system's capacity is reached, so this run measured it), or latency passed twice the
    sustain bound (deep in the queue)."""
    if summary["num_rejected"] or summary["num_errors"] or base_e2e is None:
        return True
    offered = summary.get("offered_rps")
    if offered and summary.get("throughput_rps", 0.0) < KEEP_UP * offered:
        return True
    e2e = summary.get("e2e_ms_p50")
    return e2e is None or e2e > 2 * latency_bound * base_e2e


class Ramp:
    """One system's rising rates, a run at a time: first the given ladder, then doubling the
    last rate, until the system saturates (`_saturated`) or `max_runs` ran. `runs` is {rate
    key: summary}; its last run is the saturated one unless `max_runs` ran out first. A run
    past the latency bound but still keeping up does not stop the ramp: capacity is not
    reached."""

    def __init__(self, rates: Sequence[float], max_runs: int, latency_bound: float) -> None:
        self.ladder = sorted(rates)
        self.max_runs = max_runs
        self.latency_bound = latency_bound
        self.runs: dict[str, dict[str, Any]] = {}
        self._rate = self.ladder[0]
        self._base: float | None = None
        self._done = False

    def next_rate(self) -> float | None:
        """The rate of the next run, or None when the ramp is over."""
        i = len(self.runs)
        if self._done or i >= self.max_runs:
            return None
        return self.ladder[i] if i < len(self.ladder) else self._rate * 2.0

    def record(self, rate: float, summary: dict[str, Any]) -> None:
        self._rate = rate
        self.runs[rate_key(rate)] = summary
        if self._base is None:
            self._base = summary.get("e2e_ms_p50")
        self._done = _saturated(summary, self._base, self.latency_bound)


def _run_line(rate: float, summary: Mapping[str, Any]) -> str:
    offered = "burst (all at once)" if math.isinf(rate) else f"{rate_key(rate)} req/s offered"
    return (
        f"{offered}: {summary.get('num_completed')} done, "
        f"{summary.get('throughput_rps', 0.0):.3f} req/s, TTFT p50 {summary.get('ttft_ms_p50')} ms, "
        f"e2e p50 {summary.get('e2e_ms_p50')} ms, computed {summary.get('computed_tokens_per_s')} "
        f"tok/s, rejected/errors {summary.get('num_rejected')}/{summary.get('num_errors')}"
    )


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num is not None and den else None


def _warm_up(base_url: str, trace: list[Any]) -> None:
    """Replay the warm-up requests one after another (unmeasured): one-off start-up costs stay
    out of the first rate, and the caches hold what a running deployment would."""
    for req in trace:
        res = replay([req], base_url, request_timeout_s=600.0)[0]
        if not res.is_ok:
            logger.warning("warm-up request failed on %s: %s", base_url, res.error or res.status)


def split_stream(
    items: Sequence[WorkloadItem], warmup: int, num_requests: int, max_runs: int
) -> tuple[list[WorkloadItem], list[list[WorkloadItem]]]:
    """The warm-up head of the stream and the requests of each run after it (the ramp's runs,
    then the burst's). A stream shorter than warm-up + max_runs x num_requests wraps around to
    just after the warm-up (and with fewer items than the warm-up, the warm-up is the whole
    stream)."""
    items = list(items)
    warm = items[: min(warmup, len(items))]
    rest = items[len(warm) :] or items
    runs = [
        [rest[(i * num_requests + j) % len(rest)] for j in range(num_requests)]
        for i in range(max_runs)
    ]
    return warm, runs


def _server_context(start_server: ServerFactory | Mapping[str, str], mode: str) -> Any:
    if isinstance(start_server, Mapping):
        return contextlib.nullcontext(start_server[mode])
    return start_server(mode)


def _with_rate(summary: dict[str, Any]) -> dict[str, Any]:
    """Adds computed prompt tokens and work tokens (loadgen.RequestResult.work_tokens) per
    second, over the run's makespan."""
    span = summary.get("makespan_s")
    for key in ("computed_tokens", "work_tokens"):
        done = summary.get(key)
        summary[f"{key}_per_s"] = round(done / span, 1) if done and span else None
    return summary


Runs = dict[str, Any]
"""One system's runs: {rate key: summary}, plus BURST: [summary of each burst] when it ran any."""
BURST = "burst"
DEFAULT_BURSTS = 3
"""Bursts per system; its capacity is their median (`median_run`)."""
DEFAULT_REFINE = 2
"""Runs after the ramp, on every system, at a rate between the highest one every system
sustained and the next (`refine_rate`). Two leave the common rate within 2 ** 0.25 = 1.19x of
the true one (one within 1.41x): latencies at a rate well below where the slowest system stops
keeping up compare its light load, not the load the question is about (in session 37 `prefix`
failed 1.2 req/s by 2% of the latency bound, and one refining run compared the systems at
0.849). About a minute more: one run of 16 requests per system near 1 req/s."""


RunAt = Callable[[list[WorkloadItem], float], dict[str, Any]]
"""`run_at(items, rate)`: one run of a started, warmed-up system (rate inf: the burst)."""


def _take_turns(
    systems: Mapping[str, RunAt],
    runs: list[list[WorkloadItem]],
    rates: Sequence[float],
    opts: dict[str, Any],
) -> dict[str, Runs]:
    """Every system's ramp over runs[0..max_runs-1] in order, rate by rate in turns (each
    rate on every system still ramping, in `systems` order); then up to opts["refine"] runs
    on every system at `refine_rate` (each over the next part of the stream after the
    bursts'); then opts["bursts"] rounds of bursts, burst i over runs[max_runs + i] on every
    system in turn."""
    ramps = {name: Ramp(rates, opts["max_runs"], opts["latency_bound"]) for name in systems}
    while True:
        turn = {name: ramp.next_rate() for name, ramp in ramps.items()}
        if all(rate is None for rate in turn.values()):
            break
        for name, rate in turn.items():
            if rate is not None:
                items = runs[len(ramps[name].runs)]
                ramps[name].record(rate, systems[name](items, rate))
    out = {name: ramp.runs for name, ramp in ramps.items()}
    first = opts["max_runs"] + opts["bursts"]  # the refining runs' parts of the stream
    for i in range(opts.get("refine", 0)):
        rate = refine_rate(out, opts["latency_bound"])
        if rate is None:
            break
        for name, run_at in systems.items():
            out[name][rate_key(rate)] = run_at(runs[first + i], rate)
    for i in range(opts["bursts"]):
        for name, run_at in systems.items():
            out[name].setdefault(BURST, []).append(run_at(runs[opts["max_runs"] + i], math.inf))
    return out


def median_run(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput (the lower one of an even count: always a run that
    happened, so its latencies and token rates belong to it)."""
    ordered = sorted(summaries, key=lambda s: s["throughput_rps"])
    return ordered[(len(ordered) - 1) // 2]


def refine_rate(per_system: Mapping[str, Runs], latency_bound: float) -> float | None:
    """The next rate to try between the highest rate every system sustained (`low`) and the
    lowest rate above it that some system ran and did not sustain (`high`): their geometric
    midpoint, to three significant digits. None when there is no such pair (a system sustained
    nothing, or nobody failed above `low`) or the two are too close to split. A doubling ramp
    finds the common rate only to within 2x, and the latencies compared there are those of
    the load every system still carries: one refining run halves that gap."""
    lows, highs = [], []
    for runs in per_system.values():
        ran = {float(k): s for k, s in runs.items() if k != BURST}
        if not ran:
            return None
        base = ran[min(ran)].get("e2e_ms_p50")
        ok = {r: _sustains(s, base, latency_bound) for r, s in ran.items()}
        if not any(ok.values()):
            return None
        lows.append(max(r for r, sustained in ok.items() if sustained))
        highs.append([r for r, sustained in ok.items() if not sustained])
    low = min(lows)
    above = [r for failed in highs for r in failed if r > low]
    if not above:
        return None
    rate = float(f"{math.sqrt(low * min(above)):.3g}")
    return rate if low < rate < min(above) else None


@contextlib.contextmanager
def _ours(
    start_server: ServerFactory | Mapping[str, str],
    mode: str,
    warm_items: list[WorkloadItem],
    seed: int,
    opts: dict[str, Any],
) -> Iterator[RunAt]:
    """Our server in `mode`, started and warmed up, as a `RunAt`."""
    namespace = f"bench-{mode}-{seed}"  # one cache per system and stream, warm across runs
    with _server_context(start_server, mode) as base_url:
        kw = {"namespace": namespace, "ignore_eos": opts["ignore_eos"], "client": opts["client"]}
        opts["progress"](mode, f"warming up with {len(warm_items)} requests")
        _warm_up(base_url, rag_trace(warm_items, None, seed, mode, opts["max_tokens"], **kw))

        def run_at(items: list[WorkloadItem], rate: float) -> dict[str, Any]:
            trace = rag_trace(items, rate, seed, mode, opts["max_tokens"], **kw)
            results = replay(trace, base_url, request_timeout_s=opts["request_timeout_s"])
            summary = _with_rate(summarize(results))
            summary["offered_rps"] = _offered(trace)
            logger.info("%s @ %s rps: %s", mode, rate_key(rate), summary)
            opts["progress"](mode, _run_line(rate, summary))
            return summary

        yield run_at


@contextlib.contextmanager
def _vllm(
    warm_items: list[WorkloadItem],
    seed: int,
    opts: dict[str, Any],
    peer_server: Callable[[], AbstractContextManager[Any]] | None,
    peer_info: dict[str, Any],
) -> Iterator[RunAt]:
    """vLLM with prefix caching, started and warmed up, as a `RunAt`; fills `peer_info`."""
    import torch
    from transformers import AutoTokenizer

    from cachecraft_bench.peer_vllm import VllmServer, prefix_cache_stats

    threads = torch.get_num_threads()  # our child server takes the same default; vLLM as many
    make = peer_server or (
        lambda: VllmServer(
            opts.get("model_dir"), opts["peer_python"], num_threads=threads, dtype=opts["dtype"]
        )
    )
    with make() as srv:
        tokenizer = AutoTokenizer.from_pretrained(srv.model_dir)
        kw = {
            "tokenizer": tokenizer,
            "model": srv.model_name,
            "ignore_eos": opts["ignore_eos"],
            "client": opts["client"],
            "max_tokens": opts["max_tokens"],
            "cache_salt": f"bench-vllm-{seed}",  # one cache per stream, warm across runs
        }
        opts["progress"]("vllm", f"warming up with {len(warm_items)} requests")
        _warm_up(srv.base_url, vllm_trace(warm_items, None, seed, **kw))

        def run_at(items: list[WorkloadItem], rate: float) -> dict[str, Any]:
            before = prefix_cache_stats(srv.base_url)
            trace = vllm_trace(items, rate, seed, **kw)
            results = replay(trace, srv.base_url, request_timeout_s=opts["request_timeout_s"])
            after = prefix_cache_stats(srv.base_url)
            summary = summarize(results)
            summary["prefix_cache"] = {k: int(after[k] - before[k]) for k in after}
            summary["offered_rps"] = _offered(trace)
            logger.info("vllm @ %s rps: %s", rate_key(rate), summary)
            summary = _with_rate(summary)
            opts["progress"]("vllm", _run_line(rate, summary))
            return summary

        peer_info.update(name="vllm", startup_s=getattr(srv, "startup_s", None))
        yield run_at


def run_serve_bench(
    start_server: ServerFactory | Mapping[str, str],
    peer: str | None = None,
    rates: Sequence[float] = DEFAULT_RATES,
    num_requests: int = 20,
    seed: int = 0,
    modes: Sequence[str] = DEFAULT_MODES,
    items: Sequence[WorkloadItem] | None = None,
    max_tokens: int = 32,
    ignore_eos: bool = True,
    latency_bound: float = 3.0,
    request_timeout_s: float = 600.0,
    peer_python: str | None = None,
    peer_server: Callable[[], AbstractContextManager[Any]] | None = None,
    max_runs: int = DEFAULT_MAX_RUNS,
    warmup: int = 0,
    progress: Progress | None = None,
    bursts: int = DEFAULT_BURSTS,
    dtype: str = "float32",
    client: str = "documents",
    refine: int = DEFAULT_REFINE,
) -> dict[str, Any]:
    """Replay one request stream (synthetic Zipf workload unless `items`) per system (each
    mode, then the peer, all started at once): its first `warmup` requests one by one,
    unmeasured, then runs of `num_requests` Poisson requests at rising rates until the system
    saturates (`Ramp`), the systems taking turns rate by rate, each run the next part of the
    stream (`split_stream`), caches warm throughout; then `bursts` runs of `num_requests`
    sent at once per system, in turns (the median one's throughput is the capacity). Between
    the two, `refine` runs on every system narrow the highest rate all sustain (`refine_rate`).

    `start_server` is a factory (a fresh server per mode) or a {mode: base URL} mapping.
    Reported: per system the maximum throughput it reached (the best of its runs, the bursts
    counted as their median; `max_throughput_run` names the run) and its computed prompt
    tokens/s there;
    latencies at `common_rate`, the highest rate every system sustained. `ignore_eos` makes every mode
    generate exactly `max_tokens`, so latencies compare prefill work, not answer lengths.
    `client`: how our servers get each request's passages (`trace.CLIENTS`: the documents
    field, or pasted into the user or the system message); vLLM the same prompt tokens.
    `peer_server` replaces the vLLM launcher (tests). `dtype` is vLLM's (our servers take
    theirs from `server_factory`: `cachecraft bench serve --dtype` passes the same to both)."""
    if not rates or any(r <= 0 for r in rates):
        raise CachecraftError(f"rates must be positive, got {list(rates)}")
    if max_runs < 1:
        raise CachecraftError(f"max_runs must be >= 1, got {max_runs}")
    if peer is not None and peer not in PEERS:
        raise CachecraftError(f"unknown peer {peer!r}; choose one of {', '.join(PEERS)}")
    if num_requests < 1 or warmup < 0 or refine < 0 or bursts < 0:
        raise CachecraftError(
            "need requests >= 1, warmup >= 0, refine >= 0 and bursts >= 0, "
            f"got {num_requests}, {warmup}, {refine}, {bursts}"
        )
    if items is None:
        from cachecraft_bench.synthetic import synthetic

        items = synthetic(warmup + (max_runs + bursts + refine) * num_requests, seed=seed)
    items = list(items)
    if not items:
        raise CachecraftError("the serving bench needs at least one request")
    stream = split_stream(items, warmup, num_requests, max_runs + bursts + refine)
    rates = sorted(rates)
    opts = {
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "request_timeout_s": request_timeout_s,
        "peer_python": peer_python or ".peer-venv/bin/python",
        "max_runs": max_runs,
        "latency_bound": latency_bound,
        "bursts": bursts,
        "refine": refine,
        "dtype": dtype,
        "client": client,
        "progress": progress or (lambda system, message: None),
    }
    warm_items, runs = stream
    peer_info: dict[str, Any] = {}
    with contextlib.ExitStack() as started:
        systems = {
            m: started.enter_context(_ours(start_server, m, warm_items, seed, opts)) for m in modes
        }
        if peer == "vllm":
            systems["vllm"] = started.enter_context(
                _vllm(warm_items, seed, opts, peer_server, peer_info)
            )
        per_mode = _take_turns(systems, runs, rates, opts)
    result: dict[str, Any] = {
        "config": {
            "modes": list(modes),
            "peer": peer,
            "num_requests": num_requests,
            "warmup": len(stream[0]),
            "seed": seed,
            "max_tokens": max_tokens,
            "ignore_eos": ignore_eos,
            "latency_bound": latency_bound,
            "max_runs": max_runs,
            "bursts": bursts,
            "refine": refine,
            "dtype": dtype,
            "client": client,
        },
    }
    systems = list(per_mode)
    if peer_info:
        result["peer"] = peer_info
    each_burst = {m: per_mode[m].pop(BURST) for m in systems if BURST in per_mode[m]}
    median = {m: median_run(runs) for m, runs in each_burst.items()}
    ran = sorted({float(k) for runs in per_mode.values() for k in runs})
    result["rates"] = ran
    per_rate = {
        rate_key(r): {m: per_mode[m][rate_key(r)] for m in systems if rate_key(r) in per_mode[m]}
        for r in ran
    }
    result["per_rate"] = per_rate
    result["sustained_rate"] = {m: sustained_rate(per_rate, ran, m, latency_bound) for m in systems}
    result["saturated"] = {
        m: _saturated(
            per_mode[m][max(per_mode[m], key=float)],
            per_mode[m][min(per_mode[m], key=float)].get("e2e_ms_p50"),
            latency_bound,
        )
        for m in systems
    }
    if median:
        result["burst"] = median
        result["burst_throughputs_rps"] = {
            m: [s["throughput_rps"] for s in runs] for m, runs in each_burst.items()
        }
    best = {
        m: max(
            [*per_mode[m].items(), *([(BURST, median[m])] if m in median else [])],
            key=lambda kv: kv[1]["throughput_rps"],
        )
        for m in systems
    }
    result["max_throughput_rps"] = {m: best[m][1]["throughput_rps"] for m in systems}
    result["max_throughput_run"] = {m: best[m][0] for m in systems}
    for key in ("computed_tokens_per_s", "work_tokens_per_s"):
        result[key] = {m: best[m][1].get(key) for m in systems}
    sustained = [result["sustained_rate"][m] for m in systems]
    common = min(sustained) if all(r is not None for r in sustained) else None  # type: ignore[type-var]
    result["common_rate"] = common if common is not None else rates[0]
    result["common_rate_is_sustained"] = common is not None
    result["chosen_rate"] = result["common_rate"]  # older name of the same rate
    at = per_rate[rate_key(result["common_rate"])]
    result["modes"] = at
    result.update(_ratios(at, result["max_throughput_rps"]))
    return result


def _ratios(at: Mapping[str, Mapping[str, Any]], max_tput: Mapping[str, float]) -> dict[str, Any]:
    """cachecraft over each other system: maximum throughput, and p50 e2e at the common rate."""
    out: dict[str, Any] = {}
    cc = at.get("cachecraft")
    if cc is None:
        return out
    for other in ("prefix", "vllm"):
        if other not in max_tput:
            continue
        out[f"throughput_ratio_vs_{other}"] = _ratio(max_tput["cachecraft"], max_tput[other])
        o = at.get(other, {})
        out[f"e2e_p50_ratio_{other}_over_cachecraft"] = _ratio(
            o.get("e2e_ms_p50"), cc["e2e_ms_p50"]
        )
    if "vllm" in at:
        prompt, computed = cc.get("prompt_tokens"), cc.get("computed_tokens")
        out["vllm_prefix_cache"] = at["vllm"].get("prefix_cache")
        out["cachecraft_reused_tokens"] = (
            prompt - computed if prompt is not None and computed is not None else None
        )
        out["cachecraft_prompt_tokens"] = prompt
    return out
