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
    `weights` (cachecraft) the rank is the question's attention x the deviation's norm.

    `prepare(rows)` with the work's rows (host positions) works out before the forward every
    choice but the ranking itself: which rows each span's top-k ranks, how many, the sinks kept
    first. The check then runs on the device with no read-back and says how many rows it keeps
    (`num_kept`). Without it (or seeing other rows than prepared) it works them out itself."""

    spans: tuple[tuple[int, int, int], ...]  # (start, end, budget)
    total: int | None = None
    """If set, keep the top `total` tokens over all spans together (CacheBlend's global pick)."""
    weights: torch.Tensor | None = None
    """[num_tokens] by absolute position: rank by weight x norm of the deviation instead."""
    sink: int = 0
    """The first `sink` positions of each span are kept first, whatever their deviation (they
    count in the budget or the total)."""
    num_kept: int | None = None
    """Rows the check keeps of the prepared rows (None: not prepared)."""
    _rows: int = 0
    _base: torch.Tensor | None = None  # bool [rows]: kept whatever the ranking
    _picks: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (rows ranked, k)
    _row_weights: torch.Tensor | None = None  # [rows] the weights at the rows' positions

    def prepare(self, rows: torch.Tensor, device: torch.device) -> None:
        """Work out the check for rows (positions [n] ascending, on the host) that all reach
        its layer; the tensors it needs go to `device` now."""
        keep, in_spans, left, picks = self._choices(rows)
        self._picks = []
        for ranked, k in picks:
            if k > 0 and ranked.numel():
                self._picks.append((ranked.to(device), min(k, ranked.numel())))
        if left is not None and left > 0:
            ranked = torch.nonzero(in_spans).flatten()
            if ranked.numel():
                self._picks.append((ranked.to(device), min(left, ranked.numel())))
        self._rows = rows.shape[0]
        self._base = keep.to(device)
        self.num_kept = int(keep.sum()) + sum(k for _, k in self._picks)
        if self.weights is not None:
            self._row_weights = self.weights[rows].to(device)

    def _choices(
        self, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int | None, list[tuple[torch.Tensor, int]]]:
        """(keep: rows kept whatever the ranking, in_spans: rows the global pick ranks, what
        the global pick has left, per span (rows it ranks, how many it keeps))."""
        keep = torch.ones_like(positions, dtype=torch.bool)
        in_spans = torch.zeros_like(keep)
        left = self.total  # the global pick's tokens still to give (None: per span)
        picks: list[tuple[torch.Tensor, int]] = []
        for start, end, budget in self.spans:
            rows = torch.nonzero(_in_span(positions, start, end)).flatten()
            keep[rows] = False
            if self.sink > 0:  # rows ascend by position: a span's first tokens come first
                room = max(budget if left is None else left, 0)
                lifted = rows[positions[rows] < start + self.sink][:room]
                keep[lifted] = True
                rows = rows[~keep[rows]]
                if left is None:
                    budget -= lifted.numel()
                else:
                    left -= lifted.numel()
            in_spans[rows] = True
            if left is None:
                picks.append((rows, budget))
        return keep, in_spans, left, picks

    def __call__(self, view: LayerView) -> torch.Tensor | None:
        assert view.k_old is not None and view.v_old is not None
        dk = (view.k_new - view.k_old).float().pow(2).sum((0, 2))  # [n]
        dev = dk + (view.v_new - view.v_old).float().pow(2).sum((0, 2))
        if self._base is None or view.positions.shape[0] != self._rows:
            self.prepare(view.positions.cpu(), view.positions.device)  # reads back: not prepared
        assert self._base is not None
        if self._row_weights is not None:
            dev = dev.sqrt() * self._row_weights
        keep = self._base.clone()
        for ranked, k in self._picks:
            top = torch.topk(dev[ranked], k).indices
            keep[ranked[top]] = True
        return keep
