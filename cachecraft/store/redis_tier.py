"""RedisTier: variants shared by several processes or machines through one Redis server.

Owns the Redis layout (key prefix; per variant a hash with the safetensors blob, its checksum,
meta JSON and chunk key; per chunk a set of variant ids; a zset of last access for LRU within
the tier's capacity) and the outage handling: an error is logged once, the tier then answers
"absent" until a back-off expires and it retries. It never raises to the caller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis
import torch

from cachecraft.store import codec
from cachecraft.store.meta import VariantMeta
from cachecraft.store.policy import VariantStats
from cachecraft.store.tier import Chooser
from cachecraft.store.variant import Variant

logger = logging.getLogger(__name__)
T = TypeVar("T")
_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


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
    ) -> None:
        self.url = url
        self.capacity_bytes = capacity_bytes
        self.prefix = prefix
        self.int8 = int8
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._backoff0, self._max_backoff = backoff_s, max_backoff_s
        self._backoff = backoff_s
        self._down_until = 0.0
        self.is_down = False
        self.num_errors = 0
        self.num_corrupt = 0

    def _k(self, kind: str, name: str = "") -> str:
        return f"{self.prefix}{kind}:{name}" if name else f"{self.prefix}{kind}"

    def _call(self, fn: Callable[[], T], default: T) -> T:
        now = time.monotonic()
        if self.is_down and now < self._down_until:
            return default
        try:
            out = fn()
        except _ERRORS as exc:
            self.num_errors += 1
            if not self.is_down:
                logger.warning("redis %s unreachable (%s): serving from local tiers", self.url, exc)
            self.is_down = True
            self._down_until = now + self._backoff
            self._backoff = min(self._max_backoff, self._backoff * 2)
            return default
        if self.is_down:
            logger.info("redis %s reachable again", self.url)
        self.is_down = False
        self._backoff = self._backoff0
        return out

    # -- reads ----------------------------------------------------------------------------
    def metas(self, chunk_key: str) -> list[VariantMeta]:
        def fetch() -> list[VariantMeta]:
            ids = sorted(self.client.smembers(self._k("c", chunk_key)))
            if not ids:
                return []
            pipe = self.client.pipeline()
            for vid in ids:
                pipe.hget(self._k("v", vid.decode()), "meta")
            return [codec.meta_from_json(m.decode()) for m in pipe.execute() if m is not None]

        return self._call(fetch, [])

    def __contains__(self, variant_id: object) -> bool:
        return bool(self._call(lambda: self.client.exists(self._k("v", str(variant_id))), 0))

    def get(self, variant_id: str, device: torch.device | str = "cpu") -> Variant | None:
        key = self._k("v", variant_id)
        got = self._call(lambda: self.client.hmget(key, "data", "sum"), [None, None])
        data, want = got
        if data is None:
            return None
        if want is None or not codec.matches(data, want.decode()):
            return self._corrupt(variant_id, "checksum mismatch")
        try:
            variant = codec.from_bytes(data, device)
        except codec.CorruptVariantError as exc:
            return self._corrupt(variant_id, str(exc))
        self._call(lambda: self.client.zadd(self._k("lru"), {variant_id: time.time()}), 0)
        return variant

    def _corrupt(self, variant_id: str, why: str) -> None:
        logger.warning("redis variant %s is corrupt (%s): removed, not served", variant_id, why)
        self.num_corrupt += 1
        self.delete(variant_id)
        return None

    @property
    def nbytes(self) -> int:
        sizes = self._call(lambda: self.client.hvals(self._k("sizes")), [])
        return sum(int(s) for s in sizes)

    def __len__(self) -> int:
        return int(self._call(lambda: self.client.hlen(self._k("sizes")), 0))

    # -- writes ---------------------------------------------------------------------------
    @property
    def is_reachable(self) -> bool:
        """Pings unless inside a back-off after an error."""
        return bool(self._call(self.client.ping, False))

    def put(self, variant: Variant, stats: VariantStats, choose: Chooser) -> list[str] | None:
        data = codec.to_bytes(variant, self.int8)
        if len(data) > self.capacity_bytes:
            return None
        vid, chunk = variant.variant_id, variant.chunk_key

        def write() -> list[str] | None:
            sizes = {k.decode(): int(v) for k, v in self.client.hgetall(self._k("sizes")).items()}
            sizes.pop(vid, None)
            need = sum(sizes.values()) + len(data) - self.capacity_bytes
            evicted: list[str] = []
            if need > 0:
                lru = self.client.zrange(self._k("lru"), 0, -1, withscores=True)
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
            pipe = self.client.pipeline()
            pipe.hset(
                self._k("v", vid),
                mapping={
                    "data": data,
                    "sum": codec.checksum(data),
                    "meta": codec.meta_to_json(variant.meta),
                    "chunk": chunk,
                },
            )
            pipe.sadd(self._k("c", chunk), vid)
            pipe.hset(self._k("sizes"), vid, len(data))
            pipe.zadd(self._k("lru"), {vid: time.time()})
            pipe.execute()
            return evicted

        return self._call(write, None)

    def _delete(self, variant_id: str) -> bool:
        key = self._k("v", variant_id)
        chunk = self.client.hget(key, "chunk")
        pipe = self.client.pipeline()
        pipe.delete(key)
        if chunk is not None:
            pipe.srem(self._k("c", chunk.decode()), variant_id)
        pipe.hdel(self._k("sizes"), variant_id)
        pipe.zrem(self._k("lru"), variant_id)
        return bool(pipe.execute()[0])

    def delete(self, variant_id: str) -> bool:
        return self._call(lambda: self._delete(variant_id), False)

    def remove_chunk(self, chunk_key: str) -> int:
        ids = self._call(lambda: self.client.smembers(self._k("c", chunk_key)), set())
        return sum(self.delete(v.decode()) for v in ids)

    def clear(self) -> int:
        def wipe() -> int:
            keys = list(self.client.scan_iter(match=self.prefix + "*"))
            n = int(self.client.hlen(self._k("sizes")))
            if keys:
                self.client.delete(*keys)
            return n

        return self._call(wipe, 0)

    def check_integrity(self) -> None:
        """Sizes, LRU zset and per-variant hashes name the same ids; each chunk set points at
        existing variants. Skipped (no assertion) while Redis is unreachable."""
        if self.is_down:
            return
        c = self.client
        try:
            sized = {v.decode() for v in c.hkeys(self._k("sizes"))}
            lru = {v.decode() for v in c.zrange(self._k("lru"), 0, -1)}
            assert sized == lru, "redis sizes and lru disagree"
            for vid in sized:
                assert c.exists(self._k("v", vid)), f"redis variant {vid} has no hash"
            for key in c.scan_iter(match=self._k("c", "*")):
                for vid in c.smembers(key):
                    assert vid.decode() in sized, f"{key!r} names a missing variant"
        except _ERRORS:
            return
