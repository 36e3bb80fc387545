"""MemoryStore: LRU by bytes, per-chunk cap, refusal of oversize variants, integrity."""

from __future__ import annotations

import pytest
from store_helpers import make_variant

from cachecraft.store.memory import MemoryStore

SIZE = 512  # bytes of one default test variant


def test_offer_load_variants_roundtrip() -> None:
    store = MemoryStore(capacity_bytes=4 * SIZE)
    v = make_variant("a")
    assert store.offer(v).stored
    store.check_integrity()
    assert len(store) == 1 and store.nbytes == SIZE
    assert [m.variant_id for m in store.variants("a")] == [v.variant_id]
    assert store.variants("zzz") == []
    loaded = store.load(v.variant_id)
    assert loaded is not None and loaded.keys.equal(v.keys)
    assert store.load("missing") is None


def test_lru_eviction_order_with_hits() -> None:
    store = MemoryStore(capacity_bytes=3 * SIZE)
    a, b, c, d, e = (make_variant(k) for k in "abcde")
    for v in (a, b, c):
        assert store.offer(v).stored
        store.check_integrity()
    store.record_hit(a.variant_id, 0.2)  # order now b, c, a
    assert store.offer(d).stored  # evicts b
    store.check_integrity()
    assert store.variant_ids() == [c.variant_id, a.variant_id, d.variant_id]
    assert store.load(c.variant_id) is not None  # order a, d, c
    assert store.offer(e).stored  # evicts a
    store.check_integrity()
    assert store.variant_ids() == [d.variant_id, c.variant_id, e.variant_id]
    assert sum(store.stats().evictions.values()) == 2
    assert store.variants("a") == [] and store.variants("b") == []


def test_bigger_than_capacity_is_refused_and_evicts_nothing() -> None:
    store = MemoryStore(capacity_bytes=3 * SIZE)
    small = make_variant("a")
    store.offer(small)
    big = make_variant("big", num_tokens=32)  # 2048 bytes
    assert not store.offer(big).stored
    store.check_integrity()
    assert store.variant_ids() == [small.variant_id]


def test_large_variant_evicts_several() -> None:
    store = MemoryStore(capacity_bytes=4 * SIZE)
    small = [make_variant(k) for k in "abcd"]
    for v in small:
        store.offer(v)
    big = make_variant("big", num_tokens=16)  # 1024 bytes: two small ones go
    assert store.offer(big).stored
    store.check_integrity()
    assert store.variant_ids() == [small[2].variant_id, small[3].variant_id, big.variant_id]


def test_cap_per_chunk_evicts_that_chunks_lru_variant() -> None:
    store = MemoryStore(capacity_bytes=100 * SIZE, max_variants_per_chunk=2)
    v1 = make_variant("c", s_old=("x",))
    v2 = make_variant("c", s_old=("y",))
    other = make_variant("o")
    v3 = make_variant("c", s_old=("z",))
    for v in (v1, v2, other):
        store.offer(v)
    store.record_hit(v1.variant_id, 0.1)  # v2 is now the chunk's least recently used
    assert store.offer(v3).stored
    store.check_integrity()
    assert {m.variant_id for m in store.variants("c")} == {v1.variant_id, v3.variant_id}
    assert other.variant_id in store


def test_reoffer_same_variant_replaces_it() -> None:
    store = MemoryStore(capacity_bytes=4 * SIZE)
    v = make_variant("a")
    store.offer(v)
    store.offer(make_variant("a", seed=1))
    store.check_integrity()
    assert len(store) == 1 and store.nbytes == SIZE


def test_remove_and_clear() -> None:
    store = MemoryStore(capacity_bytes=10 * SIZE)
    for v in (make_variant("a", s_old=("x",)), make_variant("a"), make_variant("b")):
        store.offer(v)
    assert store.remove("a") == 2
    store.check_integrity()
    assert len(store) == 1 and store.nbytes == SIZE
    assert store.remove("a") == 0
    store.clear()
    store.check_integrity()
    assert len(store) == 0 and store.nbytes == 0


def test_check_integrity_detects_corruption() -> None:
    store = MemoryStore(capacity_bytes=10 * SIZE)
    store.offer(make_variant("a"))
    store.ram[0].nbytes += 1  # simulate a bookkeeping bug
    with pytest.raises(AssertionError):
        store.check_integrity()


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        MemoryStore(capacity_bytes=10, max_variants_per_chunk=0)
