"""RedisTier: variants shared by several processes or machines through Redis or Valkey, one
server or a cluster.

Owns the Redis layout and the outage handling. Layout, under the key prefix P:
* `P{<chunk key>}:v:<variant id>`: a hash with the safetensors blob, its checksum, the meta
  JSON and the chunk key; `P{<chunk key>}:c`: the set of the chunk's variant ids. The braces
  are a hash tag: every key of one chunk lives on one cluster shard, and no command spans
  two slots.
* `P{index}:sizes` (variant id -> blob bytes), `P{index}:lru` (variant id -> last access) and
  `P{index}:owner` (variant id -> chunk key): the capacity accounting, on one shard.
An error marks the whole tier down (logged once): it answers "absent" until a back-off
expires, then comes back only once every shard answers, and after repairing what an outage
left behind (a shard restarted empty). It never raises to the caller.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
import torch

from cachecraft.store import codec
from cachecraft.store.meta import VariantMeta
from cachecraft.store.policy import VariantStats
from cachecraft.store.redis_client import REDIS_ERRORS, Client, RedisConnection, tag
from cachecraft.store.tier import Chooser
from cachecraft.store.variant import Variant

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_KNOWN_OWNERS = 1 << 17
"""Variant id -> chunk key pairs remembered locally (an id hashes its chunk key, so a pair never
goes stale; past this many the map starts over and is read from `P{index}:owner` again)."""


class RedisTier:
    """Capacity counts blob bytes. `put` offers `choose` the residents least recently accessed
    first (access times are shared by every process), each with `last_tick` = its access time."""

    name = "redis"

    def __init__(
        self,
        url: str,
        capacity_bytes: int,
        prefix: str = "cachecraft:",
        int8: bool = False,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        timeout_s: float = 0.5,
        cluster: bool = False,
    ) -> None:
        self.conn = RedisConnection(url, cluster, timeout_s)
        self.capacity_bytes = capacity_bytes
        self.prefix = prefix
        self.int8 = int8
        self._backoff0, self._max_backoff = backoff_s, max_backoff_s
        self._backoff = backoff_s
        self._down_until = 0.0
        self._recovering = threading.Lock()
        self._owner: dict[str, str] = {}
        self.is_down = False
        self.num_errors = 0
        self.num_corrupt = 0
        self.num_shards_down = 0
        """Shards that did not answer the last probe (0 while up)."""
        self.num_shards = 1

    @property
    def url(self) -> str:
        return self.conn.url

    @property
    def client(self) -> Client:
        return self.conn.client

    # -- layout ---------------------------------------------------------------------------
    def _vkey(self, chunk_key: str, variant_id: str) -> str:
        return f"{self.prefix}{tag(chunk_key)}:v:{variant_id}"

    def _ckey(self, chunk_key: str) -> str:
        return f"{self.prefix}{tag(chunk_key)}:c"

    def _ikey(self, kind: str) -> str:
        return f"{self.prefix}{tag('index')}:{kind}"

    def _remember(self, variant_id: str, chunk_key: str) -> None:
        if len(self._owner) >= MAX_KNOWN_OWNERS:
            self._owner.clear()
        self._owner[variant_id] = chunk_key

    def _chunk_of(self, variant_id: str) -> str | None:
        """The variant's chunk key (locally known, else from the index); None if unknown."""
        chunk = self._owner.get(variant_id)
        if chunk is None:
            raw = self.client.hget(self._ikey("owner"), variant_id)
            if raw is None:
                return None
            chunk = raw.decode()
            self._remember(variant_id, chunk)
        return chunk

    # -- outages --------------------------------------------------------------------------
    def _call(self, fn: Callable[[], T], default: T) -> T:
        if self.is_down and not self._recover():
            return default
        try:
            return fn()
        except REDIS_ERRORS as exc:
            self._went_down(exc)
            return default

    def _went_down(self, exc: BaseException) -> None:
        self.num_errors += 1
        if not self.is_down:
            logger.warning("redis %s unreachable (%s): serving from local tiers", self.url, exc)
        self.is_down = True
        self._down_until = time.monotonic() + self._backoff
        self._backoff = min(self._max_backoff, self._backoff * 2)

    def _recover(self) -> bool:
        """Past the back-off: probe every shard, repair, and come back up. False while inside
        the back-off or while any shard is unreachable."""
        if time.monotonic() < self._down_until:
            return False
        with self._recovering:  # one thread probes and repairs; the others wait for it
            if not self.is_down:
                return True
            try:
                self._probe()
                repaired = self._reconcile()
            except REDIS_ERRORS as exc:
                self._went_down(exc)
                return False
            logger.info("redis %s reachable again (%d index entries repaired)", self.url, repaired)
            self.is_down = False
            self._backoff = self._backoff0
            return True

    def _probe(self) -> None:
        """Raise redis.ConnectionError unless every shard answers PING."""
        down, total = self.conn.shards_down()
        self.num_shards_down, self.num_shards = down, total
        if down:
            raise redis.ConnectionError(f"{down} of {total} shards unreachable")

    @property
    def is_reachable(self) -> bool:
        """Every shard answers (probed unless inside a back-off after an error)."""
        return bool(self._call(lambda: self._probe() or True, False))

    @property
    def detail(self) -> str | None:
        """What `/health` should say beyond reachable or not: shards down, or None."""
        if self.is_down and self.num_shards_down:
            return (
                f"{self.num_shards_down} of {self.num_shards} shards unreachable: "
                "serving from local tiers"
            )
        if self.is_down:
            return "unreachable: serving from local tiers"
        return None

    def _reconcile(self) -> int:
        """Repair what an outage left: index entries of variants whose hash is gone (a shard
        came back empty) are dropped, variant hashes the index lost are indexed again, chunk
        sets drop ids with no hash. Returns the number of entries repaired."""
        c = self.client
        owner = {k.decode(): v.decode() for k, v in c.hgetall(self._ikey("owner")).items()}
        indexed = owner.keys() | {v.decode() for v in c.hkeys(self._ikey("sizes"))}
        indexed |= {v.decode() for v in c.zrange(self._ikey("lru"), 0, -1)}
        held: dict[str, str] = {}  # variant id -> chunk key, for every variant hash present
        glob = _escape_glob(self.prefix)
        start = len(self.prefix) + 1
        for raw in c.scan_iter(match=glob + "{*}:v:*"):
            left, vid = raw.decode().rsplit(":v:", 1)
            held[vid] = left[start:-1]
        lost = [v for v in indexed if v not in held]
        stray = [v for v in held if v not in owner or v not in indexed]
        pipe = c.pipeline()
        for vid in lost:
            pipe.hdel(self._ikey("sizes"), vid)
            pipe.zrem(self._ikey("lru"), vid)
            pipe.hdel(self._ikey("owner"), vid)
        pipe.execute()
        now = time.time()
        for vid in stray:
            chunk = held[vid]
            nbytes = c.hstrlen(self._vkey(chunk, vid), "data")
            pipe = c.pipeline()
            pipe.hset(self._ikey("sizes"), vid, nbytes)
            pipe.zadd(self._ikey("lru"), {vid: now})
            pipe.hset(self._ikey("owner"), vid, chunk)
            pipe.execute()
        dangling = 0
        for raw in c.scan_iter(match=glob + "{*}:c"):
            chunk = raw.decode()[start:-3]
            for vid in c.smembers(raw):
                if not c.exists(self._vkey(chunk, vid.decode())):
                    dangling += c.srem(raw, vid)
        return len(lost) + len(stray) + dangling

    # -- reads ----------------------------------------------------------------------------
    def metas(self, chunk_key: str) -> list[VariantMeta]:
        def fetch() -> list[VariantMeta]:
            ids = sorted(v.decode() for v in self.client.smembers(self._ckey(chunk_key)))
            if not ids:
                return []
            pipe = self.client.pipeline()
            for vid in ids:
                self._remember(vid, chunk_key)
                pipe.hget(self._vkey(chunk_key, vid), "meta")
            return [codec.meta_from_json(m.decode()) for m in pipe.execute() if m is not None]

        return self._call(fetch, [])

    def __contains__(self, variant_id: object) -> bool:
        def check() -> bool:
            chunk = self._chunk_of(str(variant_id))
            return chunk is not None and bool(
                self.client.exists(self._vkey(chunk, str(variant_id)))
            )

        return bool(self._call(check, False))

    def get(self, variant_id: str, device: torch.device | str = "cpu") -> Variant | None:
        def fetch() -> list[bytes | None]:
            chunk = self._chunk_of(variant_id)
            if chunk is None:
                return [None, None]
            return self.client.hmget(self._vkey(chunk, variant_id), "data", "sum")

        data, want = self._call(fetch, [None, None])
        if data is None:
            return None
        if want is None or not codec.matches(data, want.decode()):
            return self._corrupt(variant_id, "checksum mismatch")
        try:
            variant = codec.from_bytes(data, device)
        except codec.CorruptVariantError as exc:
            return self._corrupt(variant_id, str(exc))
        self._call(lambda: self.client.zadd(self._ikey("lru"), {variant_id: time.time()}), 0)
        return variant

    def _corrupt(self, variant_id: str, why: str) -> None:
        logger.warning("redis variant %s is corrupt (%s): removed, not served", variant_id, why)
        self.num_corrupt += 1
        self.delete(variant_id)
        return None

    @property
    def nbytes(self) -> int:
        sizes = self._call(lambda: self.client.hvals(self._ikey("sizes")), [])
        return sum(int(s) for s in sizes)

    def __len__(self) -> int:
        return int(self._call(lambda: self.client.hlen(self._ikey("sizes")), 0))

    # -- writes ---------------------------------------------------------------------------
    def put(self, variant: Variant, stats: VariantStats, choose: Chooser) -> list[str] | None:
        data = codec.to_bytes(variant, self.int8)
        if len(data) > self.capacity_bytes:
            return None
        vid, chunk = variant.variant_id, variant.chunk_key

        def write() -> list[str] | None:
            raw = self.client.hgetall(self._ikey("sizes"))
            sizes = {k.decode(): int(v) for k, v in raw.items()}
            sizes.pop(vid, None)
            need = sum(sizes.values()) + len(data) - self.capacity_bytes
            evicted: list[str] = []
            if need > 0:
                lru = self.client.zrange(self._ikey("lru"), 0, -1, withscores=True)
                residents = [
                    VariantStats(v.decode(), "", 0, sizes[v.decode()], last_tick=t)
                    for v, t in lru
                    if v.decode() in sizes
                ]
                victims = choose(residents, need)
                if victims is None:
                    return None
                for s in victims:
                    self._delete(s.variant_id)
                    evicted.append(s.variant_id)
            # The variant's own keys first: an index entry never names a hash not yet written
            # (on one server; a cluster pipeline sends per shard, and `_reconcile` repairs).
            pipe = self.client.pipeline()
            pipe.hset(
                self._vkey(chunk, vid),
                mapping={
                    "data": data,
                    "sum": codec.checksum(data),
                    "meta": codec.meta_to_json(variant.meta),
                    "chunk": chunk,
                },
            )
            pipe.sadd(self._ckey(chunk), vid)
            pipe.hset(self._ikey("sizes"), vid, len(data))
            pipe.zadd(self._ikey("lru"), {vid: time.time()})
            pipe.hset(self._ikey("owner"), vid, chunk)
            pipe.execute()
            self._remember(vid, chunk)
            return evicted

        return self._call(write, None)

    def _delete(self, variant_id: str) -> bool:
        chunk = self._chunk_of(variant_id)
        pipe = self.client.pipeline()  # single-key commands only: a cluster groups them by shard
        if chunk is not None:
            pipe.delete(self._vkey(chunk, variant_id))
            pipe.srem(self._ckey(chunk), variant_id)
        pipe.hdel(self._ikey("sizes"), variant_id)
        pipe.zrem(self._ikey("lru"), variant_id)
        pipe.hdel(self._ikey("owner"), variant_id)
        out = pipe.execute()
        return chunk is not None and bool(out[0])

    def delete(self, variant_id: str) -> bool:
        return self._call(lambda: self._delete(variant_id), False)

    def remove_chunk(self, chunk_key: str) -> int:
        ids = self._call(lambda: self.client.smembers(self._ckey(chunk_key)), set())
        for vid in ids:
            self._remember(vid.decode(), chunk_key)
        return sum(self.delete(v.decode()) for v in ids)

    def clear(self) -> int:
        def wipe() -> int:
            n = int(self.client.hlen(self._ikey("sizes")))
            keys = list(self.client.scan_iter(match=_escape_glob(self.prefix) + "*"))
            pipe = self.client.pipeline()
            for key in keys:  # one DEL per key: keys of many slots never share a command
                pipe.delete(key)
            pipe.execute()
            return n

        self._owner.clear()
        return self._call(wipe, 0)

    def check_integrity(self) -> None:
        """The index's three maps name the same ids, each with its variant hash; each chunk set
        names existing variants. Skipped (no assertion) while Redis is unreachable."""
        if self.is_down:
            return
        c = self.client
        try:
            sized = {v.decode() for v in c.hkeys(self._ikey("sizes"))}
            lru = {v.decode() for v in c.zrange(self._ikey("lru"), 0, -1)}
            owner = {k.decode(): v.decode() for k, v in c.hgetall(self._ikey("owner")).items()}
            assert sized == lru, "redis sizes and lru disagree"
            assert sized == owner.keys(), "redis sizes and owners disagree"
            for vid, chunk in owner.items():
                assert c.exists(self._vkey(chunk, vid)), f"redis variant {vid} has no hash"
            start = len(self.prefix) + 1
            for key in c.scan_iter(match=_escape_glob(self.prefix) + "{*}:c"):
                chunk = key.decode()[start:-3]
                for vid in c.smembers(key):
                    assert vid.decode() in sized, f"{key!r} names a missing variant"
                    assert owner[vid.decode()] == chunk, f"{key!r} names another chunk's variant"
        except REDIS_ERRORS:
            return

    def close(self) -> None:
        self.conn.close()


def _escape_glob(text: str) -> str:
    """`text` matched literally by a SCAN pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
