"""Chunk management for the server: the per-namespace chunk registry and the /v1/chunks
routes (precompute, list, delete). Pinning is the store's (`ChunkStore.pin`).

Chunk keys hash the namespace in, so a key cannot tell its tenant; the registry remembers which
keys each namespace precomputed or used, and which variants it pinned. With a disk tier it keeps
them in `registry.sqlite` beside the chunk files, so a restarted server lists, deletes and pins
what it did before (`restore_pins`); without one it lives in memory and restarts empty. Replicas
sharing a directory each read it once, at start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from cachecraft.engine.engine import Engine
from cachecraft.errors import PinLimitError
from cachecraft.request import Chunk, RagRequest
from cachecraft.reuse.layout import PromptLayout
from cachecraft.store.base import ChunkStore, RefusalReason
from cachecraft.store.config import StoreConfig

log = logging.getLogger(__name__)

REGISTRY_FILE = "registry.sqlite"

REFUSALS: dict[RefusalReason, str] = {
    "doorkeeper": "the doorkeeper has not seen this chunk often enough",
    "chunk_cap": "the chunk has max_variants_per_chunk more valuable variants",
    "value": "the eviction policy values it below what it would have to evict",
    "too_big": "bigger than every tier's capacity",
    "write_failed": "every tier that would take it failed to write it",
}
"""The words for each OfferResult.reason in a precompute answer."""


class ChunkRegistry:
    """namespace -> {chunk key: (label, num_tokens)} for the keys it precomputed or used, and
    the variants each namespace pinned. `path`: a SQLite file that keeps both across restarts
    (None: memory only). A failed write is logged and the entry kept in memory: a full or
    read-only disk never fails a request here."""

    def __init__(self, path: str | Path | None = None) -> None:
        self._keys: dict[str, dict[str, tuple[str | None, int]]] = {}
        self._pins: dict[str, tuple[str, str]] = {}  # variant id -> (namespace, chunk key)
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        if path is not None:
            self._open(Path(path))

    def _open(self, path: Path) -> None:
        try:
            self._load(path)
        except sqlite3.Error as e:
            code = getattr(e, "sqlite_errorcode", None) or 0
            if code & 0xFF not in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
                log.warning("chunk registry %s unusable (%s): kept in memory only", path, e)
                return
            # a damaged file: set it aside (never deleted) and keep registering from now on
            aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
            log.warning("chunk registry %s is corrupt (%s): moved to %s", path, e, aside.name)
            self._keys.clear()
            self._pins.clear()
            try:
                for suffix in ("", "-wal", "-shm"):
                    part = path.with_name(path.name + suffix)
                    if part.exists():
                        os.replace(part, aside.with_name(aside.name + suffix))
                self._load(path)
            except (OSError, sqlite3.Error) as e2:
                log.warning("chunk registry %s unusable (%s): kept in memory only", path, e2)

    def _load(self, path: Path) -> None:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            # Writes can run on the event loop: wait at most 1 s for another replica's lock
            # (then the write is logged as failed and kept in memory), and no fsync per commit
            # (WAL at NORMAL survives a killed process; a power cut loses at most the last
            # listings, never a chunk file).
            db.execute("PRAGMA busy_timeout=1000")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(
                "CREATE TABLE IF NOT EXISTS chunks (namespace TEXT, chunk_key TEXT, label TEXT,"
                " num_tokens INTEGER, PRIMARY KEY (namespace, chunk_key))"
            )
            db.execute(
                "CREATE TABLE IF NOT EXISTS pins (variant_id TEXT PRIMARY KEY, namespace TEXT,"
                " chunk_key TEXT)"
            )
            for ns, key, label, n in db.execute("SELECT * FROM chunks"):
                self._keys.setdefault(ns, {})[key] = (label, int(n))
            for vid, ns, key in db.execute("SELECT * FROM pins"):
                self._pins[vid] = (ns, key)
        except BaseException:
            db.close()
            raise
        self._db = db

    def _write(self, sql: str, args: tuple[Any, ...]) -> None:
        """Caller holds the lock."""
        if self._db is None:
            return
        try:
            self._db.execute(sql, args)
        except sqlite3.Error as e:
            log.warning("chunk registry write failed (%s): kept in memory only", e)

    def add(self, namespace: str, chunk_key: str, label: str | None, num_tokens: int) -> None:
        with self._lock:
            known = self._keys.setdefault(namespace, {})
            old = known.get(chunk_key)
            entry = (label or (old[0] if old else None), num_tokens)
            if entry == old:
                return
            known[chunk_key] = entry
            self._write(
                "INSERT OR REPLACE INTO chunks VALUES (?,?,?,?)", (namespace, chunk_key, *entry)
            )

    def keys(self, namespace: str) -> dict[str, tuple[str | None, int]]:
        with self._lock:
            return dict(self._keys.get(namespace, {}))

    def discard(self, namespace: str, chunk_key: str) -> bool:
        """Forget a chunk of a namespace and its pins."""
        with self._lock:
            for vid in [v for v, nk in self._pins.items() if nk == (namespace, chunk_key)]:
                del self._pins[vid]
            self._write(
                "DELETE FROM pins WHERE namespace=? AND chunk_key=?", (namespace, chunk_key)
            )
            self._write(
                "DELETE FROM chunks WHERE namespace=? AND chunk_key=?", (namespace, chunk_key)
            )
            return self._keys.get(namespace, {}).pop(chunk_key, None) is not None

    def pin(self, namespace: str, chunk_key: str, variant_id: str) -> None:
        with self._lock:
            self._pins[variant_id] = (namespace, chunk_key)
            self._write(
                "INSERT OR REPLACE INTO pins VALUES (?,?,?)", (variant_id, namespace, chunk_key)
            )

    def unpin(self, variant_id: str) -> None:
        with self._lock:
            self._pins.pop(variant_id, None)
            self._write("DELETE FROM pins WHERE variant_id=?", (variant_id,))

    def pins(self) -> dict[str, tuple[str, str]]:
        """variant id -> (namespace, chunk key) of every pin recorded."""
        with self._lock:
            return dict(self._pins)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def open_registry(store: StoreConfig | None) -> ChunkRegistry:
    """The registry for a store built from `store`: in its cache directory when it has a disk
    tier, else in memory."""
    if store is None or not store.cache_dir or store.disk_bytes <= 0:
        return ChunkRegistry()
    return ChunkRegistry(Path(store.cache_dir) / REGISTRY_FILE)


def restore_pins(store: ChunkStore, registry: ChunkRegistry) -> int:
    """Pin again what the registry says was pinned (a restart empties the store's memory);
    a pinned variant no longer stored anywhere is forgotten. Returns how many were pinned."""
    num_pinned = 0
    for vid, (namespace, _) in registry.pins().items():
        variant = store.load(vid)
        if variant is None:
            log.warning("pinned variant %s is no longer stored: pin dropped", vid)
            registry.unpin(vid)
            continue
        try:
            store.pin(variant, namespace)
        except PinLimitError as e:
            log.warning("pin of %s not restored: %s", vid, e)
            registry.unpin(vid)
            continue
        num_pinned += 1
    return num_pinned


def precompute_request(
    text: str, label: str | None, namespace: str, system: str | None
) -> RagRequest:
    """The request whose prefill computes one document's chunk-cache after `system`."""
    return RagRequest(".", [Chunk(text, label)], system=system, namespace=namespace)


def precompute(
    engine: Engine,
    store: ChunkStore,
    registry: ChunkRegistry,
    request: RagRequest,
    layout: PromptLayout | None,
    pin: bool,
) -> dict[str, Any]:
    """Step thread: compute one document alone after the system prompt and store it.

    An explicit precompute is demand enough: a first offer turned away by the doorkeeper
    (chunk seen once) is repeated. Why the store turned the variant away (`OfferResult.reason`)
    or that a write failed ("write_failed": disk full or unwritable; the variant may still be
    served from memory, `stored`) is reported in `not_stored_reason`, with the words in
    `not_stored_detail`."""
    runner = engine.runner
    plan = runner.plan(request, "cachecraft", lookup=False, layout=layout)
    job = runner.start(plan, precompute=True)
    outcome = runner.finish(job, runner.loaded.model.forward_step([job.work])[0])
    variant = runner.variants(outcome)[-1]
    offered = store.offer(variant)
    if offered.reason == "doorkeeper":
        offered = store.offer(variant)
    label = request.chunks[0].id
    registry.add(request.namespace, variant.chunk_key, label, variant.meta.num_tokens)
    if pin:
        store.pin(variant, request.namespace)  # PinLimitError: a 400 naming the cap
        registry.pin(request.namespace, variant.chunk_key, variant.variant_id)
    row: dict[str, Any] = {
        "id": label,
        "chunk_key": variant.chunk_key,
        "variant_id": variant.variant_id,
        "num_tokens": variant.meta.num_tokens,
        "stored": offered.stored or pin,
        "pinned": pin,
    }
    if offered.write_error is not None:
        row["not_stored_reason"] = "write_failed"
        row["not_stored_detail"] = f"disk write failed: {offered.write_error}"
    elif offered.reason is not None and not pin:
        row["not_stored_reason"] = offered.reason
        row["not_stored_detail"] = REFUSALS[offered.reason]
    return row


async def precompute_async(engine: Engine, *args: Any) -> dict[str, Any]:
    return await asyncio.wrap_future(engine.call(lambda: precompute(engine, *args)))


def list_chunks(store: ChunkStore, registry: ChunkRegistry, namespace: str) -> dict[str, Any]:
    pinned = store.pinned_chunk_keys()
    data = []
    for key, (label, num_tokens) in sorted(registry.keys(namespace).items()):
        variants = store.variants(key)
        data.append(
            {
                "chunk_key": key,
                "id": label,
                "num_tokens": num_tokens,
                "pinned": key in pinned,
                "num_variants": len(variants),
                "variants": [
                    {"variant_id": m.variant_id, "num_s_old": len(m.s_old), "cci": m.cci}
                    for m in variants
                ],
            }
        )
    # Only this namespace's own figures: whole-store numbers (other tenants' bytes) are for
    # operators, on /metrics.
    stats = {
        "num_chunks": len(data),
        "num_variants": sum(d["num_variants"] for d in data),
        "num_pinned": sum(1 for d in data if d["pinned"]),
        "pinned_bytes": store.pinned_nbytes({d["chunk_key"] for d in data}),
    }
    return {"object": "list", "data": data, "stats": stats}
