"""Attention of computed rows over a sequence's K/V with an exact mask over absolute positions.

A query at position p sees every key at position <= p (and > p - window with a sliding
window). Two paths: SDPA (fast), and an explicit block-wise path that also returns how much
attention mass each row puts on each span; both give the same output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _mask(q_pos: torch.Tensor, ctx: int, window: int | None) -> torch.Tensor:
    """[n, ctx] bool, True where query row may attend to key position."""
    k_pos = torch.arange(ctx, device=q_pos.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[Hkv, ctx, D] -> [H, ctx, D] (GQA): CPU SDPA is fastest on plain 4-D multi-head input."""
    group = num_heads // x.shape[0]
    return x.repeat_interleave(group, dim=0) if group > 1 else x


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window: int | None
) -> torch.Tensor:
    """q [H, n, D] at sorted positions q_pos [n]; k, v [Hkv, ctx, D] with ctx = q_pos[-1] + 1.

    Returns [H, n, D].
    """
    num_heads, n, head_dim = q.shape
    num_kv, ctx = k.shape[0], k.shape[1]
    group = num_heads // num_kv
    needs_window = window is not None and ctx > window
    if not needs_window and n == ctx:
        # q_pos == 0..ctx-1: plain causal (top-left aligned == exact here since n == ctx).
        k, v = _expand_kv(k, num_heads)[None], _expand_kv(v, num_heads)[None]
        return F.scaled_dot_product_attention(q[None], k, v, is_causal=True)[0]
    mask = _mask(q_pos, ctx, window if needs_window else None)
    if group * n <= ctx:
        # Few rows (decode, partial prefill): fold the query heads of each KV group into rows
        # instead of copying K/V per head; head h reads KV head h // group.
        qg = q.reshape(num_kv, group * n, head_dim)
        out = F.scaled_dot_product_attention(
            qg[None], k[None], v[None], attn_mask=mask.repeat(group, 1)
        )
        return out[0].reshape(num_heads, n, head_dim)
    k, v = _expand_kv(k, num_heads)[None], _expand_kv(v, num_heads)[None]
    return F.scaled_dot_product_attention(q[None], k, v, attn_mask=mask)[0]


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
