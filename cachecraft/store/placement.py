"""Placement: the half of `TieredStore` that moves variants between tiers.

Owns where a variant lives: placement into a RAM tier with demotion of what the policy evicts,
write-through to disk and Redis, reads from the slow tiers (a Redis hit copied to local disk)
with the guard that keeps a removal during a read from being undone, the per-chunk cap,
removal from every tier, the admission room check, and the invariants of where variants
live (`check_integrity`). It holds no state of its own: the attributes below are set by
`TieredStore.__init__`, and every method expects the store's lock held unless it says
otherwise. Never imported but by `store.py`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque

from cachecraft.store.config import StoreConfig
from cachecraft.store.disk import DiskTier
from cachecraft.store.pins import PinSet
from cachecraft.store.policy import EvictionPolicy, VariantStats
from cachecraft.store.ram_tier import RamTier
from cachecraft.store.redis_tier import RedisTier
from cachecraft.store.stats import StoreStats
from cachecraft.store.tally import Tally
from cachecraft.store.variant import Variant
from cachecraft.store.write_behind import WriteBehind


class Placement:
    """Tier moves shared by the lookup cascade, admission and removal (see the module)."""

    config: StoreConfig
    policy: EvictionPolicy
    ram: list[RamTier]
    disk: DiskTier | None
    redis: RedisTier | None
    tally: Tally
    pins: PinSet
    writes: WriteBehind
    eviction_log: deque[tuple[str, str, str]]
    _lock: threading.RLock
    _stats: StoreStats
    _stats_by_id: dict[str, VariantStats]
    _tick: float
    _use: int
    _room: bool
    _room_at: float
    _reading: dict[str, int]
    _removed_while_read: set[str]

    def _touch(self, variant_id: str) -> None:
        """Mark a use (LRU order). Caller holds the lock."""
        st = self._stats_by_id.get(variant_id)
        if st is not None:
            self._use += 1
            st.last_use = self._use

    def _has_slow_tier(self) -> bool:
        return self.disk is not None or self.redis is not None

    def _write_slow(self, variant: Variant, st: VariantStats) -> tuple[bool, str | None]:
        """Write through to disk and Redis: (a slow tier stored it, the disk's write error)."""
        stored, write_error = False, None
        if self.disk is not None:
            stored, write_error = self._disk_write(variant, st)
        if self.redis is not None:
            stored = self.redis.put(variant, st, _in_order) is not None or stored
        return stored, write_error

    def _place(self, variant: Variant, level: int = 0) -> bool:
        """Put `variant` into RAM tier `level`, evicting (and demoting) what the policy picks.
        Caller holds the lock. False if it does not fit or the policy refuses."""
        tier = self.ram[level]
        vid = variant.variant_id
        if vid in tier:
            return True
        st = self._stats_of(vid) or VariantStats(
            vid, variant.chunk_key, variant.meta.num_tokens, variant.nbytes
        )
        self._stats_by_id.setdefault(vid, st)
        leaving: list[Variant] = []

        def choose(residents: list[VariantStats], need: int) -> list[VariantStats] | None:
            known = [self._stats_of(s.variant_id) or s for s in residents]
            victims = self.policy.victims(known, need, self._tick, st)
            if victims is not None:  # keep the tensors: a victim is demoted, not lost
                leaving.extend(v for v in (tier.get(s.variant_id) for s in victims) if v)
            return victims

        evicted = tier.put(variant, st, choose)
        if evicted is None:
            return False
        for victim in leaving:
            self._evicted(level, victim)
        for lower in self.ram[level + 1 :]:  # promoted out of a lower RAM tier: one copy in RAM
            lower.delete(vid)
        return True

    def _evicted(self, level: int, variant: Variant) -> None:
        """`variant` left RAM tier `level` for capacity: demote it. Caller holds the lock."""
        variant_id = variant.variant_id
        name = self.ram[level].name
        self._stats.evictions[f"{name}:capacity"] += 1
        self.eviction_log.append((name, variant_id, "capacity"))
        if level + 1 < len(self.ram):
            self._place(variant, level + 1)
        elif (
            self.disk is not None
            and variant_id not in self.disk
            and not self.writes.will_write(variant_id)
        ):
            st = self._stats_of(variant_id)
            if st is not None:
                self._disk_put(variant, st)
        if not self._is_local(variant_id) and self.redis is None:
            self._stats_by_id.pop(variant_id, None)
            self.tally.forget(variant_id)

    def _disk_put(self, variant: Variant, st: VariantStats) -> bool:
        return self._disk_write(variant, st)[0]

    def _disk_write(self, variant: Variant, st: VariantStats) -> tuple[bool, str | None]:
        """Write through to disk: (stored, this write's own error or None)."""
        assert self.disk is not None

        def choose(residents: list[VariantStats], need: int) -> list[VariantStats] | None:
            # Called under the disk's write lock: taking the store lock here could deadlock with
            # a demotion (store lock -> disk lock), so read the stats dict without it.
            # Hit statistics from this process (fresher), sizes as the disk counts them.
            # A pinned variant's file is never a victim: it is what a restart pins again.
            fresh = [
                dataclasses.replace(self._stats_by_id.get(s.variant_id, s), nbytes=s.nbytes)
                for s in residents
                if s.variant_id not in self.pins
            ]
            return self.policy.victims(fresh, need, self._tick)

        evicted, error = self.disk.write(variant, st, choose)
        if evicted is None:
            return False, error
        with self._lock:
            self._stats.evictions["disk:capacity"] += len(evicted)
            self.eviction_log.extend(("disk", v, "capacity") for v in evicted)
            gone = [v for v in evicted if self.redis is None and not self._is_local(v)]
            for v in gone:  # nowhere any more: its statistics go too
                self._stats_by_id.pop(v, None)
        for v in gone:
            self.tally.forget(v)
        return True, None

    def _enforce_chunk_cap(self, st: VariantStats) -> bool:
        """Keep at most max_variants_per_chunk variants per chunk, the most valuable ones.
        False if the candidate itself is the least valuable. Caller holds the lock."""
        ids = self._chunk_ids(st.chunk_key)
        ids.discard(st.variant_id)
        cap = self.config.max_variants_per_chunk
        if len(ids) < cap:
            return True
        pool = [s for s in (self._stats_of(v) for v in ids) if s is not None] + [st]
        # Pinned variants count against the cap but are never removed for it.
        losers = [s for s in self.policy.order(pool, self._tick) if s.variant_id not in self.pins]
        for loser in losers[: len(pool) - cap]:
            if loser is st:
                return False
            self._remove_variant(loser.variant_id, "chunk_cap")
        return True

    def _make_way_in_chunk(self, st: VariantStats) -> None:
        """Remove the least valuable unpinned variants of `st`'s chunk until it fits under
        max_variants_per_chunk (a pinned variant is stored whatever admission said). Caller
        holds the lock."""
        ids = self._chunk_ids(st.chunk_key)
        ids.discard(st.variant_id)
        excess = len(ids) + 1 - self.config.max_variants_per_chunk
        pool = [s for s in (self._stats_of(v) for v in ids - self.pins.variant_ids()) if s]
        for loser in self.policy.order(pool, self._tick)[: max(0, excess)]:
            self._remove_variant(loser.variant_id, "chunk_cap")

    def _chunk_ids(self, chunk_key: str) -> set[str]:
        """Ids of the chunk's variants in memory, on disk or waiting to be written there.
        Caller holds the lock."""
        ids = {v for t in self.ram for v in t.chunk_ids(chunk_key)}
        ids |= self.writes.waiting(chunk_key).keys()
        if self.disk is not None:
            ids |= {m.variant_id for m in self.disk.metas(chunk_key)}
        return ids

    def _remove_variant(self, variant_id: str, reason: str) -> None:
        self.eviction_log.append(("*", variant_id, reason))
        self.writes.cancel(variant_id)
        if variant_id in self._reading:
            self._removed_while_read.add(variant_id)
        for tier in self.ram:
            if tier.delete(variant_id):
                self._stats.evictions[f"{tier.name}:{reason}"] += 1
        if self.disk is not None and self.disk.delete(variant_id):
            self._stats.evictions[f"disk:{reason}"] += 1
        if self.redis is not None and self.redis.delete(variant_id):
            self._stats.evictions[f"redis:{reason}"] += 1
        self._stats_by_id.pop(variant_id, None)
        self.tally.forget(variant_id)

    def _removed_during_read(self, variant_id: str) -> bool:
        """End one slow read of `variant_id` (`_fetch_slow`): True if the variant was removed
        while it ran (then what it read must not be placed anywhere). Caller holds the lock."""
        left = self._reading.get(variant_id, 0) - 1
        removed = variant_id in self._removed_while_read
        if left > 0:
            self._reading[variant_id] = left
        else:
            self._reading.pop(variant_id, None)
            self._removed_while_read.discard(variant_id)
        return removed

    def _fetch_slow(self, variant_id: str) -> tuple[Variant | None, str]:
        """Disk, then Redis (a Redis hit is copied to local disk). No store lock held. Counts
        as a read in flight: the caller ends it with `_removed_during_read` under the lock."""
        with self._lock:
            self._reading[variant_id] = self._reading.get(variant_id, 0) + 1
        try:
            return self._read_slow(variant_id)
        except BaseException:
            with self._lock:
                self._removed_during_read(variant_id)
            raise

    def _read_slow(self, variant_id: str) -> tuple[Variant | None, str]:
        device = self.config.device
        if self.disk is not None:
            variant = self.disk.get(variant_id, device)
            if variant is not None:
                return variant, "disk"
            with self._lock:
                self._stats.tier_misses["disk"] += 1
        if self.redis is not None:
            variant = self.redis.get(variant_id, device)
            if variant is None:
                with self._lock:
                    self._stats.tier_misses["redis"] += 1
            else:
                if self.disk is not None:
                    with self._lock:
                        removed = variant_id in self._removed_while_read
                        st = self._stats_of(variant_id) or VariantStats(
                            variant_id, variant.chunk_key, variant.meta.num_tokens, variant.nbytes
                        )
                    if not removed:
                        self._disk_put(variant, st)
                return variant, "redis"
        return None, ""

    def _stats_of(self, variant_id: str) -> VariantStats | None:
        """This process's view, else the shared tally's, else the disk row's."""
        st = self._stats_by_id.get(variant_id)
        if st is None and self.tally.is_shared:
            st = self.tally.stats_of(variant_id)
        if st is None and self.disk is not None:
            st = self.disk.stats_of(variant_id)
        if st is not None:
            self._stats_by_id[variant_id] = st
        return st

    def _is_local(self, variant_id: str) -> bool:
        return any(variant_id in t for t in self.ram) or (
            self.disk is not None and variant_id in self.disk
        )

    ROOM_RECHECK_S = 1.0
    """How long a fill measurement of the largest tier is trusted (it may be a SQL sum or a
    Redis round trip; admission asks on every offer and every missed chunk)."""

    def _has_room(self) -> bool:
        """Is the largest tier filled below `admit_all_below` of its capacity? Caller holds
        the lock."""
        share = self.config.admit_all_below
        if share <= 0.0:
            return False
        now = time.monotonic()
        if now - self._room_at >= self.ROOM_RECHECK_S:
            tiers = [*self.ram, *(t for t in (self.disk, self.redis) if t is not None)]
            largest = max(tiers, key=lambda t: t.capacity_bytes)
            self._room = largest.nbytes < share * largest.capacity_bytes
            self._room_at = now
        return self._room

    def _max_cap(self) -> int:
        caps = [t.capacity_bytes for t in self.ram]
        caps += [self.disk.capacity_bytes] if self.disk else []
        caps += [self.redis.capacity_bytes] if self.redis else []
        return max(caps)

    def check_integrity(self) -> None:
        """Raise AssertionError unless every tier is internally consistent and within capacity,
        each RAM variant has stats, no variant sits in two RAM tiers and the per-chunk cap holds
        (after the queued writes ended)."""
        self.writes.flush()
        with self._lock:
            seen: set[str] = set()
            for tier in self.ram:
                tier.check_integrity()
                ids = set(tier.ids())
                assert not ids & seen, f"a variant is in {tier.name} and a tier above"
                seen |= ids
                for vid in ids:
                    assert vid in self._stats_by_id, f"{vid} in {tier.name} without stats"
            by_chunk: dict[str, set[str]] = {}
            for tier in self.ram:
                for vid in tier.ids():
                    by_chunk.setdefault(tier.get(vid).chunk_key, set()).add(vid)  # type: ignore[union-attr]
            if self.disk is not None:
                self.disk.check_integrity()
                for s in self.disk.all_stats():
                    by_chunk.setdefault(s.chunk_key, set()).add(s.variant_id)
            cap = self.config.max_variants_per_chunk
            for chunk, ids in by_chunk.items():
                assert len(ids) <= cap, f"chunk {chunk} has {len(ids)} variants > {cap}"
        if self.redis is not None:
            self.redis.check_integrity()


def _in_order(residents: list[VariantStats], need: int) -> list[VariantStats] | None:
    """The Redis tier's choice: residents in the order given (least recently accessed by any
    process first) until `need` bytes are free; value scores are per process, access is shared."""
    chosen, freed = [], 0
    for s in residents:
        if freed >= need:
            break
        chosen.append(s)
        freed += s.nbytes
    return chosen if freed >= need else None
