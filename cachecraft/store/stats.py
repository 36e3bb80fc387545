"""StoreStats: the store's counters in one dataclass (later exported as Prometheus metrics).

Owns no logic beyond counting and serializing.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class StoreStats:
    hits: Counter[str] = field(default_factory=Counter)
    """Loads served, per tier that served them (memory, host, disk, redis; pending: a variant
    waiting for the writer thread)."""
    misses: int = 0
    """Chunk lookups that found no variant (record_miss)."""
    tier_misses: Counter[str] = field(default_factory=Counter)
    """Per tier, loads that looked there and did not find the variant."""
    load_misses: int = 0
    """load() of an advertised variant that was gone (evicted meanwhile, corrupt, unreachable)."""
    nbytes: dict[str, int] = field(default_factory=dict)
    num_variants: dict[str, int] = field(default_factory=dict)
    evictions: Counter[str] = field(default_factory=Counter)
    """By "tier:reason": capacity, chunk_cap, corrupt, removed."""
    admitted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    """Offers not stored, by reason: doorkeeper, chunk_cap, value, too_big, write_failed,
    not_finite."""
    prefetch_loads: int = 0
    prefetch_load_s: float = 0.0
    prefetch_hidden_s: float = 0.0
    """Background load time that a later load() did not have to wait for."""
    layer_read_s: float = 0.0
    layer_hidden_s: float = 0.0
    """Layer read time overlapped with the caller's compute (read-ahead)."""
    redis_errors: int = 0
    disk_write_errors: int = 0
    """Disk writes that failed (full, unwritable); the variant stayed in the tiers above."""
    last_disk_write_error: str | None = None
    pending_writes: int = 0
    """Variants whose disk / Redis writes wait on the writer thread now (write-behind)."""

    def as_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        for name in ("hits", "tier_misses", "evictions", "rejected"):
            out[name] = dict(getattr(self, name))
        return out
