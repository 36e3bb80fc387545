"""Confidence for `bench serve`: a point of repeated runs summarised with bootstrap CIs, and
ratios between systems with theirs. Pure arithmetic over run summaries; owns no I/O.

A point is `repeats` runs of one system at one rate, each over its own part of the stream.
Its throughput is the median of the runs' (CI: bootstrap over the runs); its latencies are
percentiles of every request of every run pooled (CI of the p50: bootstrap over the requests).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cachecraft_bench.metrics import bootstrap_ci, p50, p95

N_BOOT = 2000
SUM_KEYS = ("num_requests", "num_completed", "num_rejected", "num_errors", "output_tokens")
TOKEN_KEYS = ("prompt_tokens", "computed_tokens", "work_tokens")
RUN_KEYS = ("throughput_rps", "offered_rps", "e2e_ms_p50", "ttft_ms_p50", "makespan_s")


def ci(values: Sequence[float | None], stat: Any = np.median, seed: int = 0) -> list[float] | None:
    """The 95% percentile-bootstrap interval of `stat` over `values` (rounded), or None when
    fewer than two values are known (JSON-clean: never NaN)."""
    known = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if len(known) < 2:
        return None
    lo, hi = bootstrap_ci(known, n_boot=N_BOOT, seed=seed, stat=stat)
    return [round(lo, 4), round(hi, 4)]


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(float(np.median(known)), 4) if known else None


def aggregate_runs(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One point from the summaries of its repeated runs (each a `loadgen.summarize` result
    with `e2e_ms` / `ttft_ms`: its completed requests' latencies, and `offered_rps`). Counts
    and tokens add up; token rates are over the summed makespans; `runs` keeps each run's
    headline numbers."""
    out: dict[str, Any] = {key: sum(int(r.get(key) or 0) for r in runs) for key in SUM_KEYS}
    for key in TOKEN_KEYS:
        values = [r.get(key) for r in runs]
        out[key] = None if any(v is None for v in values) else round(sum(values), 1)
    span = sum(float(r.get("makespan_s") or 0.0) for r in runs)
    out["makespan_s"] = round(span, 3)
    prompt, computed = out["prompt_tokens"], out["computed_tokens"]
    out["computed_fraction"] = (
        round(computed / prompt, 4) if prompt and computed is not None else None
    )
    for key in ("computed_tokens", "work_tokens"):
        out[f"{key}_per_s"] = round(out[key] / span, 1) if out[key] and span else None
    tput = [r.get("throughput_rps", 0.0) for r in runs]
    out["throughput_rps"] = _median(tput) or 0.0
    out["throughput_rps_ci"] = ci(tput)
    out["offered_rps"] = _median([r.get("offered_rps") for r in runs])
    for name in ("e2e", "ttft"):
        pooled = [v for r in runs for v in r.get(f"{name}_ms") or []]
        out[f"{name}_ms_p50"] = None if not pooled else round(p50(pooled), 2)  # type: ignore[arg-type]
        out[f"{name}_ms_p95"] = None if not pooled else round(p95(pooled), 2)  # type: ignore[arg-type]
        out[f"{name}_ms_p50_ci"] = ci(pooled)
        out[f"{name}_ms"] = pooled
    out["send_lag_ms_max"] = max((r.get("send_lag_ms_max") or 0.0 for r in runs), default=0.0)
    caches = [r["prefix_cache"] for r in runs if "prefix_cache" in r]
    if caches:
        out["prefix_cache"] = {k: sum(c[k] for c in caches) for k in caches[0]}
    out["num_runs"] = len(runs)
    out["runs"] = [{k: r.get(k) for k in RUN_KEYS} for r in runs]
    return out


def ratio_of_medians_ci(
    num: Sequence[float], den: Sequence[float], seed: int = 0
) -> list[float] | None:
    """95% bootstrap interval of median(num) / median(den), the two samples resampled apart
    (independent requests: latencies of two systems). None with fewer than two of either."""
    a = np.asarray([v for v in num if v is not None], dtype=np.float64)
    b = np.asarray([v for v in den if v is not None], dtype=np.float64)
    if a.size < 2 or b.size < 2:
        return None
    rng = np.random.default_rng(seed)
    ra = np.median(a[rng.integers(0, a.size, size=(N_BOOT, a.size))], axis=1)
    rb = np.median(b[rng.integers(0, b.size, size=(N_BOOT, b.size))], axis=1)
    keep = rb > 0
    if not keep.any():
        return None
    lo, hi = np.percentile(ra[keep] / rb[keep], [2.5, 97.5])
    return [round(float(lo), 3), round(float(hi), 3)]


def paired_ratio_ci(
    num: Sequence[float], den: Sequence[float], seed: int = 0
) -> list[float] | None:
    """95% bootstrap interval of median(num) / median(den) with the pairs resampled together
    (the bursts of two systems ran in the same rounds, seconds apart: a round's drift is
    shared). None with fewer than two pairs."""
    pairs = [(a, b) for a, b in zip(num, den, strict=True) if a is not None and b]
    if len(pairs) < 2:
        return None
    arr = np.asarray(pairs, dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(arr), size=(N_BOOT, len(arr)))
    ratios = np.median(arr[idx, 0], axis=1) / np.median(arr[idx, 1], axis=1)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return [round(float(lo), 3), round(float(hi), 3)]


def latency_at_fraction(point: Mapping[str, Any]) -> dict[str, Any]:
    """The headline of a point run at a fraction of its system's own capacity."""
    keys = ("offered_rps", "throughput_rps", "e2e_ms_p50", "e2e_ms_p50_ci", "ttft_ms_p50")
    return {k: point.get(k) for k in keys}
