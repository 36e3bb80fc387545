"""A fake OpenAI-compatible SSE server for the load generator and serving-bench tests.

Chat: `delay_s` per content chunk (or a per-`cachecraft_mode` delay), usage with a cachecraft
report; `reject`/`fail` give 429/500; `gate` [name, n] holds every answer of that gate until
n of its requests arrived; GET /fake/modes lists the modes asked for. Completions
(the vLLM stand-in) count prefix-cache queries/hits in /metrics like vLLM does. Runs under
uvicorn on a free loopback port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

NUM_CHUNKS = 4
CHUNK_DELAY_S = 0.05
MODE_DELAY_S = {"full": 0.03, "prefix": 0.025, "cachecraft": 0.01}
MODE_COMPUTED = {"full": 1.0, "prefix": 0.9, "cachecraft": 0.3}


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def fake_app() -> FastAPI:
    app = FastAPI()
    counters = {"queries": 0, "hits": 0}
    seen: set[tuple[int, ...]] = set()
    modes: list[str | None] = []  # every chat request's cachecraft_mode, in arrival order
    gates: dict[str, tuple[int, asyncio.Event]] = {}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> object:
        body = await request.json()
        if body.get("reject"):
            return JSONResponse({"error": {"message": "busy"}}, status_code=429)
        if body.get("fail"):
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if body.get("gate"):  # [name, n]: no answer before n requests of that gate arrived
            name, n = body["gate"]
            count, opened = gates.get(name, (0, asyncio.Event()))
            gates[name] = (count + 1, opened)
            if count + 1 >= n:
                opened.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(opened.wait(), 60)
        mode = body.get("cachecraft_mode")
        modes.append(mode)
        delay = float(body.get("delay_s", MODE_DELAY_S.get(mode, CHUNK_DELAY_S)))
        prompt = 100 if mode is None else 10 + 100 * len(body.get("documents", []))
        computed = 30 if mode is None else round(MODE_COMPUTED[mode] * prompt)
        num_out = body.get("max_tokens", NUM_CHUNKS) if mode is not None else NUM_CHUNKS

        async def events() -> object:
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i in range(num_out):
                await asyncio.sleep(delay)
                yield _sse({"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]})
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": num_out,
                "prompt_tokens_details": {"cached_tokens": 60 if mode is None else 0},
                "cachecraft": {"tokens_computed": computed, "prompt_tokens": prompt},
            }
            yield _sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> object:
        body = await request.json()
        ids = tuple(body["prompt"])
        cached = len(ids) - 1 if (ids, body.get("cache_salt")) in seen else 0
        seen.add((ids, body.get("cache_salt")))
        counters["queries"] += len(ids)
        counters["hits"] += cached
        usage = {"prompt_tokens": len(ids), "completion_tokens": 2}
        if not body.get("stream"):
            return {"choices": [{"index": 0, "text": "ab"}], "usage": usage}

        async def events() -> object:
            for piece in ("a", "b"):
                await asyncio.sleep(0.01)
                yield _sse({"choices": [{"index": 0, "text": piece}]})
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
            yield _sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/fake/modes")
    async def modes_seen() -> object:
        return modes

    @app.get("/metrics")
    async def metrics() -> object:
        lines = []
        for name, value in counters.items():
            lines.append(f"# TYPE vllm:prefix_cache_{name}_total counter")
            lines.append(f'vllm:prefix_cache_{name}_total{{engine="0"}} {float(value)}')
        return PlainTextResponse("\n".join(lines) + "\n")

    return app


@contextmanager
def serve_fake() -> Iterator[str]:
    """Run a fresh fake app; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake_app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        assert server.started, "fake server did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
