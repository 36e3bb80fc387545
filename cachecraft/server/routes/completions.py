"""POST /v1/chat/completions, /v1/completions and /v1/responses (the last over the chat path:
server/responses.py). `generate` checks the request, turns it into engine requests (one per
prompt and choice), submits them all or none, and answers (server/generation.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from cachecraft.errors import CachecraftError
from cachecraft.server import chunks
from cachecraft.server.auth import Namespace, salted, scoped
from cachecraft.server.convert import choice_sampling, sampling_of, to_rags
from cachecraft.server.errors import ApiError, refuse
from cachecraft.server.generation import Generation, respond
from cachecraft.server.protocol import ChatCompletionRequest, CompletionRequest
from cachecraft.server.responses import (
    ResponseBuilder,
    ResponsesRequest,
    responses_field,
    responses_loc,
)
from cachecraft.server.state import ServerState, State
from cachecraft.server.validate import (
    check_documents,
    check_fields,
    check_mode,
    check_model,
    check_vocabulary,
)

router = APIRouter()


async def generate(
    state: ServerState,
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    base_ns: str,
) -> Response:
    engine, config = state.engine, state.config
    check_model(state, body)
    mode = check_mode(state, body)
    check_fields(state, body)
    check_documents(config, body.documents)
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
        await asyncio.to_thread(chunks.follow_registry, state.store, state.registry, state.owner)
    sampling = sampling_of(body, config)
    check_vocabulary(state, "logit_bias", [t for t, _ in sampling.logit_bias])
    check_vocabulary(state, "stop_token_ids", sampling.stop_token_ids)
    layouts = [await state.layout(rag) for rag in rags]
    echoes: list[str | None] = [None] * len(rags)
    hide = False  # `max_tokens: 0` with echo: one token is made, none shown
    if isinstance(body, CompletionRequest) and body.echo:
        decode = state.loaded.tokenizer.decode
        for i, p in enumerate(body.prompts()):  # token ids decoded off the event loop
            echoes[i] = p if isinstance(p, str) else await state.off_loop(decode, p)
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
                gens.append(
                    Generation(
                        state,
                        handle,
                        chat,
                        body.model or state.loaded.name,
                        ns,
                        sampling.stop,
                        p * n + i,
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


@router.post("/v1/chat/completions")
async def chat(
    request: Request, body: ChatCompletionRequest, ns: Namespace, state: State
) -> Response:
    return await generate(state, request, body, ns)


@router.post("/v1/completions")
async def completions(
    request: Request, body: CompletionRequest, ns: Namespace, state: State
) -> Response:
    return await generate(state, request, body, ns)


@router.post("/v1/responses")
async def responses(
    request: Request, body: ResponsesRequest, ns: Namespace, state: State
) -> Response:
    """OpenAI's Responses API over the chat path (server/responses.py)."""
    refuse(body.refused())
    try:
        chat = ChatCompletionRequest.model_validate(body.to_chat())
    except ValidationError as e:  # named as the Responses request's fields
        errors = [{**x, "loc": ("body", *responses_loc(x["loc"], body))} for x in e.errors()]
        raise RequestValidationError(errors) from None
    try:
        out = await generate(state, request, chat, ns)
    except ApiError as e:
        param = e.param and responses_field(e.param, body)
        raise ApiError(e.status, responses_field(str(e), body), e.type, e.code, param) from None
    except CachecraftError as e:
        raise CachecraftError(responses_field(str(e), body)) from None
    builder = ResponseBuilder(body, chat.model or state.loaded.name)
    if isinstance(out, StreamingResponse):
        events = builder.events(out.body_iterator)
        return StreamingResponse(events, media_type="text/event-stream")
    if out.status_code != 200:  # the client went away
        return out
    return JSONResponse(builder.from_chat(json.loads(bytes(out.body))))
