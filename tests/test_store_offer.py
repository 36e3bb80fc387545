"""`ChunkStore.offer` answers with an OfferResult: stored or not, and why not, for every reason
a real store (memory, a real disk directory with its SQLite index) can give."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_helpers import make_variant
from test_store_faults import writes_fail_past

from cachecraft.store.base import OfferResult
from cachecraft.store.config import StoreConfig
from cachecraft.store.store import TieredStore

SIZE = 512  # one make_variant() at the defaults


def test_stored() -> None:
    store = TieredStore(StoreConfig(memory_bytes=SIZE, doorkeeper_threshold=1))
    v = make_variant("a")
    assert store.offer(v) == OfferResult(v.variant_id, stored=True)


def test_doorkeeper_then_stored() -> None:
    store = TieredStore(StoreConfig(memory_bytes=SIZE, doorkeeper_threshold=2, admit_all_below=0))
    v = make_variant("a")
    assert store.offer(v) == OfferResult(v.variant_id, False, "doorkeeper")
    assert store.offer(v).stored  # the second sighting
    assert store.stats().rejected["doorkeeper"] == 1


def test_chunk_cap_keeps_the_more_valuable_variant() -> None:
    cfg = StoreConfig(
        memory_bytes=4 * SIZE, policy="value", doorkeeper_threshold=1, max_variants_per_chunk=1
    )
    store = TieredStore(cfg)
    kept = make_variant("a", s_old=("x",))
    assert store.offer(kept).stored
    for _ in range(3):
        store.record_hit(kept.variant_id, 0.0)
    other = make_variant("a", s_old=("y",), seed=1)
    assert store.offer(other) == OfferResult(other.variant_id, False, "chunk_cap")
    assert [m.variant_id for m in store.variants("a")] == [kept.variant_id]
    store.check_integrity()


def test_value_refuses_what_saves_less_than_the_residents() -> None:
    store = TieredStore(StoreConfig(memory_bytes=SIZE, policy="value", doorkeeper_threshold=1))
    hot = make_variant("hot")
    assert store.offer(hot).stored
    for _ in range(3):
        store.record_hit(hot.variant_id, 0.0)
    cold = make_variant("cold")
    assert store.offer(cold) == OfferResult(cold.variant_id, False, "value")
    assert store.stats().rejected["value"] == 1


def test_too_big() -> None:
    store = TieredStore(StoreConfig(memory_bytes=SIZE, doorkeeper_threshold=1))
    big = make_variant("big", num_tokens=64)
    assert store.offer(big) == OfferResult(big.variant_id, False, "too_big")


def test_write_failed_on_a_disk_only_store(tmp_path: Path) -> None:
    cfg = StoreConfig(memory_bytes=0, cache_dir=str(tmp_path), doorkeeper_threshold=1)
    store = TieredStore(cfg)
    v = make_variant("a")
    with writes_fail_past(64):
        result = store.offer(v)
    assert not result.stored and result.reason == "write_failed"
    assert result.write_error is not None and "File too large" in result.write_error
    assert store.stats().rejected["write_failed"] == 1 and store.variants("a") == []
    store.close()


def test_write_failed_but_kept_in_memory(tmp_path: Path) -> None:
    cfg = StoreConfig(memory_bytes=SIZE, cache_dir=str(tmp_path), doorkeeper_threshold=1)
    store = TieredStore(cfg)
    v = make_variant("a")
    with writes_fail_past(64):
        result = store.offer(v)
    assert result.stored and result.reason is None and result.write_error is not None
    store.close()


def test_a_result_is_not_a_truth_value() -> None:
    result = OfferResult("v", stored=True)
    with pytest.raises(TypeError, match="stored"):
        bool(result)
    with pytest.raises(ValueError):
        OfferResult("v", stored=True, reason="value")
    with pytest.raises(ValueError):
        OfferResult("v", stored=False)
