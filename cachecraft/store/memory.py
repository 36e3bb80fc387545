"""MemoryStore: a single-tier ChunkStore, plain LRU over variants by bytes.

Owns the variants it holds and their recency order; knows nothing of disk, Redis or value
scores (those are the tiered store's job). A variant larger than the capacity is refused.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from cachecraft.store.meta import VariantMeta
from cachecraft.store.variant import Variant

logger = logging.getLogger(__name__)


class MemoryStore:
    """ChunkStore kept in one dict; least recently used variants are evicted first.

    "Used" means offered, loaded or hit. At most `max_variants_per_chunk` variants per chunk key;
    offering one more evicts that chunk's least recently used variant. Thread-safe.
    """

    def __init__(self, capacity_bytes: int, max_variants_per_chunk: int = 4) -> None:
        if capacity_bytes < 0 or max_variants_per_chunk < 1:
            raise ValueError("capacity_bytes must be >= 0 and max_variants_per_chunk >= 1")
        self.capacity_bytes = capacity_bytes
        self.max_variants_per_chunk = max_variants_per_chunk
        self._lru: OrderedDict[str, Variant] = OrderedDict()  # oldest first
        self._by_chunk: dict[str, list[str]] = {}  # chunk_key -> variant ids, insertion order
        self._nbytes = 0
        self._lock = threading.RLock()
        self.num_evictions = 0

    # -- ChunkStore -------------------------------------------------------------------------
    def variants(self, chunk_key: str) -> list[VariantMeta]:
        with self._lock:
            return [self._lru[vid].meta for vid in self._by_chunk.get(chunk_key, ())]

    def load(self, variant_id: str) -> Variant | None:
        with self._lock:
            variant = self._lru.get(variant_id)
            if variant is not None:
                self._lru.move_to_end(variant_id)
            return variant

    def offer(self, variant: Variant) -> bool:
        size = variant.nbytes
        if size > self.capacity_bytes:
            logger.debug("refused variant %s: %d bytes > capacity", variant.variant_id, size)
            return False
        with self._lock:
            vid = variant.variant_id
            if vid in self._lru:
                self._drop(vid)
            siblings = self._by_chunk.get(variant.chunk_key, [])
            while len(siblings) >= self.max_variants_per_chunk:
                oldest = min(siblings, key=self._recency_rank)
                self._drop(oldest)
                self.num_evictions += 1
                siblings = self._by_chunk.get(variant.chunk_key, [])
            while self._nbytes + size > self.capacity_bytes:
                oldest, _ = next(iter(self._lru.items()))
                self._drop(oldest)
                self.num_evictions += 1
            self._lru[vid] = variant
            self._by_chunk.setdefault(variant.chunk_key, []).append(vid)
            self._nbytes += size
            return True

    def record_hit(self, variant_id: str, cfo: float) -> None:
        with self._lock:
            if variant_id in self._lru:
                self._lru.move_to_end(variant_id)

    def would_admit(self, chunk_key: str) -> bool:
        return True  # no doorkeeper: every offer that fits is stored

    def record_miss(self, chunk_key: str) -> None:
        """Plain LRU keeps no miss statistics."""

    # -- housekeeping -----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, variant_id: object) -> bool:
        return variant_id in self._lru

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def variant_ids(self) -> list[str]:
        """Ids held, least recently used first."""
        with self._lock:
            return list(self._lru)

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
            self._by_chunk.clear()
            self._nbytes = 0

    def remove(self, chunk_key: str) -> int:
        """Drop every variant of `chunk_key`; returns how many were dropped."""
        with self._lock:
            ids = list(self._by_chunk.get(chunk_key, ()))
            for vid in ids:
                self._drop(vid)
            return len(ids)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the byte count, LRU order and per-chunk index agree."""
        with self._lock:
            total = sum(v.nbytes for v in self._lru.values())
            assert total == self._nbytes, f"nbytes {self._nbytes} != sum of variants {total}"
            assert self._nbytes <= self.capacity_bytes, "over capacity"
            indexed = [vid for ids in self._by_chunk.values() for vid in ids]
            assert len(indexed) == len(set(indexed)), "a variant is indexed twice"
            assert set(indexed) == set(self._lru), "chunk index and LRU disagree"
            for chunk_key, ids in self._by_chunk.items():
                assert ids, f"empty entry for chunk {chunk_key}"
                assert len(ids) <= self.max_variants_per_chunk, f"too many variants of {chunk_key}"
                for vid in ids:
                    assert self._lru[vid].chunk_key == chunk_key, f"{vid} filed under {chunk_key}"
                    assert self._lru[vid].variant_id == vid, f"{vid} stored under a wrong id"

    # -- internals --------------------------------------------------------------------------
    def _recency_rank(self, variant_id: str) -> int:
        for rank, vid in enumerate(self._lru):
            if vid == variant_id:
                return rank
        raise KeyError(variant_id)

    def _drop(self, variant_id: str) -> None:
        variant = self._lru.pop(variant_id)
        self._nbytes -= variant.nbytes
        ids = self._by_chunk[variant.chunk_key]
        ids.remove(variant_id)
        if not ids:
            del self._by_chunk[variant.chunk_key]
