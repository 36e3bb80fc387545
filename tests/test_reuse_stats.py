"""Hand-computed checks of the reuse arithmetic: CCI, beta, gamma, CFO and top-N selection."""

from __future__ import annotations

import json
import math

import pytest

from cachecraft.config import ReuseConfig
from cachecraft.reuse.selectors import top_scored as top_tokens
from cachecraft.reuse.stats import (
    Scoring,
    cache_fix_overhead,
    cci,
    order_penalty,
    prefix_overlap,
    stats_layers,
)
from cachecraft.store.codec import meta_from_json, meta_to_json
from cachecraft.store.meta import VariantMeta


def meta(s_old: tuple[str, ...], totals: tuple[float, ...], cci_value: float = 0.8) -> VariantMeta:
    """A one-layer variant of a 4-token chunk whose layer-summed inter mass is `totals`."""
    return VariantMeta(
        chunk_key="K",
        prefix_key="P",
        s_old=s_old,
        s_old_sizes=tuple(4 for _ in s_old),
        num_tokens=4,
        num_layers=1,
        inter=tuple((t,) for t in totals),
        intra=(1.0,),
        token_scores=(0.0, 0.0, 0.0, 0.0),
        cci=cci_value,
    )


# --- CCI ---------------------------------------------------------------------------------------


def test_cci_without_old_chunks_is_half() -> None:
    assert cci([], [3.0, 2.0], [], 4) == 0.5


def test_cci_worked_example_one_old_chunk() -> None:
    # abar = mean(2/(2*4), 4/(2*4)) = 0.375; bbar = mean(2/4, 2/4) = 0.5; ratio 0.75
    assert cci([[2.0, 4.0]], [2.0, 2.0], [4], 2) == pytest.approx(1 / (1 + math.exp(-0.75)))


def test_cci_worked_example_two_old_chunks() -> None:
    # per layer: 1/(2*2) + 3/(2*3) = 0.75 -> abar 0.75; bbar = 1/4 = 0.25; ratio 3
    value = cci([[1.0, 1.0], [3.0, 3.0]], [1.0, 1.0], [2, 3], 2)
    assert value == pytest.approx(1 / (1 + math.exp(-3.0)))
    assert value == pytest.approx(0.9525741268)


def test_cci_guards_zero_intra() -> None:
    assert cci([[1.0, 0.0]], [0.0, 0.0], [2], 2) == 1.0
    assert cci([[0.0, 0.0]], [0.0, 0.0], [2], 2) == 0.5


def test_cci_no_external_attention_is_half() -> None:
    assert cci([[0.0]], [1.0], [3], 3) == 0.5


# --- beta --------------------------------------------------------------------------------------


def test_beta_empty_s_old_paper_rule_is_one() -> None:
    assert prefix_overlap(meta((), ()), ["A", "B"], "paper") == 1.0
    assert prefix_overlap(meta((), ()), [], "paper") == 1.0


def test_beta_empty_s_old_safe_rule() -> None:
    assert prefix_overlap(meta((), ()), ["A"], "safe") == 0.0
    assert prefix_overlap(meta((), ()), [], "safe") == 1.0


def test_beta_disjoint_is_zero() -> None:
    assert prefix_overlap(meta(("A", "B"), (1.0, 2.0)), ["X", "Y"], "safe") == 0.0


def test_beta_same_set_reordered_is_one() -> None:
    assert prefix_overlap(meta(("A", "B", "C"), (1.0, 2.0, 3.0)), ["C", "B", "A"], "safe") == 1.0


def test_beta_partial_overlap_weights_by_inter_mass() -> None:
    m = meta(("A", "B", "C"), (1.0, 3.0, 6.0))  # total 10
    assert prefix_overlap(m, ["B"], "safe") == pytest.approx(0.3)
    assert prefix_overlap(m, ["C", "X", "A"], "safe") == pytest.approx(0.7)


def test_beta_zero_mass_falls_back_to_set_overlap() -> None:
    m = meta(("A", "B", "C", "D"), (0.0, 0.0, 0.0, 0.0))
    assert prefix_overlap(m, ["C", "A", "X"], "safe") == 0.5


def test_beta_unknown_rule_raises() -> None:
    with pytest.raises(ValueError):
        prefix_overlap(meta((), ()), [], "lenient")  # type: ignore[arg-type]


# --- gamma -------------------------------------------------------------------------------------


def test_gamma_full_reversal_of_three_is_one() -> None:
    assert order_penalty(["A", "B", "C"], ["C", "B", "A"]) == 1.0


def test_gamma_one_swap_of_three() -> None:
    assert order_penalty(["A", "B", "C"], ["B", "A", "C"]) == pytest.approx(1 / 3)


def test_gamma_same_order_is_zero() -> None:
    assert order_penalty(["A", "B", "C"], ["X", "A", "B", "Y", "C"]) == 0.0


def test_gamma_fewer_than_two_common_is_zero() -> None:
    assert order_penalty(["A"], ["A", "B"]) == 0.0
    assert order_penalty(["A", "B"], ["C", "D"]) == 0.0
    assert order_penalty([], []) == 0.0


def test_gamma_counts_only_common_chunks() -> None:
    # common chunks B, C appear in reversed order: m = 2, D = 1
    assert order_penalty(["A", "B", "C"], ["X", "C", "B", "Y"]) == 1.0


# --- CFO ---------------------------------------------------------------------------------------


def test_cfo_formula_with_order_penalty() -> None:
    # beta' = 0.5 * 0.5 = 0.25; CFO = 0.5 * 0.8 * 0.75 = 0.3
    beta_adj, cfo = cache_fix_overhead(0.8, 0.5, 0.5, Scoring(alpha=0.5), False)
    assert beta_adj == pytest.approx(0.25)
    assert cfo == pytest.approx(0.3)


def test_cfo_order_penalty_off() -> None:
    config = Scoring(alpha=0.5, use_order_penalty=False)
    beta_adj, cfo = cache_fix_overhead(0.8, 0.5, 0.5, config, False)
    assert beta_adj == 0.5
    assert cfo == pytest.approx(0.2)


def test_cfo_min_and_max_fix_clamp() -> None:
    assert cache_fix_overhead(0.8, 0.5, 0.5, Scoring(min_fix=0.4), False)[1] == 0.4
    assert cache_fix_overhead(0.8, 0.5, 0.5, Scoring(max_fix=0.1), False)[1] == 0.1
    assert cache_fix_overhead(0.8, 1.0, 0.0, Scoring(min_fix=0.2), False)[1] == 0.2


def test_cfo_novel_prefix_floor() -> None:
    config = Scoring(novel_prefix_min_fix=0.5)
    assert cache_fix_overhead(0.8, 0.5, 0.5, config, True)[1] == 0.5
    assert cache_fix_overhead(0.8, 0.5, 0.5, config, False)[1] == pytest.approx(0.3)
    capped = Scoring(novel_prefix_min_fix=0.5, max_fix=0.4)
    assert cache_fix_overhead(0.8, 0.5, 0.5, capped, True)[1] == 0.4


def test_cfo_huge_alpha_is_one() -> None:
    assert cache_fix_overhead(0.6, 0.1, 0.0, Scoring(alpha=1e9), False)[1] == 1.0


def test_cfo_full_overlap_is_zero() -> None:
    assert cache_fix_overhead(0.99, 1.0, 0.0, Scoring(alpha=1e9), False)[1] == 0.0


# --- top-N -------------------------------------------------------------------------------------


def test_top_tokens_returns_sorted_offsets_of_highest() -> None:
    assert top_tokens([0.1, 0.9, 0.3, 0.8, 0.2], 2) == (1, 3)


def test_top_tokens_ties_prefer_lower_offset() -> None:
    assert top_tokens([0.5, 0.1, 0.5, 0.5], 2) == (0, 2)
    assert top_tokens([0.0, 0.0, 0.0], 1) == (0,)


def test_top_tokens_bounds() -> None:
    assert top_tokens([0.3, 0.2], 0) == ()
    assert top_tokens([0.3, 0.2], 5) == (0, 1)
    assert top_tokens([], 3) == ()


# --- statistics at a subset of layers ----------------------------------------------------------


def test_stats_layers_take_the_middle_of_every_run() -> None:
    assert stats_layers(1, 4) == (0, 1, 2, 3)
    assert stats_layers(3, 30) == tuple(range(1, 30, 3))
    assert stats_layers(2, 5) == (1, 3)
    assert stats_layers(100, 30) == (14,)  # a stride longer than the model: its middle layer
    assert stats_layers(3, 1) == (0,)
    with pytest.raises(ValueError):
        stats_layers(0, 4)
    with pytest.raises(ValueError):
        ReuseConfig(stats_stride=0)


def _layered(stats: tuple[int, ...], width: int) -> VariantMeta:
    return VariantMeta(
        chunk_key="K",
        prefix_key="P",
        s_old=("A",),
        s_old_sizes=(4,),
        num_tokens=2,
        num_layers=4,
        inter=(tuple(0.1 * (k + 1) for k in range(width)),),
        intra=tuple(1.0 for _ in range(width)),
        token_scores=(0.0, 0.0),
        cci=0.7,
        stats_layers=stats,
    )


def test_meta_holds_one_value_per_measured_layer() -> None:
    assert _layered((1, 3), 2).inter_total() == pytest.approx((0.3,))
    assert _layered((), 4).stats_layers == ()  # every layer
    for stats, width in (((1, 3), 4), ((), 2), ((3, 1), 2), ((1, 1), 2), ((2, 4), 2)):
        with pytest.raises(ValueError):
            _layered(stats, width)


def test_meta_json_keeps_stats_layers_and_reads_older_metadata() -> None:
    m = _layered((1, 3), 2)
    assert meta_from_json(meta_to_json(m)) == m
    old = json.loads(meta_to_json(_layered((), 4)))
    del old["stats_layers"]  # metadata written before the field: every layer was measured
    assert meta_from_json(json.dumps(old)).stats_layers == ()
