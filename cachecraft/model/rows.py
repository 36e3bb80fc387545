"""StepRows: one sequence's rows during a forward step, with what the host knows of them.

The device holds the rows still computed (positions, original numbers, last layers, RoPE
tables, statistics); the host holds their counts per layer and the bounds of their positions,
all worked out before the layer loop. So the layer loop never reads the device to decide
anything (on a GPU each read is a synchronisation that drains the queue): rows that stop are
dropped by a stable sort whose length the host knows (`kept_index`), not by `nonzero`.

What the host knows: the rows a work gives up front (their per-row last layers are read
before the loop), and after a hook the rows it keeps when the hook declares that count
(`Hook.num_kept`, e.g. the deviation check's budget) and saw every row. A hook that stops an
unknown number of rows (early termination) makes the next layer read the count back once.
"""

from __future__ import annotations

import torch

from cachecraft.model.attention import MeterPlan, RowPlan, plan_meter, plan_rows, span_onehot
from cachecraft.model.rope import Rope
from cachecraft.model.step import SeqWork


def kept_index(stop: torch.Tensor, num_kept: int) -> torch.Tensor:
    """Ascending indexes of the False entries of bool `stop` [n], of which the caller knows
    there are `num_kept`: a stable sort puts them first, in order, with no read-back."""
    if num_kept == stop.shape[0]:
        return torch.arange(num_kept, device=stop.device)
    return torch.sort(stop.to(torch.int32), stable=True).indices[:num_kept]


class StepRows:
    """Book-keeping of one sequence's active rows during a step, on the cache's device (a
    SeqWork's index tensors may come from the host; the step's results go back to it)."""

    def __init__(self, work: SeqWork, num_layers: int, num_spans: int, rope: Rope) -> None:
        n = work.positions.shape[0]
        device = work.kv.k.device
        self.work = work
        top = num_layers - 1
        # host facts, read before the layer loop
        self.num_rows = n
        self.first: int | None = int(work.positions[0]) if n else 0
        self.last = int(work.positions[-1]) if n else -1
        self.is_contiguous = n > 0 and self.last - self.first + 1 == n
        self.alive: list[int | None] = [n] * num_layers
        """Rows computed at each layer (None: known only by reading the device)."""
        if work.last_layer is not None and n:
            ends = work.last_layer.to("cpu", torch.long).clamp(min=0, max=top)
            stops = torch.bincount(ends, minlength=num_layers).tolist()
            left = n
            for layer in range(num_layers):
                self.alive[layer] = left
                left -= stops[layer]
        self.num_metered = 0
        if work.meter is not None:
            self.num_metered = int((work.positions >= work.meter.start).sum())
        self.positions = work.positions.to(device)
        self.cos, self.sin = rope.cos_sin(self.positions, work.kv.k.dtype)
        self.index = torch.arange(n, device=device)  # original row numbers
        self.last_layer = (
            torch.full((n,), top, dtype=torch.long, device=device)
            if work.last_layer is None
            else work.last_layer.to(device, torch.long).clamp(max=top).clone()
        )
        self.final_last_layer = self.last_layer.clone()
        self.attn_plan: RowPlan | None = None  # for the current `positions` (see `plan`)
        self.meter_at: torch.Tensor | None = None  # the `positions` of meter_plan (`metered`)
        self.meter_plan: MeterPlan | None = None
        self.mass_layers: torch.Tensor | None = None
        self.mass_rows: torch.Tensor | None = None
        self.row_layers: torch.Tensor | None = None
        self.key_total: torch.Tensor | None = None  # the KeyMeter's sum over its layers
        self.key_layers = 0
        self.has_stats_rows = False
        if work.meter is not None and work.span_bounds is not None:
            raise ValueError("a work measures span statistics or a key meter, not both")
        if work.span_bounds is not None:
            self.mass_layers = torch.zeros((num_layers, num_spans, num_spans), device=device)
            self.mass_rows = torch.zeros((n, num_spans), device=device)
            self.row_layers = torch.zeros(n, device=device)
            bounds = work.span_bounds.to(device)
            starts = bounds[:, 0].contiguous()
            self.row_span = torch.bucketize(self.positions, starts, right=True) - 1
            self.onehot = span_onehot(bounds, self.last + 1, work.kv.k.dtype)
            self.has_stats_rows = work.stats_rows is None or bool(work.stats_rows.any())
            self.stats_rows = (
                torch.ones(n, dtype=torch.bool, device=device)
                if work.stats_rows is None
                else work.stats_rows.to(device, torch.bool).clone()
            )
            self.stats_at = (
                frozenset(range(num_layers))
                if work.stats_layers is None
                else frozenset(work.stats_layers)
            )

    @property
    def is_whole(self) -> bool:
        """No row has stopped yet (the rows are the work's own)."""
        return self.num_rows == self.work.positions.shape[0]

    def rows_at(self, layer: int) -> int:
        """Rows computed at `layer` (read back from the device only where the host cannot know:
        after a hook that does not say how many rows it keeps)."""
        count = self.alive[layer]
        if count is None:
            count = int((self.last_layer >= layer).sum())
            self.alive[layer] = count
            if self.work.last_layer is None:  # only hooks stop rows: the count holds on
                for above in range(layer + 1, len(self.alive)):
                    if self.alive[above] is not None:
                        break
                    self.alive[above] = count
        return count

    def compact(self, layer: int) -> torch.Tensor | None:
        """Drop the rows whose last layer is below `layer`; their indexes among the rows before
        (None: none stopped)."""
        count = self.rows_at(layer)
        if count == self.num_rows:
            return None
        keep = kept_index(self.last_layer < layer, count)
        self.positions, self.index = self.positions[keep], self.index[keep]
        self.last_layer = self.last_layer[keep]
        self.cos, self.sin = self.cos[keep], self.sin[keep]
        if self.mass_rows is not None:
            self.stats_rows = self.stats_rows[keep]
        self.num_rows = count
        self.is_contiguous = False
        self.first = None  # the last position stays an upper bound (keys past it are masked)
        return keep

    def going_on(self, layer: int) -> torch.Tensor:
        """Indexes among the current rows of those computed at `layer + 1`."""
        count = self.rows_at(layer + 1)
        return kept_index(self.last_layer <= layer, count)

    def stop(self, keep: torch.Tensor, layer: int, num_kept: int | None) -> None:
        """A hook's keep mask (bool [rows]): the others stop after `layer`. `num_kept`: how
        many it keeps, when it says so (it then counts for every layer above, unless per-row
        last layers or rows already stopped make it unknowable)."""
        keep = keep.to(torch.bool)
        self.last_layer = torch.where(keep, self.last_layer, layer)
        self.final_last_layer.index_copy_(0, self.index, self.last_layer)
        known = num_kept if self.work.last_layer is None and self.is_whole else None
        for above in range(layer + 1, len(self.alive)):
            self.alive[above] = known

    def plan(self, window: int | None, dtype: torch.dtype) -> RowPlan:
        """The attention plan of the rows still computed: built on the first layer, again only
        after rows stopped (`positions` is then a new tensor)."""
        if self.attn_plan is None or self.attn_plan.q_pos is not self.positions:
            self.attn_plan = plan_rows(self.positions, window, dtype, (self.first, self.last))
        return self.attn_plan

    def metered(self, window: int | None, num_heads: int, num_kv: int) -> MeterPlan | None:
        """The KeyMeter's plan for the rows still computed (None: none of them reports),
        built as `plan` is: on the first metered layer, again only after rows stopped."""
        meter = self.work.meter
        assert meter is not None
        if self.meter_at is not self.positions:
            self.meter_at = self.positions
            rows = self.positions >= meter.start
            if self.is_whole:  # the host counted them before the loop
                count, last = self.num_metered, self.last
            else:
                count, last = int(rows.sum()), int(self.positions[-1])
            self.meter_plan = (
                plan_meter(
                    self.positions, window, num_heads, num_kv, rows, meter.last_row, (last, count)
                )
                if count
                else None
            )
        return self.meter_plan

    def add_key_mass(self, mass: torch.Tensor) -> None:
        """One layer's KeyMeter measure [meter.start]."""
        mass = mass.float()
        self.key_total = mass if self.key_total is None else self.key_total + mass
        self.key_layers += 1

    def key_mass(self) -> torch.Tensor | None:
        """The KeyMeter's mean over the layers it measured (zeros if none; None: no meter)."""
        meter = self.work.meter
        if meter is None:
            return None
        if self.key_total is None:
            return torch.zeros(meter.start, device=self.positions.device)
        return self.key_total / self.key_layers

    def collect(self, layer: int, mass: torch.Tensor) -> None:
        """Add one layer's span mass [rows, S]: the statistics rows' share (the others add
        zeros, so that no boolean gather reads the device)."""
        assert self.mass_layers is not None and self.mass_rows is not None
        assert self.row_layers is not None
        sel = self.stats_rows
        mass = mass.float() * sel[:, None]
        self.mass_layers[layer].index_add_(0, self.row_span[self.index], mass)
        self.mass_rows.index_add_(0, self.index, mass)
        self.row_layers.index_add_(0, self.index, sel.float())
