"""Layer hooks the runner installs: adaptive early termination and CacheBlend's selection.

Both return a keep mask over the rows computed at their layer; rows set False keep their
given (cached) K/V for the layers above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cachecraft.model.step import LayerView


def _in_span(positions: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return (positions >= start) & (positions < end)


@dataclass(slots=True)
class EarlyTermination:
    """Stop recomputing reused chunks the question hardly attends to (cache-craft.md §4).

    chunk_bounds [k, 2]: every chunk's span; eligible: indices of reused chunks that may stop.
    A chunk is unfocused when its share of the question rows' attention to all chunks is
    below `threshold`.
    """

    question_start: int
    chunk_bounds: torch.Tensor
    eligible: tuple[int, ...]
    threshold: float
    unfocused: list[int] = field(default_factory=list)

    def __call__(self, view: LayerView) -> torch.Tensor | None:
        question = view.positions >= self.question_start
        if not bool(question.any()) or not self.eligible:
            return None
        mass = view.attention_mass(question, self.chunk_bounds)
        share = mass / mass.sum().clamp(min=1e-12)
        keep = torch.ones_like(view.positions, dtype=torch.bool)
        for i in self.eligible:
            if float(share[i]) < self.threshold:
                self.unfocused.append(i)
                start, end = (int(x) for x in self.chunk_bounds[i])
                keep &= ~_in_span(view.positions, start, end)
        return keep


@dataclass(slots=True)
class DeviationSelect:
    """CacheBlend: at the check layer keep, per reused chunk, the `budget` tokens whose fresh
    K/V deviate most from the cached ones; every other token of the chunk stops there."""

    spans: tuple[tuple[int, int, int], ...]  # (start, end, budget)

    def __call__(self, view: LayerView) -> torch.Tensor | None:
        assert view.k_old is not None and view.v_old is not None
        dev = (view.k_new - view.k_old).pow(2).sum((0, 2)) + (view.v_new - view.v_old).pow(2).sum(
            (0, 2)
        )
        keep = torch.ones_like(view.positions, dtype=torch.bool)
        for start, end, budget in self.spans:
            rows = torch.nonzero(_in_span(view.positions, start, end)).flatten()
            keep[rows] = False
            if budget > 0 and rows.numel():
                top = torch.topk(dev[rows], min(budget, rows.numel())).indices
                keep[rows[top]] = True
        return keep
