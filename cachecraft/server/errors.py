"""Every error the app answers, in OpenAI's shape ({"error": {message, type, param, code}}):
`ApiError` (what a route raises), the handlers that turn validation errors, framework errors
(unknown route, wrong method, unparsable body), input errors, a full queue and a stopped
engine into that shape, and `refuse` for fields this server does not honour."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cachecraft.engine.engine import EngineStopped
from cachecraft.engine.scheduler import QueueFull
from cachecraft.errors import CachecraftError
from cachecraft.server.config import ServerConfig
from cachecraft.server.logprobs import NonFiniteOutput
from cachecraft.server.protocol import error_body


class ApiError(Exception):
    """An answer other than 200: `status`, OpenAI's error `type`, and optionally its `code`
    and the `param` (request field) it is about."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type_, code, param


def refuse(bad: list[str]) -> None:
    """400 naming the fields asking for what this server does not do, if any."""
    if bad:
        raise ApiError(
            400,
            f"{', '.join(bad)}: not supported by this server (remove the field)",
            "invalid_request_error",
            "unsupported_field",
            bad[0],
        )


def _clean_loc(loc: tuple[Any, ...]) -> str:
    """`body.messages.0.content.function-after[...]` -> `messages.0.content`."""
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    keep = [str(x) for x in loc if not any(c in str(x) for c in "[(")]
    return ".".join(keep)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line naming each bad field (the first as `param`); for a field that failed every
    branch of a union, the value error (what the user can act on) wins over type mismatches."""
    by_loc: dict[str, list[dict[str, Any]]] = {}
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            why = err.get("ctx", {}).get("error", err.get("msg"))
            return f"malformed JSON: {why}", None
        by_loc.setdefault(_clean_loc(tuple(err.get("loc", ()))), []).append(err)
    by_loc = _deepest(by_loc)
    parts = []
    for loc, errs in by_loc.items():
        preferred = [e for e in errs if e.get("type") == "value_error"] or errs
        msgs = dict.fromkeys(str(e.get("msg")).removeprefix("Value error, ") for e in preferred)
        parts.append(f"{loc or 'body'}: {' or '.join(msgs)}")
    return "; ".join(parts) or "invalid request", next(iter(by_loc), None) or None


def _deepest(by_loc: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Without a field's type mismatches when its value had the other branch's type and
    failed inside it: `input` given as a list is not "a valid string", its item 0 is what
    went wrong."""
    out = {}
    for loc, errs in by_loc.items():
        inside = loc and any(d.startswith(loc + ".") for d in by_loc)
        kept = [e for e in errs if not (inside and str(e.get("type", "")).endswith("_type"))]
        if kept:
            out[loc] = kept
    return out


STATUS_CODES = {
    401: "invalid_api_key",
    403: "admin_key_required",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
}
_FIELD_PREFIX = re.compile(r"([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*): ")
"""A request error's message that begins with a field ("messages.2.content: ...") names it
in `param`, as the validation errors do."""


def json_error(status: int, message: str, type_: str, code: str | None) -> tuple[dict, bytes]:
    """An error as raw ASGI messages' parts: the response start and the body's bytes."""
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json")],
    }
    return start, json.dumps(error_body(message, type_, code)).encode()


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    param: str | None = None,
    **headers: str,
) -> JSONResponse:
    body = error_body(message, type_, code, param)
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI, config: ServerConfig) -> None:
    """Register the handlers that answer every error in OpenAI's shape."""

    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        content_type = request.headers.get("content-type", "")
        if param is None and message.startswith("body:") and "json" not in content_type:
            # FastAPI parses JSON only when told so: `curl -d` sends a form content type
            message = (
                "the body must be a JSON object sent with Content-Type: application/json "
                f"(got {content_type or 'no content type'})"
            )
        return error_response(400, message, "invalid_request_error", None, param)

    async def http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Framework errors (unknown route, wrong method, unparsable body) in OpenAI's shape."""
        status = exc.status_code
        if status == 404:
            message = f"no route {request.method} {request.url.path}"
        elif status == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        type_ = "invalid_request_error" if status < 500 else "server_error"
        code = STATUS_CODES.get(status)
        return error_response(status, message, type_, code, None, **(exc.headers or {}))

    async def api(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.type, exc.code, exc.param)

    async def bad(_: Request, exc: CachecraftError) -> JSONResponse:
        message = str(exc)  # "messages.2.content: ..." names the field it is about
        field = _FIELD_PREFIX.match(message)
        return error_response(400, message, "invalid_request_error", None, field and field.group(1))

    async def full(_: Request, exc: QueueFull) -> JSONResponse:
        retry = {"Retry-After": str(config.retry_after_s)}
        return error_response(429, f"server busy: {exc}", "rate_limit_error", "queue_full", **retry)

    async def stopped(_: Request, exc: EngineStopped) -> JSONResponse:
        return error_response(503, str(exc), "server_error")

    async def non_finite(_: Request, exc: NonFiniteOutput) -> JSONResponse:
        return error_response(500, str(exc), "server_error", "non_finite_output")

    app.add_exception_handler(RequestValidationError, invalid)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http)  # type: ignore[arg-type]
    app.add_exception_handler(ApiError, api)  # type: ignore[arg-type]
    app.add_exception_handler(CachecraftError, bad)  # type: ignore[arg-type]
    app.add_exception_handler(QueueFull, full)  # type: ignore[arg-type]
    app.add_exception_handler(EngineStopped, stopped)  # type: ignore[arg-type]
    app.add_exception_handler(NonFiniteOutput, non_finite)  # type: ignore[arg-type]
