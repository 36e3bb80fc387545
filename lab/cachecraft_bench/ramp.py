"""The rate ramp of `bench serve`: which rates a system sustained, when its ramp stops, and
the rate that narrows the highest rate every system sustains. Pure arithmetic over run
summaries (`loadgen.summarize` plus `offered_rps`, or a point of repeated runs); owns no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

BURST = "burst"
"""The key of a system's bursts among its runs ({rate key: summary, BURST: [summary, ...]})."""

Runs = dict[str, Any]
"""One system's runs: {rate key: summary}, plus BURST: [summary of each burst] when it ran any."""


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
        if sustains(per_rate[rate_key(rate)][mode], base, latency_bound):
            best = rate
    return best


KEEP_UP = 0.85
"""A run keeps up when its throughput is at least this share of the rate its trace offered
(unsaturated, 16 requests whose service time is about the mean gap reach ~0.94)."""


def sustains(summary: Mapping[str, Any], base_e2e: float | None, latency_bound: float) -> bool:
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


def offered_rate(trace: Sequence[Any]) -> float | None:
    """The rate a trace actually offers: (n - 1) / last arrival (Poisson gaps vary)."""
    span = trace[-1].arrival_s if trace else 0.0
    return round((len(trace) - 1) / span, 4) if len(trace) > 1 and span > 0 else None


def saturated(summary: Mapping[str, Any], base_e2e: float | None, latency_bound: float) -> bool:
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
    last rate, until the system saturates (`saturated`) or `max_runs` ran. `runs` is {rate
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
        self._done = saturated(summary, self._base, self.latency_bound)


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
        ok = {r: sustains(s, base, latency_bound) for r, s in ran.items()}
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
