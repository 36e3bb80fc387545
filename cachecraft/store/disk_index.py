"""The disk tier's SQLite index: its schema, and opening it for reading or for use, a corrupt
one set aside (never deleted) and started anew, since every variant file's header carries its
row and `DiskTier.recover` refills the index from the verified files."""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path

from cachecraft.store.sqlite_file import is_corrupt, open_shared

logger = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS variants (
    variant_id TEXT PRIMARY KEY, chunk_key TEXT NOT NULL, file TEXT NOT NULL,
    file_size INTEGER NOT NULL, checksum TEXT NOT NULL, tensor_sums TEXT NOT NULL,
    meta TEXT NOT NULL, num_tokens INTEGER NOT NULL, nbytes INTEGER NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0, cfo_sum REAL NOT NULL DEFAULT 0,
    freq REAL NOT NULL DEFAULT 0, last_tick REAL NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS variants_chunk ON variants(chunk_key);
"""
INDEX = "index.sqlite"


class _CorruptIndex(Exception):
    """`PRAGMA quick_check` found the index damaged."""


def connect_index(root: Path, read_only: bool) -> sqlite3.Connection:
    """The directory's index, opened for reading (`read_only`: never created, checkpointed
    or truncated) or for use (created if missing; a corrupt one set aside and started anew)."""
    path = root / INDEX
    if read_only:
        if not path.is_file():
            raise FileNotFoundError(f"no index ({INDEX}); `cachecraft chunks reindex` rebuilds it")
        # mode=ro never creates the index, checkpoints or truncates the WAL. Without a WAL
        # (no writer open, all checkpointed) immutable=1 also keeps SQLite from creating
        # -wal / -shm files: the listing then changes nothing at all on disk.
        wal = path.with_name(INDEX + "-wal").exists()
        uri = f"file:{path.resolve()}?mode=ro" + ("" if wal else "&immutable=1")
        db = sqlite3.connect(uri, uri=True, timeout=30.0, check_same_thread=False)
        db.execute("PRAGMA busy_timeout=30000")
        return db
    root.mkdir(parents=True, exist_ok=True)
    if not os.access(root, os.W_OK | os.X_OK):
        raise PermissionError(f"the directory is not writable ({root})")
    try:
        return _open_index(path)
    except (sqlite3.DatabaseError, _CorruptIndex) as e:
        if isinstance(e, sqlite3.DatabaseError) and not is_corrupt(e):
            raise  # locked, read-only, I/O: not ours to repair
        # Every variant file's header carries its row: set the broken index aside (never
        # delete it) and start an empty one, which `recover` fills from the files.
        aside = path.with_name(f"{INDEX}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        logger.warning("index %s is corrupt (%s): moved to %s, rebuilt", path, e, aside.name)
        for suffix in ("", "-wal", "-shm"):
            part = path.with_name(INDEX + suffix)
            if part.exists():
                os.replace(part, aside.with_name(aside.name + suffix))
        return _open_index(path)


def _open_index(path: Path) -> sqlite3.Connection:
    def setup(db: sqlite3.Connection) -> None:
        for stmt in SCHEMA.strip().split(";"):
            if stmt.strip():
                db.execute(stmt)
        check = db.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise _CorruptIndex(check)

    return open_shared(path, 30.0, setup)
