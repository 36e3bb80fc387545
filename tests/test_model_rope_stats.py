"""Moving keys between positions for every rope scaling; attention statistics vs brute force."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from cachecraft.model.kv import KVCache
from cachecraft.model.loader import LoadedModel
from cachecraft.model.rope import Rope
from cachecraft.model.step import SeqWork

SCALINGS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
]


def _rope(params: dict) -> Rope:
    """A head-dim-16 Rope with the given scaling."""
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters=params,
    )
    return Rope(cfg, 16)


@pytest.mark.parametrize("params", SCALINGS, ids=lambda p: p["rope_type"])
def test_keys_moved_by_delta_equal_keys_at_new_position(params: dict) -> None:
    rope = _rope(params)
    k = torch.randn(2, 10, 16, dtype=torch.float64).float()
    p = torch.arange(5, 15)
    for d in (1, 37, 500):
        moved = rope.rotate(rope.unrotate(rope.rotate(k, p), p), p + d)
        assert (moved - rope.rotate(k, p + d)).abs().max() < 1e-4


@pytest.mark.parametrize("params", SCALINGS, ids=lambda p: p["rope_type"])
def test_tabled_ranges_equal_tables_computed_for_the_positions(params: dict) -> None:
    """cos_sin_range (a reused chunk's rotation, sliced from a table grown on demand) gives
    what cos_sin computes for those positions, in each dtype, across the table's growth."""
    rope = _rope(params)
    for start, end in ((0, 10), (1000, 1030), (5, 3000), (2990, 2991), (9000, 9100)):
        for dtype in (torch.float32, torch.bfloat16):
            want = rope.cos_sin(torch.arange(start, end), dtype)
            got = rope.cos_sin_range(start, end, dtype)
            assert got[0].dtype == dtype and got[0].shape == want[0].shape
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("params", SCALINGS, ids=lambda p: p["rope_type"])
def test_shift_equals_unrotate_then_rotate(params: dict) -> None:
    """One rotation by the shift (the probe's re-rotation) equals unrotate + rotate, both ways."""
    rope = _rope(params)
    p = torch.arange(600, 610)
    k = rope.rotate(torch.randn(2, 10, 16), p)
    for d in (-590, -37, 0, 250):
        two_step = rope.rotate(rope.unrotate(k, p), p + d)
        assert (rope.shift(k, d) - two_step).abs().max() < 1e-4


def test_model_keys_moved_equal_keys_computed_there(tiny: LoadedModel) -> None:
    """Layer-0 keys depend on the token only: compute a chunk at p and at p+d, compare."""
    chunk = torch.randint(3, 1000, (12,))
    filler = torch.randint(3, 1000, (100,))

    def layer0_keys(prefix: torch.Tensor) -> tuple[torch.Tensor, int]:
        ids = torch.cat([prefix, chunk])
        kv = KVCache(tiny.arch, len(ids), torch.float32, "cpu")
        tiny.model.forward_step([SeqWork(kv, ids, torch.arange(len(ids)))])
        return kv.k[0, :, len(prefix) :], len(prefix)

    k_a, p_a = layer0_keys(filler[:5])
    k_b, p_b = layer0_keys(filler)
    pos_a, pos_b = torch.arange(p_a, p_a + 12), torch.arange(p_b, p_b + 12)
    moved = tiny.model.rope.rotate(tiny.model.rope.unrotate(k_a, pos_a), pos_b)
    assert (moved - k_b).abs().max() < 1e-4


def _spans(n: int) -> torch.Tensor:
    return torch.tensor([[0, 10], [10, 30], [30, 45], [45, n]])


def test_span_mass_rows_sum_to_one(tiny: LoadedModel) -> None:
    ids = torch.randint(3, 1000, (60,))
    kv = KVCache(tiny.arch, 60, torch.float32, "cpu")
    res = tiny.model.forward_step(
        [SeqWork(kv, ids, torch.arange(60), span_bounds=_spans(60), logits_for="all")]
    )[0]
    assert torch.allclose(res.row_span_mass.sum(-1), torch.ones(60), atol=1e-5)
    assert torch.allclose(res.span_mass_layers.sum(-1).sum(-1), torch.full((4,), 60.0), atol=1e-3)


def test_span_mass_matches_brute_force_attention(tiny: LoadedModel, tiny_hf) -> None:
    ids = torch.randint(3, 1000, (60,))
    kv = KVCache(tiny.arch, 60, torch.float32, "cpu")
    bounds = _spans(60)
    res = tiny.model.forward_step(
        [SeqWork(kv, ids, torch.arange(60), span_bounds=bounds, logits_for="all")]
    )[0]
    tiny_hf.config._attn_implementation = "eager"
    with torch.no_grad():
        out = tiny_hf(ids[None], output_attentions=True)
    attn = torch.stack(out.attentions)[:, 0].mean(1)  # [L, q, k], head-averaged
    span_of = torch.bucketize(torch.arange(60), bounds[:, 0].contiguous(), right=True) - 1
    onehot = torch.nn.functional.one_hot(span_of, 4).float()  # [k, S]
    per_row = attn @ onehot  # [L, q, S]
    assert (res.row_span_mass - per_row.mean(0)).abs().max() < 1e-5
    per_span = onehot.T @ per_row  # [L, S, S]
    assert (res.span_mass_layers - per_span).abs().max() < 1e-4
    # the stats path gives the same logits as the fast path
    kv2 = KVCache(tiny.arch, 60, torch.float32, "cpu")
    fast = tiny.model.forward_step([SeqWork(kv2, ids, torch.arange(60), logits_for="all")])[0]
    assert (fast.logits - res.logits).abs().max() < 1e-4


def test_hook_sees_question_attention_and_stops_rows(tiny: LoadedModel) -> None:
    ids = torch.randint(3, 1000, (50,))
    kv = KVCache(tiny.arch, 50, torch.float32, "cpu")
    seen = {}

    def hook(view):
        rows = view.positions >= 45
        seen["mass"] = view.attention_mass(rows, _spans(50))
        return view.positions >= 30  # rows before 30 stop after this layer

    work = SeqWork(kv, ids, torch.arange(50), hooks={1: hook})
    res = tiny.model.forward_step([work])[0]
    assert abs(float(seen["mass"].sum()) - 1.0) < 1e-5
    assert res.rows_last_layer[:30].tolist() == [1] * 30
    assert res.rows_last_layer[30:].tolist() == [3] * 20


def test_stats_for_selected_rows_only(tiny: LoadedModel) -> None:
    ids = torch.randint(3, 1000, (60,))
    bounds = _spans(60)
    kv = KVCache(tiny.arch, 60, torch.float32, "cpu")
    every = tiny.model.forward_step(
        [SeqWork(kv, ids, torch.arange(60), span_bounds=bounds, logits_for="all")]
    )[0]
    sel = (torch.arange(60) >= 10) & (torch.arange(60) < 30)
    kv2 = KVCache(tiny.arch, 60, torch.float32, "cpu")
    some = tiny.model.forward_step(
        [SeqWork(kv2, ids, torch.arange(60), span_bounds=bounds, stats_rows=sel, logits_for="all")]
    )[0]
    assert (some.logits - every.logits).abs().max() < 1e-4
    assert (some.row_span_mass[sel] - every.row_span_mass[sel]).abs().max() < 1e-5
    assert float(some.row_span_mass[~sel].abs().sum()) == 0.0
    assert (some.span_mass_layers[:, 1] - every.span_mass_layers[:, 1]).abs().max() < 1e-4
