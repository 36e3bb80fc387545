"""Test helpers for the chunk-cache store: tiny random variants (no model needed)."""

from __future__ import annotations

import torch

from cachecraft.store.meta import VariantMeta
from cachecraft.store.variant import Variant


def make_meta(
    chunk_key: str, s_old: tuple[str, ...] = (), num_tokens: int = 8, num_layers: int = 2
) -> VariantMeta:
    return VariantMeta(
        chunk_key=chunk_key,
        prefix_key="p0",
        s_old=s_old,
        s_old_sizes=tuple(8 for _ in s_old),
        num_tokens=num_tokens,
        num_layers=num_layers,
        inter=tuple(tuple(0.1 for _ in range(num_layers)) for _ in s_old),
        intra=tuple(0.5 for _ in range(num_layers)),
        token_scores=tuple(float(t) / num_tokens for t in range(num_tokens)),
        cci=0.6,
    )


def make_variant(
    chunk_key: str,
    s_old: tuple[str, ...] = (),
    num_tokens: int = 8,
    num_layers: int = 2,
    num_heads: int = 1,
    head_dim: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Variant:
    """A variant of 2 x layers x heads x tokens x dim elements (512 bytes at the defaults)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_heads, num_tokens, head_dim)
    keys = torch.randn(shape, generator=gen).to(dtype)
    values = torch.randn(shape, generator=gen).to(dtype)
    return Variant(make_meta(chunk_key, s_old, num_tokens, num_layers), keys, values)
