"""`cachecraft bench serve`: the same open-loop Poisson RAG trace replayed per mode and rate against
our server (and vLLM with prefix caching as the peer), with throughput, TTFT, e2e latency and the
fraction of prompt tokens computed. Owns the orchestration and the report; our server is started
by the factory the caller passes (the CLI passes `cachecraft.server.launch.start_server`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from cachecraft.bench.item import WorkloadItem
from cachecraft.bench.loadgen import replay, summarize
from cachecraft.bench.trace import rag_trace, vllm_trace
from cachecraft.errors import CachecraftError

logger = logging.getLogger(__name__)

ServerFactory = Callable[[str], AbstractContextManager[str]]
"""`start_server(mode)` -> a context manager yielding the base URL of a fresh server."""

DEFAULT_MODES = ("full", "prefix", "cachecraft")
DEFAULT_RATES = (0.1, 0.2, 0.4)
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
    p50 e2e latency within `latency_bound` x its p50 at the lowest rate; None if none did."""
    ordered = sorted(rates)
    base = per_rate[rate_key(ordered[0])][mode].get("e2e_ms_p50")
    best = None
    for rate in ordered:
        s = per_rate[rate_key(rate)][mode]
        e2e = s.get("e2e_ms_p50")
        if s["num_rejected"] or s["num_errors"] or e2e is None or base is None:
            continue
        if e2e <= latency_bound * base:
            best = rate
    return best


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num is not None and den else None


def _warm_up(base_url: str, trace: list[Any]) -> None:
    """One short request first, so one-off start-up costs stay out of the first rate."""
    res = replay(trace[:1], base_url, request_timeout_s=600.0)[0]
    if not res.is_ok:
        logger.warning("warm-up request failed on %s: %s", base_url, res.error or res.status)


def _server_context(start_server: ServerFactory | Mapping[str, str], mode: str) -> Any:
    if isinstance(start_server, Mapping):
        return contextlib.nullcontext(start_server[mode])
    return start_server(mode)


def _run_ours(
    start_server: ServerFactory | Mapping[str, str],
    mode: str,
    items: Sequence[WorkloadItem],
    rates: Sequence[float],
    seed: int,
    opts: dict[str, Any],
) -> dict[str, dict[str, Any]]:
    out = {}
    with _server_context(start_server, mode) as base_url:
        warm = rag_trace(items[:1], None, seed, mode, 2, namespace=f"warmup-{mode}")
        _warm_up(base_url, warm)
        for rate in rates:
            # a namespace per (mode, rate, seed): every run starts from an empty chunk cache
            trace = rag_trace(
                items,
                rate,
                seed,
                mode,
                opts["max_tokens"],
                namespace=f"bench-{mode}-{rate_key(rate)}-{seed}",
                ignore_eos=opts["ignore_eos"],
            )
            results = replay(trace, base_url, request_timeout_s=opts["request_timeout_s"])
            out[rate_key(rate)] = summarize(results)
            logger.info("%s @ %s rps: %s", mode, rate_key(rate), out[rate_key(rate)])
    return out


def _run_vllm(
    items: Sequence[WorkloadItem],
    rates: Sequence[float],
    seed: int,
    opts: dict[str, Any],
    peer_server: Callable[[], AbstractContextManager[Any]] | None,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    from transformers import AutoTokenizer

    from cachecraft.bench.peer_vllm import VllmServer, prefix_cache_stats

    make = peer_server or (lambda: VllmServer(opts.get("model_dir"), opts["peer_python"]))
    out = {}
    with make() as srv:
        tokenizer = AutoTokenizer.from_pretrained(srv.model_dir)
        kw = {"tokenizer": tokenizer, "model": srv.model_name, "ignore_eos": opts["ignore_eos"]}
        _warm_up(srv.base_url, vllm_trace(items[:1], None, seed, max_tokens=2, **kw))
        for rate in rates:
            before = prefix_cache_stats(srv.base_url)
            salt = f"bench-{rate_key(rate)}-{seed}"  # vLLM's per-request cache isolation
            trace = vllm_trace(
                items, rate, seed, max_tokens=opts["max_tokens"], cache_salt=salt, **kw
            )
            results = replay(trace, srv.base_url, request_timeout_s=opts["request_timeout_s"])
            after = prefix_cache_stats(srv.base_url)
            summary = summarize(results)
            summary["prefix_cache"] = {k: int(after[k] - before[k]) for k in after}
            out[rate_key(rate)] = summary
            logger.info("vllm @ %s rps: %s", rate_key(rate), summary)
        peer_info = {"name": "vllm", "startup_s": getattr(srv, "startup_s", None)}
    return out, peer_info


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
) -> dict[str, Any]:
    """Replay one Poisson trace (synthetic Zipf workload unless `items`) at each rate, per mode.

    `start_server` is a factory (a fresh server per mode) or a {mode: base URL} mapping. The
    report's ratios are taken at `chosen_rate`, the highest rate prefix caching sustains.
    `ignore_eos` makes every mode generate exactly `max_tokens`, so latencies compare prefill
    work, not answer lengths. `peer_server` replaces the vLLM launcher (tests)."""
    if not rates or any(r <= 0 for r in rates):
        raise CachecraftError(f"rates must be positive, got {list(rates)}")
    if peer is not None and peer not in PEERS:
        raise CachecraftError(f"unknown peer {peer!r}; choose one of {', '.join(PEERS)}")
    if items is None:
        from cachecraft.bench.synthetic import synthetic

        items = synthetic(num_requests, seed=seed)
    items = list(items)
    if not items:
        raise CachecraftError("the serving bench needs at least one request")
    rates = sorted(rates)
    opts = {
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "request_timeout_s": request_timeout_s,
        "peer_python": peer_python or ".peer-venv/bin/python",
    }
    per_mode = {m: _run_ours(start_server, m, items, rates, seed, opts) for m in modes}
    result: dict[str, Any] = {
        "config": {
            "modes": list(modes),
            "peer": peer,
            "num_requests": len(items),
            "seed": seed,
            "max_tokens": max_tokens,
            "ignore_eos": ignore_eos,
            "latency_bound": latency_bound,
        },
        "rates": rates,
    }
    all_modes = list(modes)
    if peer == "vllm":
        per_mode["vllm"], result["peer"] = _run_vllm(items, rates, seed, opts, peer_server)
        all_modes.append("vllm")
    per_rate = {rate_key(r): {m: per_mode[m][rate_key(r)] for m in all_modes} for r in rates}
    result["per_rate"] = per_rate
    result["sustained_rate"] = {
        m: sustained_rate(per_rate, rates, m, latency_bound) for m in all_modes
    }
    anchor = "prefix" if "prefix" in modes else all_modes[0]
    chosen = result["sustained_rate"][anchor]
    result["chosen_rate"] = chosen if chosen is not None else rates[0]
    result["chosen_rate_is_sustained"] = chosen is not None
    at = per_rate[rate_key(result["chosen_rate"])]
    result["modes"] = at
    result.update(_ratios(at, per_mode))
    return result


def _ratios(
    at: Mapping[str, Mapping[str, Any]],
    per_mode: Mapping[str, Mapping[str, Mapping[str, Any]]],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cc = at.get("cachecraft")
    if cc is None:
        return out

    def max_tput(mode: str) -> float:
        return max(s["throughput_rps"] for s in per_mode[mode].values())

    for other in ("prefix", "vllm"):
        if other not in at:
            continue
        o = at[other]
        out[f"throughput_ratio_vs_{other}"] = _ratio(cc["throughput_rps"], o["throughput_rps"])
        out[f"e2e_p50_ratio_{other}_over_cachecraft"] = _ratio(o["e2e_ms_p50"], cc["e2e_ms_p50"])
        out[f"max_throughput_ratio_vs_{other}"] = _ratio(max_tput("cachecraft"), max_tput(other))
    if "vllm" in at:
        prompt, computed = cc.get("prompt_tokens"), cc.get("computed_tokens")
        out["vllm_prefix_cache"] = at["vllm"].get("prefix_cache")
        out["cachecraft_reused_tokens"] = (
            prompt - computed if prompt is not None and computed is not None else None
        )
        out["cachecraft_prompt_tokens"] = prompt
    return out
