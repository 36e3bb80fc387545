"""MemoryStore: the tiered store configured as one memory tier with plain LRU, no doorkeeper.

A configuration, not a second implementation: everything is `TieredStore`'s. "Used" means
offered, loaded or hit; at most `max_variants_per_chunk` variants per chunk key (offering one
more evicts that chunk's least recently used variant); a variant bigger than the capacity is
refused.
"""

from __future__ import annotations

from cachecraft.store.base import StorageDtype
from cachecraft.store.config import StoreConfig
from cachecraft.store.store import TieredStore


def memory_config(
    capacity_bytes: int, max_variants_per_chunk: int = 4, storage_dtype: StorageDtype = "float16"
) -> StoreConfig:
    """Memory only, LRU, every variant admitted on first sight."""
    return StoreConfig(
        memory_bytes=capacity_bytes,
        policy="lru",
        doorkeeper_threshold=1,
        max_variants_per_chunk=max_variants_per_chunk,
        storage_dtype=storage_dtype,
    )


class MemoryStore(TieredStore):
    """`TieredStore(memory_config(...))`."""

    def __init__(
        self,
        capacity_bytes: int,
        max_variants_per_chunk: int = 4,
        storage_dtype: StorageDtype = "float16",
    ) -> None:
        super().__init__(memory_config(capacity_bytes, max_variants_per_chunk, storage_dtype))
