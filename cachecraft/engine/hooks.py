"""Layer hooks the runner installs: adaptive early termination and CacheBlend's selection
(the question probe measures with the model's KeyMeter, model/step.py).

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
    K/V deviate most from the cached ones; every other token of the chunk stops there. With
    `weights` (cachecraft) the rank is the question's attention x the deviation's norm."""

    spans: tuple[tuple[int, int, int], ...]  # (start, end, budget)
    total: int | None = None
    """If set, keep the top `total` tokens over all spans together (CacheBlend's global pick)."""
    weights: torch.Tensor | None = None
    """[num_tokens] by absolute position: rank by weight x norm of the deviation instead."""
    sink: int = 0
    """The first `sink` positions of each span are kept first, whatever their deviation (they
    count in the budget or the total)."""

    def __call__(self, view: LayerView) -> torch.Tensor | None:
        assert view.k_old is not None and view.v_old is not None
        dk = (view.k_new - view.k_old).float().pow(2).sum((0, 2))  # [n]
        dev = dk + (view.v_new - view.v_old).float().pow(2).sum((0, 2))
        if self.weights is not None:
            dev = dev.sqrt() * self.weights.to(dev.device)[view.positions]
        keep = torch.ones_like(view.positions, dtype=torch.bool)
        in_spans = torch.zeros_like(keep)
        left = self.total  # the global pick's tokens still to give (None: per span)
        for start, end, budget in self.spans:
            rows = torch.nonzero(_in_span(view.positions, start, end)).flatten()
            keep[rows] = False
            if self.sink > 0:  # rows ascend by position: a span's first tokens come first
                room = max(budget if left is None else left, 0)
                lifted = rows[view.positions[rows] < start + self.sink][:room]
                keep[lifted] = True
                rows = rows[~keep[rows]]
                if left is None:
                    budget -= lifted.numel()
                else:
                    left -= lifted.numel()
            in_spans[rows] = True
            if left is None and budget > 0 and rows.numel():
                top = torch.topk(dev[rows], min(budget, rows.numel())).indices
                keep[rows[top]] = True
        if left is not None and left > 0:
            rows = torch.nonzero(in_spans).flatten()
            if rows.numel():
                top = torch.topk(dev[rows], min(left, rows.numel())).indices
                keep[rows[top]] = True
        return keep
