"""Chunk management for the server: pinned variants, the per-namespace chunk registry, and
the /v1/chunks routes (precompute, list, delete).

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
from cachecraft.store.base import ChunkStore
from cachecraft.store.meta import VariantMeta
from cachecraft.store.variant import Variant


class PinnedStore:
    """A ChunkStore wrapper: pinned variants are served from here and never evicted; all else
    goes to the wrapped store."""

    def __init__(self, inner: ChunkStore) -> None:
        self.inner = inner
        self._pinned: dict[str, Variant] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # close, clear, check_integrity, ...
        return getattr(self.inner, name)

    def variants(self, chunk_key: str) -> list[VariantMeta]:
        found = {m.variant_id: m for m in self.inner.variants(chunk_key)}
        with self._lock:
            for v in self._pinned.values():
                if v.chunk_key == chunk_key:
                    found.setdefault(v.variant_id, v.meta)
        return list(found.values())

    def load(self, variant_id: str) -> Variant | None:
        with self._lock:
            variant = self._pinned.get(variant_id)
        return variant if variant is not None else self.inner.load(variant_id)

    def offer(self, variant: Variant) -> bool:
        return self.inner.offer(variant)

    def record_hit(self, variant_id: str, cfo: float) -> None:
        self.inner.record_hit(variant_id, cfo)

    def record_miss(self, chunk_key: str) -> None:
        self.inner.record_miss(chunk_key)

    def prefetch(self, variant_ids: list[str]) -> None:
        prefetch = getattr(self.inner, "prefetch", None)
        with self._lock:
            ids = [i for i in variant_ids if i not in self._pinned]
        if prefetch is not None and ids:
            prefetch(ids)

    def pin(self, variant: Variant) -> None:
        with self._lock:
            self._pinned[variant.variant_id] = variant

    def pinned_nbytes(self, chunk_keys: set[str]) -> int:
        """Bytes pinned for the given chunk keys (one tenant's share)."""
        with self._lock:
            return sum(v.nbytes for v in self._pinned.values() if v.chunk_key in chunk_keys)

    def pinned_keys(self) -> set[str]:
        with self._lock:
            return {v.chunk_key for v in self._pinned.values()}

    def remove(self, chunk_key: str) -> int:
        """Unpin and drop every variant of `chunk_key`; returns how many ids were dropped."""
        with self._lock:
            ids = [i for i, v in self._pinned.items() if v.chunk_key == chunk_key]
            for i in ids:
                del self._pinned[i]
        remove = getattr(self.inner, "remove", None)
        return len(ids) + (remove(chunk_key) if remove is not None else 0)

    def stats(self) -> Any:
        stats_fn = getattr(self.inner, "stats", None)
        if stats_fn is None:
            return None
        st = stats_fn()
        with self._lock:
            st.nbytes["pinned"] = sum(v.nbytes for v in self._pinned.values())
            st.num_variants["pinned"] = len(self._pinned)
        return st


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
    store: PinnedStore,
    registry: ChunkRegistry,
    request: RagRequest,
    layout: PromptLayout | None,
    pin: bool,
) -> dict[str, Any]:
    """Step thread: compute one document alone after the system prompt and store it.

    An explicit precompute is demand enough: a first offer turned away by the doorkeeper
    (chunk seen once) is repeated. A disk write that failed (full, unwritable) is reported in
    `not_stored_reason`; the variant may still be served from memory (`stored`)."""
    runner = engine.runner
    job = runner.start(runner.plan(request, "cachecraft", lookup=False, layout=layout))
    outcome = runner.finish(job, runner.loaded.model.forward_step([job.work])[0])
    variant = outcome.variants[-1]
    disk = getattr(store, "disk", None)  # TieredStore's disk tier, if any
    errors_before = getattr(disk, "num_write_errors", 0)
    stored = store.offer(variant) or store.offer(variant)
    reason = None
    if disk is not None and disk.num_write_errors > errors_before:
        reason = f"disk write failed: {disk.last_write_error}"
    if pin:
        store.pin(variant)
    label = request.chunks[0].id
    registry.add(request.namespace, variant.chunk_key, label, variant.meta.num_tokens)
    row: dict[str, Any] = {
        "id": label,
        "chunk_key": variant.chunk_key,
        "variant_id": variant.variant_id,
        "num_tokens": variant.meta.num_tokens,
        "stored": stored or pin,
        "pinned": pin,
    }
    if reason is not None or not (stored or pin):
        row["not_stored_reason"] = reason or "the store turned the variant away (capacity)"
    return row


async def precompute_async(engine: Engine, *args: Any) -> dict[str, Any]:
    return await asyncio.wrap_future(engine.call(lambda: precompute(engine, *args)))


def list_chunks(store: PinnedStore, registry: ChunkRegistry, namespace: str) -> dict[str, Any]:
    pinned = store.pinned_keys()
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
