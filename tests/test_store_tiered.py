"""TieredStore: cascade, prefetch, layer reads, stats, factory; the host tier on a GPU."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from store_helpers import make_variant

from cachecraft.errors import PinLimitError
from cachecraft.store.base import ChunkStore
from cachecraft.store.config import StoreConfig
from cachecraft.store.memory import MemoryStore
from cachecraft.store.store import TieredStore, make_store

SIZE = 512


def test_make_store_builds_the_configured_tiers(tmp_path: Path) -> None:
    store = make_store(StoreConfig(cache_dir=str(tmp_path)))
    assert isinstance(store, TieredStore)
    assert [t.name for t in store.ram] == ["memory"] and store.disk is not None
    assert store.redis is None
    plain = make_store(StoreConfig())
    assert isinstance(plain, TieredStore) and plain.disk is None
    as_protocol: list[ChunkStore] = [store, MemoryStore(1024)]
    declared = {n for n in vars(ChunkStore) if not n.startswith("_")}
    assert {"variants", "load", "offer", "pin", "health", "close"} <= declared
    for s in as_protocol:  # every declared member is implemented
        assert all(callable(getattr(s, n)) or n == "storage_dtype" for n in declared)


def test_prefetch_brings_disk_variants_into_memory(tmp_path: Path) -> None:
    store = TieredStore(
        StoreConfig(
            memory_bytes=2 * SIZE, cache_dir=str(tmp_path), doorkeeper_threshold=1, policy="lru"
        )
    )
    vs = [make_variant(k, seed=i) for i, k in enumerate("abc")]
    for v in vs:
        store.record_miss(v.chunk_key)
        store.offer(v)
    a = vs[0].variant_id
    assert a not in store.ram[0]
    store.prefetch([a, "missing"])
    store.wait_prefetch()
    store.check_integrity()
    assert a in store.ram[0]
    got = store.load(a)
    assert got is not None and torch.equal(got.keys, vs[0].keys)
    stats = store.stats()
    assert stats.prefetch_loads == 2 and stats.hits["memory"] == 1 and "disk" not in stats.hits
    assert stats.prefetch_hidden_s > 0.0


def test_open_layers_from_memory(tmp_path: Path) -> None:
    store = TieredStore(StoreConfig(doorkeeper_threshold=1))
    v = make_variant("a", num_layers=3)
    store.offer(v)
    reader = store.open_layers(v.variant_id)
    assert reader is not None and reader.num_layers == 3
    k, val = reader.layer(2)
    assert torch.equal(k, v.keys[2]) and torch.equal(val, v.values[2])
    reader.close()
    assert store.open_layers("nope") is None
    assert store.stats().load_misses == 1


def test_stats_as_dict_and_tier_sizes(tmp_path: Path) -> None:
    store = TieredStore(
        StoreConfig(
            memory_bytes=SIZE, cache_dir=str(tmp_path), doorkeeper_threshold=2, admit_all_below=0
        )
    )
    store.record_miss("a")
    assert not store.offer(make_variant("a")).stored
    store.record_miss("a")
    assert store.offer(make_variant("a")).stored
    d = store.stats().as_dict()
    assert d["misses"] == 2 and d["admitted"] == 1 and d["rejected"] == {"doorkeeper": 1}
    assert d["nbytes"]["memory"] == SIZE and d["num_variants"] == {"memory": 1, "disk": 1}
    assert d["nbytes"]["disk"] > 0
    assert len(store) == 1 and store.nbytes == SIZE


def test_variant_bigger_than_every_tier_is_refused() -> None:
    store = TieredStore(StoreConfig(memory_bytes=SIZE, doorkeeper_threshold=1))
    assert not store.offer(make_variant("big", num_tokens=64)).stored
    assert store.stats().rejected["too_big"] == 1 and len(store) == 0
    store.check_integrity()


def test_remove_and_clear_every_tier(tmp_path: Path) -> None:
    store = TieredStore(
        StoreConfig(memory_bytes=SIZE, cache_dir=str(tmp_path), doorkeeper_threshold=1)
    )
    for k in "abc":
        store.offer(make_variant(k))
    assert store.remove("a") == 1 and store.variants("a") == []
    store.check_integrity()
    store.clear()
    store.check_integrity()
    assert len(store) == 0 and store.variants("b") == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host tier exists only on a GPU")
def test_gpu_memory_host_disk_cascade(tmp_path: Path) -> None:
    store = TieredStore(
        StoreConfig(
            memory_bytes=SIZE,
            host_bytes=SIZE,
            cache_dir=str(tmp_path),
            doorkeeper_threshold=1,
            policy="lru",
            device="cuda",
        )
    )
    assert [t.name for t in store.ram] == ["memory", "host"]
    a, b, c = (make_variant(k, seed=i) for i, k in enumerate("abc"))
    for v in (a, b, c):
        store.record_miss(v.chunk_key)
        store.offer(v)
        store.check_integrity()
    assert c.variant_id in store.ram[0] and b.variant_id in store.ram[1]
    assert store.ram[0].get(c.variant_id).keys.is_cuda  # type: ignore[union-attr]
    held = store.ram[1].get(b.variant_id)
    assert held is not None and not held.keys.is_cuda
    assert held.keys.is_pinned() and held.values.is_pinned()  # its promotion copies async
    got = store.load(b.variant_id)  # host -> memory; c demoted to host
    assert got is not None and got.keys.is_cuda and torch.equal(got.keys.cpu(), b.keys)
    assert store.ram[1].get(c.variant_id).keys.is_pinned()  # type: ignore[union-attr]
    got = store.load(a.variant_id)  # disk -> memory
    assert got is not None and got.keys.is_cuda
    store.check_integrity()
    assert store.stats().hits == {"host": 1, "disk": 1}


def test_only_a_host_tier_pins() -> None:
    from cachecraft.store.ram_tier import RamTier

    with pytest.raises(ValueError, match="host tier"):
        RamTier("memory", SIZE, "meta", pin=True)


def test_prefetch_concurrent_with_offers_and_demotions(tmp_path: Path) -> None:
    """Prefetch (store lock -> disk lock) racing offers whose disk writes pick victims under the
    disk lock must neither deadlock nor break the invariants."""
    import threading

    store = TieredStore(
        StoreConfig(
            memory_bytes=3 * SIZE,
            disk_bytes=12 * 1100,
            cache_dir=str(tmp_path),
            doorkeeper_threshold=1,
        )
    )
    vs = [make_variant(f"k{i}", seed=i) for i in range(40)]
    errors: list[BaseException] = []

    def offers() -> None:
        try:
            for v in vs:
                store.record_miss(v.chunk_key)
                store.offer(v)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    def prefetches() -> None:
        try:
            for _ in range(20):
                store.prefetch([v.variant_id for v in vs[::3]])
                for v in vs[::5]:
                    store.load(v.variant_id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=offers), threading.Thread(target=prefetches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "deadlock"
    store.wait_prefetch()
    assert errors == []
    store.check_integrity()


def test_pinned_variant_survives_eviction_until_removed() -> None:
    store = TieredStore(StoreConfig(memory_bytes=SIZE, doorkeeper_threshold=1, policy="lru"))
    pinned, other = make_variant("p"), make_variant("o")
    store.pin(pinned)  # never offered: pinning alone serves it
    assert store.offer(other).stored
    assert store.offer(make_variant("x")).stored  # evicts `other` from the one-slot memory tier
    assert store.load(other.variant_id) is None
    assert [m.variant_id for m in store.variants("p")] == [pinned.variant_id]
    got = store.load(pinned.variant_id)
    assert got is not None and torch.equal(got.keys, pinned.keys)
    assert store.pinned().chunk_keys() == {"p"}
    assert store.stats().num_variants["pinned"] == 1
    assert store.pinned().nbytes({"p", "o"}) == SIZE and store.pinned().nbytes({"o"}) == 0
    assert store.remove("p") == 1
    assert store.variants("p") == [] and store.pinned().chunk_keys() == set()
    store.check_integrity()


def test_pins_are_capped_per_namespace() -> None:
    cap = 2 * SIZE
    store = TieredStore(StoreConfig(memory_bytes=SIZE, max_pinned_bytes_per_namespace=cap))
    a1, a2, a3 = (make_variant(k) for k in ("a1", "a2", "a3"))
    store.pin(a1, "alice")
    store.pin(a2, "alice")
    store.pin(a2, "alice")  # pinned already: no-op, not counted twice
    with pytest.raises(PinLimitError, match=r"'alice' has 1024 bytes pinned.*=1024"):
        store.pin(a3, "alice")
    assert store.pinned().chunk_keys() == {"a1", "a2"}  # the refused pin left nothing behind
    store.pin(make_variant("b1"), "bob")  # another tenant has its own allowance
    assert store.remove("a1") == 1
    store.pin(a3, "alice")  # room again
    assert store.pinned().chunk_keys() == {"a2", "a3", "b1"}
    store.clear()
    store.pin(a1, "alice")
    store.pin(a2, "alice")
    store.check_integrity()
    with pytest.raises(ValueError, match="max_pinned_bytes_per_namespace"):
        StoreConfig(max_pinned_bytes_per_namespace=-1)


def test_health_lists_each_configured_tier(tmp_path: Path) -> None:
    store = TieredStore(StoreConfig(cache_dir=str(tmp_path), doorkeeper_threshold=1))
    store.offer(make_variant("a"))
    health = {h.name: h for h in store.health()}
    assert set(health) == {"memory", "disk"}
    assert health["disk"].is_reachable and health["disk"].num_variants == 1
    assert health["memory"].nbytes == SIZE
    store.close()
    store.close()  # idempotent


def test_a_pinned_variant_keeps_its_disk_file_across_a_restart(tmp_path: Path) -> None:
    """Pins are restored after a restart from the disk copy (`chunks.restore_pins`), but the
    disk evicted a pinned variant's file for capacity like any other, and the per-chunk cap
    could remove it too: after a restart the pin was dropped and the chunk-cache was gone."""
    probe = TieredStore(StoreConfig(cache_dir=str(tmp_path / "probe"), doorkeeper_threshold=1))
    assert probe.offer(make_variant("size")).stored
    file_bytes = probe.disk.nbytes  # type: ignore[union-attr]
    probe.close()
    config = StoreConfig(
        memory_bytes=SIZE,
        cache_dir=str(tmp_path / "cache"),
        disk_bytes=3 * file_bytes,
        doorkeeper_threshold=1,
        admit_all_below=1.0,
        max_variants_per_chunk=1,
        policy="lru",
    )
    store = TieredStore(config)
    pinned = make_variant("p")
    assert store.offer(pinned).stored
    store.pin(pinned)
    for i in range(6):  # three files fit: the unpinned ones make room for each other
        assert store.offer(make_variant(f"o{i}", seed=i + 1)).stored
    # another variant of the pinned chunk past max_variants_per_chunk=1: the pinned one stays
    store.offer(make_variant("p", s_old=("q",), seed=9))
    store.check_integrity()
    assert pinned.variant_id in store.disk  # type: ignore[operator]
    store.close()
    again = TieredStore(config)  # a restart: memory is empty, the disk copy is what is left
    got = again.load(pinned.variant_id)
    assert got is not None and torch.equal(got.keys, pinned.keys)
    again.close()


def test_a_variant_pinned_after_admission_refused_it_is_still_on_disk(tmp_path: Path) -> None:
    """`POST /v1/chunks` with `pin` pins a variant even when admission refused it (the
    doorkeeper, the per-chunk cap): it lived in memory only, so a restart dropped the pin."""
    config = StoreConfig(
        cache_dir=str(tmp_path),
        doorkeeper_threshold=3,
        admit_all_below=0.0,
        max_variants_per_chunk=1,
    )
    store = TieredStore(config)
    first = make_variant("c")
    for _ in range(3):
        store.record_miss("c")
    assert store.offer(first).stored
    for _ in range(3):
        store.record_hit(first.variant_id, 0.1)
    second = make_variant("c", s_old=("q",), seed=1)  # refused: the chunk's cap is full
    assert store.offer(second).reason == "chunk_cap"
    store.pin(second)
    fresh = make_variant("new", seed=2)  # refused: seen once, the doorkeeper wants 3
    assert store.offer(fresh).reason == "doorkeeper"
    store.pin(fresh)
    store.check_integrity()  # the unpinned variant of "c" made way for the pinned one
    assert [m.variant_id for m in store.variants("c")] == [second.variant_id]
    store.close()
    again = TieredStore(config)
    for v in (second, fresh):
        got = again.load(v.variant_id)
        assert got is not None and torch.equal(got.values, v.values)
    again.close()


@pytest.mark.parametrize("read", ["load", "prefetch"])
def test_a_removal_during_a_disk_read_is_not_undone_by_it(
    tmp_path: Path, read: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read from disk (a request's prefetch, a load) runs without the store lock and put
    what it read into memory when done: a `remove` of the chunk meanwhile (DELETE
    /v1/chunks) was undone, the variant listed and served again from memory. The disk read
    here holds until the removal is done (events, not a sleep), so the removal always lands
    in the middle of it."""
    config = StoreConfig(cache_dir=str(tmp_path), doorkeeper_threshold=1, memory_bytes=1 << 30)
    v = make_variant("c")
    first = TieredStore(config)
    assert first.offer(v).stored
    first.close()
    store = TieredStore(config)  # a restart: the variant is on disk only
    assert store.disk is not None
    disk_get = store.disk.get
    read_done, removed = threading.Event(), threading.Event()

    def held_get(variant_id: str, device: str) -> object:
        got = disk_get(variant_id, device)
        read_done.set()
        assert removed.wait(30), "the removal never came"
        return got

    monkeypatch.setattr(store.disk, "get", held_get)
    reading = threading.Thread(
        target=store.load if read == "load" else store.prefetch,
        args=(v.variant_id,) if read == "load" else ([v.variant_id],),
    )
    reading.start()
    assert read_done.wait(30)  # the bytes are read; the read has not finished
    assert store.remove("c") == 1
    removed.set()
    reading.join(30)
    store.wait_prefetch()
    assert store.variants("c") == [] and store.load(v.variant_id) is None
    store.check_integrity()
    store.close()


def test_a_variant_read_while_missing_then_stored_again_loads(tmp_path: Path) -> None:
    """A read that found nothing must end too: otherwise the variant counted as read forever
    and, once removed and stored again, every later read of it from disk was dropped."""
    config = StoreConfig(cache_dir=str(tmp_path), doorkeeper_threshold=1, memory_bytes=SIZE // 2)
    store = TieredStore(config)  # memory too small: every read goes to disk
    v = make_variant("c")
    assert store.load(v.variant_id) is None  # not stored yet
    store.prefetch([v.variant_id])
    store.wait_prefetch()
    assert store.offer(v).stored
    assert store.remove("c") == 1
    assert store.offer(v).stored
    got = store.load(v.variant_id)
    assert got is not None and torch.equal(got.keys, v.keys)
    store.close()
