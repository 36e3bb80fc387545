"""Serving traces: Poisson arrival times and the HTTP request bodies replayed by the load generator.

`rag_trace` makes chat-completion bodies for our server (documents as an extension field, or
the passages pasted into the user or the system message, as most RAG clients send them);
`vllm_trace` makes `/v1/completions` bodies whose prompt is the token id list of exactly the
prompt layout our engine builds, so both servers prefill the same tokens. Owns no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cachecraft.api import chat_request, prompt_token_ids
from cachecraft.errors import BadRequestError
from cachecraft.request import RagRequest
from cachecraft_bench.item import WorkloadItem

PASTED_TEMPLATE = (
    "Use the following pieces of context to answer the question at the end. If you don't know "
    "the answer, just say that you don't know, don't try to make up an answer.\n\n"
    "{context}\n\nQuestion: {question}\nHelpful Answer:"
)
"""LangChain's classic "stuff" question-answering prompt, the passages joined by blank lines:
how a RAG client that never heard of `documents` sends them."""

SYSTEM_TEMPLATE = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
    "context to answer the question. If you don't know the answer, say that you don't know. "
    "Use three sentences maximum and keep the answer concise.\n\n{context}"
)
"""The system prompt of LangChain's retrieval-chain tutorial: the passages (joined by blank
lines) in the system message, the user message the bare question."""

LLAMAINDEX_TEMPLATE = (
    "Context information is below.\n---------------------\n{context}\n---------------------\n"
    "Given the context information and not prior knowledge, answer the query.\n"
    "Query: {question}\nAnswer: "
)
"""LlamaIndex's default question-answering prompt (its heading straight above the first
passage, the passages joined by blank lines), sent as the user message."""

CLIENTS = ("documents", "pasted", "system", "llamaindex")
"""How a trace's chat bodies carry each request's passages: our `documents` field, pasted into
the user message (`PASTED_TEMPLATE`, `LLAMAINDEX_TEMPLATE`), or in the system message
(`SYSTEM_TEMPLATE`)."""

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: sent `arrival_s` seconds after the run starts, to `path`."""

    arrival_s: float
    body: dict[str, Any]
    path: str = CHAT_PATH
    id: str = ""


def poisson_arrivals(n: int, rate_per_s: float, seed: int) -> list[float]:
    """`n` arrival times of a Poisson process of `rate_per_s`, the first at 0.0 (so the n-1 gaps
    are i.i.d. exponential with mean 1/rate). Deterministic for a given seed."""
    if n < 0:
        raise BadRequestError(f"the number of arrivals must be >= 0, got {n}")
    if not rate_per_s > 0:
        raise BadRequestError(f"the arrival rate must be > 0, got {rate_per_s}")
    if n == 0:
        return []
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def _arrivals(items: Sequence[WorkloadItem], rate: float | None, seed: int) -> list[float]:
    if rate is not None:
        return poisson_arrivals(len(items), rate, seed)
    return [it.arrival_s or 0.0 for it in items]


def client_messages(request: RagRequest, client: str) -> list[dict[str, str]]:
    """`request` as the chat messages `client` (one of `CLIENTS`) sends: with "documents" the
    passages are not in them (they go in the documents field)."""
    if client not in CLIENTS:
        raise BadRequestError(f"unknown client {client!r}; choose one of {', '.join(CLIENTS)}")
    context = "\n\n".join(c.text for c in request.chunks)
    system, user = request.system, request.question
    if client == "system":
        system = SYSTEM_TEMPLATE.format(context=context)
    elif client != "documents":
        template = PASTED_TEMPLATE if client == "pasted" else LLAMAINDEX_TEMPLATE
        user = template.format(context=context, question=request.question)
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def as_served(request: RagRequest, client: str) -> RagRequest:
    """What our server makes of `request` sent as `client` sends it (pasted context cut into
    chunks): the request whose layout vLLM is sent for that client's trace."""
    if client == "documents":
        return request
    return chat_request(client_messages(request, client), namespace=request.namespace)


def chat_body(
    request: RagRequest,
    mode: str | None = None,
    max_tokens: int = 32,
    model: str = "cachecraft",
    namespace: str | None = None,
    ignore_eos: bool = False,
    client: str = "documents",
) -> dict[str, Any]:
    """A streamed, greedy chat-completion body for our server: the passages as `client` sends
    them (`client_messages`; "documents": in our documents field)."""
    documents = [{"id": c.id, "text": c.text} if c.id else {"text": c.text} for c in request.chunks]
    body = _streamed_greedy(model, max_tokens, ignore_eos)
    body["messages"] = client_messages(request, client)
    body["documents"] = documents if client == "documents" else []
    body["cache_namespace"] = namespace or request.namespace
    if mode is not None:
        body["cachecraft_mode"] = mode
    return body


def _streamed_greedy(model: str, max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    """What every body here asks for: greedy, streamed, usage in the last chunk."""
    body: dict[str, Any] = {
        "model": model,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def rag_trace(
    items: Sequence[WorkloadItem],
    rate: float | None,
    seed: int,
    mode: str | None = None,
    max_tokens: int = 32,
    model: str = "cachecraft",
    namespace: str | None = None,
    ignore_eos: bool = False,
    client: str = "documents",
) -> list[TraceRequest]:
    """Chat-completion requests for our server, Poisson at `rate` (None: the items' own
    `arrival_s`). `namespace` overrides each request's cache namespace (a fresh one per run
    gives every run an empty cache on a shared server); `client`: see `chat_body`."""
    arrivals = _arrivals(items, rate, seed)
    return [
        TraceRequest(
            arrival_s=t,
            body=chat_body(it.request, mode, max_tokens, model, namespace, ignore_eos, client),
            path=CHAT_PATH,
            id=it.id,
        )
        for it, t in zip(items, arrivals, strict=True)
    ]


def layout_token_ids(request: RagRequest, tokenizer: Any) -> list[int]:
    """The prompt token ids our engine prefills for `request` (see `prompt_token_ids`)."""
    return prompt_token_ids(request, tokenizer)


def completions_body(
    prompt_ids: list[int],
    max_tokens: int = 32,
    model: str = "cachecraft",
    cache_salt: str | None = None,
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """A streamed, greedy `/v1/completions` body with a token-id prompt (vLLM)."""
    body = _streamed_greedy(model, max_tokens, ignore_eos)
    body["prompt"] = prompt_ids
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def vllm_trace(
    items: Sequence[WorkloadItem],
    rate: float | None,
    seed: int,
    tokenizer: Any,
    model: str = "cachecraft",
    max_tokens: int = 32,
    cache_salt: str | None = None,
    ignore_eos: bool = False,
    client: str = "documents",
) -> list[TraceRequest]:
    """The same arrivals as `rag_trace(items, rate, seed, client=client)` as vLLM completion
    requests whose prompt is `layout_token_ids` of what our server makes of each.
    `cache_salt` isolates a run's prefix cache in vLLM."""
    arrivals = _arrivals(items, rate, seed)
    return [
        TraceRequest(
            arrival_s=t,
            body=completions_body(
                layout_token_ids(as_served(it.request, client), tokenizer),
                max_tokens,
                model,
                cache_salt,
                ignore_eos,
            ),
            path=COMPLETIONS_PATH,
            id=it.id,
        )
        for it, t in zip(items, arrivals, strict=True)
    ]
