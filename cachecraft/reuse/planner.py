"""The planner: turn a PromptLayout and the stored variants of its chunks into a RecomputePlan.

Owns the per-mode decision (which variant each chunk reuses, which offsets are recomputed) for
every mode in config.MODES (cache-craft.md §3, §6). Pure Python: no torch, no store access; the
caller passes the variants it fetched.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from cachecraft.config import MODES, ReuseConfig
from cachecraft.reuse.plan import ChunkPlan, ChunkSlot, PromptLayout, RecomputePlan
from cachecraft.reuse.stats import cache_fix_overhead, order_penalty, prefix_overlap, top_tokens
from cachecraft.store.meta import VariantMeta


class VariantScore(NamedTuple):
    """One variant scored for one place in a new prompt."""

    variant: VariantMeta
    beta: float
    gamma: float
    beta_adj: float
    cfo: float


def score_variant(variant: VariantMeta, s_new: Sequence[str], config: ReuseConfig) -> VariantScore:
    """beta, gamma, beta' and CFO of reusing `variant` after the chunks `s_new` (cache-craft §3)."""
    beta = prefix_overlap(variant, s_new, config.empty_s_old)
    gamma = order_penalty(variant.s_old, s_new)
    old = set(variant.s_old)
    has_novel_prefix = any(key not in old for key in s_new)
    beta_adj, cfo = cache_fix_overhead(variant.cci, beta, gamma, config, has_novel_prefix)
    return VariantScore(variant, beta, gamma, beta_adj, cfo)


def choose_variant(
    variants: Sequence[VariantMeta], s_new: Sequence[str], config: ReuseConfig
) -> VariantScore | None:
    """The variant with the lowest CFO (ties: largest beta', then the first); None if none."""
    scores = [score_variant(v, s_new, config) for v in variants]
    if not scores:
        return None
    return min(scores, key=lambda s: (s.cfo, -s.beta_adj))  # min keeps the first of equals


def fix_count(cfo: float, num_tokens: int) -> int:
    """N = ceil(CFO * |C|), with float noise (e.g. 0.3 * 10 = 3.0000000000000004) ignored."""
    return min(max(math.ceil(cfo * num_tokens - 1e-9), 0), num_tokens)


def _miss(slot: ChunkSlot) -> ChunkPlan:
    return ChunkPlan(slot=slot, variant=None, recompute=tuple(range(slot.num_tokens)))


def _hit(
    slot: ChunkSlot,
    score: VariantScore,
    recompute: tuple[int, ...],
    deviation_budget: int | None = None,
) -> ChunkPlan:
    return ChunkPlan(
        slot=slot,
        variant=score.variant,
        recompute=recompute,
        cci=score.variant.cci,
        beta=score.beta,
        gamma=score.gamma,
        beta_adj=score.beta_adj,
        cfo=score.cfo,
        deviation_budget=deviation_budget,
    )


def _usable(slot: ChunkSlot, variants: Mapping[str, Sequence[VariantMeta]]) -> list[VariantMeta]:
    # A variant of another size cannot be spliced in (its offsets and scores would not line up).
    return [v for v in variants.get(slot.key, ()) if v.num_tokens == slot.num_tokens]


def _plan_prefix(
    layout: PromptLayout, variants: Mapping[str, Sequence[VariantMeta]], config: ReuseConfig
) -> tuple[list[ChunkPlan], int]:
    """Exact reuse of the leading chunks computed after this very prefix and chunks."""
    plans: list[ChunkPlan] = []
    prefix_cached = layout.prefix_len
    matching = True
    for i, slot in enumerate(layout.chunks):
        s_new = tuple(c.key for c in layout.chunks[:i])
        exact = None
        if matching:
            exact = next(
                (
                    v
                    for v in _usable(slot, variants)
                    if v.prefix_key == layout.prefix_key and v.s_old == s_new
                ),
                None,
            )
        if exact is None:
            matching = False
            plans.append(_miss(slot))
            continue
        score = score_variant(exact, s_new, config)._replace(cfo=0.0)
        plans.append(_hit(slot, score, ()))
        prefix_cached = slot.end
    return plans, prefix_cached


def _budget(mode: str, n: int, cfo: float, config: ReuseConfig, given: int | None) -> int:
    """Tokens a baseline recomputes in a reused chunk of n tokens: `given`, else its default."""
    if given is not None:
        budget = given
    elif mode == "epic":
        budget = config.epic_k
    elif mode == "cacheblend":
        budget = math.ceil(config.cacheblend_ratio * n - 1e-9)
    else:  # random: the same count cachecraft would recompute
        budget = fix_count(cfo, n)
    return min(max(budget, 0), n)


def _plan_reused_chunk(
    mode: str,
    i: int,
    slot: ChunkSlot,
    score: VariantScore,
    config: ReuseConfig,
    budgets: Sequence[int | None] | None,
) -> ChunkPlan:
    n = slot.num_tokens
    if mode == "naive":
        return _hit(slot, score, ())
    if mode == "cachecraft":
        return _hit(slot, score, top_tokens(score.variant.token_scores, fix_count(score.cfo, n)))
    given = budgets[i] if budgets is not None else None
    budget = _budget(mode, n, score.cfo, config, given)
    if mode == "random":
        rng = random.Random(f"{config.seed}:{slot.key}:{i}")
        return _hit(slot, score, tuple(sorted(rng.sample(range(n), budget))))
    if mode == "epic":
        return _hit(slot, score, tuple(range(budget)))
    return _hit(slot, score, (), deviation_budget=budget)  # cacheblend


def _plan_reuse(
    mode: str,
    layout: PromptLayout,
    variants: Mapping[str, Sequence[VariantMeta]],
    config: ReuseConfig,
    budgets: Sequence[int | None] | None,
) -> list[ChunkPlan]:
    plans: list[ChunkPlan] = []
    for i, slot in enumerate(layout.chunks):
        s_new = tuple(c.key for c in layout.chunks[:i])
        score = choose_variant(_usable(slot, variants), s_new, config)
        if score is None:
            plans.append(_miss(slot))
        else:
            plans.append(_plan_reused_chunk(mode, i, slot, score, config, budgets))
    return plans


def plan_request(
    layout: PromptLayout,
    variants: Mapping[str, Sequence[VariantMeta]],
    mode: str,
    config: ReuseConfig,
    num_layers: int,
    budgets: Sequence[int | None] | None = None,
) -> RecomputePlan:
    """Plan one request in `mode` (one of config.MODES).

    variants: chunk key -> its stored variants (a missing key means none). budgets: per chunk,
    the token budget of random / epic / cacheblend (None entries fall back to the mode's default;
    see `cachecraft_budgets`). A repeated chunk key is planned at each occurrence on its own.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    if budgets is not None and len(budgets) != len(layout.chunks):
        raise ValueError(f"budgets has {len(budgets)} entries for {len(layout.chunks)} chunks")
    et_layer = focus_threshold = check_layer = None
    if mode == "full":
        plans, prefix_cached = [_miss(slot) for slot in layout.chunks], 0
    elif mode == "prefix":
        plans, prefix_cached = _plan_prefix(layout, variants, config)
    else:
        plans = _plan_reuse(mode, layout, variants, config, budgets)
        prefix_cached = layout.prefix_len
    if mode == "cachecraft" and config.early_termination:
        et_layer = config.et_layer if config.et_layer is not None else num_layers // 3
        focus_threshold = config.focus_threshold
    if mode == "cacheblend":
        check_layer = config.cacheblend_check_layer
    return RecomputePlan(
        mode=mode,
        layout=layout,
        chunks=tuple(plans),
        prefix_cached=prefix_cached,
        et_layer=et_layer,
        focus_threshold=focus_threshold,
        cacheblend_check_layer=check_layer,
    )


def cachecraft_budgets(plan: RecomputePlan) -> list[int | None]:
    """Per chunk, the tokens `plan` recomputes for a reused chunk (None for a miss): pass a
    cachecraft plan's budgets to random / epic / cacheblend to compare at the same budget."""
    return [c.num_recompute if c.is_hit else None for c in plan.chunks]
