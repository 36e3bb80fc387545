"""Per-request records of `bench quality` runs, kept small enough to live in git.

A run's `results.json` holds every arm's per-request records with their answers and per-chunk
plans (1-5 MB on the 1.5B model), too big to keep; without them draws cannot be pooled with
confidence intervals later. `slim` keeps, per run and arm, the scores the paired comparisons
read (`SLIM_KEYS`), column by column in request order, rounded to `DIGITS` significant digits;
`expand` gives back per-arm record lists that `paired.paired_difference` and
`paired.kl_removed` take, with request ids prefixed by the run's name so several runs pool
without clashing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

SLIM_KEYS: tuple[str, ...] = (
    "tf_kl", "first_token_kl", "rouge_l", "f1", "contains",
    "reused_recompute_fraction", "probe_fraction", "flops_fraction",
)  # fmt: skip
"""The per-request scores kept: closeness to full, the gold scores, what was computed."""

DIGITS = 4
"""Significant digits kept: a relative error of 5e-4, far below the paired differences and
their CIs the reports quote."""


def _round(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, float):
        return value
    return float(f"{value:.{DIGITS}g}")


def slim(results: Mapping[str, Any]) -> dict[str, Any]:
    """{workload: {"ids": [...], "arms": {arm: {key: [value per request]}}}} of one results.json
    (`bench quality --out`). Every arm must hold the same requests in the same order, as
    `bench quality` writes them."""
    out: dict[str, Any] = {}
    for name, workload in results["workloads"].items():
        requests: Mapping[str, Sequence[Mapping[str, Any]]] = workload["requests"]
        ids = [r["id"] for r in next(iter(requests.values()))]
        arms: dict[str, dict[str, list[Any]]] = {}
        for arm, records in requests.items():
            if [r["id"] for r in records] != ids:
                raise ValueError(f"{name}: arm {arm!r} holds other requests than the first arm")
            arms[arm] = {k: [_round(r.get(k)) for r in records] for k in SLIM_KEYS}
        out[name] = {"ids": ids, "arms": arms}
    return out


def expand(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per arm, the records of every run in `runs` ({run name: one workload of `slim`'s
    output}), pooled; ids become "RUN:ID". An arm missing from a run is missing from the
    pool for that run's requests (paired comparisons skip them)."""
    pooled: dict[str, list[dict[str, Any]]] = {}
    for run, workload in runs.items():
        ids = workload["ids"]
        for arm, columns in workload["arms"].items():
            for i, rid in enumerate(ids):
                record = {k: v[i] for k, v in columns.items()}
                pooled.setdefault(arm, []).append({"id": f"{run}:{rid}", **record})
    return pooled
