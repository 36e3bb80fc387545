"""TokenCache: a chunk's ids tokenized once per tokenizer, kept least recently used within a
token bound; a runner lays out a request's known chunks without tokenizing them again."""

from __future__ import annotations

from typing import Any

import pytest

from cachecraft.engine.runner import Runner
from cachecraft.model.loader import LoadedModel
from cachecraft.request import Chunk, RagRequest
from cachecraft.reuse.layout import build_layout
from cachecraft.reuse.token_cache import TokenCache
from cachecraft.store.memory import MemoryStore


def test_kept_ids_come_back_and_the_least_recent_go_first() -> None:
    calls: list[str] = []

    def encode(text: str) -> tuple[int, ...]:
        calls.append(text)
        return tuple(range(len(text)))

    cache = TokenCache(max_tokens=10)
    assert cache.get("m", "abcd", encode) == (0, 1, 2, 3)
    assert cache.get("m", "abcd", encode) == (0, 1, 2, 3) and calls == ["abcd"]
    cache.get("other", "abcd", encode)  # another tokenizer: its own entry
    assert calls == ["abcd", "abcd"] and cache.num_tokens == 8
    cache.get("m", "abcd", encode)  # ("m", "abcd") is now the most recent
    cache.get("m", "xyz", encode)  # 11 tokens > 10: the least recent goes
    assert len(cache) == 2 and cache.num_tokens == 7
    cache.get("m", "abcd", encode)
    assert calls == ["abcd", "abcd", "xyz"]
    cache.get("m", "a" * 11, encode)  # longer than the bound: tokenized, not kept
    assert cache.num_tokens <= 10
    with pytest.raises(ValueError):
        TokenCache(max_tokens=-1)


class CountingTokenizer:
    """The real tokenizer, counting the texts it is asked to tokenize."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.texts: list[str] = []

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.texts.append(text)
        return self.inner(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_known_chunk_is_not_tokenized_again_and_lays_out_the_same(tiny: LoadedModel) -> None:
    counting = CountingTokenizer(tiny.tokenizer)
    chunks = [Chunk("The river runs past the tower."), Chunk("The castle has a garden.")]
    first = RagRequest("Where is the tower?", chunks)
    again = RagRequest("What does the castle have?", chunks[::-1])
    cache = TokenCache()
    build_layout(first, counting, tiny.fingerprint, tokens=cache)
    counting.texts.clear()
    cached = build_layout(again, counting, tiny.fingerprint, tokens=cache)
    assert not any(c.text in t for c in chunks for t in counting.texts)
    fresh = build_layout(again, tiny.tokenizer, tiny.fingerprint)
    assert cached == fresh
    runner = Runner(tiny, MemoryStore(1 << 20))
    runner.layout(first)
    runner.layout(again)
    assert runner.tokens.num_hits >= 2
