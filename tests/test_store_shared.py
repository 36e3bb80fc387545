"""Several stores (processes) on one cache directory or one Redis share the doorkeeper's
sightings and the value policy's hit statistics: a chunk is counted once, wherever seen."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from store_helpers import make_variant

from cachecraft.store.config import StoreConfig
from cachecraft.store.redis_server import RedisServer
from cachecraft.store.store import TieredStore


def _disk_store(root: Path, **kw: object) -> TieredStore:
    kw.setdefault("admit_all_below", 0.0)  # the doorkeeper decides from the first offer
    return TieredStore(StoreConfig(cache_dir=str(root), doorkeeper_threshold=2, **kw))


def _redis_store(url: str, **kw: object) -> TieredStore:
    kw.setdefault("admit_all_below", 0.0)
    return TieredStore(
        StoreConfig(redis_url=url, redis_prefix="shared:", doorkeeper_threshold=2, **kw)
    )


def test_two_stores_on_one_directory_count_sightings_once(tmp_path: Path) -> None:
    one, two = _disk_store(tmp_path), _disk_store(tmp_path)
    v = make_variant("a")
    one.record_miss("a")
    assert not one.offer(v).stored  # first sighting anywhere: refused
    two.record_miss("a")  # the second sighting, seen by the other store
    assert two.offer(v).stored
    assert one.doorkeeper.count("a") == two.doorkeeper.count("a") == 2
    assert [m.variant_id for m in one.variants("a")] == [v.variant_id]  # through the disk
    one.check_integrity()
    two.check_integrity()


def _sight_in_child(root: str, key: str) -> None:
    store = _disk_store(Path(root))
    store.record_miss(key)
    store.offer(make_variant(key))  # the same request's offer: no second sighting
    store.close()


def test_sightings_from_another_process_count_once(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_sight_in_child, args=(str(tmp_path), "b"))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    here = _disk_store(tmp_path)
    assert here.doorkeeper.count("b") == 1  # miss + offer of one request: one sighting
    here.record_miss("b")
    assert here.offer(make_variant("b")).stored  # second sighting overall: admitted
    assert here.doorkeeper.count("b") == 2


def test_hit_statistics_are_shared_through_redis(redis_server: RedisServer) -> None:
    one, two = _redis_store(redis_server.url), _redis_store(redis_server.url)
    v = make_variant("c")
    one.record_miss("c")
    one.offer(v)
    two.record_miss("c")
    assert two.offer(v).stored
    for _ in range(3):
        assert one.load(v.variant_id) is not None
        one.record_hit(v.variant_id, 0.2)
    two.record_hit(v.variant_id, 0.4)
    shared = two.tally.stats_of(v.variant_id)
    assert shared is not None and shared.hits == 4  # three hits in one, one in the other
    assert abs(shared.cfo_sum - 1.0) < 1e-9
    assert one.tally.now() == two.tally.now()  # one logical clock for both
    client = one.redis.client  # type: ignore[union-attr]
    for key in ("shared:tally:sight:c", f"shared:tally:hs:{v.variant_id}"):
        assert 0 < client.ttl(key) <= StoreConfig().shared_ttl_s  # bounded: they expire


def test_redis_down_counts_locally_without_errors(redis_server: RedisServer) -> None:
    store = _redis_store(redis_server.url, redis_backoff_s=0.05)
    store.record_miss("d")
    redis_server.stop()
    store.record_miss("d")  # the shared count is unreachable: counted locally, no error
    v = make_variant("d")
    assert not store.offer(v).stored  # locally seen once since the outage
    store.record_miss("d")
    assert [h.is_reachable for h in store.health() if h.name == "redis"] == [False]
    assert store.variants("d") == []


def test_would_admit_counts_every_process_sightings(tmp_path: Path) -> None:
    one, two = _disk_store(tmp_path), _disk_store(tmp_path)
    assert not one.would_admit("e")  # never seen: this miss would be the first sighting
    two.record_miss("e")
    assert one.would_admit("e")  # seen once elsewhere: this miss makes two


def test_a_failing_tally_file_counts_locally_and_recovers(tmp_path: Path) -> None:
    import resource
    import signal

    from cachecraft.store.tally import SqliteTally

    tally = SqliteTally(tmp_path, retry_s=0.0)
    for i in range(200):  # the file exists and holds rows before the fault
        tally.sight(f"warm{i}")
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1, hard))  # every write that grows a file fails
    try:
        counts = [tally.sight(f"new{i}") for i in range(300)]  # the file cannot grow: no raise
        assert tally.is_failed and counts == [1] * 300  # counted locally
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert tally.sight("after") == 1 and not tally.is_failed  # the file works again
    tally.close()
    assert tally.sight("closed") == 1  # after close: local, never an error
