"""Fused attention statistics: one SDPA call returns the output and each row's mass per span;
the probe's key meter: one score matrix gives the output and the mass on each key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cachecraft.model.attention import (
    MAX_PAD_SHARE,
    ROW_BLOCK,
    ROW_BLOCK_BF16,
    attention_key_mass,
    causal_attention,
    plan_meter,
    plan_rows,
    row_span_mass,
    span_onehot,
)


def _brute(q, k, v, q_pos, window):
    """Explicit softmax attention with GQA and the exact absolute mask: (out, probs [H,n,ctx])."""
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, 0)
    v = v.repeat_interleave(group, 0)
    ctx = k.shape[1]
    scores = (q @ k.transpose(1, 2)) * q.shape[-1] ** -0.5
    kp = torch.arange(ctx)
    mask = kp[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= kp[None, :] > q_pos[:, None] - window
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    return probs @ v, probs


def _operands(q_pos: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    """Random q [6, n, 16] and k, v [2, q_pos[-1] + 1, 16] (GQA, scores large enough to be
    peaked)."""
    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv, d, ctx = 6, 2, 16, int(q_pos[-1]) + 1
    q = 3 * torch.randn(num_heads, len(q_pos), d, generator=g)
    k = 3 * torch.randn(num_kv, ctx, d, generator=g)
    v = torch.randn(num_kv, ctx, d, generator=g)
    return q, k, v


CASES = {
    "full-causal": (torch.arange(40), None),
    "partial-few-rows": (torch.tensor([3, 7, 8, 20, 39]), None),
    "partial-two-runs": (torch.cat([torch.arange(10), torch.arange(25, 40)]), None),
    "decode": (torch.tensor([39]), None),
    "window": (torch.arange(40), 16),
    # rows after a short cached prefix: one causal call over zero rows in front of them
    "suffix-padded": (torch.arange(4, 40), None),
    "suffix-long-prefix": (torch.arange(30, 40), None),
    # more rows than ROW_BLOCK: blocks of rows, each over the keys up to its last row
    "row-blocks": (torch.cat([torch.arange(0, 700, 2), torch.arange(700, 900)]), None),
    "row-blocks-window": (torch.cat([torch.arange(0, 700, 2), torch.arange(700, 900)]), 300),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_stats_equal_explicit_and_output_equals_plain(case: str) -> None:
    q_pos, window = CASES[case]
    q, k, v = _operands(q_pos, seed=0)
    ctx = k.shape[1]
    bounds = torch.tensor([(0, 5), (5, 17), (17, 30), (30, ctx)])
    assert case != "row-blocks" or len(q_pos) > ROW_BLOCK
    plain, none = causal_attention(q, k, v, q_pos, window)
    assert none is None
    dest = torch.full((len(q_pos), q.shape[0], q.shape[2]), float("nan"))  # [n, H, D]
    out, mass = causal_attention(
        q, k, v, q_pos, window, span_onehot(bounds, ctx, q.dtype), None, dest
    )
    assert out.data_ptr() == dest.data_ptr() and torch.equal(dest, out.transpose(0, 1))
    ref_out, probs = _brute(q, k, v, q_pos, window)
    assert (out - plain).abs().max() < 1e-5
    assert (out - ref_out).abs().max() < 1e-5
    assert mass is not None and mass.shape == (len(q_pos), 4)
    assert torch.allclose(mass.sum(-1), torch.ones(len(q_pos)), atol=1e-5)
    by_span = torch.stack([probs[..., a:b].sum(-1) for a, b in bounds.tolist()], -1).mean(0)
    assert (mass - by_span).abs().max() < 1e-5
    assert (mass - row_span_mass(q, k, q_pos, bounds, window)).abs().max() < 1e-5


def test_fused_uses_the_head_dim_scale_not_the_padded_width() -> None:
    """Padding Q and K must not change the softmax temperature (SDPA's default would)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, 4, generator=g) for _ in range(3))
    pos = torch.arange(8)
    out, _ = causal_attention(q, k, v, pos, None, span_onehot(torch.tensor([(0, 8)]), 8, q.dtype))
    ref = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    assert (out - ref).abs().max() < 1e-6


def test_rows_after_a_cached_prefix_equal_the_full_prefill_rows() -> None:
    """Rows after a short cached prefix (one causal call over zero rows in front of them) come
    out bit for bit as the full prefill computes them."""
    g = torch.Generator().manual_seed(2)
    ctx, pad = 300, 20
    assert pad * MAX_PAD_SHARE <= ctx - pad
    q = torch.randn(6, ctx, 16, generator=g)
    k, v = torch.randn(2, ctx, 16, generator=g), torch.randn(2, ctx, 16, generator=g)
    full, _ = causal_attention(q, k, v, torch.arange(ctx), None)
    rows, _ = causal_attention(q[:, pad:], k, v, torch.arange(pad, ctx), None)
    assert torch.equal(rows, full[:, pad:])


@pytest.mark.parametrize("case", ["row-blocks", "row-blocks-window"])
def test_bfloat16_row_blocks_equal_brute_force(case: str) -> None:
    """bf16 takes larger row blocks than fp32; the output is still the exact masked attention
    (to bf16 rounding)."""
    q_pos, window = CASES[case]
    q, k, v = (x.to(torch.bfloat16) for x in _operands(q_pos, seed=2))
    plan = plan_rows(q_pos, window, torch.bfloat16)
    assert len(plan.blocks) == -(-len(q_pos) // ROW_BLOCK_BF16) > 1
    assert len(plan.blocks) < len(plan_rows(q_pos, window, torch.float32).blocks)
    out, _ = causal_attention(q, k, v, q_pos, window, None, plan)
    ref, _ = _brute(q.float(), k.float(), v.float(), q_pos, window)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("case", ["partial-few-rows", "suffix-long-prefix", "window", "decode"])
def test_key_meter_output_equals_plain_and_mass_equals_brute_force(case: str) -> None:
    q_pos, window = CASES[case]
    q, k, v = _operands(q_pos, seed=1)
    ctx = k.shape[1]
    rows = q_pos >= q_pos[len(q_pos) // 2]  # the meter counts the later half of the rows
    plan = plan_meter(q_pos, window, q.shape[0], k.shape[0], rows)
    out, mass = attention_key_mass(q, k, v, plan)
    plain, _ = causal_attention(q, k, v, q_pos, window)
    assert torch.allclose(out, plain, atol=1e-5)
    _, probs = _brute(q, k, v, q_pos, window)
    assert mass.shape == (ctx,)
    assert torch.allclose(mass, probs[:, rows].mean((0, 1)), atol=1e-6)
    assert torch.isclose(mass.sum(), torch.tensor(1.0), atol=1e-5)  # each row's mass sums to 1
