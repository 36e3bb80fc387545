"""Linear layers (x @ W^T + b) with the weight packed once for oneDNN, or plain `F.linear`.

torch's default fp32 GEMM on a CPU runs well below oneDNN with a prepacked weight, so the
weights are packed once at load. Where oneDNN is missing, the model is neither fp32 nor bf16
that oneDNN computes natively (`_is_mkldnn_bf16_supported`), or a probe product disagrees with
`F.linear`, the plain weight is used.

Products of one or two rows (a decode step of one or two sequences) are the exception, and
which way it goes depends on the CPU: on some, torch reads the plain weight faster than oneDNN
reads the packed one, on others the packed one is much faster; from three rows on oneDNN is as
fast or faster. So `keep_plain` keeps the plain weight beside the packed one for those
products, at the cost of a second copy in memory, and `packed_is_faster` times both over a
model's weights at load: where the packed one is as fast, `pack_only` drops the plain copies.

bf16 is the other way round (`PACKED_BF16_MAX_ROWS`): packed is faster for small products (a
decode step, a probe) and not for a long prefill's, so those read the plain weight.

Long fp32 products always read the packed weight, even on CPUs where the plain one is a little
faster there: chosen by a timing at start-up, the choice flips from one process to the next
within the timing's noise, so the kernel a prompt runs on (and its rounding) would change from
run to run; chosen by instruction set, a whole prefill gained nothing. The figures behind
these choices: docs/performance.md, "Linear products".
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

PACK_ROWS = 16
"""The row count oneDNN is told to expect when packing: only a hint; a value near 1 lets it pick
kernels that are slow for long prefills, and larger values gained nothing."""


PLAIN_MAX_ROWS = 2
"""fp32: products of at most this many rows use the plain weight when it is kept."""


PLAIN_MIN_GAIN = 0.05
"""fp32: the plain weights stay for short products only when they ran them at least this
much faster (`packed_is_faster`): a closer timing is noise, and the packed-only model holds
one copy of its weights instead of two."""


PACKED_BF16_MAX_ROWS = 256
"""bf16 (where oneDNN computes it natively: AVX512-BF16 / AMX): products of at most this many
rows use the packed weight, larger ones the plain one when it is kept: packed is faster for
short products, and from about 512 rows some projections (down, o) run slower packed."""


class Linear:
    """`linear(x)`: x [n, in] -> [n, out]. `weight` [out, in] stays the plain tensor (None
    once packed and `keep_plain` was False). With both kept, a product of n rows reads the
    packed one when `packed_rows[0] <= n <= packed_rows[1]`."""

    __slots__ = ("bias", "out_features", "packed", "packed_rows", "weight")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        pack: bool,
        keep_plain: bool = False,
    ) -> None:
        """keep_plain: once packed, keep `weight` as well for the products it is faster at
        (fp32: one or two rows; bf16: more than PACKED_BF16_MAX_ROWS)."""
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self.out_features = weight.shape[0]
        self.packed = _pack(weight, bias) if pack else None
        self.packed_rows = (0, math.inf)
        if self.packed is not None and not keep_plain:
            self.weight = None  # the packed copy replaces it: no second copy in memory
        elif weight.dtype == torch.bfloat16:
            self.packed_rows = (0, PACKED_BF16_MAX_ROWS)
        else:
            self.packed_rows = (PLAIN_MAX_ROWS + 1, math.inf)

    @property
    def is_packed(self) -> bool:
        return self.packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        low, high = self.packed_rows
        return self.product(x, self.packed is not None and low <= x.shape[0] <= high)

    def product(self, x: torch.Tensor, packed: bool) -> torch.Tensor:
        """x W^T + b through the packed weight or the plain one (which must be kept)."""
        if packed:
            if not x.is_contiguous():
                x = x.contiguous()
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    def pack_only(self) -> None:
        """Every product through the packed weight from now on; the plain copy is let go."""
        if self.packed is None:
            raise ValueError("pack_only needs a packed weight")
        self.weight = None
        self.packed_rows = (0, math.inf)


def packed_is_faster(
    linears: Sequence[Linear], rows: Sequence[int] = (1, 2), rounds: int = 3
) -> bool:
    """Whether the products of `rows` rows through every weight of `linears` in turn (packed
    and plain both kept: a model's decode step, its weights read from memory rather than the
    caches when they are large) take the packed weights no more than 1 / (1 - PLAIN_MIN_GAIN)
    times what they take the plain ones: medians of `rounds` timings per form, the two forms
    alternating, after one untimed round of each (oneDNN builds its kernels then)."""
    weights = [lin.weight for lin in linears]
    if any(lin.packed is None for lin in linears) or any(w is None for w in weights):
        raise ValueError("packed_is_faster needs linears that keep both weights")
    gen = torch.Generator().manual_seed(0)
    inputs = [  # one input per product, in the order they run
        torch.randn(n, w.shape[1], generator=gen).to(w.dtype)
        for n in rows
        for w in weights
        if w is not None
    ]
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds + 1):
        for packed in (False, True):
            t0 = time.perf_counter()
            for lin, x in zip(list(linears) * len(rows), inputs, strict=True):
                lin.product(x, packed)
            if r:
                times[packed].append(time.perf_counter() - t0)
    plain, packed_t = statistics.median(times[False]), statistics.median(times[True])
    log.info(
        "short products over %d weights: plain %.1f ms, packed %.1f ms",
        len(linears),
        1000 * plain,
        1000 * packed_t,
    )
    return not plain < (1 - PLAIN_MIN_GAIN) * packed_t


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """fp32 on a CPU with oneDNN; bf16 where oneDNN computes it natively."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The oneDNN-packed weight, or None if packing fails or its product is off."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
        probe = probe.to(weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "").float()
    except (RuntimeError, AttributeError) as e:
        log.info("oneDNN linear unavailable (%r); using F.linear", e)
        return None
    want = F.linear(probe, weight, bias).float()
    tol = max(1e-4, 4 * torch.finfo(weight.dtype).eps)  # bf16: a few of its rounding steps
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max()) + 1e-6):
        log.warning("oneDNN linear disagrees with F.linear; using F.linear")
        return None
    return packed
