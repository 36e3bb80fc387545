"""TieredStore: the ChunkStore over memory -> host -> disk -> Redis tiers, and `make_store`.

Owns the lookup cascade (promotion on hit), admission (doorkeeper, per-chunk cap, policy),
eviction with demotion, write-through to disk and Redis (or write-behind, on a writer
thread, for offers that do not wait), pinning and prefetch. Tensors are
moved, never computed here; ranking arithmetic lives in `policy`, shared counts in `tally`,
file and wire formats in `disk`/`codec`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from cachecraft.errors import PinLimitError, StoreUnavailableError
from cachecraft.store.base import OfferResult, RefusalReason, StorageDtype, TierHealth
from cachecraft.store.config import StoreConfig
from cachecraft.store.disk import DiskTier
from cachecraft.store.layers import LayerReader, ReadAheadLayerReader, TensorLayerReader
from cachecraft.store.meta import VariantMeta
from cachecraft.store.policy import Doorkeeper, VariantStats, make_policy
from cachecraft.store.ram_tier import RamTier
from cachecraft.store.redis_tier import RedisTier
from cachecraft.store.stats import StoreStats
from cachecraft.store.tally import LocalTally, RedisTally, SqliteTally, Tally
from cachecraft.store.variant import Variant

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Pending:
    """A variant whose slow-tier writes wait on the writer thread. `cancelled`: it was
    removed meanwhile, so it is not written, or what was written goes again."""

    variant: Variant
    cancelled: bool = False


class TieredStore:
    """ChunkStore across tiers. Every admitted variant is written to memory (if the policy lets
    it displace residents), to disk and to Redis (write-through); a variant evicted from memory
    is demoted to the host tier or, if absent there, to disk. Thread-safe.

    `offer(variant, wait=False)` (the engine's, after a request's first token) places the
    variant in memory at once and leaves its disk and Redis writes to one writer thread, at
    most `MAX_PENDING` at a time (beyond that the offer writes them itself); `flush` waits for
    them and `close` finishes them. A variant removed while its write waits is not written."""

    MAX_PENDING = 32
    """Slow-tier writes that may wait on the writer thread; more are written by the caller."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.policy = make_policy(config.policy, config.decay_half_life, config.prior_cfo)
        device = torch.device(config.device)
        self.ram: list[RamTier] = [RamTier("memory", config.memory_bytes, device)]
        if device.type != "cpu" and config.host_bytes > 0:
            self.ram.append(RamTier("host", config.host_bytes, "cpu"))
        self.disk = (
            DiskTier(config.cache_dir, config.disk_bytes, config.int8)
            if config.cache_dir and config.disk_bytes > 0
            else None
        )
        self.redis = (
            RedisTier(
                config.redis_url,
                config.redis_bytes,
                config.redis_prefix,
                config.int8,
                backoff_s=config.redis_backoff_s,
                cluster=config.redis_cluster,
            )
            if config.redis_url and config.redis_bytes > 0
            else None
        )
        self.tally: Tally = self._make_tally()
        """Sightings, clock and hit statistics: shared through Redis, else the disk directory."""
        self.doorkeeper = Doorkeeper(
            config.doorkeeper_threshold, config.doorkeeper_size, counter=self.tally
        )
        self._room, self._room_at = False, float("-inf")  # see _has_room
        self._stats_by_id: dict[str, VariantStats] = {}
        self._pinned: dict[str, Variant] = {}
        self._pin_namespace: dict[str, str] = {}  # variant id -> the namespace that pinned it
        self._tick = self.tally.now()
        self._use = 0
        self._closed = False
        self._lock = threading.RLock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-prefetch")
        self._inflight: dict[str, Future[float]] = {}
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-writer")
        self._pending: dict[str, _Pending] = {}  # id -> slow-tier writes queued or running
        self._prefetched: dict[str, float] = {}  # id -> background load seconds, not yet used
        # Slow reads run without the lock; a removal meanwhile must not be undone by placing
        # what they read: id -> reads in flight, and the ids removed during one.
        self._reading: dict[str, int] = {}
        self._removed_while_read: set[str] = set()
        self._stats = StoreStats()
        self.eviction_log: deque[tuple[str, str, str]] = deque(maxlen=4096)
        """(tier, variant_id, reason) of recent evictions, oldest first (tests, debugging)."""

    def _make_tally(self) -> Tally:
        cfg = self.config
        if self.redis is not None:
            return RedisTally(
                self.redis.conn, cfg.redis_prefix + "tally:", cfg.doorkeeper_size,
                backoff_s=cfg.redis_backoff_s, ttl_s=cfg.shared_ttl_s,
            )  # fmt: skip
        if self.disk is not None:
            return SqliteTally(self.disk.root, cfg.doorkeeper_size)
        return LocalTally(cfg.doorkeeper_size)

    # -- ChunkStore -------------------------------------------------------------------------
    @property
    def storage_dtype(self) -> StorageDtype:
        return self.config.storage_dtype

    def variants(self, chunk_key: str) -> list[VariantMeta]:
        found: dict[str, VariantMeta] = {}
        with self._lock:
            for v in self._pinned.values():
                if v.chunk_key == chunk_key:
                    found[v.variant_id] = v.meta
            for tier in self.ram:
                for meta in tier.metas(chunk_key):
                    found.setdefault(meta.variant_id, meta)
            for vid, waiting in self._waiting(chunk_key).items():
                found.setdefault(vid, waiting.meta)
        for slow in (self.disk, self.redis):
            if slow is not None:
                for meta in slow.metas(chunk_key):
                    found.setdefault(meta.variant_id, meta)
        return list(found.values())

    def load(self, variant_id: str) -> Variant | None:
        with self._lock:
            pinned = self._pinned.get(variant_id)
            if pinned is not None:
                self._stats.hits["pinned"] += 1
                return pinned
        waited, bg = self._wait_prefetch(variant_id)
        with self._lock:
            for tier in self.ram:
                variant = tier.get(variant_id)
                if variant is None:
                    self._stats.tier_misses[tier.name] += 1
                else:
                    self._touch(variant_id)
                    self._stats.hits[tier.name] += 1
                    if bg is not None:
                        self._stats.prefetch_hidden_s += max(0.0, bg - waited)
                    if tier is not self.ram[0]:
                        self._place(variant)
                    return self.ram[0].get(variant_id) or variant
            variant = self._held_for_writing(variant_id)
            if variant is not None:
                return variant
        variant, tier_name = self._fetch_slow(variant_id)
        with self._lock:
            if self._removed_during_read(variant_id):
                variant = None
            if variant is None:
                self._stats.load_misses += 1
                if not self._is_local(variant_id):
                    self._stats_by_id.pop(variant_id, None)
                return None
            self._stats.hits[tier_name] += 1
            self._place(variant)
            self._touch(variant_id)
            return self.ram[0].get(variant_id) or variant

    def _waiting(self, chunk_key: str) -> dict[str, Variant]:
        """The chunk's variants that wait for the writer thread and were not removed. Caller
        holds the lock."""
        return {
            vid: p.variant
            for vid, p in self._pending.items()
            if p.variant.chunk_key == chunk_key and not p.cancelled
        }

    def _held_for_writing(self, variant_id: str) -> Variant | None:
        """The variant if it waits for the writer thread (memory did not keep it, or let it
        go before its file exists): served from there, counted as a "pending" hit. Caller
        holds the lock."""
        pending = self._pending.get(variant_id)
        if pending is None or pending.cancelled:
            return None
        self._touch(variant_id)
        self._stats.hits["pending"] += 1
        return pending.variant

    def _touch(self, variant_id: str) -> None:
        """Mark a use (LRU order). Caller holds the lock."""
        st = self._stats_by_id.get(variant_id)
        if st is not None:
            self._use += 1
            st.last_use = self._use

    def offer(self, variant: Variant, wait: bool = True) -> OfferResult:
        chunk, vid = variant.chunk_key, variant.variant_id
        if wait and vid in self._pending:  # its queued write first, then this one's result
            self.flush()
        with self._lock:
            self.doorkeeper.sight_offer(chunk)
            if not (self.doorkeeper.admits(chunk) or self._has_room()):
                self._stats.rejected["doorkeeper"] += 1
                return OfferResult(vid, False, "doorkeeper")
            st = self._stats_of(vid)  # a re-offered variant keeps its hit history
            if st is None:
                st = VariantStats(vid, chunk, variant.meta.num_tokens, variant.nbytes)
                self.policy.on_admit(st, self.doorkeeper.count(chunk), self._tick)
                self.tally.save(st)
            self._use += 1
            st.last_use = self._use
            if not self._enforce_chunk_cap(st):
                self._stats.rejected["chunk_cap"] += 1
                return OfferResult(vid, False, "chunk_cap")
            self._stats_by_id[vid] = st
            in_memory = self._place(variant)
            pending = self._pending.get(vid)
            if pending is not None:  # offered again while its write waits: that write does
                pending.cancelled = False
            elif not wait and self._has_slow_tier() and len(self._pending) < self.MAX_PENDING:
                pending = self._pending[vid] = _Pending(variant)
                self._writer.submit(self._write_behind, pending, st, in_memory)
            if pending is not None:
                return OfferResult(vid, in_memory, None, queued=True)
        stored, write_error = self._write_slow(variant, st)
        return self._settle(variant, in_memory or stored, write_error)

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

    def _settle(self, variant: Variant, stored: bool, write_error: str | None) -> OfferResult:
        """Count an offer's outcome; forget the statistics of one stored nowhere."""
        vid = variant.variant_id
        reason: RefusalReason | None = None
        if not stored:
            if write_error is not None:
                reason = "write_failed"
            else:
                reason = "value" if variant.nbytes <= self._max_cap() else "too_big"
        with self._lock:
            if reason is None:
                self._stats.admitted += 1
            else:
                self._stats.rejected[reason] += 1
                self._stats_by_id.pop(vid, None)
        return OfferResult(vid, stored, reason, write_error)

    def _write_behind(self, pending: _Pending, st: VariantStats, in_memory: bool) -> None:
        """The writer thread's half of `offer(..., wait=False)`."""
        variant = pending.variant
        vid = variant.variant_id
        stored, write_error = False, None
        try:
            if not pending.cancelled:
                stored, write_error = self._write_slow(variant, st)
        except Exception as e:  # never lose the writer thread to one variant
            logger.exception("writing variant %s behind failed", vid)
            write_error = f"{type(e).__name__}: {e}"
        with self._lock:  # one hold: an offer of the same id cannot write between the two
            self._pending.pop(vid, None)
            if pending.cancelled:  # removed while queued or written: its files go too
                if self.disk is not None:
                    self.disk.delete(vid)
                if self.redis is not None:
                    self.redis.delete(vid)
                return
        self._settle(variant, in_memory or stored, write_error)

    def flush(self) -> None:
        """Wait until every slow-tier write that `offer(..., wait=False)` queued has ended."""
        with contextlib.suppress(RuntimeError):  # shut down by close(), which finished them
            self._writer.submit(lambda: None).result()

    def record_hit(self, variant_id: str, cfo: float) -> None:
        tick = self.tally.tick()
        shared = self.tally.stats_of(variant_id) if self.tally.is_shared else None
        with self._lock:
            self._tick = max(self._tick, tick)
            local = self._stats_of(variant_id)
            st = shared or local
            if st is None:
                return
            if local is not None and shared is not None:  # hits from every process
                st.last_use = local.last_use
                self._stats_by_id[variant_id] = st
            self._use += 1
            st.last_use = self._use
            self.policy.on_hit(st, cfo, self._tick)
        self.tally.save(st)
        if self.disk is not None and variant_id in self.disk:
            self.disk.update_stats(st)

    def would_admit(self, chunk_key: str) -> bool:
        with self._lock:
            return self.doorkeeper.would_admit_after_miss(chunk_key) or self._has_room()

    def record_miss(self, chunk_key: str) -> None:
        tick = self.tally.tick()
        with self._lock:
            self._tick = max(self._tick, tick)
            self._stats.misses += 1
            self.doorkeeper.sight_miss(chunk_key)

    # -- prefetch and layer-wise reads ----------------------------------------------------
    def prefetch(self, variant_ids: list[str]) -> None:
        """Bring variants from slow tiers into memory on a background thread (call when a
        request is queued); a later load() finds them in memory."""
        with self._lock:
            for vid in variant_ids:
                if vid in self._pinned:
                    continue
                if vid not in self.ram[0] and vid not in self._inflight:
                    self._inflight[vid] = self._pool.submit(self._prefetch_one, vid)

    def _prefetch_one(self, variant_id: str) -> float:
        t0 = time.perf_counter()
        with self._lock:
            variant = next((t.get(variant_id) for t in self.ram[1:] if variant_id in t), None)
        if variant is None:
            variant, _ = self._fetch_slow(variant_id)
        took = time.perf_counter() - t0
        with self._lock:
            self._stats.prefetch_loads += 1
            self._stats.prefetch_load_s += took
            if self._removed_during_read(variant_id):
                variant = None
            if variant is not None and self._place(variant):
                self._prefetched[variant_id] = took
        return took

    def _wait_prefetch(self, variant_id: str) -> tuple[float, float | None]:
        """(seconds waited for an in-flight prefetch, its background load seconds or None)."""
        with self._lock:
            fut = self._inflight.get(variant_id)
        waited = 0.0
        if fut is not None:
            t0 = time.perf_counter()
            fut.result()
            waited = time.perf_counter() - t0
        with self._lock:
            self._inflight.pop(variant_id, None)
            return waited, self._prefetched.pop(variant_id, None)

    def wait_prefetch(self) -> None:
        """Block until every queued prefetch finished (tests, shutdown)."""
        with self._lock:
            futs = list(self._inflight.values())
        for fut in futs:
            fut.result()

    def open_layers(self, variant_id: str) -> LayerReader | None:
        """Layer-wise reader: from memory as slices, from disk lazily with read-ahead of layer
        l+1 while the caller computes layer l. None if the variant is nowhere."""
        with self._lock:
            pinned = self._pinned.get(variant_id)
            if pinned is not None:
                self._stats.hits["pinned"] += 1
                return TensorLayerReader(pinned.keys, pinned.values)
        self._wait_prefetch(variant_id)
        with self._lock:
            for tier in self.ram:
                variant = tier.get(variant_id)
                if variant is not None:
                    self._touch(variant_id)
                    self._stats.hits[tier.name] += 1
                    return TensorLayerReader(variant.keys, variant.values)
            variant = self._held_for_writing(variant_id)
            if variant is not None:
                return TensorLayerReader(variant.keys, variant.values)
        if self.disk is not None:
            reader = self.disk.open_layers(variant_id, self.config.device)
            if reader is not None:
                with self._lock:
                    self._stats.hits["disk"] += 1
                if not self.config.layer_read_ahead:
                    return reader
                return ReadAheadLayerReader(reader, on_close=self._count_layer_reads)
        variant = self.redis.get(variant_id, self.config.device) if self.redis else None
        with self._lock:
            if variant is None:
                self._stats.load_misses += 1
                return None
            self._stats.hits["redis"] += 1
        return TensorLayerReader(variant.keys, variant.values)

    def _count_layer_reads(self, read_s: float, wait_s: float) -> None:
        with self._lock:
            self._stats.layer_read_s += read_s
            self._stats.layer_hidden_s += max(0.0, read_s - wait_s)

    # -- placement and eviction -----------------------------------------------------------
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
            and not self._will_write(variant_id)
        ):
            st = self._stats_of(variant_id)
            if st is not None:
                self._disk_put(variant, st)
        if not self._is_local(variant_id) and self.redis is None:
            self._stats_by_id.pop(variant_id, None)
            self.tally.forget(variant_id)

    def _will_write(self, variant_id: str) -> bool:
        """The writer thread is to write this variant. Caller holds the lock."""
        pending = self._pending.get(variant_id)
        return pending is not None and not pending.cancelled

    def _cancel_write(self, variant_id: str) -> None:
        """A removed variant's queued write must not bring it back. Caller holds the lock."""
        pending = self._pending.get(variant_id)
        if pending is not None:
            pending.cancelled = True

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
                if s.variant_id not in self._pinned
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
        losers = [
            s for s in self.policy.order(pool, self._tick) if s.variant_id not in self._pinned
        ]
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
        pool = [s for s in (self._stats_of(v) for v in ids - self._pinned.keys()) if s]
        for loser in self.policy.order(pool, self._tick)[: max(0, excess)]:
            self._remove_variant(loser.variant_id, "chunk_cap")

    def _chunk_ids(self, chunk_key: str) -> set[str]:
        """Ids of the chunk's variants in memory, on disk or waiting to be written there.
        Caller holds the lock."""
        ids = {v for t in self.ram for v in t.chunk_ids(chunk_key)}
        ids |= self._waiting(chunk_key).keys()
        if self.disk is not None:
            ids |= {m.variant_id for m in self.disk.metas(chunk_key)}
        return ids

    def _remove_variant(self, variant_id: str, reason: str) -> None:
        self.eviction_log.append(("*", variant_id, reason))
        self._cancel_write(variant_id)
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

    # -- housekeeping ---------------------------------------------------------------------
    def stats(self) -> StoreStats:
        """A snapshot of the counters, with current bytes and counts per tier."""
        with self._lock:
            snap = StoreStats.__new__(StoreStats)
            for f in StoreStats.__slots__:
                value = getattr(self._stats, f)
                setattr(snap, f, value.copy() if hasattr(value, "copy") else value)
            tiers: list = [*self.ram, self.disk, self.redis]
            for tier in tiers:
                if tier is not None:
                    snap.nbytes[tier.name] = tier.nbytes
                    snap.num_variants[tier.name] = len(tier)
            if self.redis is not None:
                snap.redis_errors = self.redis.num_errors
            if self.disk is not None:
                snap.evictions["disk:corrupt"] = self.disk.num_corrupt
                snap.disk_write_errors = self.disk.num_write_errors
                snap.last_disk_write_error = self.disk.last_write_error
            snap.pending_writes = len(self._pending)
            if self._pinned:
                snap.nbytes["pinned"] = sum(v.nbytes for v in self._pinned.values())
                snap.num_variants["pinned"] = len(self._pinned)
            return snap

    def health(self) -> list[TierHealth]:
        out = [TierHealth(t.name, True, len(t), t.nbytes) for t in self.ram]
        if self.disk is not None:
            ok = os.access(self.disk.root, os.W_OK)
            n, nbytes = (len(self.disk), self.disk.nbytes) if ok else (0, 0)
            out.append(TierHealth("disk", ok, n, nbytes))
        if self.redis is not None:
            up = self.redis.is_reachable
            n, nbytes = (len(self.redis), self.redis.nbytes) if up else (0, 0)
            out.append(TierHealth("redis", up, n, nbytes, self.redis.detail))
        return out

    def variant_ids(self) -> list[str]:
        """Ids in memory, least valuable (for LRU: least recently used) first."""
        with self._lock:
            known = [self._stats_of(v) for v in self.ram[0].ids()]
            return [s.variant_id for s in self.policy.order([s for s in known if s], self._tick)]

    # -- pinning --------------------------------------------------------------------------
    def pin(self, variant: Variant, namespace: str = "default") -> None:
        cap = self.config.max_pinned_bytes_per_namespace
        vid = variant.variant_id
        with self._lock:
            if vid in self._pinned:
                return
            if cap is not None:
                used = sum(
                    self._pinned[i].nbytes
                    for i, ns in self._pin_namespace.items()
                    if ns == namespace
                )
                if used + variant.nbytes > cap:
                    raise PinLimitError(
                        f"namespace {namespace!r} has {used} bytes pinned; pinning "
                        f"{variant.nbytes} more would pass max_pinned_bytes_per_namespace={cap}: "
                        "unpin chunks (DELETE /v1/chunks/{chunk_key}) or raise "
                        "--max-pinned-bytes-per-namespace"
                    )
            self._pinned[vid] = variant
            self._pin_namespace[vid] = namespace
            on_disk = self.disk is None or vid in self.disk
            if not on_disk:
                st = self._stats_of(vid) or VariantStats(
                    vid, variant.chunk_key, variant.meta.num_tokens, variant.nbytes
                )
                self._make_way_in_chunk(st)
        if not on_disk:  # admission may have refused it: a restart pins it again from disk
            written, error = self._disk_write(variant, st)
            if not written:
                why = error or "no room: the disk holds only pinned variants, or it is too small"
                logger.warning(
                    "pinned variant %s is not on disk (%s): unpinned at restart", vid, why
                )

    def unpin(self, variant_id: str) -> bool:
        with self._lock:
            self._pin_namespace.pop(variant_id, None)
            return self._pinned.pop(variant_id, None) is not None

    def pinned_variant_ids(self) -> set[str]:
        with self._lock:
            return set(self._pinned)

    def pinned_chunk_keys(self) -> set[str]:
        with self._lock:
            return {v.chunk_key for v in self._pinned.values()}

    def pinned_nbytes(self, chunk_keys: set[str]) -> int:
        with self._lock:
            return sum(v.nbytes for v in self._pinned.values() if v.chunk_key in chunk_keys)

    def __len__(self) -> int:
        ids = {v for t in self.ram for v in t.ids()}
        if self.disk is not None:
            ids |= {s.variant_id for s in self.disk.all_stats()}
        return len(ids)

    def __contains__(self, variant_id: object) -> bool:
        """Pinned or held by a local tier (memory, host, disk)."""
        return isinstance(variant_id, str) and (
            variant_id in self._pinned or self._is_local(variant_id)
        )

    @property
    def nbytes(self) -> int:
        return self.ram[0].nbytes

    def remove(self, chunk_key: str) -> int:
        if self.redis is not None and not self.redis.is_reachable:
            raise StoreUnavailableError(
                f"redis {self.redis.url} is unreachable: its copies of chunk {chunk_key} cannot "
                "be removed, so nothing was removed; retry when it is back"
            )
        with self._lock:
            ids = self._unpin_and_list_in_memory(chunk_key)
            if self.disk is not None:
                ids |= {m.variant_id for m in self.disk.metas(chunk_key)}
            if self.redis is not None:
                ids |= {m.variant_id for m in self.redis.metas(chunk_key)}
            for vid in ids:
                self._remove_variant(vid, "removed")
            return len(ids)

    def _unpin_and_list_in_memory(self, chunk_key: str) -> set[str]:
        """Drop the chunk's pins; its variant ids that were pinned, sit in a memory tier or
        wait for the writer thread. Caller holds the lock."""
        ids = {i for i, v in self._pinned.items() if v.chunk_key == chunk_key}
        for i in ids:
            del self._pinned[i]
            self._pin_namespace.pop(i, None)
        ids |= self._waiting(chunk_key).keys()
        return ids | {v for t in self.ram for v in t.chunk_ids(chunk_key)}

    def forget_in_memory(self, chunk_key: str) -> int:
        with self._lock:
            ids = self._unpin_and_list_in_memory(chunk_key)
            for vid in ids:
                if vid in self._reading:
                    self._removed_while_read.add(vid)
                self._cancel_write(vid)  # removed by another replica: not to be written back
                for tier in self.ram:
                    if tier.delete(vid):
                        self._stats.evictions[f"{tier.name}:removed"] += 1
                if not self._is_local(vid):
                    self._stats_by_id.pop(vid, None)
            return len(ids)

    def clear(self) -> None:
        with self._lock:
            self._removed_while_read |= self._reading.keys()
            for vid in self._pending:
                self._cancel_write(vid)
            self._pinned.clear()
            self._pin_namespace.clear()
            for tier in self.ram:
                tier.clear()
            if self.disk is not None:
                self.disk.clear()
            if self.redis is not None:
                self.redis.clear()
            self._stats_by_id.clear()

    def check_integrity(self) -> None:
        """Raise AssertionError unless every tier is internally consistent and within capacity,
        each RAM variant has stats, no variant sits in two RAM tiers and the per-chunk cap holds
        (after the queued writes ended)."""
        self.flush()
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

    def close(self) -> None:
        if self._closed:
            return
        self._writer.shutdown(wait=True)  # queued writes end before the tiers close
        self._closed = True
        self._pool.shutdown(wait=True)
        self.tally.close()
        if self.disk is not None:
            self.disk.close()
        if self.redis is not None:
            self.redis.close()


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


def make_store(config: StoreConfig) -> TieredStore:
    """The tiered store for `config` (memory only when no cache_dir and no redis_url)."""
    return TieredStore(config)
