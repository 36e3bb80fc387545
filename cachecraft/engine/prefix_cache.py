"""PrefixCache: exact K/V of system prefixes, which always sit at positions 0..P-1."""

from __future__ import annotations

from collections import OrderedDict

import torch


class PrefixCache:
    """LRU over whole prefixes by count; entries are rotated K/V [L, Hkv, P, D]."""

    def __init__(self, max_entries: int = 16) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, k: torch.Tensor, v: torch.Tensor) -> None:
        self._entries[key] = (k, v)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
