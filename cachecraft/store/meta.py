"""VariantMeta: the metadata of one chunk-cache variant (cache-craft.md §2). Torch-free.

The planner reads only this; the K/V tensors live in `variant.Variant`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def variant_id_of(
    chunk_key: str, prefix_key: str, s_old: tuple[str, ...], is_exact: bool = True
) -> str:
    """Stable id of the variant of `chunk_key` computed after prefix `prefix_key` and the chunks
    `s_old` (in order). An approximate variant (computed after reused, not exact, K/V) gets an
    id of its own, so an exact one of the same context can still be stored beside it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(chunk_key.encode() + b"\x01" + prefix_key.encode())
    for key in s_old:
        h.update(b"\x00" + key.encode())
    if not is_exact:
        h.update(b"\x02approximate")
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class VariantMeta:
    """What was measured when a chunk was prefilled in full after `s_old`.

    inter[j][k]: head-averaged attention mass, summed over this chunk's tokens, that the k-th
                 measured layer put on the tokens of s_old[j] (the system prefix is never in
                 s_old).
    intra[k]:    the same mass on the chunk's own tokens (causal, m <= k).
    stats_layers: the layers measured, ascending (inter and intra hold one value per entry);
                 () for every layer 0..num_layers-1 (and for metadata stored before the field).
    token_scores[t]: per token, mean over the measured layers of its mass on all s_old chunks
                 (ranks recompute in `cachecraft-paper`).
    cci:         Cache Context Impact, in [0.5, 1).
    prefix_key:  hash of the system-prefix token ids it was computed after.
    is_exact:    its K/V equal a full prefill of [prefix, s_old..., chunk]: it was computed in
                 full after chunks that were themselves exact. Only then may it stand in for
                 exact K/V (`prefix` mode); an approximate variant is still a fine reuse source.
                 False for metadata stored before the flag existed.
    """

    chunk_key: str
    prefix_key: str
    s_old: tuple[str, ...]
    s_old_sizes: tuple[int, ...]
    num_tokens: int
    num_layers: int
    inter: tuple[tuple[float, ...], ...]
    intra: tuple[float, ...]
    token_scores: tuple[float, ...]
    cci: float
    is_exact: bool = False
    stats_layers: tuple[int, ...] = ()

    @property
    def variant_id(self) -> str:
        return variant_id_of(self.chunk_key, self.prefix_key, self.s_old, self.is_exact)

    def inter_total(self) -> tuple[float, ...]:
        """inter summed over the measured layers, one value per chunk of s_old."""
        return tuple(sum(per_layer) for per_layer in self.inter)

    def __post_init__(self) -> None:
        if len(self.inter) != len(self.s_old) or len(self.s_old_sizes) != len(self.s_old):
            raise ValueError("inter and s_old_sizes need one entry per chunk of s_old")
        if len(self.token_scores) != self.num_tokens:
            raise ValueError("token_scores needs one score per token")
        layers = self.stats_layers
        ascending = list(layers) == sorted(set(layers))
        if layers and not (ascending and layers[0] >= 0 and layers[-1] < self.num_layers):
            raise ValueError(f"stats_layers must ascend within 0..{self.num_layers - 1}")
        width = len(layers) if layers else self.num_layers
        if len(self.intra) != width or any(len(r) != width for r in self.inter):
            raise ValueError("inter and intra need one value per measured layer")
