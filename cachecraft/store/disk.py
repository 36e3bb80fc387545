"""DiskTier: one safetensors file per variant plus a SQLite index (WAL, `disk_index.py`) of
metadata and stats. Owns files and rows under one directory, their atomic writes (temp, fsync,
rename inside the SQLite write lock), verification on every read and crash recovery; several
processes may share the directory. It never chooses victims: the caller passes `choose`.

Integrity: each file carries its own checksums in its header (`codec`), verified on every
load, layer-wise read, adoption and reindex; the index only copies the header's sum. A file
that fails, holds non-finite K/V or carries no checksums (an older format: unverifiable) is
moved to `quarantine/` with a warning and never indexed: a miss is the whole cost.

Faults: a failed write removes its temp file and reports "not stored" (`put` -> None; `write`
returns that call's own error), never raises; an unusable directory raises
StoreUnavailableError in one line; a lost, stale or corrupt index is rebuilt from the verified
files' headers, never by deleting files. `read_only=True` changes nothing on disk (the CLI).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save as st_save

from cachecraft.errors import StoreUnavailableError
from cachecraft.store import codec
from cachecraft.store.disk_index import connect_index
from cachecraft.store.files import drop_cached_pages, pid_alive
from cachecraft.store.layers import FileLayerReader
from cachecraft.store.meta import VariantMeta
from cachecraft.store.policy import VariantStats
from cachecraft.store.variant import Variant

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
QUARANTINE = "quarantine"
"""Sub-directory where files that failed verification are moved (never served, never indexed;
an operator may inspect or delete them)."""
Chooser = Callable[[list[VariantStats], int], list[VariantStats] | None]


class Recovery(NamedTuple):
    """What opening the directory cleaned up: dead processes' temp files removed, files the
    index did not know adopted from their headers (`orphan_files`: ones that failed their
    checks, quarantined), rows whose file is gone dropped."""

    temp_files: int
    orphan_files: int
    rows_without_file: int
    adopted_files: int = 0


class DiskWrite(NamedTuple):
    """What one `DiskTier.write` did: the evicted ids (None: not stored) and, when the write
    itself failed, why (`"OSError: ..."`)."""

    evicted: list[str] | None
    error: str | None = None


class Reindex(NamedTuple):
    """What `reindex` did: rows kept (file verified and its row agrees), rows rebuilt from
    verified headers, files that failed verification (`unreadable`: quarantined, not indexed),
    rows dropped (file gone)."""

    num_files: int
    kept: int
    rebuilt: int
    unreadable: int
    dropped_rows: int


class DiskTier:
    """Variants on local disk. Capacity counts file bytes (`SUM(file_size)`)."""

    name = "disk"

    def __init__(
        self, root: str | Path, capacity_bytes: int, int8: bool = False, read_only: bool = False
    ) -> None:
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.int8 = int8
        self.read_only = read_only
        self.num_corrupt = 0
        self.num_write_errors = 0
        self.last_write_error: str | None = None
        self._lock = threading.RLock()
        self.recovery = Recovery(0, 0, 0)
        try:
            self._db = self._connect()
            if not read_only:
                self.recovery = self.recover()
        except (OSError, sqlite3.Error) as e:
            what = "read" if read_only else "use"
            raise StoreUnavailableError(
                f"cannot {what} the chunk-cache directory {self.root}: {e}"
            ) from None

    def _connect(self) -> sqlite3.Connection:
        return connect_index(self.root, self.read_only)

    # -- transactions ---------------------------------------------------------------------
    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE: holds SQLite's write lock, which also serializes renames and unlinks
        across processes sharing the directory."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- recovery -------------------------------------------------------------------------
    def recover(self) -> Recovery:
        """Remove dead processes' temp files and rows without a file; adopt files without a
        row from their verified headers (a lost index loses nothing), quarantining the rest."""
        temp = orphans = rowless = adopted = 0
        with self._write() as db:
            for path in self.root.glob(".*.tmp"):
                pid = int(path.name.split(".")[2]) if path.name.count(".") >= 3 else -1
                if pid != os.getpid() and not pid_alive(pid):
                    logger.warning("removing half-written temp file %s", path.name)
                    path.unlink(missing_ok=True)
                    temp += 1
            files = {p.name for p in self.root.glob("*" + SUFFIX)}
            rows = dict(db.execute("SELECT file, variant_id FROM variants").fetchall())
            for name in sorted(files - rows.keys()):
                if self._adopt(db, name):
                    adopted += 1
                else:
                    orphans += 1
            for name in sorted(rows.keys() - files):
                logger.warning("dropping index row %s: its file is missing", rows[name])
                db.execute("DELETE FROM variants WHERE variant_id=?", (rows[name],))
                rowless += 1
        if adopted:
            logger.warning("re-indexed %d variant files the index did not know", adopted)
        return Recovery(temp, orphans, rowless, adopted)

    def _adopt(self, db: sqlite3.Connection, name: str) -> bool:
        """Insert (or replace) the row of file `name` from its header once the whole file
        verified against it (hit statistics start at zero); a file that fails, or is not named
        after its variant, is quarantined: False."""
        verified = self._verify(name)
        if verified is None:
            self._quarantine_locked(db, name, None)
            return False
        variant, header, size = verified
        db.execute(
            "INSERT OR REPLACE INTO variants (variant_id, chunk_key, file, file_size, checksum,"
            " tensor_sums, meta, num_tokens, nbytes) VALUES (?,?,?,?,?,?,?,?,?)",
            (
                variant.variant_id, variant.chunk_key, name, size, header[codec.HEADER_SUM],
                header[codec.TENSORS], header["meta"], variant.meta.num_tokens, variant.nbytes,
            ),
        )  # fmt: skip
        return True

    def _verify(self, name: str) -> tuple[Variant, dict[str, str], int] | None:
        """(variant, header, size) of file `name` if it verifies against its own header, holds
        finite K/V and is named after its variant; None (logged) otherwise."""
        try:
            data = (self.root / name).read_bytes()
            variant = codec.from_bytes(data)
        except (OSError, codec.CorruptVariantError) as exc:
            logger.warning("chunk-cache file %s fails verification: %s", name, exc)
            return None
        if name != variant.variant_id + SUFFIX:
            logger.warning("%s holds variant %s: not indexed", name, variant.variant_id)
            return None
        return variant, codec.header_of(data), len(data)

    def reindex(self) -> Reindex:
        """Rebuild the index from the files, verifying each against its own header: rows of
        files that verify and agree with their header are kept (with their statistics), others
        rebuilt from the header; files that fail are quarantined; rows without a file dropped."""
        kept = rebuilt = unreadable = dropped = 0
        with self._write() as db:
            files = sorted(p.name for p in self.root.glob("*" + SUFFIX))
            rows = {
                f: (size, want)
                for f, size, want in db.execute("SELECT file, file_size, checksum FROM variants")
            }
            for name in files:
                verified = self._verify(name)
                if verified is None:
                    self._quarantine_locked(db, name, None)
                    unreadable += 1
                    continue
                _, header, size = verified
                if rows.get(name) == (size, header[codec.HEADER_SUM]):
                    kept += 1
                elif self._adopt(db, name):
                    rebuilt += 1
                else:  # changed between the two reads
                    unreadable += 1
            for name in sorted(rows.keys() - set(files)):
                db.execute("DELETE FROM variants WHERE file=?", (name,))
                dropped += 1
        return Reindex(len(files), kept, rebuilt, unreadable, dropped)

    def num_quarantined(self) -> int:
        """Files in the quarantine folder (failed verification; never served)."""
        folder = self.root / QUARANTINE
        return sum(1 for _ in folder.glob("*" + SUFFIX)) if folder.is_dir() else 0

    # -- reads ----------------------------------------------------------------------------
    def metas(self, chunk_key: str) -> list[VariantMeta]:
        rows = self._query(
            "SELECT meta FROM variants WHERE chunk_key=? ORDER BY rowid", (chunk_key,)
        )
        return [codec.meta_from_json(m) for (m,) in rows]

    def __contains__(self, variant_id: object) -> bool:
        return bool(self._query("SELECT 1 FROM variants WHERE variant_id=?", (variant_id,)))

    def __len__(self) -> int:
        return int(self._query("SELECT COUNT(*) FROM variants")[0][0])

    @property
    def nbytes(self) -> int:
        return int(self._query("SELECT COALESCE(SUM(file_size), 0) FROM variants")[0][0])

    def num_unindexed_files(self) -> int:
        """Variant files without an index row (adopted at the next writable open)."""
        files = {p.name for p in self.root.glob("*" + SUFFIX)}
        return len(files - {f for (f,) in self._query("SELECT file FROM variants")})

    def chunk_keys(self) -> list[str]:
        return [c for (c,) in self._query("SELECT DISTINCT chunk_key FROM variants ORDER BY 1")]

    _STATS_COLS = "variant_id, chunk_key, num_tokens, file_size, hits, cfo_sum, freq, last_tick"

    def all_stats(self) -> list[VariantStats]:
        return [
            VariantStats(*row) for row in self._query(f"SELECT {self._STATS_COLS} FROM variants")
        ]

    def stats_of(self, variant_id: str) -> VariantStats | None:
        rows = self._query(
            f"SELECT {self._STATS_COLS} FROM variants WHERE variant_id=?", (variant_id,)
        )
        return VariantStats(*rows[0]) if rows else None

    def rows(self) -> list[dict[str, object]]:
        """Index rows for listing (no tensors read)."""
        cols = ("variant_id", "chunk_key", "num_tokens", "file_size", "hits", "cfo_sum", "freq")
        got = self._query(f"SELECT {', '.join(cols)}, meta FROM variants ORDER BY chunk_key, rowid")
        out = []
        for row in got:
            d = dict(zip(cols, row[:-1], strict=True))
            d["s_old"] = list(json.loads(row[-1])["s_old"])
            out.append(d)
        return out

    def _row(self, variant_id: str) -> tuple[str, int] | None:
        got = self._query("SELECT file, file_size FROM variants WHERE variant_id=?", (variant_id,))
        return got[0] if got else None

    def get(self, variant_id: str, device: torch.device | str = "cpu") -> Variant | None:
        """The variant, or None if absent; a missing, short or corrupt file (one that fails
        its own header's checks, holds non-finite K/V or carries no checks) is quarantined,
        logged and reported as None (never served)."""
        row = self._row(variant_id)
        if row is None:
            return None
        file, size = row
        try:
            data = (self.root / file).read_bytes()
        except FileNotFoundError:
            data = b""
        if len(data) != size:
            self._corrupt(variant_id, file, f"{len(data)} bytes, the index says {size}")
            return None
        try:
            variant = codec.from_bytes(data, device)
        except codec.CorruptVariantError as exc:
            self._corrupt(variant_id, file, str(exc))
            return None
        if variant.variant_id != variant_id:
            self._corrupt(variant_id, file, f"holds variant {variant.variant_id}")
            return None
        return variant

    def open_layers(
        self, variant_id: str, device: torch.device | str = "cpu"
    ) -> FileLayerReader | None:
        """A layer-wise reader of the variant's file (its header verified now, each tensor as
        it is read); None if absent or the file fails (then quarantined)."""
        row = self._row(variant_id)
        if row is None:
            return None
        file, size = row
        path = self.root / file
        try:
            if path.stat().st_size != size:
                raise codec.CorruptVariantError("size mismatch")
            return FileLayerReader(
                str(path),
                device,
                on_corrupt=lambda why: self._corrupt(variant_id, file, why),
            )
        except (OSError, codec.CorruptVariantError, Exception) as exc:  # noqa: BLE001
            self._corrupt(variant_id, file, f"cannot open: {exc}")
            return None

    def _corrupt(self, variant_id: str, file: str, why: str) -> None:
        logger.warning("disk variant %s is corrupt (%s): quarantined, not served", variant_id, why)
        with self._write() as db:
            self._quarantine_locked(db, file, variant_id)

    def _quarantine_locked(self, db: sqlite3.Connection, file: str, variant_id: str | None) -> None:
        """Move `file` into the quarantine folder (if it is still there) and drop its row."""
        self.num_corrupt += 1
        if variant_id is not None:
            db.execute("DELETE FROM variants WHERE variant_id=?", (variant_id,))
        db.execute("DELETE FROM variants WHERE file=?", (file,))
        src = self.root / file
        if not src.exists():
            return
        folder = self.root / QUARANTINE
        try:
            folder.mkdir(exist_ok=True)
            dst = folder / file
            if dst.exists():  # an earlier copy of the same name: keep both
                dst = (
                    folder
                    / f"{src.stem}.{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}{SUFFIX}"
                )
            os.replace(src, dst)
            logger.warning("chunk-cache file %s quarantined in %s", file, folder)
        except OSError as exc:  # cannot move it: never leave it where it could be indexed
            logger.warning("cannot quarantine %s (%s): removed", file, exc)
            src.unlink(missing_ok=True)

    # -- writes ---------------------------------------------------------------------------
    def put(self, variant: Variant, stats: VariantStats, choose: Chooser) -> list[str] | None:
        """Write the variant atomically, evicting what `choose(residents, need_bytes)` picks.
        Returns the evicted ids, or None if it was not stored (too big, `choose` refused, or
        the write failed: then `last_write_error` says why and no temp file is left)."""
        return self.write(variant, stats, choose).evicted

    def write(self, variant: Variant, stats: VariantStats, choose: Chooser) -> DiskWrite:
        """`put`, also returning this call's own write error (None if it did not fail):
        `last_write_error` is shared by every thread and may be another write's by the time
        a caller reads it."""
        if self.read_only:
            raise StoreUnavailableError(f"{self.root} was opened read-only")
        tensors, header = codec.encode(variant, self.int8)
        data = st_save(tensors, metadata=header)
        if len(data) > self.capacity_bytes:
            return DiskWrite(None, None)
        vid = variant.variant_id
        tmp = self.root / f".{vid}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            return DiskWrite(self._put_file(variant, stats, choose, tensors, header, data, tmp))
        except (OSError, sqlite3.Error) as e:
            error = f"{type(e).__name__}: {e}"
            with self._lock:
                self.num_write_errors += 1
                self.last_write_error = error
            logger.warning("variant %s not written to %s: %s", vid, self.root, e)
            return DiskWrite(None, error)
        finally:
            tmp.unlink(missing_ok=True)  # absent after a rename; a leftover after any failure

    def _put_file(
        self,
        variant: Variant,
        stats: VariantStats,
        choose: Chooser,
        tensors: dict[str, torch.Tensor],
        header: dict[str, str],
        data: bytes,
        tmp: Path,
    ) -> list[str] | None:
        vid = variant.variant_id
        file = vid + SUFFIX
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
            drop_cached_pages(fh.fileno())
        evicted: list[str] = []
        try:
            with self._write() as db:
                db.execute("DELETE FROM variants WHERE variant_id=?", (vid,))
                used = db.execute("SELECT COALESCE(SUM(file_size),0) FROM variants").fetchone()[0]
                need = used + len(data) - self.capacity_bytes
                if need > 0:
                    victims = choose([s for s in self.all_stats() if s.variant_id != vid], need)
                    if victims is None:
                        raise _Refused
                    for s in victims:
                        self._delete_locked(db, s.variant_id)
                        evicted.append(s.variant_id)
                os.replace(tmp, self.root / file)
                db.execute(
                    "INSERT INTO variants VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        vid, variant.chunk_key, file, len(data), header[codec.HEADER_SUM],
                        header[codec.TENSORS], header["meta"],
                        variant.meta.num_tokens, variant.nbytes, stats.hits, stats.cfo_sum,
                        stats.freq, stats.last_tick,
                    ),
                )  # fmt: skip
        except _Refused:
            return None
        self._fsync_dir()
        return evicted

    def update_stats(self, stats: VariantStats) -> None:
        with self._write() as db:
            db.execute(
                "UPDATE variants SET hits=?, cfo_sum=?, freq=?, last_tick=? WHERE variant_id=?",
                (stats.hits, stats.cfo_sum, stats.freq, stats.last_tick, stats.variant_id),
            )

    def delete(self, variant_id: str) -> bool:
        with self._write() as db:
            return self._delete_locked(db, variant_id)

    def remove_chunk(self, chunk_key: str) -> int:
        ids = [
            v
            for (v,) in self._query(
                "SELECT variant_id FROM variants WHERE chunk_key=?", (chunk_key,)
            )
        ]
        return sum(self.delete(v) for v in ids)

    def clear(self) -> int:
        ids = [v for (v,) in self._query("SELECT variant_id FROM variants")]
        return sum(self.delete(v) for v in ids)

    def _delete_locked(self, db: sqlite3.Connection, variant_id: str) -> bool:
        row = db.execute("SELECT file FROM variants WHERE variant_id=?", (variant_id,)).fetchone()
        if row is None:
            return False
        db.execute("DELETE FROM variants WHERE variant_id=?", (variant_id,))
        (self.root / row[0]).unlink(missing_ok=True)
        return True

    def _fsync_dir(self) -> None:
        try:
            fd = os.open(self.root, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- invariant ------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless rows and files agree one to one, sizes match, no temp
        file of this process is left and the tier is within capacity."""
        with self._lock:
            rows = self._query("SELECT variant_id, file, file_size FROM variants")
            files = {p.name: p.stat().st_size for p in self.root.glob("*" + SUFFIX)}
            assert {f for _, f, _ in rows} == set(files), "index rows and files disagree"
            for vid, file, size in rows:
                assert file == vid + SUFFIX, f"row {vid} names {file}"
                assert files[file] == size, f"{file}: {files[file]} bytes, index says {size}"
            mine = [p for p in self.root.glob(f".*.{os.getpid()}.*.tmp")]
            assert not mine, f"temp files left behind: {mine}"
            assert self.nbytes <= self.capacity_bytes, "disk tier over capacity"


class _Refused(Exception):
    pass
