"""Analytic prefill FLOPs: hand-computed small cases, full == all positions, partial < full."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cachecraft_bench.flops import (
    ModelShape,
    flops_fraction,
    full_prefill_flops,
    prefill_flops,
    token_layer_flops,
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
