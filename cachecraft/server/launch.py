"""Build the serving stack (model, store, runner, engine, app) and run it with uvicorn.

`start_server(mode, **kw)` runs it on a free loopback port in a background thread and yields
the base URL (tests, benchmarks); `serve(...)` runs it in the foreground (`cachecraft serve`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import uvicorn

from cachecraft.config import ReuseConfig
from cachecraft.engine.engine import Engine, EngineConfig
from cachecraft.engine.runner import Runner
from cachecraft.errors import CachecraftError
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.reuse.strategy import StrategyRegistry
from cachecraft.server.app import create_app
from cachecraft.server.config import ServerConfig
from cachecraft.server.registry import open_registry
from cachecraft.store.base import ChunkStore
from cachecraft.store.config import StoreConfig
from cachecraft.store.store import make_store

log = logging.getLogger(__name__)


class Stack(NamedTuple):
    """What `build_stack` built: the started engine and the store its runner uses (the app gets
    the store from here, never from inside the engine)."""

    engine: Engine
    store: ChunkStore


def build_stack(
    mode: str | None = None,
    *,
    model: str | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    loaded: LoadedModel | None = None,
    reuse: ReuseConfig | None = None,
    store: StoreConfig | None = None,
    engine: EngineConfig | None = None,
    strategies: StrategyRegistry | None = None,
) -> Stack:
    """A started Engine for `mode` (the server default; requests may override it) over a store
    built from `store`. `mode` and `engine.mode` are one setting: two different values are an
    error; so are both `model` and `loaded`. `dtype` is the weights' and the compute's (None:
    bfloat16 on a GPU, float32 on a CPU), `device` where they live (`model` only: a `loaded`
    model has its own; the store's memory tier lives on `store.device`). `strategies`: the
    registry a mode is looked up in, with its strategies' parameters (default: STRATEGIES)."""
    if model is not None and loaded is not None:
        raise ValueError("give the model once: `model` (a path) or `loaded`, not both")
    config = engine or EngineConfig()
    if mode is not None and mode != config.mode:
        if engine is not None and config.mode != EngineConfig().mode:
            raise ValueError(f"mode given twice: {mode!r} and engine.mode={config.mode!r}")
        config = dataclasses.replace(config, mode=mode)
    loaded = loaded or load_model(model, dtype, device)
    chunk_store = make_store(store or StoreConfig())
    runner = Runner(loaded, chunk_store, reuse or ReuseConfig())
    return Stack(Engine(runner, config, strategies=strategies).start(), chunk_store)


def close_stack(stack: Stack) -> None:
    stack.engine.stop()
    stack.store.close()


def _uvicorn(app: Any, log_level: str, shutdown_timeout_s: float) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=shutdown_timeout_s,
    )
    return uvicorn.Server(config)


@contextlib.contextmanager
def start_server(
    mode: str | None = None,
    *,
    server: ServerConfig | None = None,
    log_level: str = "warning",
    **engine_kw: Any,
) -> Iterator[str]:
    """Serve on 127.0.0.1:<free port> in a thread; yields "http://127.0.0.1:PORT".
    engine_kw go to `build_stack` (model, loaded, reuse, store, engine, strategies)."""
    stack = build_stack(mode, **engine_kw)
    registry = open_registry(engine_kw.get("store"))
    try:
        app = create_app(stack.engine, stack.store, server, registry)
        with serve_app(app, log_level) as url:
            yield url
    finally:
        close_stack(stack)
        registry.close()


@contextlib.contextmanager
def serve_app(app: Any, log_level: str = "warning") -> Iterator[str]:
    """Serve an app made by `create_app` on a free loopback port in a thread (its engine is
    the caller's to stop); yields the base URL."""
    config: ServerConfig = app.state.config
    uv = _uvicorn(app, log_level, config.shutdown_timeout_s)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not uv.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(10 + config.shutdown_timeout_s)
        sock.close()
        app.state.tokenize.shutdown(wait=False)


def serve(
    mode: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    server: ServerConfig | None = None,
    log_level: str = "info",
    **engine_kw: Any,
) -> None:
    """Serve in the foreground until SIGTERM / SIGINT; open requests get
    `shutdown_timeout_s` to finish (those waiting on a dead engine are failed at once), so
    stopping always ends. `port=0` takes a free port; the log line "serving ... on
    http://HOST:PORT" names the one bound."""
    server = server or ServerConfig()
    stack = build_stack(mode, **engine_kw)
    engine = stack.engine
    registry = open_registry(engine_kw.get("store"))
    app = create_app(engine, stack.store, server, registry)
    loaded = engine.runner.loaded
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        close_stack(stack)
        registry.close()
        app.state.tokenize.shutdown(wait=False)
        raise CachecraftError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound = sock.getsockname()[1]
    log.info("serving %s (mode %s) on http://%s:%d", loaded.name, engine.config.mode, host, bound)
    config = uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="off",
        timeout_graceful_shutdown=server.shutdown_timeout_s,
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        close_stack(stack)
        registry.close()
        app.state.tokenize.shutdown(wait=False)
