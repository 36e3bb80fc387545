"""ServerState: what every route of one app reads (engine, store, registry, limits, metrics,
the tokenizer's worker thread), built once by `create_app` and handed to routes through
`server_state` (a FastAPI dependency), never through a closure or a global."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from cachecraft.engine.engine import Engine
from cachecraft.model.loader import LoadedModel
from cachecraft.request import RagRequest
from cachecraft.reuse.layout import PromptLayout
from cachecraft.server.auth import tenant_of
from cachecraft.server.config import ServerConfig
from cachecraft.server.metrics import ServerMetrics
from cachecraft.server.registry import ChunkRegistry
from cachecraft.store.base import ChunkStore


@dataclass(slots=True)
class ServerState:
    """engine: the started engine; store: the store its runner uses; registry: the chunk
    registry (pins and labels); tokenize: the one worker that tokenizes prompts (HF fast
    tokenizers are not meant to be shared across threads, and the step thread must not)."""

    engine: Engine
    store: ChunkStore
    config: ServerConfig
    registry: ChunkRegistry
    metrics: ServerMetrics
    tokenize: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="cachecraft-tokenize")
    )

    @property
    def loaded(self) -> LoadedModel:
        return self.engine.runner.loaded

    @property
    def model_names(self) -> set[str]:
        """The served model's name and its aliases (what `model` may say)."""
        return {self.loaded.name, *self.config.model_aliases}

    @property
    def max_ctx(self) -> int:
        return self.loaded.arch.max_position_embeddings

    def owner(self, namespace: str) -> str:
        """The tenant whose pin budget a pin in `namespace` counts against."""
        return tenant_of(namespace, self.config)

    async def layout(self, rag: RagRequest) -> PromptLayout:
        """The request's layout (tokens, keys; context length checked) off the step thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenize, self.engine.runner.layout, rag)

    async def off_loop(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the tokenizer's worker (tokenizer calls: one thread owns it)."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize, fn, *args)


def server_state(request: Request) -> ServerState:
    """The app's state, as a route dependency."""
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]
