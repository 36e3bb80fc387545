"""Lay a RagRequest out as [prefix][chunk 1]...[chunk k][question] through the chat template.

Each chunk is tokenized on its own (as `text + "\\n\\n"`), so its ids and key are the same
wherever it appears. The template is rendered once around a sentinel to find its head (goes
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
    layout = PromptLayout(
        prefix_key=prefix_key(fingerprint, request.namespace, prefix_ids),
        prefix_ids=prefix_ids,
        chunks=tuple(slots),
        question_ids=question_ids,
    )
    if max_tokens is not None and layout.num_tokens > max_tokens:
        raise ContextLengthError(layout.num_tokens, max_tokens)
    return layout
