"""POST /v1/chunks (precompute, optionally pinned), GET /v1/chunks (the caller's chunks and
its figures), DELETE /v1/chunks/{chunk_key}; the work is server/chunks.py's."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query

from cachecraft.errors import PinLimitError, StoreUnavailableError
from cachecraft.server import chunks
from cachecraft.server.auth import Namespace, checked_query, scoped
from cachecraft.server.errors import ApiError
from cachecraft.server.protocol import ChunksRequest
from cachecraft.server.state import State
from cachecraft.server.validate import check_documents, check_system

router = APIRouter()
NamespaceQuery = Annotated[str | None, Query(min_length=1, max_length=128)]


@router.post("/v1/chunks")
async def add_chunks(body: ChunksRequest, ns: Namespace, state: State) -> dict[str, Any]:
    check_documents(state.config, body.documents)
    check_system(state.config, body.system)
    scope = scoped(ns, body.cache_namespace)
    await asyncio.to_thread(chunks.follow_registry, state.store, state.registry, state.owner)
    rows = []
    for i, d in enumerate(body.documents):  # one engine call each: generation interleaves
        rag = chunks.precompute_request(d.passage, d.id, scope, body.system)
        layout = await state.layout(rag)
        try:
            rows.append(
                await chunks.precompute_async(
                    state.engine, state.store, state.registry, rag, layout, body.pin, state.owner
                )
            )
        except PinLimitError as e:  # say what was done: the documents before it are pinned
            message = chunks.pin_refused(i, len(body.documents), e)
            raise ApiError(
                400, message, "invalid_request_error", "pin_limit", f"documents.{i}"
            ) from None
    return {"object": "list", "data": rows}


@router.get("/v1/chunks")
async def list_chunks(
    ns: Namespace, state: State, cache_namespace: NamespaceQuery = None
) -> dict[str, Any]:
    scope = scoped(ns, checked_query(cache_namespace))

    def listing() -> dict[str, Any]:  # a store lookup per chunk: off the event loop
        chunks.follow_registry(state.store, state.registry, state.owner)
        return chunks.list_chunks(state.store, state.registry, scope)

    return await asyncio.to_thread(listing)


@router.delete("/v1/chunks/{chunk_key}")
async def delete_chunk(
    chunk_key: Annotated[str, Path(max_length=128)],
    ns: Namespace,
    state: State,
    cache_namespace: NamespaceQuery = None,
) -> dict[str, Any]:
    scope = scoped(ns, checked_query(cache_namespace))
    store, registry = state.store, state.registry
    missing = ApiError(
        404, f"chunk {chunk_key} not found in this namespace", "invalid_request_error"
    )
    if chunk_key not in registry.keys(scope):
        raise missing
    was_pinned = chunk_key in registry.pinned_keys(scope)
    try:
        removed = await asyncio.wrap_future(state.engine.call(lambda: store.remove(chunk_key)))
    except StoreUnavailableError as e:  # nothing removed: the client may retry
        raise ApiError(503, str(e), "server_error", "tier_unreachable") from None
    registry.discard(scope, chunk_key)
    registry.record_removal(chunk_key)  # other replicas drop their memory copies
    if removed == 0 and not was_pinned:  # a row left behind: nothing was stored (listed)
        raise missing
    return {"chunk_key": chunk_key, "deleted": True, "num_variants": removed}
