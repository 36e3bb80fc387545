"""Lay a RagRequest out as [prefix][chunk 1]...[chunk k][question] through the chat template.

Each chunk is tokenized on its own (as `text + "\\n\\n"`), so its ids and key are the same
wherever it appears; a long question lends its leading token blocks to chunk slots too
(`QUESTION_BLOCK`). The template is rendered once around a sentinel to find its head (goes
into the prefix, after the system prompt) and its tail (goes after the question).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from cachecraft.errors import ContextLengthError
from cachecraft.request import RagRequest
from cachecraft.reuse.keys import chunk_key, prefix_key
from cachecraft.reuse.plan import ChunkSlot, PromptLayout

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


class TemplateParts(NamedTuple):
    head: str
    tail: str


def template_parts(tokenizer: Any, system: str) -> TemplateParts:
    """Text before and after the user message for `system` (plain fallback without template)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": SENTINEL}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        head, _, tail = text.partition(SENTINEL)
        return TemplateParts(head, tail)
    return TemplateParts(f"{system}\n\n", "\nAnswer:")


def question_text(question: str) -> str:
    """`Question: ` and the question, unless it begins so already (a RAG client's template
    that the server cut its pasted passages from often ends in "Question: ...")."""
    return question if question.startswith(QUESTION_LEAD) else QUESTION_LEAD + question


def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_layout(
    request: RagRequest, tokenizer: Any, fingerprint: str, max_tokens: int | None = None
) -> PromptLayout:
    """The request's prompt layout with chunk and prefix keys; checks the context length."""
    parts = template_parts(tokenizer, request.system)
    prefix_ids = _encode(tokenizer, parts.head)
    slots = []
    start = len(prefix_ids)
    for chunk in request.chunks:
        ids = _encode(tokenizer, chunk.text + CHUNK_SEPARATOR)
        key = chunk_key(fingerprint, request.namespace, ids)
        slots.append(ChunkSlot(key=key, label=chunk.id, token_ids=ids, start=start))
        start += len(ids)
    question_ids = _encode(tokenizer, question_text(request.question) + parts.tail)
    cut = 0  # question tokens lent to blocks so far
    while len(question_ids) - cut >= QUESTION_BLOCK + QUESTION_KEEP:
        ids = question_ids[cut : cut + QUESTION_BLOCK]
        key = chunk_key(fingerprint, request.namespace, ids)
        label = f"question[{cut}:{cut + QUESTION_BLOCK}]"
        slots.append(ChunkSlot(key=key, label=label, token_ids=ids, start=start))
        start += QUESTION_BLOCK
        cut += QUESTION_BLOCK
    question_ids = question_ids[cut:]
    layout = PromptLayout(
        prefix_key=prefix_key(fingerprint, request.namespace, prefix_ids),
        prefix_ids=prefix_ids,
        chunks=tuple(slots),
        question_ids=question_ids,
    )
    if max_tokens is not None and layout.num_tokens > max_tokens:
        raise ContextLengthError(layout.num_tokens, max_tokens)
    return layout
