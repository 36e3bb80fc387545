"""The product's strategies, `full`, `prefix` and `cachecraft`, and STRATEGIES, the registry
every entry point resolves a strategy name with (the lab adds its baselines to it)."""

from __future__ import annotations

from cachecraft.reuse.cachecraft import CachecraftStrategy
from cachecraft.reuse.modes import PlanInput, plan_full, plan_prefix
from cachecraft.reuse.plan import RecomputePlan
from cachecraft.reuse.strategy import ReuseStrategy, StrategyRegistry


class FullStrategy(ReuseStrategy):
    """Everything computed; nothing read from or offered to any cache (the reference)."""

    name = "full"
    reads_store = False

    def plan(self, inp: PlanInput) -> RecomputePlan:
        return plan_full(inp)


class PrefixStrategy(ReuseStrategy):
    """Exact reuse only, as a prefix cache: the leading chunks made after this very prefix."""

    name = "prefix"
    exact_only = True

    def plan(self, inp: PlanInput) -> RecomputePlan:
        return plan_prefix(inp)


FULL = FullStrategy()
"""Every prompt row computed (prompt log-probabilities need them all)."""
DEFAULT_STRATEGY = "cachecraft"
PRODUCT_STRATEGIES: tuple[str, ...] = ("full", "prefix", "cachecraft")


def product_registry() -> StrategyRegistry:
    """A registry of the product's three strategies (at their default parameters)."""
    return StrategyRegistry([FULL, PrefixStrategy(), CachecraftStrategy()])


STRATEGIES = product_registry()
"""The process's registry: `serve`, `ask`, `LLM` and the server resolve names here."""
