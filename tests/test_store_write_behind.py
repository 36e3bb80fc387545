"""Write-behind: `offer(variant, wait=False)` acts on memory at once and leaves the disk (and
Redis) writes to the store's writer thread. Nothing is lost or brought back: a queued variant
is served while it waits, lands on disk, is not written when removed meanwhile, and `close`
finishes what waits. Real disk directories; the writer is held back by a gate task queued
in front of the writes, so that "while it waits" is certain rather than a race.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from store_helpers import make_variant
from test_engine_faults import run
from test_store_faults import writes_fail_past

from cachecraft.engine.engine import Engine, EngineConfig
from cachecraft.engine.handle import Finished
from cachecraft.engine.runner import Runner
from cachecraft.engine.sampling import SamplingParams
from cachecraft.llm import reuse_config
from cachecraft.model.loader import LoadedModel
from cachecraft.request import Chunk, RagRequest
from cachecraft.reuse.cachecraft import CachecraftParams, CachecraftStrategy
from cachecraft.store.config import StoreConfig
from cachecraft.store.store import TieredStore

SIZE = 512  # one make_variant() at the defaults


def disk_store(root: Path, memory_bytes: int = 4 * SIZE) -> TieredStore:
    return TieredStore(
        StoreConfig(cache_dir=str(root), memory_bytes=memory_bytes, doorkeeper_threshold=1)
    )


@contextmanager
def writer_held(store: TieredStore) -> Iterator[None]:
    """The writer thread is busy until the block ends, so writes queued inside it wait."""
    gate = threading.Event()
    store.writes._writer.submit(gate.wait, 30)
    try:
        yield
    finally:
        gate.set()


def files(root: Path) -> list[str]:
    return sorted(p.stem for p in root.glob("*.safetensors"))


def test_a_queued_offer_is_in_memory_at_once_and_on_disk_after_flush(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    v = make_variant("a")
    with writer_held(store):
        result = store.offer(v, wait=False)
        assert result.queued and result.stored and result.reason is None
        assert files(tmp_path) == []
        assert store.stats().pending_writes == 1
        assert store.load(v.variant_id) is not None
    store.flush()
    assert files(tmp_path) == [v.variant_id]
    st = store.stats()
    assert (st.pending_writes, st.admitted) == (0, 1)
    store.check_integrity()
    store.close()


def test_a_variant_memory_refused_is_served_while_it_waits(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory_bytes=0)
    v = make_variant("a")
    with writer_held(store):
        result = store.offer(v, wait=False)
        assert result.queued and not result.stored  # memory holds nothing
        assert [m.variant_id for m in store.variants("a")] == [v.variant_id]
        reader = store.open_layers(v.variant_id)
        assert reader is not None
        reader.close()
        assert store.stats().hits["pending"] == 1
    store.flush()
    assert files(tmp_path) == [v.variant_id]
    assert store.load(v.variant_id) is not None  # now from disk
    assert store.stats().hits["disk"] == 1
    store.close()


@pytest.mark.parametrize("how", ["remove", "clear", "forget_in_memory"])
def test_a_variant_removed_while_its_write_waits_is_never_written(tmp_path: Path, how: str) -> None:
    store = disk_store(tmp_path)
    v = make_variant("a")
    with writer_held(store):
        assert store.offer(v, wait=False).queued
        if how == "remove":
            assert store.remove("a") == 1
        elif how == "clear":
            store.clear()
        else:
            assert store.forget_in_memory("a") == 1
        assert store.variants("a") == []
    store.flush()
    assert files(tmp_path) == []
    assert store.variants("a") == []
    store.check_integrity()
    store.close()


def test_offered_again_after_a_removal_the_queued_write_counts(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    v = make_variant("a")
    with writer_held(store):
        assert store.offer(v, wait=False).queued
        store.remove("a")
        assert store.offer(v, wait=False).queued  # the same write, wanted again
    store.flush()
    assert files(tmp_path) == [v.variant_id]
    store.close()


def test_a_waiting_offer_first_lets_the_queued_write_end(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    v = make_variant("a")
    assert store.offer(v, wait=False).queued
    result = store.offer(v)  # wait=True: the answer is the disk's, not a promise
    assert result.stored and not result.queued
    assert files(tmp_path) == [v.variant_id]
    store.close()


def test_the_queue_is_bounded_then_offers_write_themselves(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory_bytes=64 * SIZE)
    store.writes.max_pending = 2
    variants = [make_variant(f"c{i}") for i in range(4)]
    with writer_held(store):
        results = [store.offer(v, wait=False) for v in variants]
        assert [r.queued for r in results] == [True, True, False, False]
        assert files(tmp_path) == sorted(v.variant_id for v in variants[2:])
    store.flush()
    assert files(tmp_path) == sorted(v.variant_id for v in variants)
    store.close()


def test_close_finishes_the_queued_writes(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    variants = [make_variant(f"c{i}") for i in range(3)]
    with writer_held(store):
        for v in variants:
            assert store.offer(v, wait=False).queued
    store.close()
    reopened = disk_store(tmp_path, memory_bytes=0)
    assert sorted(m.variant_id for c in ("c0", "c1", "c2") for m in reopened.variants(c)) == sorted(
        v.variant_id for v in variants
    )
    reopened.close()


def test_a_failed_write_behind_is_counted(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory_bytes=0)
    v = make_variant("a")
    with writes_fail_past(64):
        with writer_held(store):
            assert store.offer(v, wait=False).queued
        store.flush()
    st = store.stats()
    assert st.disk_write_errors == 1 and st.rejected["write_failed"] == 1
    assert files(tmp_path) == [] and store.variants("a") == []
    assert list(tmp_path.glob(".*.tmp")) == []
    store.close()


def test_the_engine_answers_while_its_variants_wait_for_the_writer(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    store = disk_store(tmp_path, memory_bytes=0)  # only the writer holds them meanwhile
    reuse = reuse_config(alpha=1e9, min_fix=1.0)
    everything = CachecraftStrategy(CachecraftParams(early_termination=False))
    engine = Engine(
        Runner(tiny, store, reuse), EngineConfig(mode="cachecraft"), strategy=everything
    )
    engine.start()
    rag = RagRequest("Which planet has rings?", [Chunk("Saturn has rings."), Chunk("Mars is red.")])
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    try:
        with writer_held(store):
            first = run(engine.submit(rag, greedy))
            assert isinstance(first, Finished), first
            assert files(tmp_path) == []  # answered without waiting for the files
            again = run(engine.submit(rag, greedy))
            assert isinstance(again, Finished), again
            assert again.report is not None
            assert all(c.is_hit for c in again.report.chunks)  # served while waiting
            assert again.output_ids == first.output_ids  # alpha 1e9: exact either way
        store.flush()
        assert len(files(tmp_path)) == 2
        store.check_integrity()
    finally:
        engine.stop()
        store.close()
