"""Time to first token with the chunk-caches in each tier, vs full recompute (bench store).

One request of k chunks whose variants were computed in exactly this context, answered in
`naive` mode (only the question is computed) so the figure is dominated by where the K/V come
from: memory, disk read layer by layer (with and without read-ahead), disk after a prefetch
while the request waited, Redis; and `full` (no reuse) as the reference. Disk reads go to the
device: each file is dropped from the page cache (posix_fadvise) before every repeat.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from cachecraft.engine.prefix_cache import PrefixCache
from cachecraft.engine.runner import Runner
from cachecraft.model.loader import LoadedModel
from cachecraft.request import RagRequest
from cachecraft.store.config import StoreConfig
from cachecraft.store.store import make_store


def _drop_page_cache(root: Path) -> None:
    for f in root.rglob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _ttft(runner: Runner, request: RagRequest, mode: str) -> float:
    t0 = time.perf_counter()
    job, outcome = runner.prefill(request, mode)
    int(outcome.first_logits.argmax())
    return 1000 * (time.perf_counter() - t0)


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
    nothing in memory), sharing one prefix cache so only the chunk-caches move.
    """
    root = Path(tempfile.mkdtemp(prefix="cachecraft-tier-"))
    prefix_cache = PrefixCache()
    results: dict[str, Any] = {}
    try:
        for name, fields in _settings(root / "disk", redis_url).items():
            shutil.rmtree(root / "disk", ignore_errors=True)
            config = StoreConfig(**fields)
            store = make_store(config)
            runner = Runner(loaded, store, prefix_cache=prefix_cache)
            _, outcome = runner.prefill(request, "cachecraft")  # every chunk computed in full
            runner.commit(outcome)
            _ttft(runner, request, "naive")  # warm the prefix cache and the code paths
            times, read_s, hidden_s = [], 0.0, 0.0
            for _ in range(repeats):
                if name != "memory":
                    store.close()
                    if config.cache_dir:
                        _drop_page_cache(Path(config.cache_dir))
                    store = make_store(config)
                    runner = Runner(loaded, store, prefix_cache=prefix_cache)
                if name == "disk_prefetched":
                    plan = runner.plan(request, "naive")
                    store.prefetch([c.variant.variant_id for c in plan.chunks if c.variant])
                    store.wait_prefetch()  # the request waited in the queue meanwhile
                times.append(_ttft(runner, request, "naive"))
                stats = store.stats()
                read_s, hidden_s = read_s + stats.layer_read_s, hidden_s + stats.layer_hidden_s
            results[name] = {
                "ttft_ms_p50": round(statistics.median(times), 1),
                "layer_read_ms_per_request": round(1000 * read_s / repeats, 1),
                "layer_read_hidden_fraction": round(hidden_s / read_s, 3) if read_s else None,
            }
            store.close()
        runner = Runner(loaded, make_store(StoreConfig()))
        full = [_ttft(runner, request, "full") for _ in range(repeats)]
        results["full_recompute"] = {"ttft_ms_p50": round(statistics.median(full), 1)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results
