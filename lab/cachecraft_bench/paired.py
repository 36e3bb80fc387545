"""Paired comparisons: every arm against cachecraft on the same requests.

Two arms that answered the same requests are compared request by request: the mean of the
per-request differences, with a bootstrap CI over requests, is much tighter than two
overlapping per-arm CIs, because both arms share each request's difficulty. Also the share of
naive reuse's teacher-forced KL that an arm removes, 1 - mean(arm) / mean(naive), with its CI
from resampling requests jointly.

Pure arithmetic over the per-request records of bench/quality.py; no model, no tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cachecraft_bench.metrics import bootstrap_ci, summarize

PAIRED_METRICS: tuple[str, ...] = (
    "tf_kl", "first_token_kl", "rouge_l", "tf_agreement", "computed_fraction", "flops_fraction",
)  # fmt: skip
"""Per-request metrics whose paired differences are reported (arm minus reference)."""

GOLD_METRICS: tuple[str, ...] = ("f1", "em", "contains")
"""Scores against the gold answers, also paired with `full` (how much an arm loses of what the
full prefill answers right)."""

Records = Sequence[Mapping[str, Any]]


def _aligned(a: Records, b: Records, key: str) -> tuple[np.ndarray, np.ndarray]:
    """Values of `key` for the requests both record lists have (by id), in a's order."""
    by_id = {r["id"]: r.get(key) for r in b}
    pairs = [
        (r.get(key), by_id[r["id"]])
        for r in a
        if r["id"] in by_id and r.get(key) is not None and by_id[r["id"]] is not None
    ]
    x = np.asarray([p[0] for p in pairs], dtype=np.float64)
    y = np.asarray([p[1] for p in pairs], dtype=np.float64)
    return x, y


def paired_difference(arm: Records, ref: Records, key: str) -> dict[str, Any]:
    """{"mean", "ci95", "n"} of arm[key] - ref[key] over shared requests, plus "ref_lower":
    the share of requests where the reference's value is strictly lower."""
    x, y = _aligned(arm, ref, key)
    out = summarize((x - y).tolist())
    out["ref_lower"] = float(np.mean(y < x)) if x.size else None
    return out


def kl_removed(
    arm: Records, naive: Records, key: str = "tf_kl", n_boot: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """1 - mean(arm) / mean(naive) over shared requests, with a bootstrap 95% CI, and "worse":
    how many requests the arm left further off than naive reuse (a ratio of means hides
    them: one such request can set it)."""
    x, y = _aligned(arm, naive, key)
    worse = int((x > y).sum())
    if x.size == 0 or y.sum() <= 0:
        return {"mean": None, "ci95": [None, None], "n": int(x.size), "worse": worse}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    num, den = x[idx].sum(axis=1), y[idx].sum(axis=1)
    ratios = 1.0 - num[den > 0] / den[den > 0]
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return {
        "mean": float(1.0 - x.sum() / y.sum()),
        "ci95": [float(lo), float(hi)],
        "n": int(x.size),
        "worse": worse,
    }


def median_ratio(
    arm: Records, ref: Records, key: str = "ttft_ms", n_boot: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """{"median", "ci95", "n"}: the median over shared requests of arm[key] / ref[key], with a
    bootstrap 95% CI of that median (a ratio per request, so that one long prompt's time does
    not outweigh the others')."""
    x, y = _aligned(arm, ref, key)
    r = x[y > 0] / y[y > 0]
    if r.size == 0:
        return {"median": None, "ci95": [None, None], "n": 0}
    lo, hi = bootstrap_ci(r, n_boot=n_boot, seed=seed, stat=np.median)
    return {"median": float(np.median(r)), "ci95": [lo, hi], "n": int(r.size)}


def paired_summary(
    requests: Mapping[str, Records], ref: str = "cachecraft", naive: str = "naive"
) -> dict[str, Any]:
    """{"reference": ref, "arms": {arm: {metric: paired_difference}}, "kl_removed": {arm: ...},
    "vs_full": {arm: {gold metric: paired_difference with full}}, "ttft_vs_full": {arm:
    median_ratio of its TTFT to full's}} for every arm but `full` and the reference (vs_full
    and ttft_vs_full: every arm but full, when the requests have gold answers / timings); only
    ttft_vs_full (or nothing) when the reference was not run."""
    ttft = {}
    if "full" in requests and any(r.get("ttft_ms") for r in requests["full"]):
        full = requests["full"]
        ttft = {name: median_ratio(recs, full) for name, recs in requests.items() if name != "full"}
    if ref not in requests:
        return {"ttft_vs_full": ttft} if ttft else {}
    others = [name for name in requests if name not in ("full", ref)]
    arms = {
        name: {k: paired_difference(requests[name], requests[ref], k) for k in PAIRED_METRICS}
        for name in others
    }
    removed = {}
    if naive in requests:
        removed = {
            name: kl_removed(requests[name], requests[naive])
            for name in requests
            if name not in ("full", naive)
        }
    vs_full = {}
    if "full" in requests and any(r.get("f1") is not None for r in requests["full"]):
        vs_full = {
            name: {k: paired_difference(requests[name], requests["full"], k) for k in GOLD_METRICS}
            for name in requests
            if name != "full"
        }
    return {
        "reference": ref,
        "arms": arms,
        "kl_removed": removed,
        "vs_full": vs_full,
        "ttft_vs_full": ttft,
    }
