"""The app's one middleware (`Guard`): body-size cap, the last line of defence against an
escaped exception, a JSON 503 for requests a stopping server cancels, and request counting."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException

from cachecraft.server.errors import json_error
from cachecraft.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` as the body streams in: an HTTPException, so FastAPI's body
    parsing passes it on (it turns other errors into a 400) to the 413 handler."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body over {max_bytes} bytes (max_request_bytes)")


class Guard:
    """Pure ASGI middleware (streams and disconnects pass through untouched), between
    Starlette's error middleware and the routes:
    * refuses a body over `max_bytes` with 413 (by Content-Length, or while it streams in);
    * turns any exception a route let escape into a 500 JSON answer *without* re-raising, so
      the server keeps the keep-alive connection open (a re-raise makes uvicorn drop it);
    * answers a request cancelled by a stopping server (past `shutdown_timeout_s`) with 503;
    * counts each HTTP response by route template and status."""

    def __init__(self, app: Any, metrics: ServerMetrics, max_bytes: int) -> None:
        self.app, self.metrics, self.max_bytes = app, metrics, max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def guarded_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                route = scope.get("route")
                path = getattr(route, "path", None) or "other"
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        async def reply(status: int, message: str, type_: str, code: str | None) -> None:
            start, body = json_error(status, message, type_, code)
            await guarded_send(start)
            await guarded_send({"type": "http.response.body", "body": body})

        too_large = str(BodyTooLarge(self.max_bytes).detail)
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length", b"").decode("latin-1").strip()
        if length.isdigit() and int(length) > self.max_bytes:
            await reply(413, too_large, "invalid_request_error", "request_too_large")
            return
        seen = 0

        async def limited_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        try:
            await self.app(scope, limited_receive, guarded_send)
        except BodyTooLarge:
            if not started:
                await reply(413, too_large, "invalid_request_error", "request_too_large")
        except asyncio.CancelledError:
            # The server is stopping and `shutdown_timeout_s` ran out: answer in OpenAI's shape
            # (uvicorn would send a plain-text 500), then let the cancellation go on.
            if not started:
                message = "the server is shutting down; retry the request"
                await reply(503, message, "server_error", "shutting_down")
            raise
        except Exception as exc:  # noqa: BLE001 - the last line of defence, logged
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                message = f"internal error: {type(exc).__name__}: {exc}"
                await reply(500, message, "server_error", None)
