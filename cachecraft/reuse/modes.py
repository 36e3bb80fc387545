"""What every strategy plans from (PlanInput) and the rules they share, plus the plans of the
two simplest strategies (`full`, `prefix`). Pure Python, no torch.

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
from cachecraft.reuse.plan import ChunkPlan, ChunkSlot, PromptLayout, RecomputePlan
from cachecraft.reuse.stats import Scoring
from cachecraft.reuse.variant_choice import VariantScore, choose_variant
from cachecraft.store.meta import VariantMeta


@dataclass(frozen=True, slots=True)
class PlanInput:
    """Everything a strategy plans from. budgets: per chunk a caller's token budget (None
    entries: the strategy's default). prefix_hit: the exact prefix cache holds this layout's
    prefix. repeat: the engine saw this very prompt before. scoring: how variants are scored
    (the planner sets the strategy's own)."""

    layout: PromptLayout
    variants: Mapping[str, Sequence[VariantMeta]]
    config: ReuseConfig
    num_layers: int
    budgets: Sequence[int | None] | None = None
    prefix_hit: bool = True
    repeat: bool = False
    """The same prompt was planned before (`ReuseConfig.refresh_repeats`)."""
    scoring: Scoring = Scoring()

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
            self.scoring,
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


def make_plan(inp: PlanInput, name: str, chunks: Sequence[ChunkPlan], **checks) -> RecomputePlan:
    """The RecomputePlan of strategy `name` over `chunks` (exactness marked)."""
    return RecomputePlan(
        mode=name,
        layout=inp.layout,
        chunks=mark_exact(chunks, inp.layout),
        prefix_hit=inp.prefix_hit,
        **checks,
    )


def per_chunk(
    inp: PlanInput, plan_hit: Callable[[int, ChunkSlot, VariantScore], ChunkPlan]
) -> list[ChunkPlan]:
    """Each chunk planned on its own: a miss without a usable variant, else `plan_hit`."""
    out = []
    for i, slot in enumerate(inp.layout.chunks):
        score = inp.choose(i)
        out.append(miss(slot) if score is None else plan_hit(i, slot, score))
    return out


def given_budget(inp: PlanInput, i: int, default: int) -> tuple[int, str]:
    """Chunk i's budget: the caller's ("given") or `default` ("mode"), within its size."""
    n = inp.layout.chunks[i].num_tokens
    given = inp.given(i)
    budget, reason = (default, "mode") if given is None else (given, "given")
    return min(max(budget, 0), n), reason


# ---- the modes --------------------------------------------------------------------------------


def plan_full(inp: PlanInput) -> RecomputePlan:
    """Everything computed; nothing read from or offered to any cache (the reference)."""
    chunks = [miss(slot) for slot in inp.layout.chunks]
    return replace(make_plan(inp, "full", chunks), prefix_hit=False, make_variants=False)


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
                    score = choose_variant([v], inp.s_new(i), inp.scoring, rule="paper")
                    assert score is not None
                    exact = score._replace(cfo=0.0, error=0.0, is_exact_here=True)
                    break
        if exact is None:
            matching = False
            chunks.append(miss(slot))
        else:
            chunks.append(hit(slot, exact, (), "exact"))
    return replace(make_plan(inp, "prefix", chunks), measure_stats=False)
