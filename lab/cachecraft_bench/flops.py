"""Analytic FLOPs of a (partial) prefill: attention projections, causal attention and the MLP.

A computed token at position p, in one layer, costs the Q/K/V/O projections, the gated MLP and
attention over p + 1 keys. Embeddings, norms, RoPE and the LM head are left out (equal across
modes). Counts multiply-adds as 2 FLOPs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers-style config (num_hidden_layers, hidden_size, ...)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            num_layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
        )

    def as_kwargs(self) -> dict[str, int]:
        return asdict(self)


def token_layer_flops(
    hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int, keys: int
) -> int:
    """FLOPs of one token in one layer that attends over `keys` keys."""
    projections = 2 * (
        hidden * (num_heads + 2 * num_kv_heads) * head_dim + num_heads * head_dim * hidden
    )
    mlp = 2 * 3 * hidden * intermediate
    attention = 2 * 2 * num_heads * head_dim * keys  # QK^T and attn @ V
    return projections + mlp + attention


def prefill_flops(
    num_layers: int,
    hidden: int,
    intermediate: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    computed_positions: Sequence[int] | np.ndarray,
    layers_per_position: Sequence[int] | np.ndarray | int | None = None,
) -> int:
    """FLOPs of computing the tokens at `computed_positions` (0-based positions in the whole
    sequence), each through `layers_per_position` layers (one number per position, one for all,
    or None for all `num_layers`; early termination stops some tokens before the top)."""
    pos = np.asarray(computed_positions, dtype=np.int64).reshape(-1)
    if pos.size and pos.min() < 0:
        raise ValueError("positions must be >= 0")
    if layers_per_position is None:
        layers = np.full(pos.shape, num_layers, dtype=np.int64)
    else:
        layers = np.broadcast_to(np.asarray(layers_per_position, dtype=np.int64), pos.shape)
    if layers.size and (layers.min() < 0 or layers.max() > num_layers):
        raise ValueError(f"layers per position must be in [0, {num_layers}]")
    fixed = token_layer_flops(hidden, intermediate, num_heads, num_kv_heads, head_dim, keys=0)
    per_key = 2 * 2 * num_heads * head_dim
    # sum over tokens of layers_p * (fixed + per_key * (p + 1)), in Python ints (no overflow)
    return int(layers.sum()) * fixed + per_key * int((layers * (pos + 1)).sum())


def full_prefill_flops(
    num_layers: int,
    hidden: int,
    intermediate: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_len: int,
) -> int:
    """FLOPs of prefilling all `seq_len` tokens through every layer (closed form)."""
    fixed = token_layer_flops(hidden, intermediate, num_heads, num_kv_heads, head_dim, keys=0)
    per_key = 2 * 2 * num_heads * head_dim
    return num_layers * (seq_len * fixed + per_key * seq_len * (seq_len + 1) // 2)


def flops_fraction(
    shape: ModelShape,
    computed_positions: Sequence[int] | np.ndarray,
    seq_len: int,
    layers_per_position: Sequence[int] | np.ndarray | int | None = None,
) -> float:
    """Partial-prefill FLOPs as a fraction of the full prefill of `seq_len` tokens."""
    full = full_prefill_flops(**shape.as_kwargs(), seq_len=seq_len)
    part = prefill_flops(
        **shape.as_kwargs(),
        computed_positions=computed_positions,
        layers_per_position=layers_per_position,
    )
    return part / full if full else 0.0


FLOPS_TOLERANCE = 0.005
"""Two arms are compute-equal when their FLOPs fractions of the prompt's full prefill differ by
at most this (half a point); an arm further off is labelled so (`compute_label`)."""


def token_flops(
    shape: ModelShape,
    positions: Sequence[int] | np.ndarray,
    layers_per_position: Sequence[int] | np.ndarray | int | None = None,
) -> np.ndarray:
    """FLOPs of each token at `positions` through its layers, one number per position: a late
    token attends over more keys and costs more than an early one."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    if layers_per_position is None:
        layers = np.full(pos.shape, shape.num_layers, dtype=np.int64)
    else:
        layers = np.broadcast_to(np.asarray(layers_per_position, dtype=np.int64), pos.shape)
    kw = shape.as_kwargs()
    kw.pop("num_layers")
    fixed = token_layer_flops(**kw, keys=0)
    per_key = 2 * 2 * shape.num_heads * shape.head_dim
    return layers * (fixed + per_key * (pos + 1))


def count_for_flops(
    shape: ModelShape,
    ranked_positions: Sequence[int] | np.ndarray,
    target_flops: float,
    layers_per_position: Sequence[int] | np.ndarray | int | None = None,
) -> int:
    """How many of `ranked_positions` (a baseline's own order of preference) to compute so
    that their FLOPs come closest to `target_flops`, by position: matching a count of tokens
    instead gave a baseline that picks late tokens more FLOPs than the arm it was matched to
    (and one that picks early tokens fewer)."""
    costs = token_flops(shape, ranked_positions, layers_per_position)
    cumulative = np.concatenate([[0], np.cumsum(costs, dtype=np.float64)])
    return int(np.argmin(np.abs(cumulative - float(target_flops))))


def compute_label(arm_fraction: float | None, ref_fraction: float | None) -> str:
    """ "compute-equal" when two FLOPs fractions differ by at most `FLOPS_TOLERANCE`, else
    "not compute-equal (+1.2 pts)" (the arm's fraction minus the reference's, in points of the
    prompt's full-prefill FLOPs); "unknown" when either is missing."""
    if arm_fraction is None or ref_fraction is None:
        return "unknown"
    delta = arm_fraction - ref_fraction
    if abs(delta) <= FLOPS_TOLERANCE + 1e-12:
        return "compute-equal"
    return f"not compute-equal ({100 * delta:+.1f} pts)"


def uniform_k_for_flops(
    shape: ModelShape,
    chunk_starts: Sequence[int],
    chunk_sizes: Sequence[int],
    target_flops: float,
) -> int:
    """EPIC's own shape at a given cost: the one k (tokens recomputed at the start of every
    chunk, as EPIC's LegoLink does) whose FLOPs, by position, come closest to `target_flops`
    (ties: the smaller k). A chunk shorter than k is recomputed whole."""
    if len(chunk_starts) != len(chunk_sizes):
        raise ValueError("one start per chunk size")
    longest = max(chunk_sizes, default=0)
    best_k, best_gap = 0, float(target_flops)
    for k in range(1, longest + 1):
        positions = [
            s + i for s, n in zip(chunk_starts, chunk_sizes, strict=True) for i in range(min(k, n))
        ]
        gap = abs(float(token_flops(shape, positions).sum()) - float(target_flops))
        if gap < best_gap:
            best_k, best_gap = k, gap
    return best_k
