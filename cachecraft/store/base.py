"""ChunkStore: the narrow interface the planner and runner use to reach chunk-caches.

Implementations: `memory.MemoryStore` (LRU, one tier) and the tiered store.
"""

from __future__ import annotations

from typing import Protocol

from cachecraft.store.meta import VariantMeta
from cachecraft.store.variant import Variant


class ChunkStore(Protocol):
    def variants(self, chunk_key: str) -> list[VariantMeta]:
        """Metadata of every stored variant of `chunk_key` (cheap: no tensors are read)."""
        ...

    def load(self, variant_id: str) -> Variant | None:
        """The variant's K/V, or None if it is gone (evicted, corrupt, unreachable)."""
        ...

    def offer(self, variant: Variant) -> bool:
        """Offer a freshly computed variant; admission decides. Returns True if it was stored."""
        ...

    def would_admit(self, chunk_key: str) -> bool:
        """Would admission let in a variant of `chunk_key` offered by a request that misses it
        now (its miss counted)? Cheap; the prefill skips attention statistics for chunks that
        would be turned away. Space may still refuse it later."""
        ...

    def record_hit(self, variant_id: str, cfo: float) -> None:
        """A request reused this variant, recomputing a fraction `cfo` of its tokens."""
        ...

    def record_miss(self, chunk_key: str) -> None:
        """A request needed `chunk_key` and no variant was found."""
        ...
