"""StoreConfig (every store knob, one field each) and `make_store`, the one factory.

Owns defaults and validation; builds stores but holds no state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachecraft.store.base import ChunkStore
from cachecraft.store.policy import POLICIES

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Capacities are bytes per tier; a tier with no location (cache_dir / redis_url None) or
    capacity 0 is absent. The host tier exists only when `device` is not the CPU."""

    memory_bytes: int = 1 * GiB
    host_bytes: int = 4 * GiB
    disk_bytes: int = 32 * GiB
    redis_bytes: int = 4 * GiB
    cache_dir: str | None = None
    redis_url: str | None = None
    redis_prefix: str = "cachecraft:"
    redis_backoff_s: float = 1.0
    """After a Redis error, wait this long before retrying (doubling, up to 30 s)."""
    policy: str = "value"
    doorkeeper_threshold: int = 2
    """A chunk's variant is admitted once the chunk was seen this many times (<= 1: always)."""
    doorkeeper_size: int = 65536
    max_variants_per_chunk: int = 4
    int8: bool = False
    """Store K/V as int8 with per-channel scales on disk and in Redis (memory keeps the dtype)."""
    decay_half_life: float = 10000.0
    """Hit frequency halves every this many chunk lookups (record_hit + record_miss calls);
    long enough that a warm chunk's frequency spans several of its reuses (store_bench)."""
    prior_cfo: float = 0.5
    """CFO assumed for a variant with no hits yet when estimating tokens saved per hit."""
    device: str = "cpu"
    layer_read_ahead: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}: choose one of {POLICIES}")
        if self.max_variants_per_chunk < 1:
            raise ValueError("max_variants_per_chunk must be >= 1")
        if min(self.memory_bytes, self.host_bytes, self.disk_bytes, self.redis_bytes) < 0:
            raise ValueError("capacities must be >= 0")


def make_store(config: StoreConfig) -> ChunkStore:
    """The tiered store for `config` (memory only when no cache_dir and no redis_url)."""
    from cachecraft.store.store import TieredStore

    return TieredStore(config)
