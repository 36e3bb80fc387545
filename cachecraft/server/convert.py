"""Request bodies to what the engine takes: a chat or completion body -> one RagRequest per
prompt (system, chunks from history, documents and pasted context, the question) and its
SamplingParams (the server's defaults filled in; each of `n` choices its own seed)."""

from __future__ import annotations

import dataclasses
from typing import Any

from cachecraft.engine.sampling import SamplingParams
from cachecraft.errors import BadRequestError
from cachecraft.request import Chunk, RagRequest
from cachecraft.server.config import ServerConfig
from cachecraft.server.protocol import (
    SEED_MAX,
    ChatCompletionRequest,
    CompletionRequest,
    Document,
)
from cachecraft.server.split import history_chunks, pasted_chunks


def to_rag(
    body: ChatCompletionRequest | CompletionRequest,
    namespace: str,
    config: ServerConfig | None = None,
) -> RagRequest:
    """system messages -> system, and the context pasted into them (retrieved passages, as
    LangChain's and LlamaIndex's chat prompts put them there) -> system chunks (`pasted_chunks`
    of the whole message); earlier turns (tool results included) -> chunks
    (`history_chunks`), then the documents -> chunks; the last user message (a completion's
    prompt) -> chunks of the context pasted into it (`pasted_chunks` with the server's
    `pasted_chunk_chars`, none when 0, and `max_document_chars`), the rest of it -> the
    question. Turns after it (a tool call and its results: retrieval as a tool) join the
    earlier ones, so the results are chunks read before the question they answer."""
    config = config or ServerConfig()
    if isinstance(body, CompletionRequest):
        prompts = body.prompts()
        if len(prompts) != 1:
            raise BadRequestError("prompt: give one prompt here (to_rags takes a list of them)")
        return _completion_rag(prompts[0], body, namespace, config)
    split = config.pasted_chunk_chars, config.max_document_chars
    chunks = _chunks(body.documents)
    system = "\n".join(m.text() for m in body.messages if m.role in ("system", "developer"))
    turns = [(i, m) for i, m in enumerate(body.messages) if m.role in ("user", "assistant", "tool")]
    asked = max((k for k, (_, m) in enumerate(turns) if m.role == "user"), default=None)
    if asked is None:
        raise BadRequestError("messages: there is no user message; give the question as one")
    after = turns[asked + 1 :]  # a tool call's turns: the assistant's call, the tool's results
    if after and after[-1][1].role != "tool":
        raise BadRequestError(
            f"messages: the last message (after any system ones) must be the user's question "
            f"or a tool's result for it, not {after[-1][1].role!r}: this server answers a "
            f"user's question"
        )
    last, message = turns[asked]
    if not message.text().strip():
        raise BadRequestError(
            f"messages.{last}.content: the user's message, the question, is empty"
        )
    history = history_chunks([(i, m.role, m.text()) for i, m in turns[:asked] + after], *split)
    where = f"messages[{last}]"
    pasted, question = pasted_chunks(message.text(), where, *split)
    in_system, rest = pasted_chunks(system, "system", *split, keep_question=False)
    if rest.strip():  # a passage over max_document_chars: the system message stays whole
        in_system = []
    return RagRequest(
        question,
        history + chunks + pasted,
        system="" if in_system else system or None,
        namespace=namespace,
        system_chunks=in_system,
    )


def to_rags(
    body: ChatCompletionRequest | CompletionRequest,
    namespace: str,
    config: ServerConfig | None = None,
) -> list[RagRequest]:
    """One RagRequest per prompt (`to_rag`): a completion may send a list of prompts (OpenAI's
    batched prompts, as LangChain's completion model sends them), each with the documents."""
    if isinstance(body, ChatCompletionRequest):
        return [to_rag(body, namespace, config)]
    config = config or ServerConfig()
    return [_completion_rag(p, body, namespace, config) for p in body.prompts()]


def _completion_rag(
    prompt: str | list[int], body: CompletionRequest, namespace: str, config: ServerConfig
) -> RagRequest:
    """One completion prompt: read as given (token ids, `echo`, `raw_completions`: no template,
    no chunks), else the documents, then the context pasted into it, as chunks."""
    if isinstance(prompt, str) and not prompt.strip():
        raise BadRequestError("prompt: is empty")  # as the engine reads it, raw or not
    if not isinstance(prompt, str) or body.echo or config.raw_completions:
        if body.documents:
            raise BadRequestError(
                "documents: a prompt read as given (token ids, echo or --raw-completions) "
                "takes no documents; put them in the prompt"
            )
        if isinstance(prompt, str):
            return RagRequest(prompt, namespace=namespace, raw=True)
        return RagRequest("", namespace=namespace, prompt_ids=prompt)
    split = config.pasted_chunk_chars, config.max_document_chars
    pasted, question = pasted_chunks(prompt, "prompt", *split)
    return RagRequest(question, _chunks(body.documents) + pasted, namespace=namespace)


def _chunks(documents: list[Document]) -> list[Chunk]:
    return [Chunk(d.passage, d.label) for d in documents]


def sampling_of(body: ChatCompletionRequest | CompletionRequest, defaults: Any) -> SamplingParams:
    max_tokens = body.max_completion_tokens or body.max_tokens or defaults.default_max_tokens
    temperature = defaults.default_temperature if body.temperature is None else body.temperature
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=0 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else float(body.min_p),
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        stop=body.stop_strings(),
        logprobs=body.logprobs_k(),
        prompt_logprobs=body.prompt_logprobs,
        presence_penalty=float(body.presence_penalty or 0),
        frequency_penalty=float(body.frequency_penalty or 0),
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=tuple((int(t), float(b)) for t, b in (body.logit_bias or {}).items()),
        min_tokens=body.min_tokens or 0,
        stop_token_ids=tuple(body.stop_token_ids or ()),
    )


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of `n`: the request's seed plus the index (so seeded choices differ and
    repeat), the same settings otherwise; greedy choices are all the same answer."""
    if index == 0 or sampling.seed is None:
        return sampling
    seed = sampling.seed + index if sampling.seed + index <= SEED_MAX else sampling.seed - index
    return dataclasses.replace(sampling, seed=seed)
