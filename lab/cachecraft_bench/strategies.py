"""The lab's baselines as reuse strategies (naive, EPIC, random, CacheBlend, the paper's
selector, ProphetKV-style), each with its own parameters, and `register`, which adds them to
the product's registry when the lab runs (`cachecraft serve` never sees them).

Ablations of `cachecraft` are not registered: an arm makes the strategy with other parameters
(`ReuseStrategy.with_params`), so its plans and reports keep the name `cachecraft`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from cachecraft.api import (
    STRATEGIES,
    CachecraftParams,
    ChunkPlan,
    ChunkSlot,
    DeviationCheck,
    EarlyExit,
    PlanInput,
    RecomputePlan,
    ReuseStrategy,
    ScoringRules,
    StrategyRegistry,
    VariantScore,
    check_fields,
    first_n,
    fix_count,
    given_budget,
    hit,
    make_plan,
    make_probe,
    miss,
    per_chunk,
    probe_cost,
    random_n,
    ranged,
    rows_that_fit,
    top_scored,
)
from cachecraft.config import ReuseConfig
from cachecraft.errors import BadRequestError
from cachecraft.llm import split_settings
from cachecraft_bench.modes import LAB_MODES


class NaiveStrategy(ReuseStrategy):
    """Every stored chunk reused as is (positions fixed), nothing recomputed."""

    name = "naive"
    params: ScoringRules

    @classmethod
    def default_params(cls) -> ScoringRules:
        return ScoringRules()

    def plan(self, inp: PlanInput) -> RecomputePlan:
        return make_plan(inp, self.name, per_chunk(inp, lambda i, s, sc: hit(s, sc, (), "none")))


@dataclass(frozen=True, slots=True)
class EpicParams(ScoringRules):
    epic_k: int = ranged(32, 0)
    """Tokens recomputed at the start of every reused chunk."""

    def __post_init__(self) -> None:
        check_fields(self)


class EpicStrategy(ReuseStrategy):
    """EPIC: the first epic_k tokens (or the given budget) of every reused chunk."""

    name = "epic"
    params: EpicParams

    @classmethod
    def default_params(cls) -> EpicParams:
        return EpicParams()

    def plan(self, inp: PlanInput) -> RecomputePlan:
        def one(i: int, slot: ChunkSlot, score: VariantScore) -> ChunkPlan:
            budget, reason = given_budget(inp, i, self.params.epic_k)
            return hit(slot, score, first_n(slot.num_tokens, budget), reason)

        return make_plan(inp, self.name, per_chunk(inp, one))


@dataclass(frozen=True, slots=True)
class RandomParams(ScoringRules):
    seed: int = 0
    """Seeds the tokens drawn (with the chunk's key and place)."""

    def __post_init__(self) -> None:
        check_fields(self)


class RandomStrategy(ReuseStrategy):
    """Random tokens, as many as cachecraft-paper's CFO would give (or the given budget)."""

    name = "random"
    params: RandomParams

    @classmethod
    def default_params(cls) -> RandomParams:
        return RandomParams()

    def plan(self, inp: PlanInput) -> RecomputePlan:
        def one(i: int, slot: ChunkSlot, score: VariantScore) -> ChunkPlan:
            budget, reason = given_budget(inp, i, fix_count(score.cfo, slot.num_tokens))
            seed = f"{self.params.seed}:{slot.key}:{i}"
            return hit(slot, score, random_n(slot.num_tokens, budget, seed), reason)

        return make_plan(inp, self.name, per_chunk(inp, one))


@dataclass(frozen=True, slots=True)
class CacheblendParams(ScoringRules):
    cacheblend_ratio: float = ranged(0.15, 0.0, 1.0)
    """Share of a reused chunk's tokens kept past the check layer."""
    cacheblend_global: bool = False
    """Pick the top deviating tokens across all reused chunks, not per chunk."""
    cacheblend_check_layer: int = ranged(1, 0)
    """The layer whose K/V deviation picks the tokens."""

    def __post_init__(self) -> None:
        check_fields(self)


class CacheblendStrategy(ReuseStrategy):
    """CacheBlend: every reused token runs to the check layer, where the ones whose K/V deviate
    most keep going: per chunk its budget (cacheblend_ratio or given), or with
    cacheblend_global the sum of those budgets over all reused chunks."""

    name = "cacheblend"
    params: CacheblendParams

    @classmethod
    def default_params(cls) -> CacheblendParams:
        return CacheblendParams()

    def plan(self, inp: PlanInput) -> RecomputePlan:
        p = self.params

        def one(i: int, slot: ChunkSlot, score: VariantScore) -> ChunkPlan:
            default = math.ceil(p.cacheblend_ratio * slot.num_tokens - 1e-9)
            budget, reason = given_budget(inp, i, default)
            every = tuple(range(slot.num_tokens))  # all tokens are candidates at the check
            return hit(slot, score, every, reason, budget=budget, select="deviation")

        chunks = per_chunk(inp, one)
        total = None
        if p.cacheblend_global:
            total = sum(c.budget for c in chunks if c.select == "deviation")
            chunks = [replace(c, reason=c.reason + "+global") if c.is_hit else c for c in chunks]
        check = DeviationCheck(min(p.cacheblend_check_layer, inp.num_layers - 1), total)
        return make_plan(inp, self.name, chunks, deviation=check)


@dataclass(frozen=True, slots=True)
class PaperParams(ScoringRules):
    early_termination: bool = True
    """Unfocused chunks (ReuseConfig.focus_threshold) stop being recomputed at et_layer."""
    et_layer: int | None = ranged(None, 0)
    """The layer of that early exit (None: num_layers // 3)."""

    def __post_init__(self) -> None:
        check_fields(self)


class PaperStrategy(ReuseStrategy):
    """The paper: the variant with the lowest CFO (paper beta), its top ceil(CFO x |C|) tokens
    by stored score, early termination inside the forward."""

    name = "cachecraft-paper"
    params: PaperParams

    @classmethod
    def default_params(cls) -> PaperParams:
        return PaperParams()

    def plan(self, inp: PlanInput) -> RecomputePlan:
        p = self.params
        chunks = []
        for i, slot in enumerate(inp.layout.chunks):
            score = inp.choose(i, rule="paper")
            if score is None:
                chunks.append(miss(slot))
                continue
            n = fix_count(score.cfo, slot.num_tokens)
            chunks.append(hit(slot, score, top_scored(score.variant.token_scores, n), "cfo"))
        early = None
        if p.early_termination:
            layer = p.et_layer if p.et_layer is not None else inp.num_layers // 3
            early = EarlyExit(layer, inp.config.focus_threshold)
        return make_plan(inp, self.name, chunks, early_exit=early)


@dataclass(frozen=True, slots=True)
class ProphetParams(ScoringRules):
    prophet_ratio: float = ranged(0.2, 0.0, 1.0)
    """Share of the reused chunks' tokens recomputed (when no budget is given)."""
    probe: CachecraftParams = field(default_factory=CachecraftParams)
    """The probe's layers and rows, as cachecraft's probe runs them."""

    def __post_init__(self) -> None:
        check_fields(self)


class ProphetStrategy(ReuseStrategy):
    """ProphetKV-style baseline: one budget for the request (prophet_ratio of the reused
    tokens, or the sum of the given budgets), spent on the tokens the question attends to most,
    wherever they are. Variants chosen as cachecraft chooses them; its probe trimmed as
    cachecraft's is (to the question's last rows that cost at most probe_max_cost x the budget,
    and at least one row), so neither side pays for a probe the other would cut."""

    name = "prophet"
    params: ProphetParams

    @classmethod
    def default_params(cls) -> ProphetParams:
        return ProphetParams()

    def plan(self, inp: PlanInput) -> RecomputePlan:
        chunks = []
        for i, slot in enumerate(inp.layout.chunks):
            score = inp.choose(i)
            if score is None:
                chunks.append(miss(slot))
            else:
                chunks.append(hit(slot, score, (), "global", budget=0, select="probe"))
        reused = sum(c.slot.num_tokens for c in chunks if c.is_hit)
        if not reused:
            return make_plan(inp, self.name, chunks)
        given = inp.given_total()
        ratio = self.params.prophet_ratio
        total = fix_count(ratio, reused) if given is None else min(given, reused)
        p = self.params.probe
        rows = None
        cost = probe_cost(inp.layout, inp.prefix_hit, p, inp.num_layers)
        if p.probe_trim and p.probe_max_cost is not None and cost > p.probe_max_cost * total:
            cap = p.probe_max_cost * total
            rows = max(rows_that_fit(inp.layout, inp.prefix_hit, p, inp.num_layers, cap), 1)
        probe = make_probe(inp, p, total, "global", 0.0, 0.0, 0, rows)
        return make_plan(inp, self.name, chunks, probe=probe)


BASELINES: tuple[type[ReuseStrategy], ...] = (
    NaiveStrategy,
    CacheblendStrategy,
    EpicStrategy,
    RandomStrategy,
    ProphetStrategy,
    PaperStrategy,
)


def register(registry: StrategyRegistry = STRATEGIES) -> StrategyRegistry:
    """Add the baselines (default parameters) to `registry`; again is a no-op."""
    for cls in BASELINES:
        if cls.name not in registry:
            registry.register(cls())
    assert set(registry.names()) >= set(LAB_MODES)
    return registry


def arm_settings(
    mode: str, changes: Mapping[str, Any], base: ReuseConfig, seed: int = 0
) -> tuple[ReuseStrategy, ReuseConfig, dict[str, Any]]:
    """What an arm of `mode` runs with `changes`: (its strategy, with its parameters changed;
    `base` with its ReuseConfig fields changed; its store's settings). `seed`: the random
    baseline's. A setting `mode` does not take, or a bad value, is a BadRequestError."""
    strategy = register().get(mode)
    if isinstance(strategy, RandomStrategy):
        strategy = strategy.with_params(seed=seed)
    reuse, params, store = split_settings(changes, strategy)
    try:
        if params:
            strategy = strategy.with_params(**params)
        config = replace(base, **reuse)
    except ValueError as e:
        raise BadRequestError(f"{mode}: {e}") from None
    return strategy, config, store
