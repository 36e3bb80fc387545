"""Aggregate per-request quality records into the report schema (bench/report.py) and into the
flat per-mode summary that `cachecraft bench quality --json` prints.

Pure arithmetic over small dicts: no model, no tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cachecraft_bench.metrics import percentile, summarize
from cachecraft_bench.paired import paired_summary

MEAN_METRICS: tuple[str, ...] = (
    "computed_fraction",
    "token_layers_fraction",
    "flops_fraction",
    "reused_recompute_fraction",
    "probe_fraction",
    "rouge_l",
    "first_token_kl",
    "tf_kl",
    "tf_agreement",
    "f1",
    "em",
    "contains",
    "chunk_hit_rate",
)
"""Per-request numbers summarised by their mean with a bootstrap 95% CI."""

FLAT_KEYS: dict[str, str] = {
    "computed_fraction": "computed_fraction",
    "ttft_ms_p50": "ttft_p50_ms",
    "ttft_speedup_vs_full": "ttft_speedup_vs_full",
    "rouge_l_vs_full": "rouge_l",
    "first_token_kl_vs_full": "first_token_kl",
    "tf_kl_vs_full": "tf_kl",
    "tf_agreement_vs_full": "tf_agreement",
    "f1_vs_gold": "f1",
    "em_vs_gold": "em",
    "contains_vs_gold": "contains",
    "flops_fraction": "flops_fraction",
    "ttft_ms_p95": "ttft_p95_ms",
    "chunk_hit_rate": "chunk_hit_rate",
    "storage_bytes": "storage_bytes",
}
"""--json key -> report-schema key. The first nine are the ones issue 3 lists."""

SWEEP_METRICS: tuple[str, ...] = (
    "computed_fraction",
    "token_layers_fraction",
    "flops_fraction",
    "tf_kl",
    "tf_agreement",
    "rouge_l",
    "first_token_kl",
)


def percentile_summary(
    values: Sequence[float], q: float, n_boot: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """{"mean": the q-th percentile, "ci95": its bootstrap CI, "n"}; "mean" keeps the key the
    report reads (bench/report.py metric_value) although it holds a percentile."""
    value = percentile(values, q)
    if value is None:
        return {"mean": None, "ci95": [None, None], "n": 0}
    vals = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    samples = vals[rng.integers(0, vals.size, size=(n_boot, vals.size))]
    stats = np.percentile(samples, q, axis=1)  # vectorised: one percentile per resample
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return {"mean": value, "ci95": [float(lo), float(hi)], "n": int(vals.size)}


def summarize_records(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One arm's per-request metrics: summaries for MEAN_METRICS and TTFT p50/p95, and "n"."""
    out: dict[str, Any] = {k: summarize([r.get(k) for r in records]) for k in MEAN_METRICS}
    ttft = [float(r["ttft_ms"]) for r in records]
    out["ttft_p50_ms"] = percentile_summary(ttft, 50)
    out["ttft_p95_ms"] = percentile_summary(ttft, 95)
    out["n"] = len(records)
    return out


def summarize_arm(records: Sequence[Mapping[str, Any]], store: Any) -> dict[str, Any]:
    """`summarize_records` plus the arm's store size at the end of the run."""
    out = summarize_records(records)
    out["storage_bytes"] = int(store.nbytes)
    out["num_variants"] = len(store)
    return out


def add_speedups(summaries: Mapping[str, dict[str, Any]]) -> None:
    """Set each summary's ttft_speedup_vs_full (full's TTFT p50 over its own)."""
    full_p50 = (summaries.get("full") or {}).get("ttft_p50_ms", {}).get("mean")
    for s in summaries.values():
        p50 = s["ttft_p50_ms"]["mean"]
        s["ttft_speedup_vs_full"] = full_p50 / p50 if full_p50 and p50 else None


def sweep_point(arm: str, param: float, summary: Mapping[str, Any]) -> dict[str, Any]:
    """One point of a sweep curve from its arm's summary."""
    point: dict[str, Any] = {"param": param, "arm": arm}
    point.update({k: summary[k]["mean"] for k in SWEEP_METRICS})
    point["ttft_p50_ms"] = summary["ttft_p50_ms"]["mean"]
    point["n"] = summary["n"]
    return point


def summarize_results(arms: Sequence[Any], out: Mapping[str, tuple[list, Any]]) -> dict[str, Any]:
    """{"modes": {arm: metrics}, "sweep": {mode: [points]}, "requests": {arm: records}} for
    the arms of one workload (`out`: arm name -> (records, store), as run_arms returns)."""
    summaries = {a.name: summarize_arm(*out[a.name]) for a in arms}
    add_speedups(summaries)
    modes = {a.name: summaries[a.name] for a in arms if a.sweep is None}
    sweep: dict[str, list[dict[str, Any]]] = {}
    for a in arms:
        if a.sweep is not None:
            point = sweep_point(a.name, a.sweep[1], summaries[a.name])
            sweep.setdefault(a.sweep[0], []).append(point)
    for points in sweep.values():
        points.sort(key=lambda p: p["param"])
    requests = {a.name: out[a.name][0] for a in arms}
    paired = paired_summary({name: requests[name] for name in modes})
    return {"modes": modes, "sweep": sweep, "paired": paired, "requests": requests}


def _flat_mode(metrics: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    ci: dict[str, Any] = {}
    for key, src in FLAT_KEYS.items():
        entry = metrics.get(src)
        if isinstance(entry, dict):
            flat[key] = entry.get("mean")
            ci[key] = entry.get("ci95")
        else:
            flat[key] = entry
    flat["n"] = metrics.get("n")
    flat["ci95"] = ci
    return flat


def flat_summary(results: Mapping[str, Any]) -> dict[str, Any]:
    """The `--json` object: config, then per mode under "modes" the means (keys FLAT_KEYS, "n"),
    their 95% CIs under that mode's "ci95", and the sweep points under "sweep"."""
    config = dict(results.get("config") or {})
    workloads = results.get("workloads") or {}
    name, wl = next(iter(workloads.items())) if workloads else ("", {})
    return {
        "model": config.get("model"),
        "workload": name,
        "requests": config.get("requests"),
        "warmup": config.get("warmup"),
        "match_budget": config.get("match_budget"),
        "modes": {m: _flat_mode(v) for m, v in (wl.get("modes") or {}).items()},
        "sweep": wl.get("sweep") or {},
    }
