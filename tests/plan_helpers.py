"""Hand-made prompt layouts for the torch-free planner tests (tests/test_planner.py and
tests/test_reuse_modes.py): chunk keys with made-up sizes, laid after a 3-token prefix."""

from __future__ import annotations

from collections.abc import Mapping

from cachecraft.reuse.plan import ChunkSlot, PromptLayout


def make_layout(keys: tuple[str, ...], sizes: Mapping[str, int], prefix: str) -> PromptLayout:
    """Chunk i gets ids 100 * (i + 1) ..., `sizes[key]` of them; the question is (9, 9)."""
    start, slots = 3, []
    for i, key in enumerate(keys):
        ids = tuple(range(100 * (i + 1), 100 * (i + 1) + sizes[key]))
        slots.append(ChunkSlot(key=key, label=None, token_ids=ids, start=start))
        start += sizes[key]
    return PromptLayout(prefix, (1, 2, 3), tuple(slots), (9, 9))
