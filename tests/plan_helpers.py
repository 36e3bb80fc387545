"""Hand-made prompt layouts for the torch-free planner tests (tests/test_planner.py and
tests/test_reuse_modes.py): chunk keys with made-up sizes, laid after a 3-token prefix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cachecraft.config import ReuseConfig, field_names
from cachecraft.reuse.plan import ChunkSlot, PromptLayout
from cachecraft.reuse.strategies import STRATEGIES
from cachecraft.reuse.strategy import ReuseStrategy
from cachecraft_bench.strategies import register

register()  # the planner tests cover the lab's baselines too


def make_layout(keys: tuple[str, ...], sizes: Mapping[str, int], prefix: str) -> PromptLayout:
    """Chunk i gets ids 100 * (i + 1) ..., `sizes[key]` of them; the question is (9, 9)."""
    start, slots = 3, []
    for i, key in enumerate(keys):
        ids = tuple(range(100 * (i + 1), 100 * (i + 1) + sizes[key]))
        slots.append(ChunkSlot(key=key, label=None, token_ids=ids, start=start))
        start += sizes[key]
    return PromptLayout(prefix, (1, 2, 3), tuple(slots), (9, 9))


def settings(
    mode: str, fields: Mapping[str, Any] | None = None, shared: bool = False
) -> tuple[ReuseStrategy, ReuseConfig]:
    """The strategy `mode` and a ReuseConfig with `fields` given to whichever owns each (a bad
    value is the owner's ValueError). shared: `fields` are one set for every strategy, and a
    strategy's parameter another strategy does not take is left out for it."""
    fields = dict(fields or {})
    reuse = {k: v for k, v in fields.items() if k in field_names(ReuseConfig)}
    params = {k: v for k, v in fields.items() if k not in reuse}
    if shared:
        own = STRATEGIES.get(mode).param_names()
        params = {k: v for k, v in params.items() if k in own}
    strategy = STRATEGIES.get(mode)
    return (strategy.with_params(**params) if params else strategy), ReuseConfig(**reuse)
