"""The runner over the tiered store: layer-wise loading from disk, corruption, restart."""

from __future__ import annotations

from pathlib import Path

import torch

from cachecraft.engine.sampling import SamplingParams
from cachecraft.llm import LLM
from cachecraft.request import Chunk, RagRequest
from cachecraft.store.config import StoreConfig
from cachecraft.store.store import make_store

DOCS = [
    "Saturn is the sixth planet from the Sun and has a prominent ring system.",
    "Jupiter is the largest planet in the Solar System, a gas giant.",
    "Mercury is the smallest planet and the closest to the Sun.",
]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _req(order: list[int]) -> RagRequest:
    return RagRequest("Which planet has rings?", [Chunk(DOCS[i]) for i in order])


def _disk_llm(tiny_dir: Path, cache_dir: Path) -> LLM:
    # memory tier off: every hit is read layer by layer from disk
    config = StoreConfig(cache_dir=str(cache_dir), memory_bytes=0, doorkeeper_threshold=1)
    return LLM(
        str(tiny_dir), store=make_store(config), alpha=1e9, min_fix=1.0, early_termination=False
    )


def test_disk_variants_loaded_layer_by_layer_equal_full(tiny_dir: Path, tmp_path: Path) -> None:
    llm = _disk_llm(tiny_dir, tmp_path)
    llm.generate(_req([0, 1, 2]), GREEDY, mode="cachecraft")
    full = llm.generate(_req([2, 0, 1]), GREEDY, mode="full", keep_logits=True)[0]
    out = llm.generate(_req([2, 0, 1]), GREEDY, mode="cachecraft", keep_logits=True)[0]
    assert all(c.is_hit for c in out.report.chunks)
    assert (out.first_token_logits - full.first_token_logits).abs().max() < 1e-4
    assert llm.store.stats().as_dict()["hits"]["disk"] >= 3


def test_restart_finds_variants_and_corrupt_file_is_never_served(
    tiny_dir: Path, tmp_path: Path
) -> None:
    llm = _disk_llm(tiny_dir, tmp_path)
    llm.generate(_req([0, 1, 2]), GREEDY, mode="cachecraft")
    llm.store.close()
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert len(files) == 3
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)  # flip K/V bytes, keep the size
    files[0].write_bytes(bytes(data))

    again = _disk_llm(tiny_dir, tmp_path)  # a restarted process
    full = again.generate(_req([0, 1, 2]), GREEDY, mode="full", keep_logits=True)[0]
    out = again.generate(_req([0, 1, 2]), GREEDY, mode="naive", keep_logits=True)[0]
    hits = [c.is_hit for c in out.report.chunks]
    assert hits.count(True) == 2 and hits.count(False) == 1
    # exact context and fp16 storage: naive reuse of the two good variants is near exact
    assert (out.first_token_logits - full.first_token_logits).abs().max() < 5e-2
    assert torch.isfinite(out.first_token_logits).all()
    again.store.check_integrity()
