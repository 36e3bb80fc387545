"""Time to first token with the chunk-caches in each tier, vs full recompute (bench store).

One request of k chunks whose variants were computed in exactly this context, answered in
`naive` mode (only the question is computed) so the figure is dominated by where the K/V come
from: memory, disk read layer by layer (with and without read-ahead), disk after a prefetch
while the request waited, Redis; and `full` (no reuse) as the reference. Disk reads go to the
device: each file is dropped from the page cache (posix_fadvise) before every repeat.
TTFT is the engine's own (`report.ttft_ms`: plan, KV assembly, prefill, first token).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from cachecraft.api import LLM, LoadedModel, SamplingParams, make_store
from cachecraft.request import RagRequest
from cachecraft.store.base import ChunkStore
from cachecraft.store.config import StoreConfig

ONE_TOKEN = SamplingParams(max_tokens=1)


def _drop_page_cache(root: Path) -> None:
    for f in root.rglob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _ttft(llm: LLM, request: RagRequest, mode: str) -> float:
    return llm.generate(request, ONE_TOKEN, mode)[0].report.ttft_ms


def _fresh(loaded: LoadedModel, store: ChunkStore, request: RagRequest) -> LLM:
    """An LLM over `store` (a restarted process) whose exact prefix cache already holds the
    request's system prompt (a chunk-less request with that system computed it), so only the
    chunk-caches move."""
    llm = LLM(loaded, store=store)
    no_chunks = RagRequest(request.question, [], request.system, request.namespace)
    llm.generate(no_chunks, ONE_TOKEN)
    return llm


def _settings(cache_dir: Path, redis_url: str | None) -> dict[str, dict[str, Any]]:
    disk = {"cache_dir": str(cache_dir), "memory_bytes": 0, "doorkeeper_threshold": 1}
    out = {
        "memory": {"doorkeeper_threshold": 1},
        "disk_layerwise_readahead": dict(disk, layer_read_ahead=True),
        "disk_no_readahead": dict(disk, layer_read_ahead=False),
        "disk_prefetched": dict(disk, memory_bytes=1 << 30, layer_read_ahead=True),
    }
    if redis_url:
        out["redis"] = {"redis_url": redis_url, "memory_bytes": 0, "doorkeeper_threshold": 1}
    return out


def run_tier_ttft(
    loaded: LoadedModel, request: RagRequest, repeats: int = 5, redis_url: str | None = None
) -> dict[str, Any]:
    """Median TTFT (ms) per tier and for full recompute, plus the load time hidden.

    Every repeat opens a fresh store on the same directory / Redis (a restarted process:
    nothing in memory) with the system prompt's prefix cached, so only the chunk-caches move.
    """
    root = Path(tempfile.mkdtemp(prefix="cachecraft-tier-"))
    results: dict[str, Any] = {}
    try:
        for name, fields in _settings(root / "disk", redis_url).items():
            shutil.rmtree(root / "disk", ignore_errors=True)
            config = StoreConfig(**fields)
            store = make_store(config)
            llm = LLM(loaded, store=store)
            llm.warm(request)  # every chunk computed in full in this context
            warm = llm.generate(request, ONE_TOKEN, "naive")[0]  # and the code paths
            variant_ids = [c.variant_id for c in warm.report.chunks if c.variant_id]
            times, read_s, hidden_s = [], 0.0, 0.0
            for _ in range(repeats):
                if name != "memory":
                    store.close()
                    if config.cache_dir:
                        _drop_page_cache(Path(config.cache_dir))
                    store = make_store(config)
                    llm = _fresh(loaded, store, request)
                if name == "disk_prefetched":
                    store.prefetch(variant_ids)
                    store.wait_prefetch()  # the request waited in the queue meanwhile
                times.append(_ttft(llm, request, "naive"))
                stats = store.stats()
                read_s, hidden_s = read_s + stats.layer_read_s, hidden_s + stats.layer_hidden_s
            results[name] = {
                "ttft_ms_p50": round(statistics.median(times), 1),
                "layer_read_ms_per_request": round(1000 * read_s / repeats, 1),
                "layer_read_hidden_fraction": round(hidden_s / read_s, 3) if read_s else None,
            }
            store.close()
        llm = LLM(loaded, store=StoreConfig())
        full = [_ttft(llm, request, "full") for _ in range(repeats)]
        results["full_recompute"] = {"ttft_ms_p50": round(statistics.median(full), 1)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results
