"""Rotary position embedding at explicit positions, and moving keys between positions.

Uses transformers' own rope-parameter functions, so every scaling a model ships (default,
linear, llama3, yarn, longrope, dynamic at its base length) gives the model's own frequencies.
Keys are stored before RoPE; `rotate` applies it at any positions and `unrotate` removes it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class Rope:
    """cos/sin tables for positions, computed in fp32 from the model's inv_freq."""

    def __init__(self, hf_config: Any, head_dim: int, device: torch.device | str = "cpu") -> None:
        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, device=None)
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        self.scaling = float(scaling)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # fp32 [n, head_dim] x 2

    def cos_sin_range(self, start: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin [end - start, head_dim] for positions start..end-1, sliced from a table
        of positions 0..n-1 kept in fp32 and grown by doubling: a reused chunk's rotation
        then costs no cos/sin evaluation on the request's path (the host work a GPU cannot
        hide). Host ints, so no device read-back."""
        table = self._table
        if table is None or table[0].shape[0] < end:
            n = max(end, 2 * (0 if table is None else table[0].shape[0]), 1024)
            positions = torch.arange(n, device=self.inv_freq.device)
            cos, sin = self.cos_sin(positions, torch.float32)
            table = self._table = (cos, sin)  # one assignment: a reader sees old or new
        return table[0][start:end].to(dtype), table[1][start:end].to(dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions [n] (any device) -> cos, sin [n, head_dim] on the tables' device
        (attention scaling folded in)."""
        freqs = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., n, head_dim] before RoPE -> rotated at `positions` [n]."""
        cos, sin = self.cos_sin(positions, x.dtype)
        return self.apply(x, cos.to(x.device), sin.to(x.device))

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [..., n, head_dim] with precomputed cos, sin [n, head_dim]: (x1, x2) ->
        (x1 c - x2 s, x2 c + x1 s) in three kernels, x * cos then one multiply-add per half
        (both halves of the tables are equal), with no temporaries: multiplying the halves
        apart and concatenating them allocates and copies far more."""
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])
        return out

    def shift(self, x: torch.Tensor, delta: int) -> torch.Tensor:
        """x [..., n, head_dim] rotated at some positions -> rotated at those positions + delta
        (one rotation by delta: RoPE's rotations compose, and the scaling is not applied
        again)."""
        freqs = float(delta) * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs))
        return self.apply(x, emb.cos().to(x.dtype), emb.sin().to(x.dtype))

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Inverse of `rotate`: x [..., n, head_dim] rotated at `positions` -> before RoPE."""
        cos, sin = self.cos_sin(positions, torch.float32)  # rotating by -angle: sin negated
        cos, sin = cos.to(x.device), sin.to(x.device)
        square = self.scaling * self.scaling  # the tables carry scaling: divide them, not x
        out = self.apply(x.to(torch.float32), cos.div_(square), sin.div_(-square))
        return out.to(x.dtype)
