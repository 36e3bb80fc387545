"""A layer's MLP block after attention's residual: h + down(SiLU(gate x) * up x).

Two forms of the same sum:
* products through `Linear` (gate and up as one product, SiLU, the multiply and the residual
  as separate passes): float32, and wherever oneDNN's post-ops are missing;
* bfloat16 on oneDNN: SiLU runs inside gate's GEMM, the multiply by up inside up's and the
  residual inside down's (post-ops of `_linear_pointwise`), so the [n, I] intermediates are
  written once instead of three times, which makes a bf16 prefill faster. In float32 the
  split products are slower than one gate-and-up product, so float32 keeps the first form
  (figures: docs/performance.md).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from cachecraft.model.linear import PACK_ROWS, Linear

log = logging.getLogger(__name__)


FUSED_MIN_ROWS = 16
"""bf16: products of fewer rows (a decode step of a few sequences) take the first form: for a
few rows the fused form saves no time and makes three GEMM calls instead of two, which a
decode step pays for; from 16 rows on the fused form is faster."""


ROW_BLOCK = 512
"""Rows per product in the first form: its [n, 2 I] intermediate stays the same few MB, which
glibc hands back from its heap step after step. Unblocked, a large step (a burst's probe and
check rows on top of the token budget) makes the intermediate larger than glibc's 32 MiB mmap
threshold, so every layer would map it afresh and fault in its pages; smaller blocks also
stay in cache better (figures: docs/performance.md)."""


class Mlp:
    """`mlp(x, h)` = h + down(SiLU(gate x) * up x) for x, h [n, hidden]; gate_up [2 I, hidden]
    (gate's rows, then up's), down [hidden, I]. `fused` holds the three oneDNN-packed
    weights when the bfloat16 post-op form is in use, from `fused_from` rows on
    (FUSED_MIN_ROWS; 0 when the model keeps no plain weights: no second copy for short
    products then)."""

    __slots__ = ("down", "fused", "fused_from", "gate_up")

    def __init__(
        self, gate_up: torch.Tensor, down: torch.Tensor, pack: bool, keep_plain: bool
    ) -> None:
        """pack, keep_plain: as `Linear`'s (pack only where oneDNN runs this dtype)."""
        self.fused = _fuse(gate_up, down) if pack and gate_up.dtype == torch.bfloat16 else None
        self.fused_from = FUSED_MIN_ROWS
        self.gate_up: Linear | None = None
        self.down: Linear | None = None
        if self.fused is not None and not keep_plain:
            self.fused_from = 0  # a model too large for second copies: fused for every product
            return
        # Fused, the short products keep the first form over packed weights only (the long
        # ones that read plain bf16 weights are all fused): as much memory as packed + plain.
        keep_plain = keep_plain and self.fused is None
        self.gate_up = Linear(gate_up, None, pack, keep_plain)
        self.down = Linear(down, None, pack, keep_plain)

    def __call__(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h + MLP(x); the first form adds into h in place, the fused one returns a new
        tensor. x and h must be contiguous."""
        if self.fused is not None and x.shape[0] >= self.fused_from:
            return _fused_call(x, h, *self.fused)
        assert self.gate_up is not None and self.down is not None
        for a in range(0, x.shape[0], ROW_BLOCK):
            gate, up = self.gate_up(x[a : a + ROW_BLOCK]).chunk(2, dim=-1)
            # The SiLU out of place: `gate` is a strided half of the product, and an in-place
            # SiLU on it computes a copy and writes it back (one more pass over [n, I]).
            h[a : a + ROW_BLOCK].add_(self.down(F.silu(gate).mul_(up)))
        return h


def _fused_call(
    x: torch.Tensor, h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    mkldnn = torch.ops.mkldnn
    a = mkldnn._linear_pointwise(x, gate, None, "swish", [], "")  # SiLU(x gate^T)
    a = mkldnn._linear_pointwise.binary(x, a, up, None, "mul")  # (x up^T) * a
    return mkldnn._linear_pointwise.binary(a, h, down, None, "add")  # (a down^T) + h


def _fuse(
    gate_up: torch.Tensor, down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The packed gate, up and down weights, or None if oneDNN cannot run the post-ops here
    or their result is off (checked against the float32 sum on a few random rows)."""
    inter = gate_up.shape[0] // 2
    try:
        packed = tuple(
            torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS)
            for w in (gate_up[:inter], gate_up[inter:], down)
        )
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, gate_up.shape[1], generator=gen).to(gate_up.dtype)
        h = torch.randn(3, down.shape[0], generator=gen).to(gate_up.dtype)
        got = _fused_call(x, h, *packed).float()
    except (RuntimeError, AttributeError) as e:
        log.info("oneDNN post-ops unavailable (%r); MLP unfused", e)
        return None
    g, u = (x.float() @ gate_up.float().T).chunk(2, dim=-1)
    want = h.float() + (F.silu(g) * u) @ down.float().T
    tol = 4 * torch.finfo(gate_up.dtype).eps * float(want.abs().max())
    if not torch.allclose(got, want, rtol=0.0, atol=tol):
        log.warning("oneDNN's fused MLP disagrees with the plain one; MLP unfused")
        return None
    return packed  # type: ignore[return-value]
