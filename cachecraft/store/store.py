"""TieredStore: the ChunkStore over memory -> host -> disk -> Redis tiers, and `make_store`.

Owns the lookup cascade (promotion on hit), admission (doorkeeper, per-chunk cap, policy),
eviction with demotion and write-through to disk and Redis. Its collaborators own the rest:
`WriteBehind` the writer thread for offers that do not wait, `Prefetcher` the fetch thread,
`PinSet` the pins and their per-namespace cap. Tensors are moved, never computed here; ranking
arithmetic lives in `policy`, shared counts in `tally`, file and wire formats in
`disk`/`codec`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque

import torch

from cachecraft.errors import StoreUnavailableError
from cachecraft.store.base import OfferResult, PinView, RefusalReason, StorageDtype, TierHealth
from cachecraft.store.codec import CorruptVariantError
from cachecraft.store.config import StoreConfig
from cachecraft.store.disk import DiskTier
from cachecraft.store.layers import LayerReader, ReadAheadLayerReader, TensorLayerReader
from cachecraft.store.meta import VariantMeta
from cachecraft.store.pins import PinSet
from cachecraft.store.placement import Placement
from cachecraft.store.policy import Doorkeeper, VariantStats, make_policy
from cachecraft.store.prefetcher import Prefetcher
from cachecraft.store.ram_tier import RamTier
from cachecraft.store.redis_tier import RedisTier
from cachecraft.store.stats import StoreStats
from cachecraft.store.tally import LocalTally, RedisTally, SqliteTally, Tally
from cachecraft.store.variant import Variant
from cachecraft.store.write_behind import WriteBehind

logger = logging.getLogger(__name__)


class TieredStore(Placement):
    """ChunkStore across tiers. Every admitted variant is written to memory (if the policy lets
    it displace residents), to disk and to Redis (write-through); a variant evicted from memory
    is demoted to the host tier or, if absent there, to disk. Thread-safe.

    `offer(variant, wait=False)` (the engine's, after a request's first token) places the
    variant in memory at once and leaves its disk and Redis writes to `writes` (one writer
    thread, at most `writes.max_pending` queued; beyond that the offer writes them itself);
    `flush` waits for them and `close` finishes them. A variant removed while its write waits
    is not written. `pins` holds the pinned variants, `prefetcher` the background fetches."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.policy = make_policy(config.policy, config.decay_half_life, config.prior_cfo)
        device = torch.device(config.device)
        self.ram: list[RamTier] = [RamTier("memory", config.memory_bytes, device)]
        if device.type != "cpu" and config.host_bytes > 0:
            pin = device.type == "cuda"  # its promotions to the GPU then copy asynchronously
            self.ram.append(RamTier("host", config.host_bytes, "cpu", pin=pin))
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
        self._tick = self.tally.now()
        self._use = 0
        self._closed = False
        self._lock = threading.RLock()
        self._stats = StoreStats()
        self.pins = PinSet(config.max_pinned_bytes_per_namespace)
        self.writes = WriteBehind(self._lock, self._write_slow, self._settle, self._drop_slow)
        self.prefetcher = Prefetcher(self._lock, self._prefetch_one, self._stats)
        # Slow reads run without the lock; a removal meanwhile must not be undone by placing
        # what they read: id -> reads in flight, and the ids removed during one.
        self._reading: dict[str, int] = {}
        self._removed_while_read: set[str] = set()
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
            for meta in self.pins.metas(chunk_key):
                found[meta.variant_id] = meta
            for tier in self.ram:
                for meta in tier.metas(chunk_key):
                    found.setdefault(meta.variant_id, meta)
            for vid, waiting in self.writes.waiting(chunk_key).items():
                found.setdefault(vid, waiting.meta)
        for slow in (self.disk, self.redis):
            if slow is not None:
                for meta in slow.metas(chunk_key):
                    found.setdefault(meta.variant_id, meta)
        return list(found.values())

    def load(self, variant_id: str) -> Variant | None:
        with self._lock:
            pinned = self.pins.get(variant_id)
            if pinned is not None:
                self._stats.hits["pinned"] += 1
                return pinned
        waited, bg = self.prefetcher.wait(variant_id)
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

    def _held_for_writing(self, variant_id: str) -> Variant | None:
        """The variant if it waits for the writer thread (memory did not keep it, or let it
        go before its file exists): served from there, counted as a "pending" hit. Caller
        holds the lock."""
        variant = self.writes.held(variant_id)
        if variant is not None:
            self._touch(variant_id)
            self._stats.hits["pending"] += 1
        return variant

    def offer(self, variant: Variant, wait: bool = True) -> OfferResult:
        chunk, vid = variant.chunk_key, variant.variant_id
        if not variant.is_finite():  # never stored: every later request would reuse it
            logger.warning("variant %s holds non-finite K/V: not stored", vid)
            with self._lock:
                self._stats.rejected["not_finite"] += 1
            return OfferResult(vid, False, "not_finite")
        if wait and vid in self.writes:  # its queued write first, then this one's result
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
            # offered again while its write waits: that write does
            if self.writes.requeue(vid) or (
                not wait and self._has_slow_tier() and self.writes.submit(variant, st, in_memory)
            ):
                return OfferResult(vid, in_memory, None, queued=True)
        stored, write_error = self._write_slow(variant, st)
        return self._settle(variant, in_memory or stored, write_error)

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

    def _drop_slow(self, variant_id: str) -> None:
        """Delete the variant's disk and Redis copies (written by a write removed meanwhile).
        Caller holds the lock."""
        if self.disk is not None:
            self.disk.delete(variant_id)
        if self.redis is not None:
            self.redis.delete(variant_id)

    def flush(self) -> None:
        """Wait until every slow-tier write that `offer(..., wait=False)` queued has ended."""
        self.writes.flush()

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
            self.prefetcher.start(
                v for v in variant_ids if v not in self.pins and v not in self.ram[0]
            )

    def _prefetch_one(self, variant_id: str) -> bool:
        """The prefetch thread's fetch: from the host tier or a slow one into memory. True if
        memory holds it now."""
        with self._lock:
            variant = next((t.get(variant_id) for t in self.ram[1:] if variant_id in t), None)
        from_slow = variant is None
        if from_slow:
            variant, _ = self._fetch_slow(variant_id)
        with self._lock:
            if from_slow and self._removed_during_read(variant_id):
                variant = None
            return variant is not None and self._place(variant)

    def wait_prefetch(self) -> None:
        """Block until every queued prefetch finished (tests, shutdown)."""
        self.prefetcher.wait_all()

    def open_layers(self, variant_id: str) -> LayerReader | None:
        """Layer-wise reader: from memory as slices, from disk lazily with read-ahead of layer
        l+1 while the caller computes layer l. None if the variant is nowhere."""
        with self._lock:
            pinned = self.pins.get(variant_id)
            if pinned is not None:
                self._stats.hits["pinned"] += 1
                return TensorLayerReader(pinned.keys, pinned.values)
        self.prefetcher.wait(variant_id)
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
            snap.pending_writes = len(self.writes)
            if len(self.pins):
                snap.nbytes["pinned"] = self.pins.nbytes()
                snap.num_variants["pinned"] = len(self.pins)
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
    def pin(self, variant: Variant, namespace: str = "default") -> bool:
        vid = variant.variant_id
        if not variant.is_finite():
            raise CorruptVariantError(f"variant {vid} holds non-finite K/V: not pinned")
        with self._lock:
            if not self.pins.add(variant, namespace):  # pinned already: nothing to do
                return self.disk is not None and vid in self.disk
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
                return False
        return self.disk is not None

    def unpin(self, variant_id: str) -> bool:
        with self._lock:
            return self.pins.discard(variant_id)

    def pinned(self) -> PinView:
        return self.pins

    def __len__(self) -> int:
        ids = {v for t in self.ram for v in t.ids()}
        if self.disk is not None:
            ids |= {s.variant_id for s in self.disk.all_stats()}
        return len(ids)

    def __contains__(self, variant_id: object) -> bool:
        """Pinned or held by a local tier (memory, host, disk)."""
        return isinstance(variant_id, str) and (
            variant_id in self.pins or self._is_local(variant_id)
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
        ids = self.pins.discard_chunk(chunk_key)
        ids |= self.writes.waiting(chunk_key).keys()
        return ids | {v for t in self.ram for v in t.chunk_ids(chunk_key)}

    def forget_in_memory(self, chunk_key: str) -> int:
        with self._lock:
            ids = self._unpin_and_list_in_memory(chunk_key)
            for vid in ids:
                if vid in self._reading:
                    self._removed_while_read.add(vid)
                self.writes.cancel(vid)  # removed by another replica: not to be written back
                for tier in self.ram:
                    if tier.delete(vid):
                        self._stats.evictions[f"{tier.name}:removed"] += 1
                if not self._is_local(vid):
                    self._stats_by_id.pop(vid, None)
            return len(ids)

    def clear(self) -> None:
        with self._lock:
            self._removed_while_read |= self._reading.keys()
            self.writes.cancel_all()
            self.pins.clear()
            for tier in self.ram:
                tier.clear()
            if self.disk is not None:
                self.disk.clear()
            if self.redis is not None:
                self.redis.clear()
            self._stats_by_id.clear()

    def close(self) -> None:
        if self._closed:
            return
        self.writes.close()  # queued writes end before the tiers close
        self._closed = True
        self.prefetcher.close()
        self.tally.close()
        if self.disk is not None:
            self.disk.close()
        if self.redis is not None:
            self.redis.close()


def make_store(config: StoreConfig) -> TieredStore:
    """The tiered store for `config` (memory only when no cache_dir and no redis_url)."""
    return TieredStore(config)
