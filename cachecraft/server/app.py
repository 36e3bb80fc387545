"""create_app(engine, store, config): the OpenAI-compatible FastAPI app, kept thin. It uses the
store it is given (the one the engine's runner was built with) and never reaches into the engine.

Routes: /v1/chat/completions, /v1/completions, /v1/models, /v1/chunks (POST, GET, DELETE),
/health, /metrics. Errors map to OpenAI-shaped bodies: 400 bad input, 401 bad key, 404 unknown
model or chunk, 429 queue full (Retry-After), 500 anything else; the server never dies on input.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from cachecraft.config import MODES
from cachecraft.engine.engine import Engine, EngineStopped
from cachecraft.engine.scheduler import QueueFull
from cachecraft.errors import CachecraftError
from cachecraft.server import chunks
from cachecraft.server.config import ServerConfig
from cachecraft.server.generation import Generation, respond, sampling_of, to_rag
from cachecraft.server.metrics import ServerMetrics
from cachecraft.server.protocol import (
    ChatCompletionRequest,
    ChunksRequest,
    CompletionRequest,
    Document,
    error_body,
)
from cachecraft.store.base import ChunkStore

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.code = status, type_, code


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            parts.append(f"malformed JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
        else:
            parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"


class _CountRequests:
    """Pure ASGI middleware (streams and disconnects pass through untouched): counts each
    HTTP response by route template and status."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                path = getattr(route, "path", None) or "other"
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(engine: Engine, store: ChunkStore, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    app = FastAPI(title="cachecraft", version="0.1.0")
    state = app.state
    state.engine, state.config = engine, config
    state.metrics = ServerMetrics(engine, store)
    state.registry = chunks.ChunkRegistry()
    loaded = engine.runner.loaded
    model_names = {loaded.name, *config.model_aliases}
    max_ctx = loaded.arch.max_position_embeddings

    # ---- errors -----------------------------------------------------------------------------
    def err(status: int, message: str, type_: str, code: str | None = None, **headers: str):
        return JSONResponse(error_body(message, type_, code), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return err(400, _validation_message(exc), "invalid_request_error")

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return err(exc.status, str(exc), exc.type, exc.code)

    @app.exception_handler(CachecraftError)
    async def _bad(_: Request, exc: CachecraftError) -> JSONResponse:
        return err(400, str(exc), "invalid_request_error")

    @app.exception_handler(QueueFull)
    async def _full(_: Request, exc: QueueFull) -> JSONResponse:
        return err(
            429,
            f"server busy: {exc}",
            "rate_limit_error",
            "queue_full",
            **{"Retry-After": str(config.retry_after_s)},
        )

    @app.exception_handler(EngineStopped)
    async def _stopped(_: Request, exc: EngineStopped) -> JSONResponse:
        return err(503, str(exc), "server_error")

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return err(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    app.add_middleware(_CountRequests, metrics=state.metrics)

    # ---- auth and namespaces ----------------------------------------------------------------
    keys = set(config.api_keys)

    def namespace(request: Request) -> str:
        """The caller's cache namespace: one per API key unless shared."""
        if not keys:
            return "default"
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in keys:
            raise ApiError(
                401, "missing or invalid API key", "authentication_error", "invalid_api_key"
            )
        if config.share_namespace:
            return "default"
        return "key-" + hashlib.blake2b(key.strip().encode(), digest_size=8).hexdigest()

    def scoped(base: str, requested: str | None) -> str:
        if requested is None:
            return base
        return requested if base == "default" else f"{base}/{requested}"

    def check_documents(documents: list[Document]) -> None:
        if len(documents) > config.max_documents:
            raise ApiError(
                400,
                f"{len(documents)} documents; at most {config.max_documents} are allowed",
                "invalid_request_error",
                "too_many_documents",
            )
        for i, d in enumerate(documents):
            if len(d.text) > config.max_document_chars:
                raise ApiError(
                    400,
                    f"documents.{i} has {len(d.text)} characters; at most "
                    f"{config.max_document_chars} are allowed",
                    "invalid_request_error",
                    "document_too_large",
                )

    # ---- generation -------------------------------------------------------------------------
    async def generate(
        request: Request, body: ChatCompletionRequest | CompletionRequest, base_ns: str
    ) -> Response:
        if body.model not in model_names:
            raise ApiError(
                404,
                f"model {body.model!r} not found; this server serves {loaded.name!r}",
                "invalid_request_error",
                "model_not_found",
            )
        mode = body.cachecraft_mode or engine.config.mode
        if mode not in MODES:
            raise ApiError(
                400,
                f"cachecraft_mode {mode!r}: choose one of {', '.join(MODES)}",
                "invalid_request_error",
            )
        check_documents(body.documents)
        ns = scoped(base_ns, body.cache_namespace)
        rag = to_rag(body, ns)
        sampling = sampling_of(body, config)
        handle = engine.submit(rag, sampling, mode, loop=asyncio.get_running_loop())
        chat = isinstance(body, ChatCompletionRequest)
        gen = Generation(state, handle, chat, body.model, ns, sampling.stop)
        try:
            await gen.planned()
        except BaseException:
            handle.abort()
            raise
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await respond(request, gen, body.stream, include_usage)

    @app.post("/v1/chat/completions")
    async def chat(
        request: Request, body: ChatCompletionRequest, ns: str = Depends(namespace)
    ) -> Response:
        return await generate(request, body, ns)

    @app.post("/v1/completions")
    async def completions(
        request: Request, body: CompletionRequest, ns: str = Depends(namespace)
    ) -> Response:
        return await generate(request, body, ns)

    @app.get("/v1/models")
    async def models(_: str = Depends(namespace)) -> dict[str, Any]:
        card = {
            "id": loaded.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "cachecraft",
            "max_model_len": max_ctx,
        }
        return {"object": "list", "data": [card]}

    # ---- chunks -----------------------------------------------------------------------------
    @app.post("/v1/chunks")
    async def add_chunks(body: ChunksRequest, ns: str = Depends(namespace)) -> dict[str, Any]:
        check_documents(body.documents)
        scope = scoped(ns, body.cache_namespace)
        docs = [(d.text, d.id) for d in body.documents]
        rows = await chunks.precompute_async(
            engine, store, state.registry, docs, scope, body.system, body.pin
        )
        return {"object": "list", "data": rows}

    @app.get("/v1/chunks")
    async def list_chunks(
        ns: str = Depends(namespace), cache_namespace: str | None = None
    ) -> dict[str, Any]:
        scope = scoped(ns, cache_namespace)
        return chunks.list_chunks(store, state.registry, scope)

    @app.delete("/v1/chunks/{chunk_key}")
    async def delete_chunk(
        chunk_key: str, ns: str = Depends(namespace), cache_namespace: str | None = None
    ) -> dict[str, Any]:
        scope = scoped(ns, cache_namespace)
        if chunk_key not in state.registry.keys(scope):
            raise ApiError(
                404, f"chunk {chunk_key} not found in this namespace", "invalid_request_error"
            )
        removed = await asyncio.wrap_future(engine.call(lambda: store.remove(chunk_key)))
        state.registry.discard(scope, chunk_key)
        return {"chunk_key": chunk_key, "deleted": True, "num_variants": removed}

    # ---- operations -------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> dict[str, Any]:
        tiers = await asyncio.to_thread(store.health)  # may ping Redis
        return {
            "status": "ok",
            "tiers": {t.name: t._asdict() for t in tiers},
            "model": loaded.name,
            "mode": engine.config.mode,
            "num_waiting": engine.num_waiting,
            "num_running": engine.num_running,
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
