"""ReuseStrategy (how one request reuses stored chunk-caches: a name, its own parameters, a
`plan`, and the capability flags the engine and runner read instead of names) and the
StrategyRegistry that resolves a name to one, once, where a request enters (`LLM`, the server's
request parsing, the server's `--mode`). Pure Python, no torch.

The product registers `full`, `prefix` and `cachecraft` (`reuse/strategies.py`); the lab
registers its baselines into the same registry when it runs.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from cachecraft.config import ReuseConfig
from cachecraft.errors import BadRequestError
from cachecraft.reuse.modes import PlanInput
from cachecraft.reuse.plan import RecomputePlan
from cachecraft.reuse.stats import Scoring, ScoringRules


@dataclasses.dataclass(frozen=True, slots=True)
class NoParams:
    """The parameters of a strategy that has none."""


class ReuseStrategy(ABC):
    """One way of planning a request's recompute. Subclasses set `name` and the flags, and
    take their parameters as one frozen dataclass (`params`), checked when made."""

    name: ClassVar[str]
    reads_store: ClassVar[bool] = True
    """It looks stored variants up (False: every chunk is computed, none offered)."""
    exact_only: ClassVar[bool] = False
    """It reuses only exact variants made in exactly this place (a chunk another request is
    computing serves it only when that one will be exact here)."""
    remembers_prompts: ClassVar[bool] = False
    """The engine remembers the prompts it prefilled with this strategy and tells the planner
    when one comes again (`PlanInput.repeat`), so it can refresh the repeat."""

    def __init__(self, params: Any = None) -> None:
        self.params = params if params is not None else self.default_params()

    @classmethod
    def default_params(cls) -> Any:
        """The parameters when none are given."""
        return NoParams()

    @abstractmethod
    def plan(self, inp: PlanInput) -> RecomputePlan:
        """The plan of one request (pure: store metadata and the prefix cache's state in)."""

    def scoring(self, config: ReuseConfig) -> Scoring:
        """How its stored variants are scored: the user's CFO bounds and its own rules (its
        parameters, when they are ScoringRules; else the default rules)."""
        p = self.params
        rules = p if isinstance(p, ScoringRules) else ScoringRules()
        return Scoring.of(config.alpha, config.min_fix, config.max_fix, rules)

    def with_params(self, **changes: Any) -> ReuseStrategy:
        """The same strategy with some parameters changed (an ablation); a bad value is a
        ValueError from the parameters' own check."""
        return type(self)(dataclasses.replace(self.params, **changes))

    def param_names(self) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(self.params))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.params == self.params  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self.params))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params!r})"


class StrategyRegistry:
    """Name -> strategy. `resolve` is the one check of a strategy name in the code base."""

    def __init__(self, strategies: Iterable[ReuseStrategy] = ()) -> None:
        self._by_name: dict[str, ReuseStrategy] = {}
        for s in strategies:
            self.register(s)

    def register(self, strategy: ReuseStrategy, *, replace: bool = False) -> None:
        """Add `strategy` under its name; a name taken by another kind of strategy is a
        ValueError unless `replace`."""
        old = self._by_name.get(strategy.name)
        if old is not None and type(old) is not type(strategy) and not replace:
            raise ValueError(f"a strategy named {strategy.name!r} is registered already")
        self._by_name[strategy.name] = strategy

    def get(self, name: str) -> ReuseStrategy:
        """The strategy registered as `name`; BadRequestError naming the valid ones."""
        strategy = self._by_name.get(name) if isinstance(name, str) else None
        if strategy is None:
            raise BadRequestError(f"unknown mode {name!r}; choose one of {', '.join(self.names())}")
        return strategy

    def resolve(self, strategy: str | ReuseStrategy) -> ReuseStrategy:
        """A name looked up, or a strategy object (e.g. an ablation's) as it is."""
        return strategy if isinstance(strategy, ReuseStrategy) else self.get(strategy)

    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def __iter__(self) -> Iterator[ReuseStrategy]:
        return iter(tuple(self._by_name.values()))

    def param_names(self) -> frozenset[str]:
        """Every parameter some registered strategy takes."""
        return frozenset().union(*(s.param_names() for s in self))

    def with_params(self, **changes: Any) -> StrategyRegistry:
        """A registry of the same strategies, each with those of `changes` it takes changed."""
        out = StrategyRegistry()
        for s in self:
            own = {k: v for k, v in changes.items() if k in s.param_names()}
            out.register(s.with_params(**own) if own else s)
        return out

    def __contains__(self, name: object) -> bool:
        return name in self._by_name


__all__ = ["NoParams", "ReuseStrategy", "StrategyRegistry"]
