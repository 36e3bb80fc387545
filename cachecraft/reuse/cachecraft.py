"""The `cachecraft` strategy: CachecraftParams (its own parameters: the variant-scoring rules,
the question probe and the check layer) and its plan, plus the probe helpers the lab's
prophet baseline shares. Pure Python, no torch.

The plan: the variant with the lowest predicted error (honest beta); a chunk whose best
predicted error is above `ReuseConfig.refresh_error`, or that has no exact variant here in a
repeated prompt (`refresh_repeats`), is computed in full (a fresh variant); CFO sets the
request's budget; a probe of the question ranks the tokens and, with probe_check, the
top-ranked run to a check layer where question attention x K/V deviation picks the ones that go
on (selectors.select_by_question). A probe costing more than probe_max_cost x the budget is
trimmed to the question's last rows that fit (probe_trim) or replaced by a check of every
reused token at budget + probe cost; so is a probe whose candidates would be every reused token
anyway (probe_skip_wide: many short chunks), since it would rank nothing out. A ceiling
(ReuseConfig.max_recompute) bounds the budget and the probe's rows together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from cachecraft.config import check_fields, ranged
from cachecraft.reuse.modes import (
    PlanInput,
    fix_count,
    given_budget,
    hit,
    make_plan,
    mark_exact,
    miss,
)
from cachecraft.reuse.plan import ChunkPlan, DeviationCheck, ProbeCheck, PromptLayout, RecomputePlan
from cachecraft.reuse.plan import probe_rows as _probe_rows
from cachecraft.reuse.selectors import spread_by_size
from cachecraft.reuse.stats import ScoringRules
from cachecraft.reuse.strategy import ReuseStrategy


@dataclass(frozen=True, slots=True)
class CachecraftParams(ScoringRules):
    """The cachecraft strategy's parameters (its variant-scoring rules first); ablations make a
    strategy with other values."""

    inherit_error: bool = True
    """A reused chunk in front counts in beta only by (1 - its predicted error)."""
    early_termination: bool = True
    """The 'need' split gives chunks below ReuseConfig.focus_threshold nothing (False: all)."""
    probe_split: Literal["need", "global", "chunk"] = "global"
    """How the probe spends the budget: top tokens of all reused chunks by question attention
    ('global'), by predicted error x attention ('need'), or each chunk its own ('chunk')."""
    probe_first_layer: int | None = ranged(None, 0)
    """First layer whose question attention the probe averages (None: set by probe_from)."""
    probe_from: float = ranged(0.0, 0.0, 1.0)
    """Share of the model's layers, the first ones, whose question attention the probe runs
    but leaves out of its measure when probe_first_layer is None."""
    probe_last_layer: int | None = ranged(None, 0)
    """Last layer the probe runs and averages (None: set by probe_depth)."""
    probe_depth: float = ranged(1.0, 0.0)
    """Share of the model's layers the probe runs when probe_last_layer is None."""
    probe_blend: float = ranged(0.0, 0.0)
    """Weight of the stored token score added to the question attention."""
    probe_check: float = ranged(3.0, 0.0)
    """The top probe_check x budget tokens run to the check layer (0: no check)."""
    probe_check_layer: int = ranged(3, 0)
    """The layer whose fresh-minus-cached K/V the check measures."""
    probe_check_score: Literal["product", "deviation"] = "product"
    """The check ranks by attention ** probe_check_power x K/V deviation, or deviation alone."""
    probe_check_power: float = ranged(0.75, 0.0)
    """Exponent of the question attention in the check's rank."""
    probe_sink: int = ranged(4, 0)
    """The first probe_sink tokens of every probed chunk rank first."""
    probe_sink_kept: bool = True
    """The check keeps those first tokens whatever it measures (False: they are candidates
    it ranks like the others, and a check without a probe lifts none)."""
    probe_last_row: float = ranged(0.5, 0.0, 1.0)
    """Share of the probe's measure taken from the question's last row."""
    probe_max_cost: float | None = ranged(0.5, 0.0)
    """The probe costs at most this many times the budget it steers (None: no cap, and the
    probe runs even where probe_skip_wide would skip it)."""
    probe_skip_share: float = ranged(1.0, 0.0, 1.0)
    """Share of the probe cost cut by probe_max_cost that is added to the budget."""
    probe_trim: bool = True
    """A probe over its cost is trimmed to the question's last rows (False: skipped)."""
    probe_skip_wide: bool = True
    """No probe when its candidates would be every reused token anyway (probe_check x budget
    >= the reused tokens: it would rank nothing out); its cost goes to a check of them all.
    Needs a probe_max_cost (None: always probe)."""
    check_alone_layer: int | None = ranged(None, 0)
    """The layer of a check run without a probe (None: probe_check_layer)."""

    def __post_init__(self) -> None:
        check_fields(self)


class CachecraftStrategy(ReuseStrategy):
    """CFO budgets spent on the tokens the question reads (a probe pass, then a check)."""

    name = "cachecraft"
    remembers_prompts = True
    params: CachecraftParams

    @classmethod
    def default_params(cls) -> CachecraftParams:
        return CachecraftParams()

    def plan(self, inp: PlanInput) -> RecomputePlan:
        return plan_cachecraft(inp, self.params)


def make_probe(
    inp: PlanInput,
    p: CachecraftParams,
    total: int,
    split: str,
    focus: float,
    check: float,
    sink: int,
    question_rows: int | None = None,
) -> ProbeCheck:
    """The probe of a plan run with `p`'s probe settings; `sink`: each probed chunk's first
    tokens lifted in the ranking; `question_rows`: a trimmed probe's rows (None: all)."""
    return ProbeCheck(
        total=total,
        split=split,  # type: ignore[arg-type]
        first_layer=probe_first_layer(p, inp.num_layers),
        last_layer=probe_last_layer(p, inp.num_layers),
        focus_threshold=focus,
        blend=p.probe_blend,
        check=check,
        check_layer=_check_layer(p, inp.num_layers),
        check_score=p.probe_check_score,
        num_layers=inp.num_layers,
        sink=sink,
        sink_kept=p.probe_sink_kept,
        check_power=p.probe_check_power,
        last_row=p.probe_last_row,
        question_rows=question_rows,
    )


def plan_cachecraft(inp: PlanInput, p: CachecraftParams) -> RecomputePlan:
    """cachecraft's plan (the module's docstring)."""
    config = inp.config
    chunks: list[ChunkPlan] = []
    errors: dict[str, float] | None = {} if p.inherit_error else None
    for i, slot in enumerate(inp.layout.chunks):
        score = inp.choose(i, inherited=errors)
        if score is None:
            chunks.append(miss(slot))
        elif (config.refresh_error is not None and score.error > config.refresh_error) or (
            inp.repeat and config.refresh_repeats and not score.is_exact_here
        ):
            chunks.append(replace(miss(slot, "refresh"), error=score.error, cfo=score.cfo))
        else:
            budget, reason = given_budget(inp, i, fix_count(score.cfo, slot.num_tokens))
            reason = "cfo" if reason == "mode" else reason
            chunks.append(hit(slot, score, (), reason, budget=budget, select="probe"))
        if errors is not None:  # a chunk computed in full passes no staleness on
            last = chunks[-1]
            errors[slot.key] = (last.error or 0.0) if last.is_hit else 0.0
    total = _pooled_total(p, chunks)
    reused = sum(c.slot.num_tokens for c in chunks if c.select == "probe")
    ceiling = _ceiling(config.max_recompute, chunks, reused)
    if not total or ceiling == 0:  # nothing to recompute: no probe to steer it
        return make_plan(inp, "cachecraft", [_planned(c) for c in chunks])
    cost = probe_cost(inp.layout, inp.prefix_hit, p, inp.num_layers)
    # the budget if the whole probe runs; without a probe, its cost is spent instead
    budget = total if ceiling is None else min(total, math.floor(ceiling - cost + 1e-9))
    instead = total + math.ceil(p.probe_skip_share * cost - 1e-9)
    instead = instead if ceiling is None else min(instead, ceiling)
    wide = p.probe_check > 0 and p.probe_check * budget >= reused
    if p.probe_skip_wide and p.probe_max_cost is not None and wide:
        return _check_instead_of_probe(inp, p, chunks, instead)
    rows = None  # the question rows the probe runs (None: all of them)
    if budget < 1 or (p.probe_max_cost is not None and cost > p.probe_max_cost * budget):
        fit = 0  # a ceiling can leave no budget for a whole probe (no cap: budget >= 1)
        if p.probe_trim and p.probe_max_cost is not None and budget >= 1:
            room = p.probe_max_cost * budget
            fit = rows_that_fit(inp.layout, inp.prefix_hit, p, inp.num_layers, room)
        if fit < 1:
            return _check_instead_of_probe(inp, p, chunks, instead)
        rows = fit
        trimmed = probe_cost(inp.layout, inp.prefix_hit, p, inp.num_layers, rows)
        budget = min(budget + math.ceil(p.probe_skip_share * (cost - trimmed) - 1e-9), reused)
        if ceiling is not None:
            budget = min(budget, math.floor(ceiling - trimmed + 1e-9))
    focus = config.focus_threshold if p.early_termination else 0.0
    probe = make_probe(inp, p, budget, p.probe_split, focus, p.probe_check, p.probe_sink, rows)
    return make_plan(inp, "cachecraft", chunks, probe=probe)


def rows_that_fit(
    layout: PromptLayout, prefix_hit: bool, p: CachecraftParams, num_layers: int, cost: float
) -> int:
    """The most question rows a probe run with `p` can run within `cost` (full-depth rows;
    the uncached prefix, which the probe must run as well, comes first)."""
    share = (probe_last_layer(p, num_layers) + 1) / num_layers
    prefix = 0 if prefix_hit else layout.prefix_len
    return max(min(math.floor(cost / share + 1e-9) - prefix, len(layout.question_ids)), 0)


def _pooled_total(p: CachecraftParams, chunks: Sequence[ChunkPlan]) -> int:
    """The probe's budget: the chunks' budgets added up, except that under a split across
    chunks ('need', 'global') the CFO budgets are rounded up once, as a sum of CFO x |C|, and
    not once per chunk (ten short chunks would each add up to a token)."""
    probed = [c for c in chunks if c.select == "probe"]
    if p.probe_split == "chunk":
        return sum(c.budget for c in probed)
    given = sum(c.budget for c in probed if c.reason == "given")
    cfo = sum((c.cfo or 0.0) * c.slot.num_tokens for c in probed if c.reason == "cfo")
    return given + max(math.ceil(cfo - 1e-9), 0)


def _ceiling(share: float | None, chunks: Sequence[ChunkPlan], reused: int) -> int | None:
    """ReuseConfig.max_recompute in tokens of the `reused` ones, the probe's rows included; None
    when there is no cap or a caller gave a chunk its budget (given budgets are spent as given)."""
    if share is None or any(c.reason == "given" for c in chunks if c.select == "probe"):
        return None
    return math.floor(share * reused + 1e-9)


def _planned(c: ChunkPlan) -> ChunkPlan:
    """A chunk waiting for the probe, planned with nothing recomputed instead."""
    return replace(c, select="planned", budget=0) if c.select == "probe" else c


def _check_instead_of_probe(
    inp: PlanInput, p: CachecraftParams, chunks: Sequence[ChunkPlan], spend: int
) -> RecomputePlan:
    """cachecraft without its probe (dearer than the recompute it steers, or ranking nothing
    out): `spend` tokens (the budget plus the probe's cost, at most every reused token), every
    reused token a candidate at the check layer: each chunk's first probe_sink tokens keep
    going, then the ones whose K/V deviate most across chunks (CacheBlend's check, with the
    probe's sink). A chunk whose K/V are exact here (its variant made after this very prefix
    and chunks) is left out: recomputing it would change nothing."""
    exact = mark_exact(chunks, inp.layout)
    sizes = {
        i: c.slot.num_tokens
        for i, c in enumerate(chunks)
        if c.select == "probe" and not exact[i].is_exact
    }
    if not sizes:
        return make_plan(inp, "cachecraft", [_planned(c) for c in chunks])
    spend = min(spend, sum(sizes.values()))
    shares = spread_by_size(spend, sizes)  # chunk budgets add up to the check's total
    out = [
        replace(
            c,
            recompute=tuple(range(sizes[i])),
            budget=shares[i],
            select="deviation",
            reason=c.reason + "+check",
        )
        if i in sizes
        else _planned(c)
        for i, c in enumerate(chunks)
    ]
    sink = p.probe_sink if p.probe_sink_kept else 0
    check = DeviationCheck(_check_layer(p, inp.num_layers, alone=True), spend, sink=sink)
    return make_plan(inp, "cachecraft", out, deviation=check)


def _check_layer(config: CachecraftParams, num_layers: int, alone: bool = False) -> int:
    """The check's layer: probe_check_layer (check_alone_layer for a check without a probe,
    when set), but below the top one (a check there could stop no candidate), so a shallow
    model checks at its next-to-last layer."""
    layer = config.probe_check_layer
    if alone and config.check_alone_layer is not None:
        layer = config.check_alone_layer
    return min(max(layer, 0), max(num_layers - 2, 0))


def probe_cost(
    layout: PromptLayout,
    prefix_hit: bool,
    config: CachecraftParams,
    num_layers: int,
    question_rows: int | None = None,
) -> float:
    """What a probe of `layout` (trimmed to the question's last `question_rows`) costs under
    `config`, in full-depth rows (as RecomputePlan.probe_cost), whether or not a plan runs one."""
    rows = _probe_rows(layout, prefix_hit, question_rows)
    return rows * (probe_last_layer(config, num_layers) + 1) / num_layers


def probe_first_layer(config: CachecraftParams, num_layers: int) -> int:
    """The first layer whose attention the probe measures: probe_first_layer, or the layer
    after the first probe_from share of the layers, never past the last layer it runs."""
    first = config.probe_first_layer
    if first is None:
        first = math.floor(config.probe_from * num_layers + 1e-9)
    return min(max(first, 0), probe_last_layer(config, num_layers))


def probe_last_layer(config: CachecraftParams, num_layers: int) -> int:
    """The last layer a probe runs: probe_last_layer, or the first probe_depth share of the
    layers, within 0..num_layers - 1."""
    if config.probe_last_layer is None:
        last = math.ceil(config.probe_depth * num_layers - 1e-9) - 1
    else:
        last = config.probe_last_layer
    return min(max(last, 0), num_layers - 1)
