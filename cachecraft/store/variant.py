"""Variant: one chunk-cache, its per-layer K/V (keys before RoPE) plus its VariantMeta."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachecraft.store.meta import VariantMeta


@dataclass(slots=True)
class Variant:
    """K/V of one chunk computed after `meta.s_old`.

    keys, values: [num_layers, num_kv_heads, num_tokens, head_dim]. Keys are stored *before*
    RoPE so that the runner can rotate them to whatever positions the chunk takes next.
    """

    meta: VariantMeta
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def variant_id(self) -> str:
        return self.meta.variant_id

    @property
    def chunk_key(self) -> str:
        return self.meta.chunk_key

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + (
            self.values.numel() * self.values.element_size()
        )

    def is_finite(self) -> bool:
        """No NaN or infinity in K or V (a layer at a time: no full-size temporary)."""
        return all(
            bool(
                torch.isfinite(self.keys[layer]).all() and torch.isfinite(self.values[layer]).all()
            )
            for layer in range(self.keys.shape[0])
        )

    def __post_init__(self) -> None:
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise ValueError(f"keys {tuple(self.keys.shape)} / values {tuple(self.values.shape)}")
        if self.keys.shape[0] != self.meta.num_layers or self.keys.shape[2] != self.meta.num_tokens:
            raise ValueError("K/V shape disagrees with the variant's metadata")
