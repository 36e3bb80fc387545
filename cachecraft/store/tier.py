"""Tier: the one shape every storage level (RamTier, DiskTier, RedisTier) shares.

A tier stores and returns whole variants and never chooses what to evict: `put` asks the
caller's `choose(residents, need_bytes)` and evicts exactly what it returns. Ranking lives in
`policy`, the cascade between tiers in `store.TieredStore`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from cachecraft.store.meta import VariantMeta
from cachecraft.store.policy import VariantStats
from cachecraft.store.variant import Variant

Chooser = Callable[[list[VariantStats], int], list[VariantStats] | None]
"""choose(residents, need_bytes) -> residents to evict, in order, or None to refuse the put.
Residents carry the tier's own byte counts (`nbytes`) and whatever statistics it keeps."""


class Tier(Protocol):
    name: str
    capacity_bytes: int

    @property
    def nbytes(self) -> int:
        """Bytes held, as this tier counts them (tensor bytes, file bytes or blob bytes)."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, variant_id: object) -> bool: ...

    def metas(self, chunk_key: str) -> list[VariantMeta]:
        """Metadata of this tier's variants of `chunk_key`; [] when unreachable."""
        ...

    def get(self, variant_id: str, device: torch.device | str = "cpu") -> Variant | None:
        """The variant, or None if absent, corrupt (then removed) or unreachable."""
        ...

    def put(self, variant: Variant, stats: VariantStats, choose: Chooser) -> list[str] | None:
        """Store `variant`, first evicting what `choose` picks when room is short. Returns the
        evicted ids, or None if it was not stored (bigger than the tier, refused by `choose`,
        or the tier is unreachable)."""
        ...

    def delete(self, variant_id: str) -> bool:
        """Drop the variant; False if it was not there."""
        ...

    def check_integrity(self) -> None:
        """Raise AssertionError unless the tier's bookkeeping is consistent."""
        ...
