"""Chunk management for the server: the per-namespace chunk registry and the /v1/chunks
routes (precompute, list, delete). Pinning is the store's (`ChunkStore.pin`).

Chunk keys hash the namespace in, so a key cannot tell its tenant; the registry remembers which
keys each namespace precomputed or used (in memory: it restarts empty, the store does not).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from cachecraft.engine.engine import Engine
from cachecraft.request import Chunk, RagRequest
from cachecraft.store.base import ChunkStore


class ChunkRegistry:
    """namespace -> {chunk key: (label, num_tokens)} for the keys it precomputed or used."""

    def __init__(self) -> None:
        self._keys: dict[str, dict[str, tuple[str | None, int]]] = {}
        self._lock = threading.Lock()

    def add(self, namespace: str, chunk_key: str, label: str | None, num_tokens: int) -> None:
        with self._lock:
            known = self._keys.setdefault(namespace, {})
            old_label = known.get(chunk_key, (None, 0))[0]
            known[chunk_key] = (label or old_label, num_tokens)

    def keys(self, namespace: str) -> dict[str, tuple[str | None, int]]:
        with self._lock:
            return dict(self._keys.get(namespace, {}))

    def discard(self, namespace: str, chunk_key: str) -> bool:
        with self._lock:
            return self._keys.get(namespace, {}).pop(chunk_key, None) is not None


def precompute(
    engine: Engine,
    store: ChunkStore,
    registry: ChunkRegistry,
    documents: list[tuple[str, str | None]],
    namespace: str,
    system: str | None,
    pin: bool,
) -> list[dict[str, Any]]:
    """Step thread: compute each document alone after the system prompt and store it.

    An explicit precompute is demand enough: a first offer turned away by the doorkeeper
    (chunk seen once) is repeated."""
    runner, rows = engine.runner, []
    for text, label in documents:
        request = RagRequest(".", [Chunk(text, label)], system=system, namespace=namespace)
        job = runner.start(runner.plan(request, "cachecraft", lookup=False))
        outcome = runner.finish(job, runner.loaded.model.forward_step([job.work])[0])
        variant = outcome.variants[-1]
        stored = store.offer(variant) or store.offer(variant)
        if pin:
            store.pin(variant)
        registry.add(namespace, variant.chunk_key, label, variant.meta.num_tokens)
        rows.append(
            {
                "id": label,
                "chunk_key": variant.chunk_key,
                "variant_id": variant.variant_id,
                "num_tokens": variant.meta.num_tokens,
                "stored": stored,
                "pinned": pin,
            }
        )
    return rows


async def precompute_async(engine: Engine, *args: Any) -> list[dict[str, Any]]:
    return await asyncio.wrap_future(engine.call(lambda: precompute(engine, *args)))


def list_chunks(store: ChunkStore, registry: ChunkRegistry, namespace: str) -> dict[str, Any]:
    pinned = store.pinned_chunk_keys()
    data = []
    for key, (label, num_tokens) in sorted(registry.keys(namespace).items()):
        variants = store.variants(key)
        data.append(
            {
                "chunk_key": key,
                "id": label,
                "num_tokens": num_tokens,
                "pinned": key in pinned,
                "num_variants": len(variants),
                "variants": [
                    {"variant_id": m.variant_id, "num_s_old": len(m.s_old), "cci": m.cci}
                    for m in variants
                ],
            }
        )
    return {"object": "list", "data": data, "stats": store.stats().as_dict()}
