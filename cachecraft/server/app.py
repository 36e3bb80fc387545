"""create_app(engine, store, config): the OpenAI-compatible FastAPI app, kept thin. It uses the
store it is given (the one the engine's runner was built with) and never reaches into the engine.

Routes: /v1/chat/completions, /v1/completions, /v1/responses (over the chat path:
server/responses.py), /v1/models (and /v1/models/{model}), /v1/chunks (POST, GET, DELETE),
vLLM's /tokenize, /detokenize, /tokenizer_info, /version and /ping, /health, /metrics. Every error,
the framework's included, has OpenAI's shape: 400 bad input (unsupported fields named), 401
bad key, 404 unknown model, chunk or route, 405 wrong method, 413 body or text over a cap, 429
queue full (Retry-After), 503 engine stopped, server shutting down or (DELETE) Redis
unreachable, 500 anything else (and the connection stays open). Prompts are tokenized on a
worker thread, never on the engine's step thread; /health answers 503 when the step thread is
dead or stuck.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cachecraft.config import MODES
from cachecraft.engine.engine import Engine, EngineStopped
from cachecraft.engine.scheduler import QueueFull
from cachecraft.errors import CachecraftError, PinLimitError, StoreUnavailableError
from cachecraft.server import chunks
from cachecraft.server.config import ServerConfig
from cachecraft.server.generation import (
    Generation,
    choice_sampling,
    respond,
    sampling_of,
    to_rags,
)
from cachecraft.server.metrics import ServerMetrics
from cachecraft.server.protocol import (
    ChatCompletionRequest,
    ChunksRequest,
    CompletionRequest,
    DetokenizeRequest,
    Document,
    TokenizeRequest,
    check_utf8,
    error_body,
    unsupported_fields,
)
from cachecraft.server.registry import ChunkRegistry
from cachecraft.server.responses import (
    ResponseBuilder,
    ResponsesRequest,
    responses_field,
    responses_loc,
)
from cachecraft.store.base import ChunkStore

log = logging.getLogger(__name__)


class ApiError(Exception):
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


def _clean_loc(loc: tuple[Any, ...]) -> str:
    """`body.messages.0.content.function-after[...]` -> `messages.0.content`."""
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    keep = [str(x) for x in loc if not any(c in str(x) for c in "[(")]
    return ".".join(keep)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
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


_STATUS_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
_FIELD_PREFIX = re.compile(r"([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*): ")
"""A request error's message that begins with a field ("messages.2.content: ...") names it
in `param`, as the validation errors do."""


def _json_error(status: int, message: str, type_: str, code: str | None) -> tuple[dict, bytes]:
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json")],
    }
    return start, json.dumps(error_body(message, type_, code)).encode()


class _BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` as the body streams in: an HTTPException, so FastAPI's body
    parsing passes it on (it turns other errors into a 400) to the 413 handler."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body over {max_bytes} bytes (max_request_bytes)")


class _Guard:
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
            start, body = _json_error(status, message, type_, code)
            await guarded_send(start)
            await guarded_send({"type": "http.response.body", "body": body})

        too_large = str(_BodyTooLarge(self.max_bytes).detail)
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
                    raise _BodyTooLarge(self.max_bytes)
            return message

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLarge:
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


NamespaceQuery = Annotated[str | None, Query(min_length=1, max_length=128)]


def checked(value: str | None) -> str | None:
    """Query strings are not validated by pydantic's str type: refuse lone surrogates here."""
    if value is None:
        return None
    try:
        return check_utf8(value)
    except ValueError as e:
        raise ApiError(400, f"cache_namespace: {e}", "invalid_request_error") from None


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
    app = FastAPI(title="cachecraft", version="0.1.0", redirect_slashes=False)
    state = app.state
    state.engine, state.config = engine, config
    state.metrics = ServerMetrics(engine, store)
    state.registry = registry or ChunkRegistry()
    num_pins = chunks.restore_pins(store, state.registry)
    if num_pins:
        log.info("restored %d pinned chunk-caches", num_pins)
    chunks.forget_unstored(store, state.registry)
    # Tokenization (CPU work proportional to the text) runs here, never on the step thread;
    # one worker: HF fast tokenizers are not meant to be shared across threads.
    state.tokenize = ThreadPoolExecutor(1, thread_name_prefix="cachecraft-tokenize")
    loaded = engine.runner.loaded
    model_names = {loaded.name, *config.model_aliases}
    max_ctx = loaded.arch.max_position_embeddings

    # ---- errors -----------------------------------------------------------------------------
    def err(
        status: int,
        message: str,
        type_: str,
        code: str | None = None,
        param: str | None = None,
        **headers: str,
    ) -> JSONResponse:
        body = error_body(message, type_, code, param)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        content_type = request.headers.get("content-type", "")
        if param is None and message.startswith("body:") and "json" not in content_type:
            # FastAPI parses JSON only when told so: `curl -d` sends a form content type
            message = (
                "the body must be a JSON object sent with Content-Type: application/json "
                f"(got {content_type or 'no content type'})"
            )
        return err(400, message, "invalid_request_error", None, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Framework errors (unknown route, wrong method, unparsable body) in OpenAI's shape."""
        status = exc.status_code
        if status == 404:
            message = f"no route {request.method} {request.url.path}"
        elif status == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        type_ = "invalid_request_error" if status < 500 else "server_error"
        return err(status, message, type_, _STATUS_CODES.get(status), None, **(exc.headers or {}))

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return err(exc.status, str(exc), exc.type, exc.code, exc.param)

    @app.exception_handler(CachecraftError)
    async def _bad(_: Request, exc: CachecraftError) -> JSONResponse:
        message = str(exc)  # "messages.2.content: ..." names the field it is about
        field = _FIELD_PREFIX.match(message)
        return err(400, message, "invalid_request_error", None, field and field.group(1))

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

    app.add_middleware(_Guard, metrics=state.metrics, max_bytes=config.max_request_bytes)

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

    def salted(requested: str | None, salt: str | None) -> str | None:
        """vLLM's `cache_salt` as a namespace of its hash (the salt itself never stored or
        listed), inside the requested namespace when there is one."""
        if salt is None:
            return requested
        digest = "salt-" + hashlib.sha256(salt.encode("utf-8")).hexdigest()[:32]
        return digest if requested is None else f"{requested}/{digest}"

    def scoped(base: str, requested: str | None) -> str:
        if requested is None:
            return base
        return requested if base == "default" else f"{base}/{requested}"

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

    def check_fields(body: ChatCompletionRequest | CompletionRequest) -> None:
        refuse(unsupported_fields(body))
        if isinstance(body, CompletionRequest):
            prompts = body.prompts()
            texts = [("prompt", p) for p in prompts if isinstance(p, str)]
            for p in prompts:
                if not isinstance(p, str):
                    check_vocabulary("prompt", p)
        else:
            texts = [("messages", m.text()) for m in body.messages]
        num_chars = sum(len(t) for _, t in texts)
        if num_chars > config.max_prompt_chars:
            raise ApiError(
                413,
                f"{texts[0][0]}: {num_chars} characters in all; at most "
                f"{config.max_prompt_chars} are allowed (max_prompt_chars)",
                "invalid_request_error",
                "prompt_too_large",
                texts[0][0],
            )

    def check_vocabulary(name: str, ids: Sequence[int]) -> None:
        """400 naming `name` when a token id is past the model's vocabulary."""
        vocab = loaded.arch.vocab_size
        outside = [t for t in ids if t >= vocab]
        if outside:
            raise ApiError(
                400,
                f"{name}: token {outside[0]} is not in the vocabulary (ids 0-{vocab - 1})",
                "invalid_request_error",
                param=name,
            )

    async def tokenized(rag: Any) -> Any:
        """The request's layout (tokens, keys; context length checked) off the step thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(state.tokenize, engine.runner.layout, rag)

    def check_documents(documents: list[Document]) -> None:
        if len(documents) > config.max_documents:
            raise ApiError(
                400,
                f"{len(documents)} documents; at most {config.max_documents} are allowed",
                "invalid_request_error",
                "too_many_documents",
            )
        for i, d in enumerate(documents):
            if len(d.passage) > config.max_document_chars:
                raise ApiError(
                    413,
                    f"documents.{i} has {len(d.passage)} characters; at most "
                    f"{config.max_document_chars} are allowed (max_document_chars)",
                    "invalid_request_error",
                    "document_too_large",
                    f"documents.{i}.text",
                )

    # ---- generation -------------------------------------------------------------------------
    async def generate(
        request: Request, body: ChatCompletionRequest | CompletionRequest, base_ns: str
    ) -> Response:
        if body.model is None:
            body.model = loaded.name
        elif body.model not in model_names:
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
        check_fields(body)
        check_documents(body.documents)
        if body.prompt_logprobs is not None and body.stream:
            raise ApiError(
                400,
                "prompt_logprobs: not served with stream (ask without streaming)",
                "invalid_request_error",
                param="prompt_logprobs",
            )
        ns = scoped(base_ns, salted(body.cache_namespace, body.cache_salt))
        rags = to_rags(body, ns, config)
        if any(r.chunks or r.system_chunks for r in rags):
            # what other replicas deleted must not be served from memory here
            await asyncio.to_thread(chunks.follow_registry, store, state.registry)
        sampling = sampling_of(body, config)
        check_vocabulary("logit_bias", [t for t, _ in sampling.logit_bias])
        check_vocabulary("stop_token_ids", sampling.stop_token_ids)
        layouts = [await tokenized(rag) for rag in rags]
        echoes: list[str | None] = [None] * len(rags)
        hide = False  # `max_tokens: 0` with echo: one token is made, none shown
        if isinstance(body, CompletionRequest) and body.echo:
            loop = asyncio.get_running_loop()
            for i, p in enumerate(body.prompts()):  # token ids decoded off the event loop
                decode = loaded.tokenizer.decode
                echoes[i] = (
                    p
                    if isinstance(p, str)
                    else await loop.run_in_executor(state.tokenize, decode, p)
                )
            hide = body.max_tokens == 0
            # the echo's entries and `prompt_logprobs` share one k; each reader keeps its own
            ks = [k for k in (sampling.logprobs, sampling.prompt_logprobs) if k is not None]
            sampling = dataclasses.replace(
                sampling,
                prompt_logprobs=max(ks) if ks else None,
                max_tokens=1 if hide else sampling.max_tokens,
            )
        loop = asyncio.get_running_loop()
        chat = isinstance(body, ChatCompletionRequest)
        n = body.n or 1
        gens: list[Generation] = []
        try:  # one engine request per prompt and choice (`n`); all planned, or none kept
            for p, (rag, layout) in enumerate(zip(rags, layouts, strict=True)):
                for i in range(n):
                    handle = engine.submit(
                        rag, choice_sampling(sampling, i), mode, loop=loop, layout=layout
                    )
                    index = p * n + i
                    gens.append(
                        Generation(
                            state,
                            handle,
                            chat,
                            body.model,
                            ns,
                            sampling.stop,
                            index,
                            logprobs=sampling.logprobs,
                            echo=echoes[p],
                            hide_output=hide,
                            prompt_logprobs=body.prompt_logprobs,
                            include_stop=body.include_stop_str_in_output,
                            skip_special=body.skip_special_tokens,
                        )
                    )
            for gen in gens:
                await gen.planned()
        except BaseException:
            for gen in gens:
                gen.handle.abort()
            raise
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        return await respond(request, gens, body.stream, include_usage, n, continuous)

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

    @app.post("/v1/responses")
    async def responses(
        request: Request, body: ResponsesRequest, ns: str = Depends(namespace)
    ) -> Response:
        """OpenAI's Responses API over the chat path (server/responses.py)."""
        refuse(body.refused())
        try:
            chat = ChatCompletionRequest.model_validate(body.to_chat())
        except ValidationError as e:  # named as the Responses request's fields
            errors = [{**x, "loc": ("body", *responses_loc(x["loc"], body))} for x in e.errors()]
            raise RequestValidationError(errors) from None
        try:
            out = await generate(request, chat, ns)
        except ApiError as e:
            param = e.param and responses_field(e.param, body)
            raise ApiError(e.status, responses_field(str(e), body), e.type, e.code, param) from None
        except CachecraftError as e:
            raise CachecraftError(responses_field(str(e), body)) from None
        builder = ResponseBuilder(body, chat.model or loaded.name)
        if isinstance(out, StreamingResponse):
            events = builder.events(out.body_iterator)
            return StreamingResponse(events, media_type="text/event-stream")
        if out.status_code != 200:  # the client went away
            return out
        return JSONResponse(builder.from_chat(json.loads(bytes(out.body))))

    def model_card() -> dict[str, Any]:
        return {
            "id": loaded.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "cachecraft",
            "max_model_len": max_ctx,
        }

    @app.get("/v1/models")
    async def models(_: str = Depends(namespace)) -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model}")
    async def model(model: str, _: str = Depends(namespace)) -> dict[str, Any]:
        """OpenAI's `models.retrieve`: the served model under its name or an alias."""
        if model not in model_names:
            raise ApiError(
                404,
                f"model {model!r} not found; this server serves {loaded.name!r}",
                "invalid_request_error",
                "model_not_found",
            )
        return model_card()

    # ---- tokens (vLLM's) ----------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, ns: str = Depends(namespace)) -> dict[str, Any]:
        """The prompt a chat or completion request would prefill (template, chunks, question),
        as token ids; its length is what `usage.prompt_tokens` will say. With raw completions
        a `prompt` is tokenized as vLLM does (`add_special_tokens` honoured)."""
        check_documents(body.documents)
        if body.messages is not None:
            as_request: ChatCompletionRequest | CompletionRequest = ChatCompletionRequest(
                messages=body.messages, documents=body.documents
            )
        else:
            as_request = CompletionRequest(prompt=body.prompt, documents=body.documents)
        check_fields(as_request)
        rag = to_rags(as_request, ns, config)[0]  # a raw prompt with documents: a 400 here
        if body.prompt is not None and config.raw_completions:
            encode = functools.partial(
                loaded.tokenizer, body.prompt, add_special_tokens=body.add_special_tokens
            )
            loop = asyncio.get_running_loop()
            ids = list((await loop.run_in_executor(state.tokenize, encode))["input_ids"])
        else:
            ids = list((await tokenized(rag)).token_ids)
        strs = [loaded.tokenizer.decode([t]) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_ctx, "tokens": ids, "token_strs": strs}

    @app.get("/tokenizer_info")
    async def tokenizer_info(_: str = Depends(namespace)) -> dict[str, Any]:
        """vLLM's: what a client needs to tokenize (and template) as this server does, so it
        is served only when completions are raw (`--raw-completions`): an evaluation harness
        that finds it tokenizes through `/tokenize` and sends token ids."""
        if not config.raw_completions:
            raise ApiError(
                404,
                "/tokenizer_info is served with --raw-completions (completion prompts read as "
                "given); without it a completion's text prompt is a chat turn",
                "invalid_request_error",
            )
        t = loaded.tokenizer
        return {
            "tokenizer_class": type(t).__name__,
            "eos_token": t.eos_token,
            "bos_token": t.bos_token,
            "pad_token": t.pad_token,
            "unk_token": t.unk_token,
            "chat_template": getattr(t, "chat_template", None),
            "model_max_length": max_ctx,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, _: str = Depends(namespace)) -> dict[str, Any]:
        check_vocabulary("tokens", body.tokens)
        return {"prompt": loaded.tokenizer.decode(body.tokens)}

    # ---- chunks -----------------------------------------------------------------------------
    @app.post("/v1/chunks")
    async def add_chunks(body: ChunksRequest, ns: str = Depends(namespace)) -> dict[str, Any]:
        check_documents(body.documents)
        if body.system is not None and len(body.system) > config.max_prompt_chars:
            raise ApiError(
                413,
                f"system has {len(body.system)} characters; at most {config.max_prompt_chars} "
                "are allowed (max_prompt_chars)",
                "invalid_request_error",
                "prompt_too_large",
                "system",
            )
        scope = scoped(ns, body.cache_namespace)
        await asyncio.to_thread(chunks.follow_registry, store, state.registry)
        rows = []
        for i, d in enumerate(body.documents):  # one engine call each: generation interleaves
            rag = chunks.precompute_request(d.passage, d.id, scope, body.system)
            layout = await tokenized(rag)
            try:
                rows.append(
                    await chunks.precompute_async(
                        engine, store, state.registry, rag, layout, body.pin
                    )
                )
            except PinLimitError as e:  # say what was done: the documents before it are pinned
                message = chunks.pin_refused(i, len(body.documents), e)
                raise ApiError(
                    400, message, "invalid_request_error", "pin_limit", f"documents.{i}"
                ) from None
        return {"object": "list", "data": rows}

    @app.get("/v1/chunks")
    async def list_chunks(
        ns: str = Depends(namespace), cache_namespace: NamespaceQuery = None
    ) -> dict[str, Any]:
        scope = scoped(ns, checked(cache_namespace))

        def listing() -> dict[str, Any]:  # a store lookup per chunk: off the event loop
            chunks.follow_registry(store, state.registry)
            return chunks.list_chunks(store, state.registry, scope)

        return await asyncio.to_thread(listing)

    @app.delete("/v1/chunks/{chunk_key}")
    async def delete_chunk(
        chunk_key: Annotated[str, Path(max_length=128)],
        ns: str = Depends(namespace),
        cache_namespace: NamespaceQuery = None,
    ) -> dict[str, Any]:
        scope = scoped(ns, checked(cache_namespace))
        missing = ApiError(
            404, f"chunk {chunk_key} not found in this namespace", "invalid_request_error"
        )
        if chunk_key not in state.registry.keys(scope):
            raise missing
        was_pinned = chunk_key in state.registry.pinned_keys(scope)
        try:
            removed = await asyncio.wrap_future(engine.call(lambda: store.remove(chunk_key)))
        except StoreUnavailableError as e:  # nothing removed: the client may retry
            raise ApiError(503, str(e), "server_error", "tier_unreachable") from None
        state.registry.discard(scope, chunk_key)
        state.registry.record_removal(chunk_key)  # other replicas drop their memory copies
        if removed == 0 and not was_pinned:  # a row left behind: nothing was stored (listed)
            raise missing
        return {"chunk_key": chunk_key, "deleted": True, "num_variants": removed}

    # ---- operations -------------------------------------------------------------------------
    # one route per method, so each has an operation ID of its own in the OpenAPI schema
    @app.get("/health")
    @app.head("/health")
    @app.get("/ping")
    @app.post("/ping")
    async def health() -> JSONResponse:
        """200 while the step thread is alive and no unit of its work has run longer than
        `watchdog_s`; 503 (with the reason) otherwise, so a supervisor can restart us. Also
        `HEAD /health` (uptime checkers) and vLLM's `/ping` (GET or POST: SageMaker's)."""
        live = engine.liveness()
        problem = None
        if not live.is_alive:
            problem = "the engine step thread is not running"
        elif live.busy_s is not None and live.busy_s > config.watchdog_s:
            problem = f"the engine has been busy for {live.busy_s:.0f} s (watchdog_s)"
        tiers = await asyncio.to_thread(store.health)  # may ping Redis
        body = {
            "status": "ok" if problem is None else "unavailable",
            "reason": problem,
            "tiers": {t.name: t._asdict() for t in tiers},
            "model": loaded.name,
            "dtype": str(loaded.model.dtype).removeprefix("torch."),
            "mode": engine.config.mode,
            "num_waiting": engine.num_waiting,
            "num_running": engine.num_running,
            "num_steps": live.num_steps,
            "num_failed_requests": live.num_failed_requests,
        }
        return JSONResponse(body, status_code=200 if problem is None else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's: the server's version (a client probes it to tell what it talks to)."""
        return {"version": importlib.metadata.version("cachecraft")}

    async def metrics_access(request: Request) -> None:
        if not config.metrics_public:
            namespace(request)  # raises 401 without a valid key (when keys are configured)

    @app.get("/metrics", dependencies=[Depends(metrics_access)])
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
