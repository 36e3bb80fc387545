"""GET /v1/models (and /v1/models/{model}) and vLLM's token routes: POST /tokenize,
POST /detokenize, GET /tokenizer_info."""

from __future__ import annotations

import functools
import time
from typing import Any

from fastapi import APIRouter

from cachecraft.server.auth import Namespace
from cachecraft.server.convert import to_rags
from cachecraft.server.errors import ApiError
from cachecraft.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from cachecraft.server.state import ServerState, State
from cachecraft.server.validate import (
    check_documents,
    check_fields,
    check_vocabulary,
    model_not_found,
)

router = APIRouter()


def model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.loaded.name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "cachecraft",
        "max_model_len": state.max_ctx,
    }


@router.get("/v1/models")
async def models(_: Namespace, state: State) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(state)]}


@router.get("/v1/models/{model}")
async def model(model: str, _: Namespace, state: State) -> dict[str, Any]:
    """OpenAI's `models.retrieve`: the served model under its name or an alias."""
    if model not in state.model_names:
        raise model_not_found(state, model)
    return model_card(state)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, ns: Namespace, state: State) -> dict[str, Any]:
    """The prompt a chat or completion request would prefill (template, chunks, question),
    as token ids; its length is what `usage.prompt_tokens` will say. With raw completions
    a `prompt` is tokenized as vLLM does (`add_special_tokens` honoured)."""
    config, tokenizer = state.config, state.loaded.tokenizer
    check_documents(config, body.documents)
    if body.messages is not None:
        as_request: ChatCompletionRequest | CompletionRequest = ChatCompletionRequest(
            messages=body.messages, documents=body.documents
        )
    else:
        as_request = CompletionRequest(prompt=body.prompt, documents=body.documents)
    check_fields(state, as_request)
    rag = to_rags(as_request, ns, config)[0]  # a raw prompt with documents: a 400 here
    if body.prompt is not None and config.raw_completions:
        encode = functools.partial(
            tokenizer, body.prompt, add_special_tokens=body.add_special_tokens
        )
        ids = list((await state.off_loop(encode))["input_ids"])
    else:
        ids = list((await state.layout(rag)).token_ids)
    strs = [tokenizer.decode([t]) for t in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_ctx, "tokens": ids, "token_strs": strs}


@router.get("/tokenizer_info")
async def tokenizer_info(_: Namespace, state: State) -> dict[str, Any]:
    """vLLM's: what a client needs to tokenize (and template) as this server does, so it
    is served only when completions are raw (`--raw-completions`): an evaluation harness
    that finds it tokenizes through `/tokenize` and sends token ids."""
    if not state.config.raw_completions:
        raise ApiError(
            404,
            "/tokenizer_info is served with --raw-completions (completion prompts read as "
            "given); without it a completion's text prompt is a chat turn",
            "invalid_request_error",
        )
    t = state.loaded.tokenizer
    return {
        "tokenizer_class": type(t).__name__,
        "eos_token": t.eos_token,
        "bos_token": t.bos_token,
        "pad_token": t.pad_token,
        "unk_token": t.unk_token,
        "chat_template": getattr(t, "chat_template", None),
        "model_max_length": state.max_ctx,
    }


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, _: Namespace, state: State) -> dict[str, Any]:
    check_vocabulary(state, "tokens", body.tokens)
    return {"prompt": state.loaded.tokenizer.decode(body.tokens)}
