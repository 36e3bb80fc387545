"""StoreConfig: every store knob, one field each, with defaults and validation.

Builds nothing (the factory is `store.make_store`), so it imports no tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cachecraft.store.policy import POLICIES

GiB = 1 << 30


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
"""What the redis client parses (anything else was a ValueError traceback at start-up)."""


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
    redis_cluster: bool = False
    """`redis_url` names startup nodes of a Redis/Valkey cluster (several separated by commas);
    the tier shards across it, each chunk's keys on one shard."""
    redis_prefix: str = "cachecraft:"
    redis_backoff_s: float = 1.0
    """After a Redis error, wait this long before retrying (doubling, up to 30 s)."""
    policy: str = "value"
    doorkeeper_threshold: int = 2
    """A chunk's variant is admitted once the chunk was seen this many times (<= 1: always)."""
    admit_all_below: float = 0.5
    """While the store's largest tier is filled below this share of its capacity, every chunk
    is admitted on first sight: the doorkeeper keeps one-hit wonders from evicting valuable
    variants, and with room to spare nothing is evicted (`bench store`: hit rate 0.666 vs 0.600
    at threshold 2, 7% fewer computed tokens). 0 keeps the doorkeeper always on."""
    doorkeeper_size: int = 65536
    """Chunk keys whose sightings are remembered (locally and in the SQLite tally)."""
    shared_ttl_s: float = 7 * 86400.0
    """In Redis, a chunk's sightings and a variant's hit statistics expire this long after
    their last update (bounds what the shared tally keeps)."""
    max_variants_per_chunk: int = 4
    """Variants kept per chunk (different S_old); the least valuable goes past it."""
    storage_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    """dtype of stored K/V (the runner casts new variants to it before offering them)."""
    int8: bool = False
    """Store K/V as int8 with per-channel scales on disk and in Redis (memory keeps the dtype)."""
    decay_half_life: float = 10000.0
    """Hit frequency halves every this many chunk lookups (record_hit + record_miss calls);
    long enough that a warm chunk's frequency spans several of its reuses (store_bench)."""
    prior_cfo: float = 0.5
    """CFO assumed for a variant with no hits yet when estimating tokens saved per hit."""
    device: str = "cpu"
    layer_read_ahead: bool = True
    max_pinned_bytes_per_namespace: int | None = None
    """Pinned bytes one namespace (tenant) may hold in this process; None: no cap. Pinning past
    it raises PinLimitError (HTTP 400 from POST /v1/chunks with "pin": true)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}: choose one of {POLICIES}")
        if not 0.0 <= self.admit_all_below <= 1.0:
            raise ValueError(f"admit_all_below must be in [0, 1], got {self.admit_all_below}")
        if self.max_variants_per_chunk < 1:
            raise ValueError("max_variants_per_chunk must be >= 1")
        if min(self.memory_bytes, self.host_bytes, self.disk_bytes, self.redis_bytes) < 0:
            raise ValueError("capacities must be >= 0")
        if (
            self.max_pinned_bytes_per_namespace is not None
            and self.max_pinned_bytes_per_namespace < 0
        ):
            raise ValueError("max_pinned_bytes_per_namespace must be >= 0 (or None: no cap)")
        if self.storage_dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"storage_dtype {self.storage_dtype!r}: float16, bfloat16 or float32")
        if self.redis_url is not None and not self.redis_url.startswith(REDIS_SCHEMES):
            raise ValueError(
                f"redis_url {self.redis_url!r} must start with one of {', '.join(REDIS_SCHEMES)}"
            )
        if self.redis_cluster and self.redis_url is not None:
            for url in self.redis_url.split(","):
                if not url.strip().startswith(("redis://", "rediss://")):
                    raise ValueError(
                        f"redis_url {url!r}: a cluster's nodes are redis:// or rediss:// URLs"
                    )
        if "{" in self.redis_prefix or "}" in self.redis_prefix:
            raise ValueError(
                f"redis_prefix {self.redis_prefix!r} may not contain braces (they are the "
                "cluster's hash tags)"
            )
