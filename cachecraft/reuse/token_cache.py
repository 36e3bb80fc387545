"""TokenCache: token ids of texts tokenized before, so a known chunk is never tokenized again.

A chunk is tokenized on its own (reuse/layout.py), so its ids depend only on its text and the
tokenizer: a RAG workload sends the same passages over and over, and tokenizing them again is
host time on every request's path to its first token, which a GPU cannot hide.
Entries are keyed by (tokenizer fingerprint, text), bounded by the tokens they hold and
evicted least recently used. Thread-safe: requests are laid out on the server's threads and
the engine's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

DEFAULT_MAX_TOKENS = 1 << 21
"""Token ids kept at most: about 2,000 distinct 1,000-token passages, tens of MiB as Python
tuples (a bound in tokens, not entries, so long passages cannot grow it past that)."""


class TokenCache:
    """LRU map (fingerprint, text) -> token ids, at most `max_tokens` ids in all (a text
    longer than that is tokenized and not kept)."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._num_tokens = 0
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    def get(
        self, fingerprint: str, text: str, encode: Callable[[str], tuple[int, ...]]
    ) -> tuple[int, ...]:
        """The ids of `text` under the tokenizer `fingerprint` names: kept ones, else
        `encode(text)` (outside the lock: tokenizing may take milliseconds), then kept."""
        key = (fingerprint, text)
        with self._lock:
            ids = self._entries.get(key)
            if ids is not None:
                self._entries.move_to_end(key)
                self.num_hits += 1
                return ids
            self.num_misses += 1
        ids = encode(text)
        if len(ids) > self.max_tokens:
            return ids
        with self._lock:
            if key not in self._entries:
                self._entries[key] = ids
                self._num_tokens += len(ids)
                while self._num_tokens > self.max_tokens:
                    _, old = self._entries.popitem(last=False)
                    self._num_tokens -= len(old)
        return ids

    @property
    def num_tokens(self) -> int:
        """Token ids held now."""
        return self._num_tokens

    def __len__(self) -> int:
        return len(self._entries)
