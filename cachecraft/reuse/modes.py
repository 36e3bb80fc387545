"""One planning function per mode: PlanInput -> RecomputePlan. Pure Python, no torch.

Shared rules: a chunk without a usable variant (none stored, or of another size) is a miss,
computed in full; the system prefix comes from the exact prefix cache when it holds it; a chunk
is exact when its K/V will equal a full prefill's (a miss after exact chunks, or an exact
variant in exactly its old context), and only exact chunks make exact variants.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from cachecraft.config import ReuseConfig
from cachecraft.reuse.plan import (
    ChunkPlan,
    ChunkSlot,
    DeviationCheck,
    EarlyExit,
    ProbeCheck,
    PromptLayout,
    RecomputePlan,
    probe_rows,
)
from cachecraft.reuse.selectors import first_n, random_n, spread_by_size, top_scored
from cachecraft.reuse.variant_choice import VariantScore, choose_variant
from cachecraft.store.meta import VariantMeta


@dataclass(frozen=True, slots=True)
class PlanInput:
    """Everything a mode needs. budgets: per chunk a caller's token budget (None entries: the
    mode's default). prefix_hit: the exact prefix cache holds this layout's prefix. repeat:
    the engine saw this very prompt before."""

    layout: PromptLayout
    variants: Mapping[str, Sequence[VariantMeta]]
    config: ReuseConfig
    num_layers: int
    budgets: Sequence[int | None] | None = None
    prefix_hit: bool = True
    repeat: bool = False
    """The same prompt was planned before (`ReuseConfig.refresh_repeats`)."""

    def s_new(self, i: int) -> tuple[str, ...]:
        return tuple(c.key for c in self.layout.chunks[:i])

    def usable(self, i: int) -> list[VariantMeta]:
        # A variant of another size cannot be spliced in (its offsets would not line up).
        slot = self.layout.chunks[i]
        return [v for v in self.variants.get(slot.key, ()) if v.num_tokens == slot.num_tokens]

    def choose(
        self, i: int, rule: str | None = None, inherited: Mapping[str, float] | None = None
    ) -> VariantScore | None:
        """The variant for chunk i; inherited: the predicted errors of the chunks in front
        (`ReuseConfig.inherit_error`)."""
        sizes = [c.num_tokens for c in self.layout.chunks[:i]]
        return choose_variant(
            self.usable(i),
            self.s_new(i),
            self.config,
            s_new_sizes=sizes,
            prefix_key=self.layout.prefix_key,
            rule=rule,
            inherited=inherited,
        )

    def given(self, i: int) -> int | None:
        return None if self.budgets is None else self.budgets[i]

    def given_total(self) -> int | None:
        """Sum of the given budgets (None when no budget was given)."""
        if self.budgets is None or all(b is None for b in self.budgets):
            return None
        return sum(b for b in self.budgets if b is not None)


def fix_count(cfo: float, num_tokens: int) -> int:
    """N = ceil(CFO * |C|), with float noise (e.g. 0.3 * 10 = 3.0000000000000004) ignored."""
    return min(max(math.ceil(cfo * num_tokens - 1e-9), 0), num_tokens)


def miss(slot: ChunkSlot, reason: str = "miss") -> ChunkPlan:
    n = slot.num_tokens
    return ChunkPlan(slot=slot, variant=None, recompute=tuple(range(n)), budget=n, reason=reason)


def hit(
    slot: ChunkSlot,
    score: VariantScore,
    recompute: tuple[int, ...],
    reason: str,
    *,
    budget: int | None = None,
    select: str = "planned",
) -> ChunkPlan:
    return ChunkPlan(
        slot=slot,
        variant=score.variant,
        recompute=recompute,
        budget=len(recompute) if budget is None else budget,
        reason=reason,
        select=select,  # type: ignore[arg-type]
        cci=score.variant.cci,
        beta=score.beta,
        gamma=score.gamma,
        beta_adj=score.beta_adj,
        cfo=score.cfo,
        error=score.error,
    )


def mark_exact(chunks: Sequence[ChunkPlan], layout: PromptLayout) -> tuple[ChunkPlan, ...]:
    """Set is_exact: every chunk before is exact, and this one is a miss or an exact variant
    made after this very prefix and these chunks (recomputed tokens over exact K/V stay exact)."""
    out, exact_so_far = [], True
    for i, c in enumerate(chunks):
        s_new = tuple(x.slot.key for x in chunks[:i])
        v = c.variant
        own = v is None or (v.is_exact and v.prefix_key == layout.prefix_key and v.s_old == s_new)
        exact_so_far = exact_so_far and own
        out.append(replace(c, is_exact=exact_so_far))
    return tuple(out)


def _plan(inp: PlanInput, mode: str, chunks: Sequence[ChunkPlan], **checks) -> RecomputePlan:
    return RecomputePlan(
        mode=mode,
        layout=inp.layout,
        chunks=mark_exact(chunks, inp.layout),
        prefix_hit=inp.prefix_hit,
        **checks,
    )


def _per_chunk(
    inp: PlanInput, mode: str, plan_hit: Callable[[int, ChunkSlot, VariantScore], ChunkPlan]
) -> list[ChunkPlan]:
    out = []
    for i, slot in enumerate(inp.layout.chunks):
        score = inp.choose(i)
        out.append(miss(slot) if score is None else plan_hit(i, slot, score))
    return out


def _budget(inp: PlanInput, i: int, default: int) -> tuple[int, str]:
    n = inp.layout.chunks[i].num_tokens
    given = inp.given(i)
    budget, reason = (default, "mode") if given is None else (given, "given")
    return min(max(budget, 0), n), reason


# ---- the modes --------------------------------------------------------------------------------


def plan_full(inp: PlanInput) -> RecomputePlan:
    """Everything computed; nothing read from or offered to any cache (the reference)."""
    chunks = [miss(slot) for slot in inp.layout.chunks]
    return replace(_plan(inp, "full", chunks), prefix_hit=False, make_variants=False)


def plan_prefix(inp: PlanInput) -> RecomputePlan:
    """Exact reuse only: the leading chunks whose exact variant was made after this very
    prefix and these chunks; everything from the first mismatch on is computed."""
    chunks: list[ChunkPlan] = []
    matching = True
    for i, slot in enumerate(inp.layout.chunks):
        exact = None
        if matching:
            for v in inp.usable(i):
                if v.is_exact and v.prefix_key == inp.layout.prefix_key and v.s_old == inp.s_new(i):
                    score = choose_variant([v], inp.s_new(i), inp.config, rule="paper")
                    assert score is not None
                    exact = score._replace(cfo=0.0, error=0.0, is_exact_here=True)
                    break
        if exact is None:
            matching = False
            chunks.append(miss(slot))
        else:
            chunks.append(hit(slot, exact, (), "exact"))
    return replace(_plan(inp, "prefix", chunks), measure_stats=False)


def plan_naive(inp: PlanInput) -> RecomputePlan:
    """Every stored chunk reused as is (positions fixed), nothing recomputed."""
    return _plan(inp, "naive", _per_chunk(inp, "naive", lambda i, s, sc: hit(s, sc, (), "none")))


def plan_epic(inp: PlanInput) -> RecomputePlan:
    """EPIC: the first epic_k tokens (or the given budget) of every reused chunk."""

    def one(i: int, slot: ChunkSlot, score: VariantScore) -> ChunkPlan:
        budget, reason = _budget(inp, i, inp.config.epic_k)
        return hit(slot, score, first_n(slot.num_tokens, budget), reason)

    return _plan(inp, "epic", _per_chunk(inp, "epic", one))


def plan_random(inp: PlanInput) -> RecomputePlan:
    """Random tokens, as many as cachecraft-paper's CFO would give (or the given budget)."""

    def one(i: int, slot: ChunkSlot, score: VariantScore) -> ChunkPlan:
        budget, reason = _budget(inp, i, fix_count(score.cfo, slot.num_tokens))
        seed = f"{inp.config.seed}:{slot.key}:{i}"
        return hit(slot, score, random_n(slot.num_tokens, budget, seed), reason)

    return _plan(inp, "random", _per_chunk(inp, "random", one))


def plan_cacheblend(inp: PlanInput) -> RecomputePlan:
    """CacheBlend: every reused token runs to the check layer, where the ones whose K/V deviate
    most keep going: per chunk its budget (cacheblend_ratio or given), or with
    cacheblend_global the sum of those budgets over all reused chunks."""
    config = inp.config

    def one(i: int, slot: ChunkSlot, score: VariantScore) -> ChunkPlan:
        default = math.ceil(config.cacheblend_ratio * slot.num_tokens - 1e-9)
        budget, reason = _budget(inp, i, default)
        every = tuple(range(slot.num_tokens))  # all tokens are candidates at the check
        return hit(slot, score, every, reason, budget=budget, select="deviation")

    chunks = _per_chunk(inp, "cacheblend", one)
    total = None
    if config.cacheblend_global:
        total = sum(c.budget for c in chunks if c.select == "deviation")
        chunks = [replace(c, reason=c.reason + "+global") if c.is_hit else c for c in chunks]
    check = DeviationCheck(min(config.cacheblend_check_layer, inp.num_layers - 1), total)
    return _plan(inp, "cacheblend", chunks, deviation=check)


def plan_cachecraft_paper(inp: PlanInput) -> RecomputePlan:
    """The paper: the variant with the lowest CFO (paper beta), its top ceil(CFO x |C|) tokens
    by stored score, early termination inside the forward."""
    config = inp.config
    chunks = []
    for i, slot in enumerate(inp.layout.chunks):
        score = inp.choose(i, rule="paper")
        if score is None:
            chunks.append(miss(slot))
            continue
        n = fix_count(score.cfo, slot.num_tokens)
        chunks.append(hit(slot, score, top_scored(score.variant.token_scores, n), "cfo"))
    early = None
    if config.early_termination:
        layer = config.et_layer if config.et_layer is not None else inp.num_layers // 3
        early = EarlyExit(layer, config.focus_threshold)
    return _plan(inp, "cachecraft-paper", chunks, early_exit=early)


def _probe(
    inp: PlanInput,
    total: int,
    split: str,
    focus: float,
    check: float,
    sink: int,
    question_rows: int | None = None,
) -> ProbeCheck:
    """The probe of a plan; `sink`: each probed chunk's first tokens lifted in the ranking;
    `question_rows`: a trimmed probe's rows (None: the whole question)."""
    c = inp.config
    last = probe_last_layer(c, inp.num_layers)
    first = min(max(c.probe_first_layer, 0), last)
    check_layer = _check_layer(c, inp.num_layers)
    return ProbeCheck(
        total=total,
        split=split,  # type: ignore[arg-type]
        first_layer=first,
        last_layer=last,
        focus_threshold=focus,
        blend=c.probe_blend,
        check=check,
        check_layer=check_layer,
        check_score=c.probe_check_score,
        num_layers=inp.num_layers,
        sink=sink,
        check_power=c.probe_check_power,
        last_row=c.probe_last_row,
        question_rows=question_rows,
    )


def plan_cachecraft(inp: PlanInput) -> RecomputePlan:
    """Ours: the variant with the lowest predicted error (honest beta); a chunk whose best
    predicted error is above refresh_error, or that has no exact variant here in a repeated
    prompt (refresh_repeats), is computed in full (a fresh variant); CFO sets the
    request's budget; a probe of the question ranks the tokens and, with probe_check, the
    top-ranked run to a check layer where question attention x K/V deviation picks the ones
    that go on (selectors.select_by_question). A probe costing more than probe_max_cost x the
    budget is trimmed to the question's last rows that fit (probe_trim) or replaced by a
    check of every reused token at budget + probe cost."""
    config = inp.config
    chunks: list[ChunkPlan] = []
    errors: dict[str, float] | None = {} if config.inherit_error else None
    for i, slot in enumerate(inp.layout.chunks):
        score = inp.choose(i, inherited=errors)
        if score is None:
            chunks.append(miss(slot))
        elif (config.refresh_error is not None and score.error > config.refresh_error) or (
            inp.repeat and config.refresh_repeats and not score.is_exact_here
        ):
            chunks.append(replace(miss(slot, "refresh"), error=score.error, cfo=score.cfo))
        else:
            budget, reason = _budget(inp, i, fix_count(score.cfo, slot.num_tokens))
            reason = "cfo" if reason == "mode" else reason
            chunks.append(hit(slot, score, (), reason, budget=budget, select="probe"))
        if errors is not None:  # a chunk computed in full passes no staleness on
            last = chunks[-1]
            errors[slot.key] = (last.error or 0.0) if last.is_hit else 0.0
    total = _pooled_total(inp, chunks)
    if not total:  # nothing to recompute: no probe to steer it
        return _plan(inp, "cachecraft", [_planned(c) for c in chunks])
    cost = probe_cost(inp.layout, inp.prefix_hit, config, inp.num_layers)
    rows = None  # the question rows the probe runs (None: all of them)
    if config.probe_max_cost is not None and cost > config.probe_max_cost * total:
        rows = _rows_that_fit(inp, config.probe_max_cost * total) if config.probe_trim else 0
        if rows < 1:
            extra = math.ceil(config.probe_skip_share * cost - 1e-9)
            return _check_instead_of_probe(inp, chunks, total + extra)
        left_out = cost - probe_cost(inp.layout, inp.prefix_hit, config, inp.num_layers, rows)
        reused = sum(c.slot.num_tokens for c in chunks if c.select == "probe")
        total = min(total + math.ceil(config.probe_skip_share * left_out - 1e-9), reused)
    focus = config.focus_threshold if config.early_termination else 0.0
    probe = _probe(
        inp, total, config.probe_split, focus, config.probe_check, config.probe_sink, rows
    )
    return _plan(inp, "cachecraft", chunks, probe=probe)


def _rows_that_fit(inp: PlanInput, cost: float) -> int:
    """The most question rows a trimmed probe can run within `cost` (full-depth rows; the
    uncached prefix, which the probe must run as well, comes first)."""
    share = (probe_last_layer(inp.config, inp.num_layers) + 1) / inp.num_layers
    prefix = 0 if inp.prefix_hit else inp.layout.prefix_len
    return max(min(math.floor(cost / share + 1e-9) - prefix, len(inp.layout.question_ids)), 0)


def _pooled_total(inp: PlanInput, chunks: Sequence[ChunkPlan]) -> int:
    """The probe's budget: the chunks' budgets added up, except that under a split across
    chunks ('need', 'global') the CFO budgets are rounded up once, as a sum of CFO x |C|, and
    not once per chunk (ten short chunks would each add up to a token)."""
    probed = [c for c in chunks if c.select == "probe"]
    if inp.config.probe_split == "chunk":
        return sum(c.budget for c in probed)
    given = sum(c.budget for c in probed if c.reason == "given")
    cfo = sum((c.cfo or 0.0) * c.slot.num_tokens for c in probed if c.reason == "cfo")
    return given + max(math.ceil(cfo - 1e-9), 0)


def _planned(c: ChunkPlan) -> ChunkPlan:
    """A chunk waiting for the probe, planned with nothing recomputed instead."""
    return replace(c, select="planned", budget=0) if c.select == "probe" else c


def _check_instead_of_probe(
    inp: PlanInput, chunks: Sequence[ChunkPlan], spend: int
) -> RecomputePlan:
    """cachecraft when its probe would cost more than the recompute it steers: `spend` tokens
    (the budget plus the probe's cost, at most every reused token), every reused token a
    candidate at the check layer: each chunk's first probe_sink tokens keep going, then the
    ones whose K/V deviate most across chunks (CacheBlend's check, with the probe's sink)."""
    sizes = {i: c.slot.num_tokens for i, c in enumerate(chunks) if c.select == "probe"}
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
        else c
        for i, c in enumerate(chunks)
    ]
    config = inp.config
    check = DeviationCheck(_check_layer(config, inp.num_layers), spend, sink=config.probe_sink)
    return _plan(inp, "cachecraft", out, deviation=check)


def _check_layer(config: ReuseConfig, num_layers: int) -> int:
    """The check's layer: probe_check_layer, but below the top one (a check there could stop
    no candidate), so a shallow model checks at its next-to-last layer."""
    return min(max(config.probe_check_layer, 0), max(num_layers - 2, 0))


def probe_cost(
    layout: PromptLayout,
    prefix_hit: bool,
    config: ReuseConfig,
    num_layers: int,
    question_rows: int | None = None,
) -> float:
    """What a probe of `layout` (trimmed to the question's last `question_rows`) costs under
    `config`, in full-depth rows (as RecomputePlan.probe_cost), whether or not a plan runs one."""
    rows = probe_rows(layout, prefix_hit, question_rows)
    return rows * (probe_last_layer(config, num_layers) + 1) / num_layers


def probe_last_layer(config: ReuseConfig, num_layers: int) -> int:
    """The last layer a probe runs: probe_last_layer, or the first probe_depth share of the
    layers, within 0..num_layers - 1."""
    if config.probe_last_layer is None:
        last = math.ceil(config.probe_depth * num_layers - 1e-9) - 1
    else:
        last = config.probe_last_layer
    return min(max(last, 0), num_layers - 1)


def plan_prophet(inp: PlanInput) -> RecomputePlan:
    """ProphetKV-style baseline: one budget for the request (prophet_ratio of the reused
    tokens, or the sum of the given budgets), spent on the tokens the question attends to most,
    wherever they are. Variants chosen as cachecraft chooses them."""
    chunks = []
    for i, slot in enumerate(inp.layout.chunks):
        score = inp.choose(i)
        if score is None:
            chunks.append(miss(slot))
        else:
            chunks.append(hit(slot, score, (), "global", budget=0, select="probe"))
    reused = sum(c.slot.num_tokens for c in chunks if c.is_hit)
    if not reused:
        return _plan(inp, "prophet", chunks)
    given = inp.given_total()
    total = fix_count(inp.config.prophet_ratio, reused) if given is None else min(given, reused)
    return _plan(inp, "prophet", chunks, probe=_probe(inp, total, "global", 0.0, 0.0, 0))


MODE_PLANNERS: dict[str, Callable[[PlanInput], RecomputePlan]] = {
    "full": plan_full,
    "prefix": plan_prefix,
    "naive": plan_naive,
    "cacheblend": plan_cacheblend,
    "epic": plan_epic,
    "random": plan_random,
    "prophet": plan_prophet,
    "cachecraft-paper": plan_cachecraft_paper,
    "cachecraft": plan_cachecraft,
}
