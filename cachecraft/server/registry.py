"""ChunkRegistry: which chunk keys each namespace precomputed or used (with a label and a token
count) and which variants it pinned. Pure bookkeeping: it never touches the store
(`server/chunks.py` reconciles the two).

Chunk keys hash the namespace in, so a key cannot tell its tenant; this table does. With a disk
tier it lives in `registry.sqlite` beside the chunk files, and that file is the source of truth:
every read queries it, so replicas sharing the directory see each other's registrations,
deletions and pins at once, and a restarted server finds what it did before. Without a file, or
while the file cannot be read or written, this process's own view in memory answers instead.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from cachecraft.store.config import StoreConfig
from cachecraft.store.sqlite_file import is_corrupt, open_shared

log = logging.getLogger(__name__)

REGISTRY_FILE = "registry.sqlite"

Entry = tuple[str | None, int]
"""(label, num_tokens) of one registered chunk."""


class ChunkRegistry:
    """namespace -> {chunk key: (label, num_tokens)} and variant id -> (namespace, chunk key) of
    the pins. `path`: the SQLite file shared by every process on the cache directory (None:
    memory only).

    In memory it keeps the last view read from the file with this process's own changes applied,
    and the writes the file refused (locked past 1 s, read-only, full disk), retried in order
    before the next access. While any is pending, or a read fails, the memory view answers: a
    failing file never fails a request and never loses what this process registered. Opening
    waits up to `open_wait_s` for a replica starting beside this one; a file that still cannot
    be opened is tried again every RETRY_S, and what was registered meanwhile is written then."""

    RETRY_S = 2.0
    """How long the memory view answers after the file refused a write or an open."""
    KEEP_REMOVALS_S = 24 * 3600.0
    """How long a removal is kept for other processes to hear of (`removals`)."""

    def __init__(self, path: str | Path | None = None, open_wait_s: float = 30.0) -> None:
        self._keys: dict[str, dict[str, Entry]] = {}
        self._pins: dict[str, tuple[str, str]] = {}  # variant id -> (namespace, chunk key)
        self._pending: list[tuple[str, tuple[Any, ...]]] = []
        self._lock = threading.Lock()
        self._path = Path(path) if path is not None else None
        self._db: sqlite3.Connection | None = None
        self._is_failing = False
        self._retry_at = 0.0  # after a refused write or open: the memory view answers until then
        self._removal_seq = 0  # the last removal seen (`removals`)
        self._own_removals: set[int] = set()
        self._since = time.time()  # removals before this concern other processes only
        if self._path is not None:
            # at start (not on the event loop) wait as long as the other files do for a
            # replica starting beside this one; later reopens wait 1 s like every write
            self._open(self._path, open_wait_s)

    # -- the file -------------------------------------------------------------------------
    def _open(self, path: Path, wait_s: float) -> None:
        """Open the file into `_db`; on failure the memory view answers and the open is retried
        RETRY_S later (`_is_open`), a corrupt file is set aside."""
        try:
            self._db = open_shared(path, wait_s, self._setup)
        except sqlite3.Error as e:
            if not is_corrupt(e):
                self._failed("open", e)
                self._retry_at = time.monotonic() + self.RETRY_S
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
                self._db = open_shared(path, wait_s, self._setup)
            except (OSError, sqlite3.Error) as e2:
                log.warning("chunk registry %s unusable (%s): kept in memory only", path, e2)
                self._path = None  # nothing to retry: the file cannot be replaced

    def _is_open(self, force: bool = False) -> bool:
        """Whether the file is open, opening it again once RETRY_S has passed since a failed
        open (at once if `force`). Caller holds the lock."""
        if (
            self._db is None
            and self._path is not None
            and (force or time.monotonic() >= self._retry_at)
        ):
            self._open(self._path, 1.0)
        return self._db is not None

    def _setup(self, db: sqlite3.Connection) -> None:
        """The tables, and the file's view into memory."""
        db.execute(
            "CREATE TABLE IF NOT EXISTS chunks (namespace TEXT, chunk_key TEXT, label TEXT,"
            " num_tokens INTEGER, PRIMARY KEY (namespace, chunk_key))"
        )
        db.execute(
            "CREATE TABLE IF NOT EXISTS pins (variant_id TEXT PRIMARY KEY, namespace TEXT,"
            " chunk_key TEXT)"
        )
        db.execute(
            "CREATE TABLE IF NOT EXISTS removals (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
            " chunk_key TEXT NOT NULL, at REAL NOT NULL)"
        )
        # a starting process held nothing in memory: removals before it do not concern it
        # (the same after a late open, which must still hear of the ones since its start)
        self._removal_seq = db.execute(
            "SELECT COALESCE(MAX(seq), 0) FROM removals WHERE at < ?", (self._since,)
        ).fetchone()[0]
        for ns, key, label, n in db.execute("SELECT * FROM chunks"):
            self._keys.setdefault(ns, {})[key] = (label, int(n))
        for vid, ns, key in db.execute("SELECT * FROM pins"):
            self._pins[vid] = (ns, key)
        # Writes can run on the event loop: wait at most 1 s for another replica's lock (then
        # the write stays pending in memory), and no fsync per commit (WAL at NORMAL survives a
        # killed process; a power cut loses at most the last listings, never a chunk file).
        db.execute("PRAGMA busy_timeout=1000")

    def _failed(self, what: str, error: sqlite3.Error) -> None:
        """Log the first failure of a run of them (a read-only file fails on every access)."""
        if not self._is_failing:
            log.warning(
                "chunk registry %s failed (%s): this process answers from memory", what, error
            )
        self._is_failing = True

    def _flush(self, force: bool = False) -> bool:
        """Apply the pending writes in order; True when the file is up to date with this
        process. After a refused write the next try waits RETRY_S (unless `force`), so a
        locked file costs one busy wait per RETRY_S, not one per call. Caller holds the lock."""
        if not self._is_open(force):
            return False
        if self._pending and not force and time.monotonic() < self._retry_at:
            return False
        while self._pending:
            sql, args = self._pending[0]
            try:
                self._db.execute(sql, args)
            except sqlite3.Error as e:
                self._failed("write", e)
                self._retry_at = time.monotonic() + self.RETRY_S
                return False
            self._pending.pop(0)
        return True

    def _write(self, sql: str, args: tuple[Any, ...]) -> None:
        """Caller holds the lock and has applied the change to the memory view."""
        if self._path is not None:
            self._pending.append((sql, args))
            self._flush()

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]] | None:
        """Rows from the file, or None: no file, writes still pending or the read failed (then
        the memory view answers). Caller holds the lock."""
        if not self._flush():
            return None
        try:
            rows = self._db.execute(sql, args).fetchall()  # type: ignore[union-attr]
        except sqlite3.Error as e:
            self._failed("read", e)
            return None
        if self._is_failing:
            log.info("chunk registry readable and written again")
        self._is_failing = False
        return rows

    # -- chunks ---------------------------------------------------------------------------
    def _entry(self, namespace: str, chunk_key: str) -> Entry | None:
        """Caller holds the lock."""
        rows = self._read(
            "SELECT label, num_tokens FROM chunks WHERE namespace=? AND chunk_key=?",
            (namespace, chunk_key),
        )
        if rows is None:
            return self._keys.get(namespace, {}).get(chunk_key)
        entry = (rows[0][0], int(rows[0][1])) if rows else None
        known = self._keys.setdefault(namespace, {})
        if entry is None:
            known.pop(chunk_key, None)
        else:
            known[chunk_key] = entry
        return entry

    def add(self, namespace: str, chunk_key: str, label: str | None, num_tokens: int) -> None:
        """Register a chunk of a namespace (a new label replaces the old; None keeps it).
        Writes only when something changed: a read per chunk of a request, not a write."""
        with self._lock:
            old = self._entry(namespace, chunk_key)
            entry = (label or (old[0] if old else None), num_tokens)
            if entry == old:
                return
            self._keys.setdefault(namespace, {})[chunk_key] = entry
            self._write(
                "INSERT OR REPLACE INTO chunks VALUES (?,?,?,?)", (namespace, chunk_key, *entry)
            )

    def keys(self, namespace: str) -> dict[str, Entry]:
        """Every chunk registered for `namespace`, by any process sharing the file."""
        with self._lock:
            rows = self._read(
                "SELECT chunk_key, label, num_tokens FROM chunks WHERE namespace=?", (namespace,)
            )
            if rows is not None:
                self._keys[namespace] = {key: (label, int(n)) for key, label, n in rows}
            return dict(self._keys.get(namespace, {}))

    def entries(self) -> list[tuple[str, str]]:
        """(namespace, chunk key) of every registered chunk, every namespace."""
        with self._lock:
            rows = self._read("SELECT namespace, chunk_key FROM chunks")
            if rows is not None:
                return [(ns, key) for ns, key in rows]
            return [(ns, key) for ns, known in self._keys.items() for key in known]

    def discard(self, namespace: str, chunk_key: str) -> bool:
        """Forget a chunk of a namespace and its pins; False if it was not registered."""
        with self._lock:
            existed = self._entry(namespace, chunk_key) is not None
            for vid in [v for v, nk in self._pins.items() if nk == (namespace, chunk_key)]:
                del self._pins[vid]
            self._keys.get(namespace, {}).pop(chunk_key, None)
            self._write(
                "DELETE FROM pins WHERE namespace=? AND chunk_key=?", (namespace, chunk_key)
            )
            self._write(
                "DELETE FROM chunks WHERE namespace=? AND chunk_key=?", (namespace, chunk_key)
            )
            return existed

    # -- removals -------------------------------------------------------------------------
    def record_removal(self, chunk_key: str) -> None:
        """Tell the other processes sharing the file that this process removed every variant
        of `chunk_key` from the shared tiers: they drop their memory copies (`removals`).
        Without a file, or if the write fails (logged), nobody else hears of it."""
        with self._lock:
            if not self._is_open():
                return
            now = time.time()
            try:
                cur = self._db.execute(
                    "INSERT INTO removals (chunk_key, at) VALUES (?, ?)", (chunk_key, now)
                )
                self._own_removals.add(int(cur.lastrowid or 0))
                self._db.execute("DELETE FROM removals WHERE at < ?", (now - self.KEEP_REMOVALS_S,))
            except sqlite3.Error as e:
                self._failed("write", e)

    def removals(self) -> list[str]:
        """Chunk keys other processes removed since the last call (or since this one
        opened the file); [] without a file or while it cannot be read."""
        with self._lock:
            rows = self._read(
                "SELECT seq, chunk_key FROM removals WHERE seq > ? ORDER BY seq",
                (self._removal_seq,),
            )
            if not rows:
                return []
            self._removal_seq = int(rows[-1][0])
            keys = [key for seq, key in rows if seq not in self._own_removals]
            self._own_removals = {seq for seq in self._own_removals if seq > self._removal_seq}
            return keys

    # -- pins -----------------------------------------------------------------------------
    def pin(self, namespace: str, chunk_key: str, variant_id: str) -> bool:
        """Record a pin; True when the file holds it now (a restart will restore it), False
        in memory only (no file, or the file refused the write: retried later)."""
        with self._lock:
            self._pins[variant_id] = (namespace, chunk_key)
            self._write(
                "INSERT OR REPLACE INTO pins VALUES (?,?,?)", (variant_id, namespace, chunk_key)
            )
            return self._path is not None and not self._pending

    def unpin(self, variant_id: str) -> None:
        with self._lock:
            self._pins.pop(variant_id, None)
            self._write("DELETE FROM pins WHERE variant_id=?", (variant_id,))

    def pins(self) -> dict[str, tuple[str, str]]:
        """variant id -> (namespace, chunk key) of every pin recorded, by any process."""
        with self._lock:
            rows = self._read("SELECT variant_id, namespace, chunk_key FROM pins")
            if rows is not None:
                self._pins = {vid: (ns, key) for vid, ns, key in rows}
            return dict(self._pins)

    def pinned_keys(self, namespace: str) -> set[str]:
        """Chunk keys of `namespace` with a pin recorded."""
        return {key for ns, key in self.pins().values() if ns == namespace}

    def close(self) -> None:
        with self._lock:
            if self._path is not None and not self._flush(force=True):
                log.warning("chunk registry: %d writes lost at close", len(self._pending))
            if self._db is not None:
                self._db.close()
                self._db = None
            self._path = None


def open_registry(store: StoreConfig | None) -> ChunkRegistry:
    """The registry for a store built from `store`: in its cache directory when it has a disk
    tier, else in memory."""
    if store is None or not store.cache_dir or store.disk_bytes <= 0:
        return ChunkRegistry()
    return ChunkRegistry(Path(store.cache_dir) / REGISTRY_FILE)
