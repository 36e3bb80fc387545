"""Tally: the admission and eviction bookkeeping that every process on one store shares.

Holds the doorkeeper's sightings per chunk key, the logical clock (one tick per chunk lookup)
and each variant's hit statistics (`VariantStats`: hits, CFO sum, decayed frequency). Three
backends, one shape: `LocalTally` (this process only), `SqliteTally` (a `tally.sqlite` file
beside the disk tier: every process on one machine and one cache directory) and `RedisTally`
(every process on one Redis/Valkey; while it is down the tally falls back to a local one and
never raises). It counts; the policy and the doorkeeper decide.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from cachecraft.store.policy import VariantStats
from cachecraft.store.redis_client import REDIS_ERRORS, RedisConnection
from cachecraft.store.sqlite_file import open_shared

logger = logging.getLogger(__name__)


class Tally(Protocol):
    is_shared: bool

    def sight(self, chunk_key: str) -> int:
        """Count one sighting of `chunk_key`; returns its count including this one."""
        ...

    def sightings(self, chunk_key: str) -> int:
        """How many times `chunk_key` was sighted (0 if never or forgotten)."""
        ...

    def tick(self) -> float:
        """Advance the logical clock by one chunk lookup; returns the new time."""
        ...

    def now(self) -> float:
        """The logical clock without advancing it."""
        ...

    def stats_of(self, variant_id: str) -> VariantStats | None:
        """The variant's shared hit statistics, or None if no process recorded any."""
        ...

    def save(self, stats: VariantStats) -> None:
        """Store the variant's hit statistics for every process (last writer wins)."""
        ...

    def forget(self, variant_id: str) -> None:
        """Drop the variant's statistics (it left every tier)."""
        ...

    def close(self) -> None: ...


class LocalTally:
    """In this process only; at most `max_keys` chunk keys remembered (oldest first out)."""

    is_shared = False

    def __init__(self, max_keys: int = 65536) -> None:
        self.max_keys = max_keys
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._stats: dict[str, VariantStats] = {}
        self._tick = 0.0
        self._lock = threading.Lock()

    def sight(self, chunk_key: str) -> int:
        with self._lock:
            n = self._counts.get(chunk_key, 0) + 1
            self._counts[chunk_key] = n
            self._counts.move_to_end(chunk_key)
            while len(self._counts) > self.max_keys:
                self._counts.popitem(last=False)
            return n

    def sightings(self, chunk_key: str) -> int:
        with self._lock:
            return self._counts.get(chunk_key, 0)

    def tick(self) -> float:
        with self._lock:
            self._tick += 1
            return self._tick

    def now(self) -> float:
        return self._tick

    def stats_of(self, variant_id: str) -> VariantStats | None:
        with self._lock:
            st = self._stats.get(variant_id)
            return None if st is None else _copy(st)

    def save(self, stats: VariantStats) -> None:
        with self._lock:
            self._stats[stats.variant_id] = _copy(stats)

    def forget(self, variant_id: str) -> None:
        with self._lock:
            self._stats.pop(variant_id, None)

    def close(self) -> None:
        pass


_SCHEMA = """
CREATE TABLE IF NOT EXISTS sightings (chunk_key TEXT PRIMARY KEY, count INTEGER NOT NULL,
    seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS clock (id INTEGER PRIMARY KEY CHECK (id = 0), tick REAL NOT NULL);
INSERT OR IGNORE INTO clock VALUES (0, 0);
CREATE TABLE IF NOT EXISTS hit_stats (variant_id TEXT PRIMARY KEY, chunk_key TEXT NOT NULL,
    num_tokens INTEGER NOT NULL, nbytes INTEGER NOT NULL, hits INTEGER NOT NULL,
    cfo_sum REAL NOT NULL, freq REAL NOT NULL, last_tick REAL NOT NULL);
"""


class SqliteTally:
    """`tally.sqlite` in `root` (WAL; every statement its own transaction). Several processes
    on one machine share it; sightings beyond `max_keys` drop the least recently seen. A failing
    file (disk full, I/O error, directory gone) is logged and this process counts locally for
    `retry_s` before it tries the file again; nothing is raised."""

    is_shared = True

    def __init__(self, root: str | Path, max_keys: int = 65536, retry_s: float = 5.0) -> None:
        self.path = Path(root) / "tally.sqlite"
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self.local = LocalTally(max_keys)
        self.retry_s = retry_s
        self.is_failed = False
        self._retry_at = 0.0
        self._closed = False
        self._num_sighted = 0
        self._db: sqlite3.Connection | None = None
        try:
            self._db = open_shared(self.path, 30.0, lambda db: db.executescript(_SCHEMA))
        except (sqlite3.Error, OSError) as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if not self.is_failed:
            logger.warning("shared tally %s unusable (%s): counting locally", self.path, exc)
        self.is_failed = True
        self._retry_at = time.monotonic() + self.retry_s

    def _one(self, sql: str, args: tuple = ()) -> tuple | None:
        """One statement's first row; raises _Failed once the file is unusable."""
        with self._lock:
            if self._db is None or self._closed:
                raise _Failed
            if self.is_failed and time.monotonic() < self._retry_at:
                raise _Failed
            try:
                row = self._db.execute(sql, args).fetchone()
            except sqlite3.Error as exc:
                self._fail(exc)
                raise _Failed from None
            if self.is_failed:
                logger.info("shared tally %s usable again", self.path)
                self.is_failed = False
            return row

    def sight(self, chunk_key: str) -> int:
        try:
            return self._sight(chunk_key)
        except _Failed:
            return self.local.sight(chunk_key)

    def _sight(self, chunk_key: str) -> int:
        row = self._one(
            "INSERT INTO sightings VALUES (?, 1, ?) ON CONFLICT(chunk_key) DO UPDATE SET "
            "count = count + 1, seen = excluded.seen RETURNING count",
            (chunk_key, time.time()),
        )
        self._num_sighted += 1
        if self._num_sighted % 1024 == 0:  # trim now and then, not on every sighting
            self._one(
                "DELETE FROM sightings WHERE chunk_key IN (SELECT chunk_key FROM sightings "
                "ORDER BY seen DESC LIMIT -1 OFFSET ?)",
                (self.max_keys,),
            )
        return int(row[0]) if row else 1

    def sightings(self, chunk_key: str) -> int:
        try:
            row = self._one("SELECT count FROM sightings WHERE chunk_key=?", (chunk_key,))
        except _Failed:
            return self.local.sightings(chunk_key)
        return int(row[0]) if row else 0

    def tick(self) -> float:
        try:
            row = self._one("UPDATE clock SET tick = tick + 1 WHERE id = 0 RETURNING tick")
        except _Failed:
            return self.local.tick()
        return float(row[0]) if row else 0.0

    def now(self) -> float:
        try:
            row = self._one("SELECT tick FROM clock WHERE id = 0")
        except _Failed:
            return self.local.now()
        return float(row[0]) if row else 0.0

    def stats_of(self, variant_id: str) -> VariantStats | None:
        try:
            row = self._one("SELECT * FROM hit_stats WHERE variant_id=?", (variant_id,))
        except _Failed:
            return self.local.stats_of(variant_id)
        return VariantStats(*row) if row else None

    def save(self, stats: VariantStats) -> None:
        s = stats
        try:
            self._one(
                "INSERT OR REPLACE INTO hit_stats VALUES (?,?,?,?,?,?,?,?)",
                (s.variant_id, s.chunk_key, s.num_tokens, s.nbytes, s.hits, s.cfo_sum, s.freq,
                 s.last_tick),
            )  # fmt: skip
        except _Failed:
            self.local.save(s)

    def forget(self, variant_id: str) -> None:
        self.local.forget(variant_id)
        with contextlib.suppress(_Failed):
            self._one("DELETE FROM hit_stats WHERE variant_id=?", (variant_id,))

    def close(self) -> None:
        with self._lock:
            self._closed = True  # later calls count locally instead of raising
            if self._db is not None:
                self._db.close()
                self._db = None


class RedisTally:
    """Keys under `prefix`: `sight:<chunk key>` (a counter), `clock` (a counter) and
    `hs:<variant id>` (hash of VariantStats fields); every command names one key, so a cluster
    serves it as well as one server. Sightings and statistics expire `ttl_s` after their last
    update, which bounds what Redis keeps. Errors fall back to `local` for `backoff_s`; nothing
    is raised."""

    is_shared = True

    def __init__(
        self,
        connection: RedisConnection,
        prefix: str,
        max_keys: int = 65536,
        backoff_s: float = 1.0,
        ttl_s: float = 7 * 86400,
    ) -> None:
        self.conn = connection
        self.prefix = prefix
        self.ttl_s = max(1, int(ttl_s))
        self.local = LocalTally(max_keys)
        self.backoff_s = backoff_s
        self.is_down = False
        self._down_until = 0.0

    def _call(self, fn, fallback):  # type: ignore[no-untyped-def]
        now = time.monotonic()
        if self.is_down and now < self._down_until:
            return fallback()
        try:
            out = fn()
        except REDIS_ERRORS as exc:
            if not self.is_down:
                logger.warning("shared tally unreachable (%s): counting locally", exc)
            self.is_down = True
            self._down_until = now + self.backoff_s
            return fallback()
        self.is_down = False
        return out

    def sight(self, chunk_key: str) -> int:
        key = self.prefix + "sight:" + chunk_key

        def bump() -> int:
            pipe = self.conn.client.pipeline()
            pipe.incr(key)
            pipe.expire(key, self.ttl_s)
            return int(pipe.execute()[0])

        return int(self._call(bump, lambda: self.local.sight(chunk_key)))

    def sightings(self, chunk_key: str) -> int:
        return int(
            self._call(
                lambda: self.conn.client.get(self.prefix + "sight:" + chunk_key) or 0,
                lambda: self.local.sightings(chunk_key),
            )
        )

    def tick(self) -> float:
        clock = self.prefix + "clock"
        return float(self._call(lambda: self.conn.client.incr(clock), self.local.tick))

    def now(self) -> float:
        return float(
            self._call(lambda: self.conn.client.get(self.prefix + "clock") or 0, self.local.now)
        )

    def stats_of(self, variant_id: str) -> VariantStats | None:
        def fetch() -> VariantStats | None:
            got = self.conn.client.hgetall(self.prefix + "hs:" + variant_id)
            if not got:
                return None
            d = {k.decode(): v.decode() for k, v in got.items()}
            return VariantStats(
                variant_id, d["chunk_key"], int(d["num_tokens"]), int(d["nbytes"]),
                int(d["hits"]), float(d["cfo_sum"]), float(d["freq"]), float(d["last_tick"]),
            )  # fmt: skip

        return self._call(fetch, lambda: self.local.stats_of(variant_id))

    def save(self, stats: VariantStats) -> None:
        s = stats
        mapping = {
            "chunk_key": s.chunk_key, "num_tokens": s.num_tokens, "nbytes": s.nbytes,
            "hits": s.hits, "cfo_sum": s.cfo_sum, "freq": s.freq, "last_tick": s.last_tick,
        }  # fmt: skip
        self.local.save(s)
        key = self.prefix + "hs:" + s.variant_id

        def write() -> None:
            pipe = self.conn.client.pipeline()
            pipe.hset(key, mapping=mapping)
            pipe.expire(key, self.ttl_s)
            pipe.execute()

        self._call(write, lambda: None)

    def forget(self, variant_id: str) -> None:
        self.local.forget(variant_id)
        key = self.prefix + "hs:" + variant_id
        self._call(lambda: self.conn.client.delete(key), lambda: None)

    def close(self) -> None:
        pass


class _Failed(Exception):
    """The SQLite tally's file is unusable; the caller falls back to its local tally."""


def _copy(st: VariantStats) -> VariantStats:
    return VariantStats(
        st.variant_id, st.chunk_key, st.num_tokens, st.nbytes, st.hits, st.cfo_sum, st.freq,
        st.last_tick,
    )  # fmt: skip
