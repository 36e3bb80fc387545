"""Which part of `bench serve`'s request stream each run replays. Pure index arithmetic.

The stream after its warm-up head is cut into parts of `num_requests` requests
(`split_stream`); every system replays part k in its k-th kind of run, so runs compared across
systems always hold the same requests:

    [ramp point 0: R parts][point 1: R] ... [point M-1: R]   M = max_runs, R = repeats
    [refine 0: R] ... [refine K-1: R]                         K = refine
    [burst 0][burst 1] ... [burst B-1]                        B = bursts
    [fraction 0: R] ... [fraction F-1: R]                     F = len(fractions)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachecraft_bench.item import WorkloadItem


@dataclass(frozen=True, slots=True)
class Parts:
    max_runs: int
    repeats: int
    refine: int
    bursts: int
    fractions: int

    @classmethod
    def of(cls, opts: Mapping[str, Any]) -> Parts:
        """From `run_serve_bench`'s options."""
        return cls(
            opts["max_runs"],
            opts.get("repeats", 1),
            opts.get("refine", 0),
            opts["bursts"],
            len(opts.get("fractions", ())),
        )

    def ramp(self, point: int) -> range:
        return range(point * self.repeats, (point + 1) * self.repeats)

    def refine_point(self, i: int) -> range:
        return self.ramp(self.max_runs + i)

    def burst(self, i: int) -> int:
        return (self.max_runs + self.refine) * self.repeats + i

    def fraction(self, i: int) -> range:
        first = self.burst(self.bursts) + i * self.repeats
        return range(first, first + self.repeats)

    @property
    def total(self) -> int:
        return self.burst(self.bursts) + self.fractions * self.repeats


def split_stream(
    items: Sequence[WorkloadItem], warmup: int, num_requests: int, num_parts: int
) -> tuple[list[WorkloadItem], list[list[WorkloadItem]]]:
    """The warm-up head of the stream and `num_parts` parts of `num_requests` after it. A
    stream shorter than warm-up + num_parts x num_requests wraps around to just after the
    warm-up (and with fewer items than the warm-up, the warm-up is the whole stream)."""
    items = list(items)
    warm = items[: min(warmup, len(items))]
    rest = items[len(warm) :] or items
    runs = [
        [rest[(i * num_requests + j) % len(rest)] for j in range(num_requests)]
        for i in range(num_parts)
    ]
    return warm, runs
