"""WorkloadItem (one evaluation request plus its gold answers) and text-sizing helpers.

Owns no I/O: reading and writing workload files lives in `workloads.py`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from cachecraft.request import RagRequest

WORDS_PER_TOKEN = 0.75
"""Rough English words per model token; used only to size chunks, never to count real tokens."""


@dataclass(frozen=True, slots=True)
class WorkloadItem:
    """One request of a workload. `answers` are gold strings; `arrival_s` is offset from t=0."""

    id: str
    request: RagRequest
    answers: tuple[str, ...] | None = None
    arrival_s: float | None = None


def estimate_tokens(text: str) -> int:
    """Whitespace words / 0.75: a tokenizer-free estimate of the number of tokens in `text`."""
    return math.ceil(len(text.split()) / WORDS_PER_TOKEN)


def words_for_tokens(tokens: int) -> int:
    """How many whitespace words make about `tokens` tokens (inverse of `estimate_tokens`)."""
    return max(1, math.floor(tokens * WORDS_PER_TOKEN))


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_words(text: str, max_tokens: int) -> list[str]:
    """Cut `text` into consecutive pieces of at most ~`max_tokens` (estimated), by words."""
    words = text.split()
    step = words_for_tokens(max_tokens)
    return [" ".join(words[i : i + step]) for i in range(0, len(words), step)]


def sentences(text: str) -> list[str]:
    """Sentences of `text` (split after . ! ? followed by whitespace), whitespace normalised."""
    return [s for s in _SENTENCE_END.split(" ".join(text.split())) if s]


def split_sentences(text: str, max_tokens: int) -> list[str]:
    """Cut `text` into about equal pieces of whole sentences, each at most ~`max_tokens`.

    A sentence longer than `max_tokens` is cut by words. Pieces are balanced (a 400-token text
    with max 300 gives two of ~200, not 300 + 100) so that short tails stay rare.
    """
    max_words = words_for_tokens(max_tokens)
    units = []
    for sent in sentences(text):
        units.extend(split_words(sent, max_tokens) if len(sent.split()) > max_words else [sent])
    total = sum(len(s.split()) for s in units)
    if total == 0:
        return []
    target = math.ceil(total / math.ceil(total / max_words))
    pieces: list[list[str]] = [[]]
    size = 0
    for sent in units:
        n = len(sent.split())
        if pieces[-1] and (size >= target or size + n > max_words):
            pieces.append([])
            size = 0
        pieces[-1].append(sent)
        size += n
    return [" ".join(p) for p in pieces]
