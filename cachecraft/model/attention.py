"""Attention of computed rows over a sequence's K/V with an exact mask over absolute positions.

A query at position p sees every key at position <= p (and > p - window with a sliding
window). `causal_attention` runs float32 on a CPU through our kernel where it was built
(model/row_kernel.py: each row's limit comes from its position), else through torch's SDPA
with plain causal calls or blocks of rows under additive masks (`plan_rows`); both can return
how much attention mass each row puts on each span in the same pass. `row_span_mass` is the
explicit reference for that mass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cachecraft.model.row_kernel import VALUE_WIDTH, RowKernel


def _mask(q_pos: torch.Tensor, ctx: int, window: int | None) -> torch.Tensor:
    """[n, ctx] bool, True where query row may attend to key position."""
    k_pos = torch.arange(ctx, device=q_pos.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def span_onehot(bounds: torch.Tensor, ctx: int, dtype: torch.dtype) -> torch.Tensor:
    """[ctx, S]: 1 where key position m lies in span s of bounds [S, 2] (absolute start, end)."""
    pos = torch.arange(ctx, device=bounds.device)
    return ((pos[:, None] >= bounds[None, :, 0]) & (pos[:, None] < bounds[None, :, 1])).to(dtype)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """4-D SDPA with an explicit mask, plain causal (n == ctx), or neither (every row sees
    every key: one row at the last position). K/V may have fewer heads than q (GQA): SDPA
    reads each KV head for its group of query heads, bit for bit what expanding K/V to one
    head per query head gives, without paying for that copy at every layer."""
    gqa = k.shape[-3] != q.shape[-3]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )


def _widen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, onehot: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused-statistics operands: V gets the S span-indicator columns (onehot [ctx, S]), Q
    and K get zero columns so all three share one width (the CPU kernels want equal widths)
    while every score q.k stays exactly what it was. Softmax rows then carry, in output columns
    D..D+S, the attention mass each row puts on each span. The width is rounded up to a
    multiple of 8 (more zero columns): on this CPU SDPA at width 72 costs +8% over 64, at 71
    +26%. K and V keep their Hkv heads (SDPA reads them per query group), each written once
    (no concatenation followed by a copy)."""
    head_dim, num_spans = q.shape[-1], onehot.shape[1]
    width = -(-(head_dim + num_spans) // 8) * 8
    qw = F.pad(q, (0, width - head_dim))
    num_kv, ctx = k.shape[0], k.shape[1]
    kw = k.new_empty((num_kv, ctx, width))
    kw[..., :head_dim] = k
    kw[..., head_dim:] = 0
    vw = _wide_values(v, onehot, width)
    return qw, kw, vw


def _wide_values(v: torch.Tensor, onehot: torch.Tensor | None, width: int) -> torch.Tensor:
    """V [Hkv, ctx, D] -> [Hkv, ctx, width]: V's columns, then the span indicators of onehot
    [ctx, S] (none when None), then zeros, written once."""
    head_dim, num_spans = v.shape[-1], 0 if onehot is None else onehot.shape[1]
    wide = v.new_empty((*v.shape[:-1], width))
    wide[..., :head_dim] = v
    if onehot is not None:
        wide[..., head_dim : head_dim + num_spans] = onehot.to(v.dtype)
    wide[..., head_dim + num_spans :] = 0
    return wide


ROW_BLOCK = 64
"""Rows per SDPA call in a masked (partial) prefill: rows are sorted, so a block of rows never
sees keys past its last position and reads K/V only up to there; smaller blocks read less,
until each call's fixed cost outweighs that. That is float32's (figures:
docs/performance.md)."""

ROW_BLOCK_BF16 = 256
"""bfloat16's rows per SDPA call: its kernel does the arithmetic faster, so a call's fixed
cost weighs more and larger blocks pay (figures: docs/performance.md)."""


MAX_PAD_SHARE = 8
"""Rows after a cached prefix of `pad` positions run as one causal SDPA call over `pad` zero
query rows plus theirs when pad <= rows / MAX_PAD_SHARE: behind a short prefix the wasted
zero rows cost less than masked blocks do, behind a long one more (figures:
docs/performance.md)."""


@dataclass(frozen=True, slots=True)
class RowPlan:
    """What `causal_attention` does for rows at positions `q_pos`, independent of the layer:
    a causal call after `pad` zero rows, or blocks of rows (a, b, end, mask) over keys
    0..end-1 with their additive masks [b - a, end] already built (None: one row that sees
    every key). Built once per forward step, not per layer: under load the per-layer mask
    building cost as much as the attention itself."""

    q_pos: torch.Tensor
    pad: int
    causal: bool
    blocks: tuple[tuple[int, int, int, torch.Tensor | None], ...]


def plan_rows(
    q_pos: torch.Tensor,
    window: int | None,
    dtype: torch.dtype,
    bounds: tuple[int | None, int] | None = None,
) -> RowPlan:
    """The RowPlan of sorted positions q_pos [n] (keys 0..q_pos[-1]). `bounds`: (first, last)
    position known on the host (first None: not known; last may lie past q_pos[-1], keys up to
    it are then masked), so that off a CPU the plan reads nothing back from the device; None:
    read from q_pos."""
    n = q_pos.shape[0]
    if bounds is None:
        first, last = int(q_pos[0]), int(q_pos[-1])
    else:
        first, last = bounds
    ctx = last + 1
    pad = ctx - n
    causal = (window is None or ctx <= window) and (
        pad == 0 or (first == pad and pad * MAX_PAD_SHARE <= n)
    )
    if causal:
        return RowPlan(q_pos, pad, True, ())
    if q_pos.device.type == "cpu":
        num_blocks = -(-n // (ROW_BLOCK_BF16 if dtype == torch.bfloat16 else ROW_BLOCK))
    else:
        # One call on an accelerator: blocks keep a CPU's caches warm, but a GPU pays for
        # every call and cuDNN's SDPA builds a plan for every new shape (docs/results/gpu-h200.md).
        num_blocks = 1
    cuts = [round(i * n / num_blocks) for i in range(num_blocks + 1)]
    blocks = []
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        # keys past the block's last row are all masked; the last block's end is known (read
        # back only on a CPU, where that is no synchronisation)
        end = ctx if b == n else int(q_pos[b - 1]) + 1
        needs_window = window is not None and end > window
        at_end = b < n or first is not None  # the block's last row sits at end - 1
        mask = None
        if b - a > 1 or needs_window or not at_end:  # one row at the last position: none
            allowed = _mask(q_pos[a:b], end, window if needs_window else None)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=q_pos.device)
            mask.masked_fill_(~allowed, float("-inf"))
        blocks.append((a, b, end, mask))
    return RowPlan(q_pos, pad, False, tuple(blocks))


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    window: int | None,
    onehot: torch.Tensor | None = None,
    plan: RowPlan | None = None,
    out: torch.Tensor | None = None,
    kernel: RowKernel | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [H, n, D] at sorted positions q_pos [n]; k, v [Hkv, ctx, D] with ctx = q_pos[-1] + 1.
    `plan`: `plan_rows` of the same positions (built here when None; unused with a kernel).
    `out` [n, H, D]: where the output goes (e.g. the rows' slice of the layer's attention
    output, so no copy of it follows; allocated when None). `kernel`: `load_row_kernel()`'s,
    for float32 operands on the CPU (SDPA when None).

    Returns (`out` viewed as [H, n, D], mass): with onehot [>= ctx, S] (see `span_onehot`),
    mass [n, S] is each row's head-averaged attention probability on each span,
    computed by the same SDPA calls (fused: no score matrix of ours exists); without it mass
    is None.
    """
    num_heads, n, head_dim = q.shape
    if out is None:
        out = q.new_empty((n, num_heads, head_dim))
    if kernel is not None:
        return _kernel_attention(kernel, q, k, v, q_pos, window, onehot, out)
    ctx = k.shape[1]
    scale = head_dim**-0.5
    if plan is None:
        plan = plan_rows(q_pos, window, q.dtype)
    num_spans = 0
    if onehot is not None:
        num_spans = onehot.shape[1]
        q, k, v = _widen(q, k, v, onehot[:ctx])
    masses = []

    def put(a: int, b: int, res: torch.Tensor) -> None:
        """One SDPA call's rows a..b-1, res [H, b - a, width], into `out` (and their mass)."""
        out[a:b] = res[..., :head_dim].transpose(0, 1)
        if num_spans:
            masses.append(res[..., head_dim : head_dim + num_spans].mean(0))

    if plan.causal:
        # q_pos == pad..ctx-1: with `pad` zero query rows in front, SDPA's top-left aligned
        # causal mask is exact (pad == 0: a full prefill), and every real row is computed as
        # the full prefill computes it.
        pad = plan.pad
        if pad:
            q = torch.cat([q.new_zeros((num_heads, pad, q.shape[-1])), q], 1)
        put(0, n, _sdpa(q[None], k[None], v[None], None, True, scale)[0, :, pad:])
    else:
        for a, b, end, mask in plan.blocks:
            kb, vb = k[None, :, :end], v[None, :, :end]
            put(a, b, _sdpa(q[None, :, a:b], kb, vb, mask, False, scale)[0])
    mass = None
    if masses:
        mass = masses[0] if len(masses) == 1 else torch.cat(masses)
    return out.transpose(0, 1), mass


def _kernel_attention(
    kernel: RowKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    window: int | None,
    onehot: torch.Tensor | None,
    out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`causal_attention` through our kernel. It takes V wider than Q and K, so the fused
    statistics widen V alone: the S span-indicator columns after V's D, zeros up to a multiple
    of VALUE_WIDTH (as the kernel's vectors want; also for a D that is not one). K goes in as
    it is stored (the kernel copies it transposed)."""
    num_heads, n, head_dim = q.shape
    ctx = k.shape[1]
    num_spans = 0 if onehot is None else onehot.shape[1]
    width = -(-(head_dim + num_spans) // VALUE_WIDTH) * VALUE_WIDTH
    res = out
    if width != head_dim:
        v = _wide_values(v, None if onehot is None else onehot[:ctx], width)
        res = q.new_empty((n, num_heads, width))
    elif out.stride(-1) != 1:
        res = q.new_empty((n, num_heads, head_dim))
    q = q if q.stride(-1) == 1 else q.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    kernel(q, k, v, q_pos.long().contiguous(), window or 0, head_dim**-0.5, res)
    if res is not out:
        out.copy_(res[..., :head_dim])
    mass = res[..., head_dim : head_dim + num_spans].mean(1) if num_spans else None
    return out.transpose(0, 1), mass


def row_span_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    bounds: torch.Tensor,
    window: int | None,
    block: int = 512,
) -> torch.Tensor:
    """Per row, the head-averaged attention probability summed over each span's keys.

    q [H, n, D] at sorted positions q_pos; k [Hkv, ctx, D]; bounds [S, 2] absolute (start, end).
    Returns [n, S]. Scores exist for one block of rows at a time and only up to the block's
    last position (the causal part), so one layer's score matrix never exists whole.
    """
    num_heads, n, head_dim = q.shape
    num_kv = k.shape[0]
    group = num_heads // num_kv
    full_ctx = int(q_pos[-1]) + 1
    bounds = bounds.to(q.device)  # a hook's spans come from the host
    # onehot[m, s] = 1 if key position m lies in span s: span sums become one small GEMM.
    starts = bounds[:, 0].contiguous()
    span_of = torch.bucketize(torch.arange(full_ctx, device=q.device), starts, right=True) - 1
    inside = (span_of >= 0) & (torch.arange(full_ctx, device=q.device) < bounds[span_of, 1])
    onehot = torch.zeros((full_ctx, bounds.shape[0]), dtype=torch.float32, device=q.device)
    onehot[inside, span_of[inside]] = 1.0
    mass = torch.empty((n, bounds.shape[0]), dtype=torch.float32, device=q.device)
    scale = head_dim**-0.5
    for a in range(0, n, block):
        b = min(n, a + block)
        ctx = int(q_pos[b - 1]) + 1
        qb = (q[:, a:b] * scale).reshape(num_kv, group * (b - a), head_dim)  # heads per KV group
        scores = torch.matmul(qb, k[:, :ctx].transpose(1, 2)).view(num_heads, b - a, ctx).float()
        scores.masked_fill_(~_mask(q_pos[a:b], ctx, window), float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [H, nb, ctx]
        mass[a:b] = torch.matmul(probs, onehot[:ctx]).mean(0)
    return mass


def span_mass(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, bounds: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Mean over rows and heads of the attention mass rows put on each span: q [H, m, D] -> [S]."""
    return row_span_mass(q, k, q_pos, bounds, window).mean(0)


@dataclass(frozen=True, slots=True)
class MeterPlan:
    """What `attention_key_mass` needs of a step's rows, independent of the layer:
    the additive mask bias [1, group * n, ctx] (the query heads of a KV group as rows, as the
    scores are laid out) and per such row the weight of its probabilities in the key mass,
    weights [group * n] (1 / (H x metered rows) for a metered row, else 0). Built once per
    forward step: per layer, mask building and a boolean gather of the metered rows' scores
    would cost as much as the scores themselves."""

    bias: torch.Tensor
    weights: torch.Tensor


def plan_meter(
    q_pos: torch.Tensor,
    window: int | None,
    num_heads: int,
    num_kv: int,
    meter_rows: torch.Tensor,
    last_row: float = 0.0,
    counts: tuple[int, int] | None = None,
) -> MeterPlan:
    """The MeterPlan of sorted positions q_pos [n] (keys 0..q_pos[-1]) whose rows
    `meter_rows` (bool [n], at least one, the last row among them when last_row > 0) report
    key mass: their mean weighs 1 - last_row, the last row alone last_row. `counts`: (the
    last position, the metered rows) known on the host (None: read back)."""
    group = num_heads // num_kv
    last, num_metered = (int(q_pos[-1]), int(meter_rows.sum())) if counts is None else counts
    allowed = _mask(q_pos, last + 1, window)
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=q_pos.device)
    bias.masked_fill_(~allowed, float("-inf"))
    weights = meter_rows.to(torch.float32) * (1.0 - last_row) / num_metered
    weights[-1] += last_row
    weights /= num_heads
    return MeterPlan(bias.repeat(group, 1)[None], weights.repeat(group))


def attention_key_mass(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: MeterPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with explicit scores, for the few rows of a probe: q [H, n, D] at the sorted
    positions `plan` was made for (`plan_meter`, which also says which rows report); k, v
    [Hkv, ctx, D] with ctx = the last position + 1.

    Returns (out [H, n, D], mass [ctx]): the output as `causal_attention` gives it (to float
    rounding), and per key position the attention probability the metered rows give it
    (mean over heads and those rows). One score matrix serves both, so the probe pays for
    its scores once rather than for SDPA and the scores beside it."""
    num_heads, n, head_dim = q.shape
    qg = q.reshape(k.shape[0], -1, head_dim)  # the query heads of a KV group as rows
    scores = torch.baddbmm(plan.bias, qg.float(), k.float().transpose(1, 2), alpha=head_dim**-0.5)
    probs = torch.softmax(scores, dim=-1)  # [Hkv, group * n, ctx]
    out = torch.bmm(probs.to(v.dtype), v).view(num_heads, n, head_dim)
    mass = torch.matmul(plan.weights, probs).sum(0)  # weighted row sums: no gather of rows
    return out, mass
