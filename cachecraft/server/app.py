"""create_app(engine, store, config): the OpenAI-compatible FastAPI app, kept thin. It uses the
store it is given (the one the engine's runner was built with) and never reaches into the engine.

Routes, one router per group (server/routes/): /v1/chat/completions, /v1/completions,
/v1/responses (over the chat path: server/responses.py); /v1/models (and /v1/models/{model}),
vLLM's /tokenize, /detokenize, /tokenizer_info; /v1/chunks (POST, GET, DELETE); /health, vLLM's
/ping and /version, /metrics. Every error, the framework's included, has OpenAI's shape
(server/errors.py): 400 bad input (unsupported fields named), 401 bad key, 404 unknown model,
chunk or route, 405 wrong method, 413 body or text over a cap, 429 queue full (Retry-After),
503 engine stopped, server shutting down or (DELETE) Redis unreachable, 500 anything else (and
the connection stays open: server/guard.py). Prompts are tokenized on a worker thread, never on
the engine's step thread; /health answers 503 when the step thread is dead or stuck.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI

from cachecraft.engine.engine import Engine
from cachecraft.server import chunks
from cachecraft.server.config import ServerConfig
from cachecraft.server.errors import install_error_handlers
from cachecraft.server.guard import Guard
from cachecraft.server.metrics import ServerMetrics
from cachecraft.server.registry import ChunkRegistry
from cachecraft.server.routes import chunks as chunk_routes
from cachecraft.server.routes import completions, models, operations
from cachecraft.server.state import ServerState
from cachecraft.store.base import ChunkStore

log = logging.getLogger(__name__)


def create_app(
    engine: Engine,
    store: ChunkStore,
    config: ServerConfig | None = None,
    registry: ChunkRegistry | None = None,
) -> FastAPI:
    """`registry`: the chunk registry (`registry.open_registry`: persistent with a disk tier;
    default in memory); the pins it records are restored into `store` here, and its rows of
    chunks the store no longer holds are dropped."""
    config = config or ServerConfig()
    # redirect_slashes off: `DELETE /v1/chunks/` is a 404/405, never a 307 to another route
    # the API's schema and pages name every route and field: with keys set, the operator's
    docs = not config.is_secured or config.public_docs
    app = FastAPI(
        title="cachecraft",
        version="0.1.0",
        redirect_slashes=False,
        openapi_url="/openapi.json" if docs else None,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    state = ServerState(
        engine, store, config, registry or ChunkRegistry(), ServerMetrics(engine, store)
    )
    num_pins = chunks.restore_pins(store, state.registry, state.owner)
    if num_pins:
        log.info("restored %d pinned chunk-caches", num_pins)
    chunks.forget_unstored(store, state.registry)
    app.state.server = state
    app.state.config = config  # what `serve_app` reads
    app.state.tokenize = state.tokenize  # shut down by whoever serves the app
    install_error_handlers(app, config)
    app.add_middleware(Guard, metrics=state.metrics, max_bytes=config.max_request_bytes)
    for group in (completions, models, chunk_routes, operations):
        app.include_router(group.router)
    return app
