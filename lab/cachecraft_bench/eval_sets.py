"""The tuning set and the report set (docs/evaluation.md): which seeds, shapes and wiki-qa
questions each holds, and the workloads `bench quality --set NAME` runs.

A seed belongs to one set for good: seeds below REPORT_SEEDS_FROM tune, the rest report.
wiki-qa's 310 questions are split too (a stable hash of the question id), since its seed only
reorders them. The lab refuses nothing: a seed of the other set is used, with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from cachecraft.errors import BadRequestError
from cachecraft_bench.item import WorkloadItem
from cachecraft_bench.wiki_qa import question_set
from cachecraft_bench.workloads import build_workload

__all__ = ["SHAPES", "Shape", "question_set", "seed_set", "set_shapes", "set_workloads"]

log = logging.getLogger(__name__)

SetName = Literal["tuning", "report"]
"""The two sets (wiki_qa.py's question_set uses the same names)."""
REPORT_SEEDS_FROM = 1000
"""Seeds 0..999 are the tuning set's, 1000 and above the report set's."""
FIRST_SEED: dict[str, int] = {"tuning": 0, "report": REPORT_SEEDS_FROM}


@dataclass(frozen=True, slots=True)
class Shape:
    """One workload of a set: a built-in generator with its options, and its size."""

    name: str
    workload: str
    options: dict[str, Any] = field(default_factory=dict)
    requests: int = 24
    """Requests drawn, warm-up included."""
    warmup: int = 8


SHAPES: dict[str, tuple[Shape, ...]] = {
    "tuning": (
        Shape("wiki-qa", "wiki-qa", {"questions": "tuning", "num_questions": 8}),
        Shape("synthetic", "synthetic"),
        Shape("two-hop", "two-hop"),
        Shape("many-short", "many-short"),
        Shape("long-doc", "long-doc"),
    ),
    "report": (
        Shape("wiki-qa", "wiki-qa", {"questions": "report", "num_questions": 8}),
        Shape("synthetic", "synthetic"),
        Shape("two-hop", "two-hop"),
        Shape("many-short", "many-short"),
        Shape("long-doc", "long-doc"),
        # a shape the tuning set never has: essay-length chunks
        Shape("essays", "synthetic", {"chunk_tokens": (400, 800), "k": 4}, requests=20, warmup=6),
    ),
}
"""set -> its shapes; the report set holds one shape tuning never sees. wiki-qa asks 8
questions over and over (a repeat retrieves k of its top 2k passages, shuffled): with every
question new, few chunks would recur within a few dozen requests."""


def seed_set(seed: int) -> SetName:
    """The set a seed belongs to."""
    return "report" if seed >= REPORT_SEEDS_FROM else "tuning"


def set_shapes(name: str, seed: int | None = None) -> tuple[int, tuple[Shape, ...]]:
    """(seed, shapes) of the set `name`; `seed` None takes the set's first seed. A seed of the
    other set is allowed, with a warning (tuning on report seeds spoils them)."""
    if name not in SHAPES:
        raise BadRequestError(f"unknown set {name!r}; choose from {', '.join(SHAPES)}")
    seed = FIRST_SEED[name] if seed is None else seed
    if seed_set(seed) != name:
        log.warning("seed %d belongs to the %s set, not to %s", seed, seed_set(seed), name)
    return seed, SHAPES[name]


def set_workloads(
    name: str, seed: int | None = None, requests: int | None = None, warmup: int | None = None
) -> list[tuple[str, list[WorkloadItem], int]]:
    """(shape name, items, warm-up requests) for every shape of the set `name`; `requests` and
    `warmup`, when given, replace each shape's own."""
    seed, shapes = set_shapes(name, seed)
    out = []
    for shape in shapes:
        n = requests if requests is not None else shape.requests
        items = build_workload(shape.workload, n, seed=seed, **shape.options)
        out.append((shape.name, items, warmup if warmup is not None else shape.warmup))
    return out
