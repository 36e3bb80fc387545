"""ReuseConfig (the reuse knobs a user sets) and the declarative field check every settings
dataclass of the reuse layer uses (`ranged` next to a field, `check_fields` in its
`__post_init__`). The other settings live with their owner: StoreConfig (store/config.py),
EngineConfig (engine/engine.py), ServerConfig (server/config.py), a strategy's own parameters
(reuse/cachecraft.py); the model is chosen by path (`load_model`). Environment: env.py.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any


def ranged(default: Any, low: float | None = None, high: float | None = None) -> Any:
    """A dataclass field whose value (when not None) must lie in [low, high]."""
    return dataclasses.field(default=default, metadata={"range": (low, high)})


def check_fields(obj: Any) -> None:
    """Types, the Literal fields' choices and the `ranged` bounds of a settings dataclass, so a
    bad config file, flag or keyword is one clear ValueError when it is made."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            continue
        kinds = {hint, *options}
        if typing.get_origin(hint) is typing.Literal:
            if value not in options:
                raise ValueError(f"{f.name} must be one of {', '.join(options)}, got {value!r}")
        elif bool in kinds:
            if not isinstance(value, bool):
                raise ValueError(f"{f.name} must be true or false, got {value!r}")
        elif int in kinds and float not in kinds:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{f.name} must be an integer, got {value!r}")
        elif float in kinds and (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ValueError(f"{f.name} must be a finite number, got {value!r}")
        low, high = f.metadata.get("range", (None, None))
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
            raise ValueError(f"{f.name} must be {bounds}, got {value!r}")


@dataclass(frozen=True, slots=True)
class ReuseConfig:
    """How much of a reused chunk is recomputed, and when a chunk is computed afresh instead
    (cache-craft.md §3-§4). The strategy's finer parameters belong to the strategy."""

    alpha: float = ranged(0.5, 0.0)
    """Scales a reused chunk's cache-fix overhead: CFO = alpha x CCI x (1 - beta')."""
    min_fix: float = ranged(0.0, 0.0, 1.0)
    """Smallest share of a reused chunk's tokens recomputed."""
    max_fix: float = ranged(1.0, 0.0, 1.0)
    """Largest share of a reused chunk's tokens recomputed."""
    max_recompute: float | None = ranged(None, 0.0, 1.0)
    """Largest share of a request's reused tokens its fix spends, the question probe's rows
    included: a ceiling on the CFO budgets added up (None: none). Budgets a caller gives per
    chunk are spent as given."""
    focus_threshold: float = ranged(0.05, 0.0)
    """A chunk whose share of the question's attention is below this is not recomputed."""
    refresh_error: float | None = ranged(None, 0.0)
    """Predicted error above which a chunk is computed in full and stored anew (None: never)."""
    refresh_repeats: bool = True
    """A prompt seen before computes its inexactly reused chunks in full, so its repeats reuse
    exact caches."""
    stats_stride: int = ranged(3, 1)
    """Attention statistics of a new chunk-cache are measured at every stats_stride-th layer."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.min_fix > self.max_fix:
            raise ValueError(
                f"min_fix and max_fix must satisfy min_fix <= max_fix, got {self.min_fix} and "
                f"{self.max_fix}"
            )


def field_names(cls: type) -> frozenset[str]:
    """The field names of a settings dataclass."""
    return frozenset(f.name for f in dataclasses.fields(cls))
