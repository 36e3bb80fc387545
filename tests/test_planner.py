"""Planner scenarios on a small hand-made layout, one per mode, plus the chunk and prefix keys.

Layout used throughout: prefix (3 tokens) | A (4) | B (5) | C (3) | question (2) = 17 positions.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from cachecraft.config import MODES, ReuseConfig
from cachecraft.reuse.keys import chunk_key, prefix_key
from cachecraft.reuse.plan import ChunkSlot, PromptLayout, RecomputePlan
from cachecraft.reuse.planner import cachecraft_budgets, choose_variant, plan_request
from cachecraft.store.meta import VariantMeta

SIZES = {"A": 4, "B": 5, "C": 3, "D": 10, "X": 6}
B_SCORES = (0.1, 0.5, 0.3, 0.5, 0.2)


def layout(*keys: str, prefix: str = "P") -> PromptLayout:
    start, slots = 3, []
    for i, key in enumerate(keys):
        ids = tuple(range(100 * (i + 1), 100 * (i + 1) + SIZES[key]))
        slots.append(ChunkSlot(key=key, label=None, token_ids=ids, start=start))
        start += SIZES[key]
    return PromptLayout(prefix, (1, 2, 3), tuple(slots), (9, 9))


def variant(
    key: str,
    s_old: tuple[str, ...],
    inter: tuple[float, ...] = (),
    cci: float = 0.8,
    prefix: str = "P",
    scores: tuple[float, ...] | None = None,
) -> VariantMeta:
    """A one-layer variant; inter[j] is the mass on s_old[j]."""
    inter = inter or tuple(1.0 for _ in s_old)
    return VariantMeta(
        chunk_key=key,
        prefix_key=prefix,
        s_old=s_old,
        s_old_sizes=tuple(SIZES[k] for k in s_old),
        num_tokens=SIZES[key],
        num_layers=1,
        inter=tuple((m,) for m in inter),
        intra=(1.0,),
        token_scores=scores if scores is not None else tuple(0.0 for _ in range(SIZES[key])),
        cci=cci if s_old else 0.5,
    )


# A cached alone after P (exact at position 0); B cached after (X, A) with mass X=3, A=1, so in
# the layout (A, B, C): beta = 1/4, gamma = 0, beta' = 0.25, CFO = 0.5 * 0.8 * 0.75 = 0.3 and
# N = ceil(0.3 * 5) = 2 -> offsets (1, 3) by B_SCORES. C has no variant.
V_A = variant("A", ())
V_B = variant("B", ("X", "A"), (3.0, 1.0), scores=B_SCORES)
VARIANTS = {"A": [V_A], "B": [V_B]}
CONFIG = ReuseConfig(alpha=0.5)


def plan(mode: str, variants=VARIANTS, config=CONFIG, budgets=None, lay=None) -> RecomputePlan:
    return plan_request(lay or layout("A", "B", "C"), variants, mode, config, 30, budgets)


def counts(p: RecomputePlan) -> list[int]:
    return [c.num_recompute for c in p.chunks]


def test_planner_never_imports_torch() -> None:
    code = (
        "import sys, cachecraft.reuse.planner, cachecraft.reuse.keys; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_mode_names_valid_modes() -> None:
    with pytest.raises(ValueError, match="cachecraft"):
        plan("magic")


def test_budgets_of_wrong_length_raise() -> None:
    with pytest.raises(ValueError):
        plan("random", budgets=[1])


def test_full_mode_reuses_nothing() -> None:
    p = plan("full")
    assert p.prefix_cached == 0
    assert all(c.variant is None for c in p.chunks)
    assert [c.recompute for c in p.chunks] == [(0, 1, 2, 3), (0, 1, 2, 3, 4), (0, 1, 2)]
    assert p.num_planned_compute == 17 == p.layout.num_tokens
    assert p.et_layer is None and p.cacheblend_check_layer is None


@pytest.mark.parametrize("mode", [m for m in MODES if m != "full"])
def test_every_reuse_mode_serves_the_system_prefix_from_cache(mode: str) -> None:
    assert plan(mode).prefix_cached >= 3


def test_prefix_mode_reuses_exact_leading_chunks() -> None:
    variants = {"A": [V_A], "B": [variant("B", ("A",), scores=B_SCORES)]}
    p = plan("prefix", variants)
    a, b, c = p.chunks
    assert a.variant is V_A and b.variant is not None and c.variant is None
    assert a.recompute == () and b.recompute == () and c.recompute == (0, 1, 2)
    assert (b.beta, b.gamma, b.beta_adj, b.cfo, b.cci) == (1.0, 0.0, 1.0, 0.0, 0.8)
    assert p.prefix_cached == 3 + 4 + 5
    assert p.num_planned_compute == 2 + 3


def test_prefix_mode_stops_at_first_mismatch() -> None:
    # B's only variant was cached after (X, A): no exact match, so C's exact variant is unusable.
    variants = {"A": [V_A], "B": [V_B], "C": [variant("C", ("A", "B"))]}
    p = plan("prefix", variants)
    assert [c.is_hit for c in p.chunks] == [True, False, False]
    assert p.prefix_cached == 7
    assert p.num_planned_compute == 5 + 3 + 2


def test_prefix_mode_requires_the_same_prefix_key() -> None:
    variants = {"A": [variant("A", (), prefix="Q")]}
    p = plan("prefix", variants)
    assert not any(c.is_hit for c in p.chunks)
    assert p.prefix_cached == 3
    assert p.num_planned_compute == 14


def test_naive_recomputes_nothing_in_hits() -> None:
    p = plan("naive")
    assert [c.recompute for c in p.chunks] == [(), (), (0, 1, 2)]
    b = p.chunks[1]
    assert b.beta == pytest.approx(0.25) and b.gamma == 0.0 and b.cfo == pytest.approx(0.3)
    assert p.num_planned_compute == 2 + 3
    assert p.et_layer is None


def test_cachecraft_recomputes_ceil_cfo_n_top_scored_tokens() -> None:
    p = plan("cachecraft")
    a, b, c = p.chunks
    assert a.cfo == 0.0 and a.recompute == ()
    assert b.cfo == pytest.approx(0.3)
    assert b.recompute == (1, 3)  # ceil(0.3 * 5) = 2 highest of B_SCORES
    assert c.variant is None and c.recompute == (0, 1, 2)
    assert p.num_planned_compute == 2 + 0 + 2 + 3
    assert all(c.last_layer is None for c in p.chunks)
    assert (p.et_layer, p.focus_threshold) == (10, 0.05)


def test_cachecraft_early_termination_settings() -> None:
    assert plan("cachecraft", config=ReuseConfig(et_layer=5)).et_layer == 5
    off = plan("cachecraft", config=ReuseConfig(early_termination=False))
    assert off.et_layer is None and off.focus_threshold is None


def test_cachecraft_float_noise_does_not_add_a_token() -> None:
    # alpha * CCI * (1 - beta') = 0.6 * 0.5 * 1 = 0.3, and 0.3 * 10 is 3.0000000000000004 in floats
    lay = layout("A", "D")
    p = plan_request(lay, {"D": [variant("D", ())]}, "cachecraft", ReuseConfig(alpha=0.6), 30)
    assert p.chunks[1].num_recompute == 3


def test_novel_prefix_floor_applies_only_to_novel_prefixes() -> None:
    # B's new prefix (A) is inside its S_old (X, A); C's new prefix (A, B) holds B, absent from (A,).
    variants = {**VARIANTS, "C": [variant("C", ("A",))]}
    p = plan("cachecraft", variants, config=ReuseConfig(novel_prefix_min_fix=0.6))
    assert p.chunks[1].cfo == pytest.approx(0.3)
    assert p.chunks[2].cfo == 0.6 and p.chunks[2].num_recompute == 2  # ceil(0.6 * 3)


def test_huge_alpha_recomputes_every_token() -> None:
    # B first (beta 0: its S_old is gone), A after B (S_old empty, 'safe' rule: beta 0).
    p = plan("cachecraft", config=ReuseConfig(alpha=1e9), lay=layout("B", "A"))
    assert [c.cfo for c in p.chunks] == [1.0, 1.0]
    assert [c.recompute for c in p.chunks] == [(0, 1, 2, 3, 4), (0, 1, 2, 3)]
    assert p.num_planned_compute == p.layout.num_tokens - 3


def test_variant_choice_picks_lowest_cfo() -> None:
    exact = variant("B", ("A",), cci=0.9, prefix="Q")  # beta 1 -> CFO 0
    p = plan("cachecraft", {"A": [V_A], "B": [V_B, exact]})
    assert p.chunks[1].variant is exact
    assert p.chunks[1].recompute == ()


def test_variant_choice_ties_prefer_larger_beta_adj_then_first() -> None:
    config = ReuseConfig(min_fix=0.9)  # every CFO clamps to 0.9
    low = variant("B", ("X",))  # beta 0
    high = variant("B", ("A",))  # beta 1
    assert choose_variant([low, high], ("A",), config).variant is high
    twin = variant("B", ("X",), cci=0.7)
    assert choose_variant([low, twin], ("A",), config).variant is low
    assert choose_variant([], ("A",), config) is None


def test_repeated_chunk_is_planned_per_occurrence() -> None:
    scores = (0.1, 0.9, 0.2, 0.3)
    variants = {"A": [variant("A", (), scores=scores)]}
    p = plan("cachecraft", variants, lay=layout("A", "B", "A"))
    first, _, second = p.chunks
    assert first.cfo == 0.0 and first.recompute == ()
    # S_new = (A, B), S_old empty, 'safe' -> beta 0 -> CFO = 0.5 * 0.5 = 0.25 -> 1 token
    assert second.cfo == pytest.approx(0.25) and second.recompute == (1,)


def test_matched_budgets_for_baselines() -> None:
    budgets = cachecraft_budgets(plan("cachecraft"))
    assert budgets == [0, 2, None]
    for mode in ("random", "epic", "cacheblend"):
        p = plan(mode, budgets=budgets)
        assert counts(p) == [0, 2, 3], mode
        assert p.num_planned_compute == plan("cachecraft").num_planned_compute


def test_random_defaults_to_cachecraft_count_and_is_deterministic() -> None:
    p = plan("random")
    assert counts(p) == [0, 2, 3]
    b = p.chunks[1].recompute
    assert len(set(b)) == 2 and list(b) == sorted(b) and all(0 <= t < 5 for t in b)
    assert plan("random").chunks[1].recompute == b


def test_random_explicit_budgets_clamp_and_skip_misses() -> None:
    p = plan("random", budgets=[99, None, 1])
    assert p.chunks[0].recompute == (0, 1, 2, 3)
    assert p.chunks[1].num_recompute == 2  # None -> the cachecraft count
    assert p.chunks[2].recompute == (0, 1, 2)  # a miss is computed in full regardless


def test_epic_recomputes_the_first_tokens() -> None:
    assert [c.recompute for c in plan("epic").chunks] == [(0, 1, 2, 3), (0, 1, 2, 3, 4), (0, 1, 2)]
    p = plan("epic", config=ReuseConfig(epic_k=2))
    assert [c.recompute for c in p.chunks] == [(0, 1), (0, 1), (0, 1, 2)]
    assert [c.recompute for c in plan("epic", budgets=[1, 3, None]).chunks][:2] == [(0,), (0, 1, 2)]


def test_cacheblend_leaves_selection_to_the_runner() -> None:
    p = plan("cacheblend")
    a, b, c = p.chunks
    assert a.recompute == () and a.deviation_budget == 1  # ceil(0.15 * 4)
    assert b.recompute == () and b.deviation_budget == 1  # ceil(0.15 * 5)
    assert c.deviation_budget is None and c.recompute == (0, 1, 2)
    assert p.cacheblend_check_layer == 1 and p.et_layer is None
    assert p.num_planned_compute == 2 + 1 + 1 + 3


def test_misses_are_computed_in_full_in_every_mode() -> None:
    for mode in MODES:
        p = plan(mode, variants={})
        assert all(c.variant is None for c in p.chunks), mode
        assert p.num_planned_compute == 17 - p.prefix_cached, mode


def test_variant_of_another_size_is_ignored() -> None:
    wrong = variant("X", ())  # 6 tokens, filed under A's key (4 tokens)
    assert not plan("naive", {"A": [wrong]}).chunks[0].is_hit


# --- keys --------------------------------------------------------------------------------------


def test_chunk_key_is_stable_and_scoped() -> None:
    key = chunk_key("model-1", "tenant", [1, 2, 3])
    assert key == chunk_key("model-1", "tenant", (1, 2, 3))
    assert len(key) == 32 and int(key, 16) >= 0
    assert key != chunk_key("model-1", "other", [1, 2, 3])
    assert key != chunk_key("model-2", "tenant", [1, 2, 3])
    assert key != chunk_key("model-1", "tenant", [1, 2, 4])
    assert key != chunk_key("model-1", "tenant", [1, 2])


def test_keys_have_unambiguous_fields() -> None:
    assert chunk_key("ab", "c", [1]) != chunk_key("a", "bc", [1])
    assert chunk_key("m", "", []) != chunk_key("", "m", [])


def test_prefix_key_differs_from_chunk_key() -> None:
    assert prefix_key("m", "t", [5, 6]) == prefix_key("m", "t", [5, 6])
    assert prefix_key("m", "t", [5, 6]) != chunk_key("m", "t", [5, 6])
