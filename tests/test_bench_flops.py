"""Analytic prefill FLOPs: hand-computed small cases, full == all positions, partial < full."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cachecraft_bench.flops import (
    ModelShape,
    compute_label,
    count_for_flops,
    flops_fraction,
    full_prefill_flops,
    prefill_flops,
    token_flops,
    token_layer_flops,
    uniform_k_for_flops,
)

SHAPE = ModelShape(num_layers=2, hidden=8, intermediate=16, num_heads=2, num_kv_heads=1, head_dim=4)


def test_token_layer_flops_by_hand():
    # projections 2*(8*(2+2)*4 + 2*4*8) = 384; MLP 2*3*8*16 = 768; attention 2*2*2*4*3 = 96
    assert token_layer_flops(8, 16, 2, 1, 4, keys=3) == 384 + 768 + 96


def test_prefill_flops_by_hand():
    kw = SHAPE.as_kwargs()
    # position 2 attends over 3 keys, through both layers
    assert prefill_flops(**kw, computed_positions=[2]) == 2 * (384 + 768 + 96)
    # positions 0 and 2, position 2 only through one layer (early termination)
    expected = 2 * (384 + 768 + 32) + 1 * (384 + 768 + 96)
    assert prefill_flops(**kw, computed_positions=[0, 2], layers_per_position=[2, 1]) == expected
    assert prefill_flops(**kw, computed_positions=[]) == 0


def test_full_equals_every_position_and_partial_is_smaller():
    kw = SHAPE.as_kwargs()
    full = full_prefill_flops(**kw, seq_len=50)
    assert full == prefill_flops(**kw, computed_positions=range(50))
    assert flops_fraction(SHAPE, range(50), 50) == pytest.approx(1.0)
    # the same number of late tokens costs more than early ones (longer attention)
    late = flops_fraction(SHAPE, range(40, 50), 50)
    early = flops_fraction(SHAPE, range(10), 50)
    assert early < late < 1.0


def test_errors_and_from_config():
    kw = SHAPE.as_kwargs()
    with pytest.raises(ValueError):
        prefill_flops(**kw, computed_positions=[-1])
    with pytest.raises(ValueError):
        prefill_flops(**kw, computed_positions=[1], layers_per_position=3)
    cfg = SimpleNamespace(
        num_hidden_layers=30,
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    shape = ModelShape.from_config(cfg)
    assert shape.head_dim == 64 and shape.num_kv_heads == 3 and shape.num_layers == 30


def test_token_flops_sum_to_the_prefill_flops() -> None:
    positions, layers = [0, 5, 9], [2, 1, 2]
    assert int(token_flops(SHAPE, positions, layers).sum()) == prefill_flops(
        **SHAPE.as_kwargs(), computed_positions=positions, layers_per_position=layers
    )


def test_matching_by_flops_counts_position() -> None:
    """The same FLOPs buy fewer late tokens than early ones: a baseline ranked toward the end
    of the prompt gets fewer tokens than one ranked toward its start."""
    shape = SHAPE
    target = float(token_flops(shape, range(100, 110)).sum())  # ten tokens mid-prompt
    assert count_for_flops(shape, range(100, 200), target) == 10
    late = count_for_flops(shape, range(900, 1000), target)
    early = count_for_flops(shape, range(0, 100), target)
    assert late < 10 < early
    assert count_for_flops(shape, range(5), 0.0) == 0


def test_arms_off_by_more_than_half_a_point_are_labelled() -> None:
    assert compute_label(0.304, 0.300) == "compute-equal"
    assert compute_label(0.295, 0.300) == "compute-equal"
    assert compute_label(0.312, 0.300) == "not compute-equal (+1.2 pts)"
    assert compute_label(0.280, 0.300) == "not compute-equal (-2.0 pts)"
    assert compute_label(None, 0.3) == "unknown"


def test_epic_gets_one_uniform_k_at_the_target_cost() -> None:
    starts, sizes = [10, 50, 90], [30, 30, 5]
    k4 = [s + i for s, n in zip(starts, sizes, strict=True) for i in range(min(4, n))]
    target = float(token_flops(SHAPE, k4).sum())
    assert uniform_k_for_flops(SHAPE, starts, sizes, target) == 4
    assert uniform_k_for_flops(SHAPE, starts, sizes, 0.0) == 0
    # past the short chunk's length it is recomputed whole, the others go on growing
    k20 = [s + i for s, n in zip(starts, sizes, strict=True) for i in range(min(20, n))]
    assert uniform_k_for_flops(SHAPE, starts, sizes, float(token_flops(SHAPE, k20).sum())) == 20
