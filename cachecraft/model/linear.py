"""Linear layers (x @ W^T + b) with the weight packed once for oneDNN, or plain `F.linear`.

On this machine (AMD EPYC, AVX-512, one thread) torch's default fp32 GEMM runs at under half
the speed of oneDNN with a prepacked weight: all of SmolLM2's layer weights at 16 rows take
60 -> 27 ms, at 300 rows 659 -> 287 ms, at 1,500 rows 3.3 -> 1.4 s. Packing happens once at
load. Where oneDNN is missing, the model is not fp32 on the CPU, or a probe product disagrees
with `F.linear`, the plain weight is used.

One or two rows (a decode step of one or two sequences) are the exception: there torch's
GEMV/GEMM reads the plain weight faster than oneDNN reads the packed one (SmolLM2's layers,
one thread, A/B in one process: one row 60 -> 53 ms per step; two rows, layers and head,
56-63 -> 42-53 ms; from three rows on oneDNN is as fast or faster). `keep_plain` keeps the
plain weight beside the packed one for those products, at the cost of a second copy in
memory. Rechecked on an Intel Xeon VM (AVX-512, one thread, all 30 layers, both arms
alternating): one row plain 38.5 ms vs packed 46.5, two rows 41.7 vs 51.4, four rows 71.5 vs
53.4; the head alone at one row 9.7 vs 11.2 ms.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

PACK_ROWS = 16
"""The row count oneDNN is told to expect when packing (a hint: 16 and 128 measured the same
from 1 to 1,500 rows; 1 was slower for many rows)."""


PLAIN_MAX_ROWS = 2
"""Products of at most this many rows use the plain weight when it is kept."""


class Linear:
    """`linear(x)`: x [n, in] -> [n, out]. `weight` [out, in] stays the plain tensor (None
    once packed and `keep_plain` was False)."""

    __slots__ = ("bias", "out_features", "packed", "weight")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        pack: bool,
        keep_plain: bool = False,
    ) -> None:
        """keep_plain: once packed, keep `weight` as well for one-row products."""
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self.out_features = weight.shape[0]
        self.packed = _pack(weight, bias) if pack else None
        if self.packed is not None and not keep_plain:
            self.weight = None  # the packed copy replaces it: no second copy in memory

    @property
    def is_packed(self) -> bool:
        return self.packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and (self.weight is None or x.shape[0] > PLAIN_MAX_ROWS):
            if not x.is_contiguous():
                x = x.contiguous()
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The oneDNN-packed weight, or None if packing fails or its product is off."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
    except (RuntimeError, AttributeError) as e:
        log.info("oneDNN linear unavailable (%r); using F.linear", e)
        return None
    want = F.linear(probe, weight, bias)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()) + 1e-6):
        log.warning("oneDNN linear disagrees with F.linear; using F.linear")
        return None
    return packed
