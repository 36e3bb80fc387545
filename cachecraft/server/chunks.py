"""Chunk management for the server: the /v1/chunks routes' work (precompute, list, delete)
and keeping the chunk registry (`server/registry.py`) in agreement with the store. Pinning is
the store's (`ChunkStore.pin`); the registry records the pins so a restart restores them.

The store is the truth about what exists: files removed behind the server's back (`cachecraft
chunks rm` / `clear`, which never touch the registry: the store does not know the server) or
eviction everywhere leave registry rows whose chunk has no variant. Such a row is not listed;
at start (`forget_unstored`) and on DELETE it is dropped. Replicas sharing the registry pin and
delete through each other: before each request that uses or lists chunks, a replica drops its
memory copies of chunks another deleted and takes up or releases the pins others made or
deleted (`follow_registry`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from cachecraft.engine.engine import Engine
from cachecraft.engine.precompute import prefill_in_full
from cachecraft.errors import PinLimitError
from cachecraft.request import Chunk, RagRequest
from cachecraft.reuse.layout import PromptLayout
from cachecraft.server.registry import ChunkRegistry
from cachecraft.store.base import ChunkStore, RefusalReason

log = logging.getLogger(__name__)

REFUSALS: dict[RefusalReason, str] = {
    "doorkeeper": "the doorkeeper has not seen this chunk often enough",
    "chunk_cap": "the chunk has max_variants_per_chunk more valuable variants",
    "value": "the eviction policy values it below what it would have to evict",
    "too_big": "bigger than every tier's capacity",
    "write_failed": "every tier that would take it failed to write it",
}
"""The words for each OfferResult.reason in a precompute answer."""

Owner = Callable[[str], str]
"""A namespace's tenant, whose pin budget a pin in that namespace counts against
(`auth.tenant_of`); the identity when each namespace is its own budget."""


def _same(namespace: str) -> str:
    return namespace


def restore_pins(store: ChunkStore, registry: ChunkRegistry, owner: Owner = _same) -> int:
    """Pin again what the registry says was pinned (a restart empties the store's memory);
    a pinned variant no longer stored anywhere is forgotten. Returns how many were pinned."""
    num_pinned = 0
    for vid, (namespace, _) in registry.pins().items():
        variant = store.load(vid)
        if variant is None:
            log.warning("pinned variant %s is no longer stored: pin dropped", vid)
            registry.unpin(vid)
            continue
        try:
            store.pin(variant, owner(namespace))
        except PinLimitError as e:
            log.warning("pin of %s not restored: %s", vid, e)
            registry.unpin(vid)
            continue
        num_pinned += 1
    return num_pinned


def follow_registry(store: ChunkStore, registry: ChunkRegistry, owner: Owner = _same) -> None:
    """Catch up with what other processes sharing the registry did: drop this process's
    memory copies of chunks they deleted, then `sync_pins`. Cheap (two indexed reads) unless
    there is something to do; runs before each request that uses or lists chunks."""
    for key in registry.removals():
        store.forget_in_memory(key)
    sync_pins(store, registry, owner)


def sync_pins(store: ChunkStore, registry: ChunkRegistry, owner: Owner = _same) -> None:
    """Make this process's pins the ones the registry records (replicas sharing it pin and
    delete through each other): pin what is recorded and can be loaded, release local pins no
    longer recorded (their variants stay cached, evictable). A recorded pin that cannot be
    loaded now, or that this process's cap refuses, stays recorded."""
    recorded = registry.pins()
    local = store.pinned().variant_ids()
    for vid in local - recorded.keys():
        store.unpin(vid)
    for vid in recorded.keys() - local:
        variant = store.load(vid)
        if variant is None:
            continue
        try:
            store.pin(variant, owner(recorded[vid][0]))
        except PinLimitError as e:
            log.debug("pin of %s recorded by another process not taken here: %s", vid, e)


def forget_unstored(store: ChunkStore, registry: ChunkRegistry) -> int:
    """Drop the registry rows of chunks that no tier of `store` holds a variant of and that
    carry no pin (run after `restore_pins`, which drops the pins of variants gone). Returns how
    many rows were dropped. Drops nothing while a tier is unreachable: the chunk may be
    stored there."""
    down = [t.name for t in store.health() if not t.is_reachable]
    if down:
        log.warning("chunk registry not reconciled: %s unreachable", ", ".join(down))
        return 0
    pinned = set(registry.pins().values())
    num_dropped = 0
    for namespace, key in registry.entries():
        if (namespace, key) not in pinned and not store.variants(key):
            num_dropped += registry.discard(namespace, key)
    if num_dropped:
        log.info("chunk registry: %d chunks no longer stored were dropped", num_dropped)
    return num_dropped


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
    owner: Owner = _same,
) -> dict[str, Any]:
    """Step thread: compute one document alone after the system prompt and store it.

    An explicit precompute is demand enough: a first offer turned away by the doorkeeper
    (chunk seen once) is repeated. Why the store turned the variant away (`OfferResult.reason`)
    or that a write failed ("write_failed": disk full or unwritable; the variant may still be
    served from memory, `stored`) is reported in `not_stored_reason`, with the words in
    `not_stored_detail`. A pin counts against `owner(namespace)`'s budget; `durable` says
    whether it will outlive a restart (its disk copy and its registry row were written)."""
    outcome = prefill_in_full(engine.runner, request, layout)
    variant = engine.runner.variants(outcome)[-1]
    offered = store.offer(variant)
    if offered.reason == "doorkeeper":
        offered = store.offer(variant)
    label = request.chunks[0].id
    registry.add(request.namespace, variant.chunk_key, label, variant.meta.num_tokens)
    durable = False
    if pin:  # recorded first: a concurrent `sync_pins` must not release the new pin
        recorded = registry.pin(request.namespace, variant.chunk_key, variant.variant_id)
        try:  # PinLimitError: a 400 naming the cap
            on_disk = store.pin(variant, owner(request.namespace))
        except PinLimitError:
            registry.unpin(variant.variant_id)
            raise
        durable = recorded and on_disk
    row: dict[str, Any] = {
        "id": label,
        "chunk_key": variant.chunk_key,
        "variant_id": variant.variant_id,
        "num_tokens": variant.meta.num_tokens,
        "stored": offered.stored or pin,
        "pinned": pin,
    }
    if pin:
        row["durable"] = durable
    if offered.write_error is not None:
        row["not_stored_reason"] = "write_failed"
        row["not_stored_detail"] = f"disk write failed: {offered.write_error}"
    elif offered.reason is not None and not pin:
        row["not_stored_reason"] = offered.reason
        row["not_stored_detail"] = REFUSALS[offered.reason]
    return row


def pin_refused(index: int, num_documents: int, error: PinLimitError) -> str:
    """The 400's words when document `index` of a `POST /v1/chunks` with `pin` passes the cap:
    it was precomputed but not pinned, the ones before it were pinned, the rest not done."""
    parts = [f"documents.{index}: {error}. It was precomputed but not pinned"]
    if index == 1:
        parts.append("documents.0 was precomputed and pinned")
    elif index > 1:
        parts.append(f"documents.0 to documents.{index - 1} were precomputed and pinned")
    if index < num_documents - 1:
        parts.append("the documents after it were not processed")
    return "; ".join(parts)


async def precompute_async(engine: Engine, *args: Any) -> dict[str, Any]:
    return await asyncio.wrap_future(engine.call(lambda: precompute(engine, *args)))


def list_chunks(store: ChunkStore, registry: ChunkRegistry, namespace: str) -> dict[str, Any]:
    """The namespace's registered chunks that are stored (a variant in some tier, or a pin
    recorded by any replica), as GET /v1/chunks answers."""
    pinned = store.pinned().chunk_keys() | registry.pinned_keys(namespace)
    data = []
    for key, (label, num_tokens) in sorted(registry.keys(namespace).items()):
        variants = store.variants(key)
        if not variants and key not in pinned:
            continue  # removed or evicted everywhere: dropped at the next start or DELETE
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
        "pinned_bytes": store.pinned().nbytes({d["chunk_key"] for d in data}),
    }
    return {"object": "list", "data": data, "stats": stats}
