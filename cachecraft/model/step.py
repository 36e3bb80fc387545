"""The data a forward step takes and returns: SeqWork and DecodeBatch in, SeqResult and
StepOutput out, LayerView for hooks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from cachecraft.model.attention import span_mass
from cachecraft.model.kv import KVCache


@dataclass(slots=True)
class LayerView:
    """What a hook sees for one sequence after layer `layer` wrote its fresh K/V.

    positions [n] are the rows still computed at this layer; q [H, n, D], k_new / v_new
    [Hkv, n, D] (keys rotated); k_old / v_old the K/V that sat at those positions before the
    write (None unless the hook asked for them).
    """

    layer: int
    positions: torch.Tensor
    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    k_old: torch.Tensor | None
    v_old: torch.Tensor | None
    keys: torch.Tensor
    window: int | None

    def attention_mass(self, rows: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        """Head- and row-averaged attention mass of the selected rows (bool [n]) per span [S]."""
        return span_mass(self.q[:, rows], self.keys, self.positions[rows], bounds, self.window)


Hook = Callable[[LayerView], "torch.Tensor | None"]
"""Called after a layer; returns a bool keep mask over the view's rows (False: stop computing
that row after this layer; its K/V at higher layers stay as given) or None to keep all."""


@dataclass(frozen=True, slots=True)
class KeyMeter:
    """The question probe's measure: the rows at positions >= `start` report, at layers
    first_layer..last_layer, the attention they give each key position below `start` (mean
    over heads, then over the layers; over the rows, the last one weighs `last_row` and the
    mean of all of them the rest): SeqResult.key_mass."""

    start: int
    first_layer: int
    last_layer: int
    last_row: float = 0.0


@dataclass(slots=True)
class SeqWork:
    """One sequence's share of a forward step.

    token_ids, positions [n]: the rows to compute, positions sorted ascending and absolute.
    Every position below positions[-1] that is not computed must already hold K/V in `kv`
    for every layer the row is not computed at.
    last_layer [n]: stop computing a row after this layer (None: all layers).
    span_bounds [S, 2]: if given, collect attention mass per span (see SeqResult) for the rows
    selected by stats_rows (bool [n]; None: all rows), at the layers in stats_layers (None:
    every layer). Only those rows at those layers pay for the statistics.
    hooks: layer -> Hook; hooks_need_old: also pass the K/V the write replaced.
    meter: measure the attention some rows give each key (see KeyMeter; those layers run
    their attention with explicit scores).
    before_layer(l): called before layer l runs, to fill given K/V of that layer just in time
    (layer-wise loading of chunk-caches overlaps with the compute of the layer before).
    logits_for: "last" (the last row), "all" rows, or "none".
    The index tensors may live on the host: the step moves them to the cache's device.
    """

    kv: KVCache
    token_ids: torch.Tensor
    positions: torch.Tensor
    last_layer: torch.Tensor | None = None
    span_bounds: torch.Tensor | None = None
    stats_rows: torch.Tensor | None = None
    stats_layers: tuple[int, ...] | None = None
    hooks: dict[int, Hook] = field(default_factory=dict)
    hooks_need_old: bool = False
    before_layer: Callable[[int], None] | None = None
    logits_for: str = "last"
    meter: KeyMeter | None = None


@dataclass(slots=True)
class SeqResult:
    """logits [m, vocab] (fp32) for the rows asked for.

    rows_last_layer [n]: the layer each row was last computed at (after hooks).
    span_mass_layers [L, S, S]: row-summed mass from each span's computed rows to each span.
    row_span_mass [n, S]: per row, mass per span averaged over the measured layers it was
    computed at.
    key_mass [meter.start]: what the work's KeyMeter measured (None without one), left on the
    model's device: the probe's selection ranks it there (engine/selection.py).
    The others on the host (the CPU), whatever the model's device: sampling and planning read
    them.
    """

    logits: torch.Tensor
    rows_last_layer: torch.Tensor
    span_mass_layers: torch.Tensor | None = None
    row_span_mass: torch.Tensor | None = None
    key_mass: torch.Tensor | None = None


@dataclass(slots=True)
class DecodeBatch:
    """Plain decode rows: one token per sequence, each cache a slot of one `KVPool`; no hooks,
    statistics or early exit (what a decode step of a served request is). They share ONE
    attention call per layer (per group of neighbouring slots, model/decode.py).

    caches [B]; token_ids, positions [B]: the token fed back and where it goes (normally the
    cache's length; the K/V of every position below must be in the cache).
    """

    caches: list[KVCache]
    token_ids: torch.Tensor
    positions: torch.Tensor


class StepOutput(NamedTuple):
    """results: one per SeqWork, in order; decode_logits [B, vocab] (fp32, on the host) for
    the DecodeBatch rows in order (None without a batch)."""

    results: list[SeqResult]
    decode_logits: torch.Tensor | None


def piece(work: SeqWork, start: int, end: int) -> SeqWork:
    """Rows start..end-1 of `work` as a SeqWork of their own (a piece of a prefill split over
    several steps; later pieces read the K/V earlier ones wrote). Only a work without hooks,
    a meter or per-row last layers can be split; its layer loader goes with the first piece
    (it fills every layer of the reused K/V as that piece's forward reaches it); logits as
    asked: all rows' from every piece, the last row's from the last piece only."""
    if work.hooks or work.last_layer is not None or work.meter is not None:
        raise ValueError("a work with hooks, a key meter or per-row last layers runs whole")
    n = work.positions.shape[0]
    return SeqWork(
        work.kv,
        work.token_ids[start:end],
        work.positions[start:end],
        span_bounds=work.span_bounds,
        stats_rows=None if work.stats_rows is None else work.stats_rows[start:end],
        stats_layers=work.stats_layers,
        before_layer=work.before_layer if start == 0 else None,
        logits_for=work.logits_for if end == n or work.logits_for == "all" else "none",
    )


def merge_results(parts: list[SeqResult]) -> SeqResult:
    """One SeqResult from the results of consecutive pieces of one work (see `piece`)."""
    layers = [p.span_mass_layers for p in parts if p.span_mass_layers is not None]
    rows = [p.row_span_mass for p in parts if p.row_span_mass is not None]
    return SeqResult(
        torch.cat([p.logits for p in parts]),
        torch.cat([p.rows_last_layer for p in parts]),
        torch.stack(layers).sum(0) if layers else None,
        torch.cat(rows) if len(rows) == len(parts) else None,
    )
