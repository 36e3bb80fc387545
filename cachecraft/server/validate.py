"""Request checks the pydantic models cannot make alone (they need the server's limits, the
model's vocabulary or the engine's modes), as plain functions raising `ApiError`: each names
the field it refuses. Run before anything is tokenized or submitted."""

from __future__ import annotations

from collections.abc import Sequence

from cachecraft.reuse.strategy import ReuseStrategy
from cachecraft.server.config import ServerConfig
from cachecraft.server.errors import ApiError, refuse
from cachecraft.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Document,
    unsupported_fields,
)
from cachecraft.server.state import ServerState


def check_model(state: ServerState, body: ChatCompletionRequest | CompletionRequest) -> None:
    """404 for a model this server does not serve; a missing `model` becomes the served one."""
    if body.model is None:
        body.model = state.loaded.name
    elif body.model not in state.model_names:
        raise model_not_found(state, body.model)


def model_not_found(state: ServerState, model: str) -> ApiError:
    return ApiError(
        404,
        f"model {model!r} not found; this server serves {state.loaded.name!r}",
        "invalid_request_error",
        "model_not_found",
    )


def check_mode(
    state: ServerState, body: ChatCompletionRequest | CompletionRequest
) -> ReuseStrategy:
    """The reuse strategy the request runs with (its own, else the server's), resolved here
    once: nothing below sees its name."""
    name = body.cachecraft_mode or state.engine.config.mode
    strategies = state.engine.strategies
    if name not in strategies:
        raise ApiError(
            400,
            f"cachecraft_mode {name!r}: choose one of {', '.join(strategies.names())}",
            "invalid_request_error",
        )
    return strategies.get(name)


def check_fields(state: ServerState, body: ChatCompletionRequest | CompletionRequest) -> None:
    """Unsupported fields named, a completion's prompt count and token ids, the text's size."""
    config = state.config
    refuse(unsupported_fields(body))
    if isinstance(body, CompletionRequest):
        prompts = body.prompts()
        if len(prompts) > config.max_prompts:
            raise ApiError(
                400,
                f"prompt: {len(prompts)} prompts; at most {config.max_prompts} are allowed "
                "in one request (max_prompts)",
                "invalid_request_error",
                "too_many_prompts",
                "prompt",
            )
        texts = [("prompt", p) for p in prompts if isinstance(p, str)]
        for p in prompts:
            if not isinstance(p, str):
                check_vocabulary(state, "prompt", p)
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


def check_vocabulary(state: ServerState, name: str, ids: Sequence[int]) -> None:
    """400 naming `name` when a token id is past the model's vocabulary."""
    vocab = state.loaded.arch.vocab_size
    outside = [t for t in ids if t >= vocab]
    if outside:
        raise ApiError(
            400,
            f"{name}: token {outside[0]} is not in the vocabulary (ids 0-{vocab - 1})",
            "invalid_request_error",
            param=name,
        )


def check_documents(config: ServerConfig, documents: list[Document]) -> None:
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


def check_system(config: ServerConfig, system: str | None) -> None:
    """A precompute's `system` text within `max_prompt_chars`."""
    if system is not None and len(system) > config.max_prompt_chars:
        raise ApiError(
            413,
            f"system has {len(system)} characters; at most {config.max_prompt_chars} "
            "are allowed (max_prompt_chars)",
            "invalid_request_error",
            "prompt_too_large",
            "system",
        )
