"""The check-layer hook on hand-made layer views: CacheBlend's deviation rank and cachecraft's
question-attention-weighted one pick different tokens from the same K/V."""

from __future__ import annotations

import torch

from cachecraft.engine.hooks import DeviationSelect
from cachecraft.model.step import LayerView


def _view(dev: list[float]) -> LayerView:
    """Rows at positions 10..10+n-1, one KV head of width 1: token i's K/V are off by dev[i]."""
    n = len(dev)
    old = torch.zeros(1, n, 1)
    new = torch.tensor(dev).view(1, n, 1)
    return LayerView(
        layer=1,
        positions=torch.arange(10, 10 + n),
        q=torch.zeros(1, n, 1),
        k_new=new,
        v_new=new,
        k_old=old,
        v_old=old,
        keys=torch.zeros(1, 10 + n, 1),
        window=None,
    )


def test_unweighted_check_keeps_the_most_deviating() -> None:
    keep = DeviationSelect(((10, 14, 2),))(_view([1.0, 4.0, 2.0, 3.0]))
    assert keep.tolist() == [False, True, False, True]


def test_weighted_check_ranks_by_attention_times_deviation() -> None:
    weights = torch.zeros(14)
    weights[10:14] = torch.tensor([0.9, 0.01, 0.5, 0.1])  # question attention by position
    keep = DeviationSelect(((10, 14, 0),), total=2, weights=weights)(_view([1.0, 4.0, 2.0, 3.0]))
    # |dK, dV| = sqrt(2) x dev: 0.9 x 1, 0.01 x 4, 0.5 x 2, 0.1 x 3 -> tokens 2 (1.0), 0 (0.9)
    assert keep.tolist() == [True, False, True, False]


def test_rows_outside_the_spans_always_go_on() -> None:
    keep = DeviationSelect(((11, 13, 1),))(_view([5.0, 1.0, 2.0, 5.0]))
    assert keep.tolist() == [True, False, True, True]


def test_a_sink_keeps_each_spans_first_tokens_then_the_most_deviating() -> None:
    dev = [1.0, 4.0, 2.0, 3.0]  # positions 10..13
    # per span: token 10 first (sink 1), then the one left of the budget by deviation (11)
    keep = DeviationSelect(((10, 14, 2),), sink=1)(_view(dev))
    assert keep.tolist() == [True, True, False, False]
    # global: two spans (10-11, 12-13), total 3: both first tokens, then the larger rest (11)
    keep = DeviationSelect(((10, 12, 0), (12, 14, 0)), total=3, sink=1)(_view(dev))
    assert keep.tolist() == [True, True, True, False]
    # a total smaller than the sinks keeps the first spans' first tokens only
    keep = DeviationSelect(((10, 12, 0), (12, 14, 0)), total=1, sink=1)(_view(dev))
    assert keep.tolist() == [True, False, False, False]
