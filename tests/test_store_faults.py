"""Storage faults (issue 13, defects 6 and 7): a failed disk write leaves no temp file and
says "not stored"; an unusable directory is one clear error; a lost index is rebuilt from the
files' headers, never by deleting them; read-only commands change nothing on disk.

Write failures are real OS errors: RLIMIT_FSIZE makes every write past a few bytes fail with
EFBIG, as a full disk fails with ENOSPC (both reach the same except clause).
"""

from __future__ import annotations

import contextlib
import resource
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from store_helpers import make_variant

from cachecraft.cli import main
from cachecraft.errors import StoreUnavailableError
from cachecraft.model.loader import LoadedModel
from cachecraft.server.launch import start_server
from cachecraft.store.base import OfferResult
from cachecraft.store.cli import chunks_command
from cachecraft.store.config import StoreConfig
from cachecraft.store.disk import DiskTier
from cachecraft.store.disk_index import INDEX
from cachecraft.store.policy import VariantStats
from cachecraft.store.store import TieredStore


@contextlib.contextmanager
def writes_fail_past(num_bytes: int) -> Iterator[None]:
    """Every write that would grow a file past `num_bytes` fails with OSError (EFBIG)."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (num_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root with its size and mtime (ns)."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


def stats_of(v: object) -> VariantStats:
    return VariantStats(v.variant_id, v.chunk_key, v.meta.num_tokens, 0, 0, 0.0, 0.0, 0.0)  # type: ignore[attr-defined]


def accept(residents: list[VariantStats], need: int) -> list[VariantStats] | None:
    return []


# ---- defect 6 --------------------------------------------------------------------------------
def test_failed_write_leaves_no_temp_file_and_is_not_stored(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    v = make_variant("a")
    with writes_fail_past(64):
        assert tier.put(v, stats_of(v), accept) is None
    assert tier.num_write_errors == 1 and "File too large" in str(tier.last_write_error)
    assert list(tmp_path.glob(".*.tmp")) == [] and v.variant_id not in tier
    tier.check_integrity()
    assert tier.put(v, stats_of(v), accept) == []  # the room is back: it writes now
    assert tier.get(v.variant_id) is not None


def test_store_offer_survives_a_failing_disk(tmp_path: Path) -> None:
    store = TieredStore(StoreConfig(cache_dir=str(tmp_path), doorkeeper_threshold=1))
    v = make_variant("a")
    with writes_fail_past(64):
        assert store.offer(v).stored  # kept in memory; the disk copy was not written
    assert store.load(v.variant_id) is not None
    assert list(tmp_path.glob(".*.tmp")) == [] and list(tmp_path.glob("*.safetensors")) == []
    store.check_integrity()
    store.close()


def test_concurrent_offers_each_get_their_own_write_error(tmp_path: Path) -> None:
    """Two offers at once, one whose disk write fails: only that one reports write_error (the
    store used to compare the tier's shared error counter before and after its own write, so
    a write that succeeded while another failed was told it had failed)."""
    store = TieredStore(StoreConfig(cache_dir=str(tmp_path), doorkeeper_threshold=1))
    assert store.disk is not None
    good, bad = make_variant("good", seed=1), make_variant("bad", seed=2)
    in_write, release = threading.Event(), threading.Event()
    real_put_file = store.disk._put_file

    def paused_put_file(variant, *args):  # type: ignore[no-untyped-def]
        if variant.variant_id == good.variant_id:
            in_write.set()  # the good write has begun; hold it until the bad one failed
            assert release.wait(60)
        return real_put_file(variant, *args)

    store.disk._put_file = paused_put_file  # type: ignore[method-assign]
    results: dict[str, OfferResult] = {}
    t = threading.Thread(target=lambda: results.setdefault("good", store.offer(good)))
    t.start()
    assert in_write.wait(60)
    with writes_fail_past(64):
        results["bad"] = store.offer(bad)
    release.set()
    t.join(60)
    assert results["bad"].stored and "File too large" in str(results["bad"].write_error)
    assert results["good"].stored and results["good"].write_error is None
    assert good.variant_id in store.disk and bad.variant_id not in store.disk
    store.close()


def test_chunks_api_reports_a_failed_disk_write(tiny: LoadedModel, tmp_path: Path) -> None:
    store = StoreConfig(cache_dir=str(tmp_path / "cache"), doorkeeper_threshold=1)
    with start_server("full", loaded=tiny, store=store) as url:
        body = {"documents": [{"id": "d", "text": "A document for a full disk."}]}
        with writes_fail_past(1024):
            r = httpx.post(url + "/v1/chunks", json=body, timeout=60)
        assert r.status_code == 200, r.text
        row = r.json()["data"][0]
        assert row["stored"] and row["not_stored_reason"] == "write_failed"
        assert "disk write failed" in row["not_stored_detail"]
        assert list((tmp_path / "cache").glob(".*.tmp")) == []
        assert httpx.get(url + "/health", timeout=60).status_code == 200


def test_unusable_directory_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    with pytest.raises(StoreUnavailableError, match="not-a-dir"):
        DiskTier(a_file, 1 << 20)
    blocked = tmp_path / "blocked"
    (blocked / INDEX).mkdir(parents=True)  # the index path is taken by a directory
    with pytest.raises(StoreUnavailableError, match="cannot use the chunk-cache directory"):
        DiskTier(blocked, 1 << 20)
    assert main(["serve", "--cache-dir", str(a_file / "sub")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot create the cache directory")


# ---- defect 7 --------------------------------------------------------------------------------
def lose_index(root: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        (root / (INDEX + suffix)).unlink(missing_ok=True)


def test_lost_index_loses_no_acknowledged_write(tmp_path: Path) -> None:
    store = TieredStore(StoreConfig(cache_dir=str(tmp_path), doorkeeper_threshold=1))
    before = make_variant("a")
    assert store.offer(before).stored
    lose_index(tmp_path)  # deleted under a running store
    after = make_variant("b", seed=1)
    assert store.offer(after).stored  # acknowledged after the loss
    store.close()
    again = TieredStore(StoreConfig(cache_dir=str(tmp_path), doorkeeper_threshold=1))
    assert again.disk is not None and again.disk.recovery.adopted_files == 2
    for v in (before, after):
        got = again.load(v.variant_id)
        assert got is not None and got.values.equal(v.values)
        assert [m.variant_id for m in again.variants(v.chunk_key)] == [v.variant_id]
    again.check_integrity()
    again.close()


def test_read_only_commands_never_create_and_reindex_rebuilds(tmp_path: Path) -> None:
    store = TieredStore(StoreConfig(cache_dir=str(tmp_path), doorkeeper_threshold=1))
    vs = [make_variant(k, seed=i) for i, k in enumerate("abc")]
    for v in vs:
        store.offer(v)
    store.close()
    healthy = snapshot(tmp_path)
    assert len(chunks_command("ls", str(tmp_path))) == 3  # type: ignore[arg-type]
    assert chunks_command("stats", str(tmp_path))["num_variants"] == 3  # type: ignore[index]
    assert snapshot(tmp_path) == healthy  # nothing created, checkpointed or truncated

    lose_index(tmp_path)
    files = snapshot(tmp_path)
    for command in ("ls", "stats"):
        with pytest.raises(StoreUnavailableError, match="reindex"):
            chunks_command(command, str(tmp_path))
    assert snapshot(tmp_path) == files

    bad = tmp_path / f"{vs[2].variant_id}.safetensors"
    bad.write_bytes(b"not a variant")
    out = chunks_command("reindex", str(tmp_path))
    # the writable open adopts the two readable files; reindex then keeps them and leaves the
    # unreadable one where it is (never deleted by reindex)
    assert out["recovered"]["adopted_files"] == 2  # type: ignore[index]
    assert out["kept"] == 2 and out["unreadable"] == 0  # type: ignore[index]
    rows = chunks_command("ls", str(tmp_path))
    assert sorted(r["chunk_key"] for r in rows) == ["a", "b"]  # type: ignore[union-attr]


def test_reindex_rebuilds_stale_rows_and_quarantines_unreadable_files(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    vs = [make_variant(k, seed=i) for i, k in enumerate("ab")]
    for v in vs:
        tier.put(v, stats_of(v), accept)
    tier._db.execute("UPDATE variants SET checksum='stale'")  # a row that no longer matches
    junk = tmp_path / ("f" * 32 + ".safetensors")
    tier.close()
    junk.write_bytes(b"garbage")
    tier = DiskTier(tmp_path, 1 << 20)  # the open quarantines the undecodable orphan ...
    assert tier.recovery.orphan_files == 1
    junk.write_bytes(b"garbage")  # ... and so does reindex: moved aside, never deleted
    out = tier.reindex()
    assert (out.num_files, out.kept, out.rebuilt, out.unreadable) == (3, 0, 2, 1)
    assert not junk.exists() and tier.num_quarantined() == 2
    assert len(tier) == 2
    assert all(tier.get(v.variant_id) is not None for v in vs)
    tier.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_index_is_set_aside_and_rebuilt(tmp_path: Path, damage: str) -> None:
    """A garbage or half-truncated index.sqlite used to stop the store from opening at all
    ("cannot use the chunk-cache directory: file is not a database"), though every file's
    header carries its row."""
    variants = [make_variant(f"c{i}", seed=i) for i in range(3)]
    store = TieredStore(StoreConfig(cache_dir=str(tmp_path), doorkeeper_threshold=1))
    assert all(store.offer(v).stored for v in variants)
    store.close()
    index = tmp_path / INDEX
    for wal in tmp_path.glob(INDEX + "-*"):
        wal.unlink()
    data = index.read_bytes()
    damaged = b"\x13 not sqlite" * 64 if damage == "garbage" else data[: len(data) // 2]
    index.write_bytes(damaged)
    store = TieredStore(StoreConfig(cache_dir=str(tmp_path), doorkeeper_threshold=1))
    for v in variants:
        got = store.load(v.variant_id)
        assert got is not None and torch.equal(got.keys, v.keys)
    assert store.offer(make_variant("new", seed=9)).stored
    store.check_integrity()
    store.close()
    (aside,) = tmp_path.glob(INDEX + ".corrupt-*")  # kept for a post-mortem, not deleted
    assert aside.read_bytes() == damaged
