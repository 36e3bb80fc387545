"""The planner: the one entry point that turns a PromptLayout, the stored variants of its
chunks and the prefix cache's state into a RecomputePlan, plus the edits a plan may need
before it runs (a variant vanished, the prefix cache dropped its entry, the probe's result).

Each strategy plans in its own `plan` (`strategy.py`; the product's in `strategies.py`);
token selectors live in `selectors.py`, variant scoring in `variant_choice.py`. Pure Python:
no torch, no store access.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from cachecraft.config import ReuseConfig
from cachecraft.reuse.modes import PlanInput, fix_count, mark_exact, miss
from cachecraft.reuse.plan import PromptLayout, RecomputePlan
from cachecraft.reuse.selectors import select_by_question, spread_by_size
from cachecraft.reuse.strategy import ReuseStrategy
from cachecraft.reuse.variant_choice import VariantScore, choose_variant, score_variant
from cachecraft.store.meta import VariantMeta

__all__ = [
    "VariantScore",
    "as_miss",
    "choose_variant",
    "fix_count",
    "matched_budgets",
    "plan_request",
    "resolve_probe",
    "score_variant",
    "without_prefix_hit",
]


def plan_request(
    layout: PromptLayout,
    variants: Mapping[str, Sequence[VariantMeta]],
    strategy: ReuseStrategy,
    config: ReuseConfig,
    num_layers: int,
    budgets: Sequence[int | None] | None = None,
    prefix_hit: bool = True,
    repeat: bool = False,
) -> RecomputePlan:
    """Plan one request with `strategy` (resolved from its name where the request entered).

    variants: chunk key -> its stored variants (a missing key means none). budgets: per chunk,
    a token budget for the reused chunks (None entries fall back to the strategy's default; a
    strategy with one budget for the request spends their sum; see `matched_budgets`).
    prefix_hit: the exact prefix cache holds this prefix (its rows are then not computed).
    repeat: this very prompt was planned before (cachecraft refreshes it: `refresh_repeats`).
    A repeated chunk key is planned at each occurrence on its own.
    """
    if budgets is not None and len(budgets) != len(layout.chunks):
        raise ValueError(f"budgets has {len(budgets)} entries for {len(layout.chunks)} chunks")
    if num_layers < 1:
        raise ValueError("num_layers must be >= 1")
    scoring = strategy.scoring(config)
    inp = PlanInput(layout, variants, config, num_layers, budgets, prefix_hit, repeat, scoring)
    return strategy.plan(inp)


def resolve_probe(
    plan: RecomputePlan, attention: Sequence[Sequence[float] | None]
) -> RecomputePlan:
    """The plan with the probe's selection made (see selectors.select_by_question)."""
    return select_by_question(plan, attention)


def as_miss(plan: RecomputePlan, index: int) -> RecomputePlan:
    """The plan with chunk `index` computed in full (its variant could not be loaded); a
    probe's budget loses that chunk's share, and goes when no chunk is left to probe."""
    chunks = list(plan.chunks)
    old = chunks[index]
    chunks[index] = miss(old.slot, "vanished")
    probe = plan.probe
    if probe is not None and old.select == "probe":
        probe = replace(probe, total=max(probe.total - old.budget, 0))
        if not any(c.select == "probe" for c in chunks):
            probe = None
    return replace(plan, chunks=mark_exact(chunks, plan.layout), probe=probe)


def without_prefix_hit(plan: RecomputePlan) -> RecomputePlan:
    """The plan with the system prefix computed (the prefix cache no longer holds it)."""
    return replace(plan, prefix_hit=False)


def matched_budgets(plan: RecomputePlan, extra: int = 0) -> list[int | None]:
    """Per chunk, the tokens `plan` recomputes in a reused chunk (None for a miss), to give
    another strategy the same budget. extra: tokens added on top (e.g. the probe's rows, so that a
    strategy without a probe may compute as many tokens in all), spread over the reused chunks in
    proportion to their size, never past a chunk's size; a negative extra (a strategy's own probe
    paid out of the same total) is taken from the largest budgets, never below 0."""
    out: list[int | None] = [c.num_recompute if c.is_hit else None for c in plan.chunks]
    sizes = {i: c.slot.num_tokens for i, c in enumerate(plan.chunks) if c.is_hit}
    for i, n in spread_by_size(extra, sizes, {i: out[i] or 0 for i in sizes}).items():
        out[i] = n
    for _ in range(max(-extra, 0)):
        i = max(sizes, key=lambda j: (out[j] or 0, -j), default=None)
        if i is None or not out[i]:
            break
        out[i] = (out[i] or 0) - 1
    return out
