"""Disk tier through the tiered store: restart, crash recovery, corruption, sharing, int8."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from page_helpers import resident
from safetensors.torch import save as st_save
from store_helpers import make_variant

from cachecraft.store import codec
from cachecraft.store.config import StoreConfig
from cachecraft.store.disk import QUARANTINE, DiskTier
from cachecraft.store.disk_index import INDEX
from cachecraft.store.layers import TensorLayerReader, all_layers
from cachecraft.store.policy import VariantStats
from cachecraft.store.store import TieredStore
from cachecraft.store.variant import Variant

SIZE = 512


def disk_store(root: Path, memory_slots: int = 2, **kw: object) -> TieredStore:
    cfg = StoreConfig(
        memory_bytes=memory_slots * SIZE,
        disk_bytes=1 << 20,
        cache_dir=str(root),
        doorkeeper_threshold=1,
        **kw,
    )
    return TieredStore(cfg)


def file_of(root: Path, variant_id: str) -> Path:
    return root / f"{variant_id}.safetensors"


def test_write_through_demotion_and_promotion(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory_slots=2, policy="lru")
    vs = [make_variant(k, seed=i) for i, k in enumerate("abc")]
    for v in vs:
        store.record_miss(v.chunk_key)
        assert store.offer(v).stored
        store.check_integrity()
    assert vs[0].variant_id not in store.ram[0] and vs[0].variant_id in store.disk  # type: ignore[operator]
    got = store.load(vs[0].variant_id)  # from disk, promoted to memory
    store.check_integrity()
    assert got is not None and torch.equal(got.keys, vs[0].keys)
    assert got.meta == vs[0].meta
    assert vs[0].variant_id in store.ram[0]
    assert store.stats().hits["disk"] == 1
    assert store.load(vs[0].variant_id) is not None
    assert store.stats().hits["memory"] == 1


def test_restart_finds_variants_and_stats(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    v = make_variant("a")
    store.offer(v)
    store.record_hit(v.variant_id, 0.25)
    store.close()
    again = disk_store(tmp_path)
    again.check_integrity()
    assert [m.variant_id for m in again.variants("a")] == [v.variant_id]
    got = again.load(v.variant_id)
    assert got is not None and torch.equal(got.values, v.values)
    st = again.disk.stats_of(v.variant_id)  # type: ignore[union-attr]
    assert st is not None and st.hits == 1 and st.cfo_sum == pytest.approx(0.25)


def test_crash_leftovers_are_cleaned_on_reopen(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    keep, lose = make_variant("keep"), make_variant("lose")
    store.offer(keep)
    store.offer(lose)
    store.close()
    # 1. a half-written temp file of a process that died (pid 2**22 + 1 is beyond pid_max)
    (tmp_path / f".{'f' * 32}.{2**22 + 1}.abcd1234.tmp").write_bytes(b"half")
    # 2. an index row whose file is gone
    file_of(tmp_path, lose.variant_id).unlink()
    # 3. a file with no index row that is not the variant its name says (removed: nothing
    #    can serve it); a readable, rightly named file would be adopted instead
    shutil.copy(file_of(tmp_path, keep.variant_id), tmp_path / ("e" * 32 + ".safetensors"))
    again = disk_store(tmp_path)
    assert again.disk.recovery == (1, 1, 1, 0)  # type: ignore[union-attr]
    again.check_integrity()
    assert again.variants("lose") == [] and again.load(lose.variant_id) is None
    assert again.load(keep.variant_id) is not None
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".safetensors") == [
        keep.variant_id + ".safetensors"
    ]


def _cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore over a read-only map)."""
    import mmap

    import numpy as np

    size = path.stat().st_size
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)
        pages = resident(view.ctypes.data, size)
        del view
    return sum(pages)


def _fs_type(path: Path) -> str:
    """The type of the file system `path` lies on (the longest mount point above it)."""
    best, kind = "", ""
    mounts = Path("/proc/self/mounts")
    for line in mounts.read_text().splitlines() if mounts.exists() else ():
        _, mount, fs, *_ = line.split()
        if path.resolve().is_relative_to(mount) and len(mount) > len(best):
            best, kind = mount, fs
    return kind


def test_a_written_variant_leaves_the_page_cache_and_reads_back_whole(tmp_path: Path) -> None:
    """The memory tier holds what is written through, so the page cache need not."""
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise here (macOS): the page cache keeps what is written")
    if _fs_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("a file in memory has no device to drop its pages to")
    tier = DiskTier(tmp_path, 1 << 24)
    v = make_variant("a", num_tokens=256, num_heads=4, head_dim=64)  # 1 MiB of K/V
    assert (
        tier.put(v, VariantStats(v.variant_id, "a", 256, v.nbytes), lambda residents, need: [])
        == []
    )
    path = file_of(tmp_path, v.variant_id)
    assert path.stat().st_size > v.nbytes
    assert _cached_pages(path) == 0
    path.read_bytes()
    assert _cached_pages(path) > 0  # the probe sees cached pages when there are some
    got = tier.get(v.variant_id)
    assert got is not None and torch.equal(got.keys, v.keys) and torch.equal(got.values, v.values)


def test_live_process_temp_file_is_left_alone(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    tmp = tmp_path / f".{'a' * 32}.{os.getppid()}.abcd1234.tmp"
    tmp.write_bytes(b"being written")
    tier.close()
    tier = DiskTier(tmp_path, 1 << 20)
    assert tmp.exists() and tier.recovery.temp_files == 0


def test_corrupted_file_is_a_miss_never_served(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory_slots=0)
    v = make_variant("a")
    assert store.offer(v).stored
    path = file_of(tmp_path, v.variant_id)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # flip a bit of the last tensor
    path.write_bytes(bytes(data))
    assert store.load(v.variant_id) is None
    store.check_integrity()
    assert not path.exists() and store.variants("a") == []
    stats = store.stats()
    assert stats.evictions["disk:corrupt"] == 1 and stats.load_misses == 1


def test_corrupted_layer_raises_in_layer_reader(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory_slots=0)
    v = make_variant("a")
    store.offer(v)
    reader = store.open_layers(v.variant_id)
    assert reader is not None
    k0, v0 = reader.layer(0)
    assert torch.equal(k0, v.keys[0]) and torch.equal(v0, v.values[0])
    reader.close()
    path = file_of(tmp_path, v.variant_id)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    reader = store.open_layers(v.variant_id)
    assert reader is not None
    with pytest.raises(codec.CorruptVariantError):
        for layer in range(reader.num_layers):
            reader.layer(layer)
    reader.close()
    assert store.variants("a") == [] and not path.exists()
    store.check_integrity()


def test_a_file_without_its_own_checksums_is_quarantined_never_trusted(tmp_path: Path) -> None:
    """Files written before variants carried their checksums in their header (the index held
    them, and `reindex` recomputed them from whatever bytes were there) cannot be told sound:
    each is quarantined at its first read, a miss recomputed, never served."""
    store = disk_store(tmp_path, memory_slots=0)
    v = make_variant("a")
    assert store.offer(v).stored
    store.close()
    path = file_of(tmp_path, v.variant_id)
    tensors, header = codec.encode(v)
    old = {k: header[k] for k in ("format", "meta", "dtype", "int8")}  # the old header
    path.write_bytes(st_save(tensors, metadata=old))
    tier = DiskTier(tmp_path, 1 << 20)
    tier._db.execute("UPDATE variants SET file_size=?", (path.stat().st_size,))
    tier.close()
    store = disk_store(tmp_path, memory_slots=0)
    assert store.open_layers(v.variant_id) is None and store.variants("a") == []
    assert not path.exists()
    assert (tmp_path / QUARANTINE / path.name).exists()
    store.check_integrity()
    store.close()


def test_reindex_verifies_every_file_against_its_own_header(tmp_path: Path) -> None:
    """Issue 56, defect 1: 4 KB overwritten mid-file and the index deleted; reindex used to
    recompute the checksum from the damaged bytes and so index them. Now it finds the damage
    against the file's own header, quarantines the file and indexes the intact ones."""
    store = disk_store(tmp_path, memory_slots=0)
    vs = [make_variant(k, seed=i, num_tokens=256, head_dim=16) for i, k in enumerate("ab")]
    assert all(store.offer(v).stored for v in vs)
    store.close()
    bad = file_of(tmp_path, vs[0].variant_id)
    data = bytearray(bad.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 4096] = bytes(4096)
    bad.write_bytes(bytes(data))
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / (INDEX + suffix)).unlink(missing_ok=True)
    tier = DiskTier(tmp_path, 1 << 30)  # the open adopts the good file, quarantines the bad
    assert tier.recovery.adopted_files == 1 and tier.recovery.orphan_files == 1
    out = tier.reindex()
    assert (out.num_files, out.kept, out.unreadable) == (1, 1, 0)
    assert tier.get(vs[0].variant_id) is None and tier.num_quarantined() == 1
    got = tier.get(vs[1].variant_id)
    assert got is not None and torch.equal(got.values, vs[1].values)
    tier.close()


@pytest.mark.parametrize("where", ["header", "tensor"])
def test_a_damaged_header_or_tensor_fails_on_load(tmp_path: Path, where: str) -> None:
    store = disk_store(tmp_path, memory_slots=0)
    v = make_variant("a")
    assert store.offer(v).stored
    path = file_of(tmp_path, v.variant_id)
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    at = data.index(b'"cci\\":') + 7 if where == "header" else 8 + header_len + 5
    data[at] ^= 0x01  # one bit: a header digit of the CCI, or a K byte
    path.write_bytes(bytes(data))
    assert store.load(v.variant_id) is None
    assert (tmp_path / QUARANTINE / path.name).exists()


def test_non_finite_values_are_never_stored_nor_loaded(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory_slots=0)
    v = make_variant("a")
    v.values[1, 0, 3, 2] = float("nan")
    offered = store.offer(v)
    assert not offered.stored and offered.reason == "not_finite"
    assert store.stats().rejected["not_finite"] == 1 and store.variants("a") == []
    with pytest.raises(codec.CorruptVariantError):
        store.pin(v)
    # written with valid checksums (a bug elsewhere): refused when read, layer-wise or whole
    assert store.disk is not None
    good = make_variant("b")
    assert store.offer(good).stored
    path = file_of(tmp_path, good.variant_id)
    poisoned = Variant(good.meta, good.keys.clone(), good.values.clone())
    poisoned.keys[0, 0, 0, 0] = float("inf")
    path.write_bytes(codec.to_bytes(poisoned))
    reader = store.open_layers(good.variant_id)
    assert reader is not None
    with pytest.raises(codec.CorruptVariantError, match="non-finite"):
        reader.layer(0)
    reader.close()
    assert store.variants("b") == [] and store.load(good.variant_id) is None
    store.check_integrity()


def test_layer_reader_reads_every_layer_and_counts_time(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory_slots=0)
    v = make_variant("a", num_layers=4)
    store.offer(v)
    reader = store.open_layers(v.variant_id)
    assert reader is not None and reader.num_layers == 4
    for layer in range(4):
        k, val = reader.layer(layer)
        assert torch.equal(k, v.keys[layer]) and torch.equal(val, v.values[layer])
    reader.close()
    assert store.stats().layer_read_s > 0.0
    assert store.open_layers("nope") is None


def test_two_stores_share_one_directory(tmp_path: Path) -> None:
    one, two = disk_store(tmp_path, memory_slots=0), disk_store(tmp_path, memory_slots=0)
    a, b = make_variant("a"), make_variant("b")
    assert one.offer(a).stored
    assert [m.variant_id for m in two.variants("a")] == [a.variant_id]
    assert two.load(a.variant_id) is not None
    assert two.offer(b).stored
    assert one.load(b.variant_id) is not None
    assert two.remove("a") == 1
    assert one.load(a.variant_id) is None  # gone from under it: a miss, no error
    one.check_integrity()
    two.check_integrity()
    assert len(one) == len(two) == 1


def test_disk_capacity_evicts_by_policy(tmp_path: Path) -> None:
    vs = [make_variant(k) for k in "abcd"]
    file_size = len(codec.to_bytes(vs[0]))  # the same for all four
    cfg = StoreConfig(
        memory_bytes=0,
        disk_bytes=3 * file_size + 10,
        cache_dir=str(tmp_path),
        doorkeeper_threshold=1,
    )
    store = TieredStore(cfg)
    for v in vs[:3]:
        store.record_miss(v.chunk_key)
        assert store.offer(v).stored
    store.record_hit(vs[0].variant_id, 0.0)
    store.record_hit(vs[2].variant_id, 0.0)
    store.record_miss("d")
    assert store.offer(vs[3]).stored  # room for three: b (no hits) goes
    store.check_integrity()
    assert store.load(vs[1].variant_id) is None
    assert [e for e in store.eviction_log] == [("disk", vs[1].variant_id, "capacity")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_int8_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    store = disk_store(tmp_path, memory_slots=0, int8=True)
    v = make_variant("a", num_tokens=64, head_dim=32, dtype=dtype)  # tensors outweigh headers
    assert store.offer(v).stored
    got = store.load(v.variant_id)
    assert got is not None and got.keys.dtype == dtype
    for ref, out in ((v.keys, got.keys), (v.values, got.values)):
        err = (ref.float() - out.float()).abs().max().item()
        assert err <= ref.float().abs().max().item() / 127 + 1e-3
        assert err > 0  # really quantized
    assert file_of(tmp_path, v.variant_id).stat().st_size < len(codec.to_bytes(v))


def test_all_layers_stacks_a_file_and_hands_memory_over_as_held(tmp_path: Path) -> None:
    """`all_layers`: every layer of a disk variant stacked (each read and checked), and a
    variant in memory as the tier holds it (the splice reads it without a copy)."""
    store = disk_store(tmp_path, memory_slots=0)
    v = make_variant("a")
    store.offer(v)
    reader = store.open_layers(v.variant_id)
    assert reader is not None
    keys, values = all_layers(reader)
    reader.close()
    assert torch.equal(keys, v.keys) and torch.equal(values, v.values)
    held = TensorLayerReader(v.keys, v.values)
    keys, values = all_layers(held)
    assert keys.data_ptr() == v.keys.data_ptr() and values.data_ptr() == v.values.data_ptr()
