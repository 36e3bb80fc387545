"""Lay a RagRequest out as [prefix][chunk 1]...[chunk k][question] through the chat template.

Each chunk is tokenized on its own (as `text + "\\n\\n"`), so its ids and key are the same
wherever it appears; a long question lends its leading token blocks to chunk slots too
(`QUESTION_BLOCK`). The template is rendered around a sentinel to find its head (goes into the
prefix, after the system prompt) and its tail (goes after the question). Context carried by
the system message (`RagRequest.system_chunks`) is chunks inside the system turn: the head
then ends where they begin, and the template's end of the system turn is a slot of its own.
A raw request (`RagRequest.raw`: a prompt read as given, no template) has an empty prefix and
is all question, its leading blocks lent to chunk slots as a long question's are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from cachecraft.errors import ContextLengthError
from cachecraft.request import RagRequest
from cachecraft.reuse.keys import chunk_key, prefix_key
from cachecraft.reuse.plan import ChunkSlot, PromptLayout
from cachecraft.reuse.token_cache import TokenCache

SENTINEL = "\x00CACHECRAFT\x00"
CHUNK_SEPARATOR = "\n\n"
QUESTION_LEAD = "Question: "
QUESTION_BLOCK = 64
QUESTION_KEEP = 16
"""A question (with the template tail) of QUESTION_BLOCK + QUESTION_KEEP tokens or more lends
its leading blocks of QUESTION_BLOCK tokens to chunk slots, cut at token boundaries (no
separator: the model reads the same tokens), and keeps its last QUESTION_KEEP to
QUESTION_KEEP + QUESTION_BLOCK - 1 tokens (what the probe reads; the query is usually last).
A long prompt sent again, or with its long beginning shared, is then reused as vLLM's prefix
cache reuses it."""


SYSTEM_SENTINEL = "\x00CACHECRAFT-SYSTEM\x00"
SYSTEM_END = "template"
"""Label of the slot between a system message's chunks and the user message (the template's
end of the system turn, e.g. `<|im_end|>\n<|im_start|>user\n`): the same tokens in every
request, so it is a chunk-cache of its own."""


class TemplateParts(NamedTuple):
    """head: before the user message (or before the system chunks when `middle` is not None);
    middle: between the system chunks and the user message; tail: after the user message."""

    head: str
    tail: str
    middle: str | None = None


def _render(tokenizer: Any, system: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": SENTINEL}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return f"{system}\n\n{SENTINEL}\nAnswer:"  # plain fallback without a template


def template_parts(tokenizer: Any, system: str, system_chunks: bool = False) -> TemplateParts:
    """Text around the user message for `system`. With `system_chunks`, the system message is
    `system` (and a blank line, when not empty) followed by the chunks, and `head` ends where
    they begin, `middle` runs from after them to the user message; a template that does not
    render the system message before the user message gives `middle` None (the chunks then
    open the user message)."""
    if system_chunks:
        lead = f"{system}\n\n" if system else ""
        text = _render(tokenizer, lead + SYSTEM_SENTINEL)
        before, _, tail = text.partition(SENTINEL)
        head, found, middle = before.partition(SYSTEM_SENTINEL)
        if found:
            return TemplateParts(head, tail, middle)
    head, _, tail = _render(tokenizer, system).partition(SENTINEL)
    return TemplateParts(head, tail)


def question_text(question: str) -> str:
    """`Question: ` and the question, unless it begins so already (a RAG client's template
    that the server cut its pasted passages from often ends in "Question: ...")."""
    return question if question.startswith(QUESTION_LEAD) else QUESTION_LEAD + question


def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def _known_encoder(
    tokenizer: Any, fingerprint: str, tokens: TokenCache | None
) -> Callable[[str], tuple[int, ...]]:
    """`_encode` through `tokens` (texts that recur: chunks, system prompts; a question is
    new in every request and is tokenized as it comes)."""

    def encode(text: str) -> tuple[int, ...]:
        return _encode(tokenizer, text)

    if tokens is None:
        return encode
    return lambda text: tokens.get(fingerprint, text, encode)


def _blocks(num_tokens: int) -> list[tuple[int, int]]:
    """The leading QUESTION_BLOCK-token blocks a question of `num_tokens` tokens lends."""
    out: list[tuple[int, int]] = []
    while num_tokens - len(out) * QUESTION_BLOCK >= QUESTION_BLOCK + QUESTION_KEEP:
        a = len(out) * QUESTION_BLOCK
        out.append((a, a + QUESTION_BLOCK))
    return out


def _raw_layout(request: RagRequest, tokenizer: Any, fingerprint: str) -> PromptLayout:
    """The prompt's own ids (`prompt_ids`, or the question tokenized with the special tokens
    the tokenizer adds, as vLLM tokenizes a completion's prompt): no prefix, the leading blocks
    as chunk slots, the rest the question."""
    ids = request.prompt_ids or tuple(tokenizer(request.question)["input_ids"])
    slots = []
    for a, b in _blocks(len(ids)):
        key = chunk_key(fingerprint, request.namespace, ids[a:b])
        slots.append(ChunkSlot(key=key, label=f"prompt[{a}:{b}]", token_ids=ids[a:b], start=a))
    cut = slots[-1].end if slots else 0
    return PromptLayout(
        prefix_key=prefix_key(fingerprint, request.namespace, ()),
        prefix_ids=(),
        chunks=tuple(slots),
        question_ids=ids[cut:],
    )


def build_layout(
    request: RagRequest,
    tokenizer: Any,
    fingerprint: str,
    max_tokens: int | None = None,
    tokens: TokenCache | None = None,
) -> PromptLayout:
    """The request's prompt layout with chunk and prefix keys; checks the context length.
    `tokens`: where the ids of chunks and system prompts tokenized before are kept (keyed by
    `fingerprint`, the model's: one tokenizer per fingerprint); None: tokenize everything."""
    layout = (
        _raw_layout(request, tokenizer, fingerprint)
        if request.raw
        else _chat_layout(request, tokenizer, fingerprint, tokens)
    )
    if max_tokens is not None and layout.num_tokens > max_tokens:
        raise ContextLengthError(layout.num_tokens, max_tokens)
    return layout


def _chat_layout(
    request: RagRequest, tokenizer: Any, fingerprint: str, tokens: TokenCache | None
) -> PromptLayout:
    """[system prompt and template head][chunks][question and template tail]."""
    parts = template_parts(tokenizer, request.system, bool(request.system_chunks))
    known = _known_encoder(tokenizer, fingerprint, tokens)
    prefix_ids = known(parts.head)
    slots: list[ChunkSlot] = []

    def add(ids: tuple[int, ...], label: str | None) -> None:
        start = slots[-1].end if slots else len(prefix_ids)
        key = chunk_key(fingerprint, request.namespace, ids)
        slots.append(ChunkSlot(key=key, label=label, token_ids=ids, start=start))

    for chunk in request.system_chunks:
        add(known(chunk.text + CHUNK_SEPARATOR), chunk.id)
    if parts.middle:
        add(known(parts.middle), SYSTEM_END)

    def lend(ids: tuple[int, ...], label: str) -> int:
        """Slots for the leading blocks of a question's `ids`; how many tokens they took."""
        blocks = _blocks(len(ids))
        for a, b in blocks:
            add(ids[a:b], f"{label}[{a}:{b}]")
        return blocks[-1][1] if blocks else 0

    for chunk in request.chunks:
        if chunk.as_question:  # the blocks it lent as the question, then the rest
            ids = _encode(tokenizer, question_text(chunk.text) + CHUNK_SEPARATOR)
            cut = lend(ids, chunk.id or "chunk")
            add(ids[cut:], f"{chunk.id or 'chunk'}[{cut}:]")
        else:
            add(known(chunk.text + CHUNK_SEPARATOR), chunk.id)
    question_ids = _encode(tokenizer, question_text(request.question) + parts.tail)
    question_ids = question_ids[lend(question_ids, "question") :]
    return PromptLayout(
        prefix_key=prefix_key(fingerprint, request.namespace, prefix_ids),
        prefix_ids=prefix_ids,
        chunks=tuple(slots),
        question_ids=question_ids,
    )
