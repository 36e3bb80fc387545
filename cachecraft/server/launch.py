"""Build the serving stack (model, store, runner, engine, app) and run it with uvicorn.

`start_server(mode, **kw)` runs it on a free loopback port in a background thread and yields
the base URL (tests, benchmarks); `serve(...)` runs it in the foreground (`cachecraft serve`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from cachecraft.config import ReuseConfig
from cachecraft.engine.engine import Engine, EngineConfig
from cachecraft.engine.runner import Runner
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.server.app import create_app
from cachecraft.server.config import ServerConfig
from cachecraft.store.config import StoreConfig, make_store

log = logging.getLogger(__name__)


def build_engine(
    mode: str = "cachecraft",
    *,
    model: str | None = None,
    loaded: LoadedModel | None = None,
    reuse: ReuseConfig | None = None,
    store: StoreConfig | None = None,
    engine: EngineConfig | None = None,
) -> Engine:
    """A started Engine for `mode` (the server default; requests may override it)."""
    loaded = loaded or load_model(model)
    reuse = reuse or ReuseConfig()
    store = store or StoreConfig(max_variants_per_chunk=reuse.max_variants_per_chunk)
    config = engine or EngineConfig()
    if config.mode != mode:
        config = EngineConfig(config.token_budget, config.max_running, config.max_queue, mode)
    runner = Runner(loaded, make_store(store), reuse)
    return Engine(runner, config).start()


def close_engine(engine: Engine) -> None:
    engine.stop()
    close = getattr(engine.runner.store, "close", None)
    if close is not None:
        close()


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
    mode: str = "cachecraft",
    *,
    server: ServerConfig | None = None,
    log_level: str = "warning",
    **engine_kw: Any,
) -> Iterator[str]:
    """Serve on 127.0.0.1:<free port> in a thread; yields "http://127.0.0.1:PORT".
    engine_kw go to `build_engine` (model, loaded, reuse, store, engine)."""
    engine = build_engine(mode, **engine_kw)
    try:
        app = create_app(engine, server)
        with serve_app(app, log_level) as url:
            yield url
    finally:
        close_engine(engine)


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
    mode: str = "cachecraft",
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    server: ServerConfig | None = None,
    log_level: str = "info",
    **engine_kw: Any,
) -> None:
    """Serve in the foreground until SIGTERM / SIGINT; open requests get
    `shutdown_timeout_s` to finish (those waiting on a dead engine are failed at once), so
    stopping always ends."""
    server = server or ServerConfig()
    engine = build_engine(mode, **engine_kw)
    app = create_app(engine, server)
    loaded = engine.runner.loaded
    log.info("serving %s (mode %s) on http://%s:%d", loaded.name, mode, host, port)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="off",
        timeout_graceful_shutdown=server.shutdown_timeout_s,
    )
    try:
        uvicorn.Server(config).run()
    finally:
        close_engine(engine)
        app.state.tokenize.shutdown(wait=False)
