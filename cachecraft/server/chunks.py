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
from cachecraft.reuse.layout import PromptLayout
from cachecraft.store.base import ChunkStore, RefusalReason

REFUSALS: dict[RefusalReason, str] = {
    "doorkeeper": "the doorkeeper has not seen this chunk often enough",
    "chunk_cap": "the chunk has max_variants_per_chunk more valuable variants",
    "value": "the eviction policy values it below what it would have to evict",
    "too_big": "bigger than every tier's capacity",
    "write_failed": "every tier that would take it failed to write it",
}
"""The words for each OfferResult.reason in a precompute answer."""


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


def precompute_request(
    text: str, label: str | None, namespace: str, system: str | None
) -> RagRequest:
    """The request whose prefill computes one document's chunk-cache after `system`."""
    return RagRequest(".", [Chunk(text, label)], system=system, namespace=namespace)


def precompute(
    engine: Engine,
    store: ChunkStore,
    registry: ChunkRegistry,
    request: RagRequest,
    layout: PromptLayout | None,
    pin: bool,
) -> dict[str, Any]:
    """Step thread: compute one document alone after the system prompt and store it.

    An explicit precompute is demand enough: a first offer turned away by the doorkeeper
    (chunk seen once) is repeated. Why the store turned the variant away (`OfferResult.reason`)
    or that a write failed ("write_failed": disk full or unwritable; the variant may still be
    served from memory, `stored`) is reported in `not_stored_reason`, with the words in
    `not_stored_detail`."""
    runner = engine.runner
    plan = runner.plan(request, "cachecraft", lookup=False, layout=layout)
    job = runner.start(plan, precompute=True)
    outcome = runner.finish(job, runner.loaded.model.forward_step([job.work])[0])
    variant = runner.variants(outcome)[-1]
    offered = store.offer(variant)
    if offered.reason == "doorkeeper":
        offered = store.offer(variant)
    if pin:
        store.pin(variant, request.namespace)  # PinLimitError: a 400 naming the cap
    label = request.chunks[0].id
    registry.add(request.namespace, variant.chunk_key, label, variant.meta.num_tokens)
    row: dict[str, Any] = {
        "id": label,
        "chunk_key": variant.chunk_key,
        "variant_id": variant.variant_id,
        "num_tokens": variant.meta.num_tokens,
        "stored": offered.stored or pin,
        "pinned": pin,
    }
    if offered.write_error is not None:
        row["not_stored_reason"] = "write_failed"
        row["not_stored_detail"] = f"disk write failed: {offered.write_error}"
    elif offered.reason is not None and not pin:
        row["not_stored_reason"] = offered.reason
        row["not_stored_detail"] = REFUSALS[offered.reason]
    return row


async def precompute_async(engine: Engine, *args: Any) -> dict[str, Any]:
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
    # Only this namespace's own figures: whole-store numbers (other tenants' bytes) are for
    # operators, on /metrics.
    stats = {
        "num_chunks": len(data),
        "num_variants": sum(d["num_variants"] for d in data),
        "num_pinned": sum(1 for d in data if d["pinned"]),
        "pinned_bytes": store.pinned_nbytes({d["chunk_key"] for d in data}),
    }
    return {"object": "list", "data": data, "stats": stats}
