"""Planner scenarios on a small hand-made layout, one per mode, plus the chunk and prefix keys.
Plans are pure data: nothing here imports torch.

Layout used throughout: prefix (3 tokens) | A (4) | B (5) | C (3) | question (2) = 17 positions.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from plan_helpers import make_layout, settings

from cachecraft.errors import BadRequestError
from cachecraft.reuse.keys import chunk_key, prefix_key
from cachecraft.reuse.plan import PromptLayout, RecomputePlan
from cachecraft.reuse.planner import (
    as_miss,
    choose_variant,
    matched_budgets,
    plan_request,
    resolve_probe,
    without_prefix_hit,
)
from cachecraft.reuse.stats import Scoring
from cachecraft.store.meta import VariantMeta
from cachecraft_bench.modes import LAB_MODES as MODES

SIZES = {"A": 4, "B": 5, "C": 3, "D": 10, "X": 6}
B_SCORES = (0.1, 0.5, 0.3, 0.5, 0.2)


def layout(*keys: str, prefix: str = "P") -> PromptLayout:
    return make_layout(keys, SIZES, prefix)


def variant(
    key: str,
    s_old: tuple[str, ...],
    inter: tuple[float, ...] = (),
    cci: float = 0.8,
    prefix: str = "P",
    scores: tuple[float, ...] | None = None,
    exact: bool = True,
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
        is_exact=exact,
    )


# A cached alone after P (exact at position 0); B cached after (X, A) with mass X=3, A=1, so in
# the layout (A, B, C): beta = 1/4, gamma = 0, beta' = 0.25, CFO = 0.5 * 0.8 * 0.75 = 0.3 and
# N = ceil(0.3 * 5) = 2 -> offsets (1, 3) by B_SCORES. C has no variant.
V_A = variant("A", ())
V_B = variant("B", ("X", "A"), (3.0, 1.0), scores=B_SCORES)
VARIANTS = {"A": [V_A], "B": [V_B]}
CONFIG = dict(alpha=0.5, beta_rule="paper")
HONEST = Scoring(alpha=0.5)


def plan(
    mode: str, variants=VARIANTS, config=CONFIG, budgets=None, lay=None, prefix_hit=True
) -> RecomputePlan:
    lay = lay or layout("A", "B", "C")
    strategy, reuse = settings(mode, config, shared=True)
    return plan_request(lay, variants, strategy, reuse, 30, budgets, prefix_hit)


def counts(p: RecomputePlan) -> list[int]:
    return [c.num_recompute for c in p.chunks]


def test_planner_never_imports_torch() -> None:
    code = (
        "import sys, cachecraft.reuse.planner, cachecraft.reuse.keys; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_mode_names_valid_modes() -> None:
    with pytest.raises(BadRequestError, match="unknown mode 'magic'; choose one of full, prefix, "):
        plan("magic")


def test_budgets_of_wrong_length_raise() -> None:
    with pytest.raises(ValueError):
        plan("random", budgets=[1])


def test_full_mode_reuses_nothing() -> None:
    p = plan("full")
    assert not p.prefix_hit and not p.make_variants
    assert all(c.variant is None for c in p.chunks)
    assert [c.recompute for c in p.chunks] == [(0, 1, 2, 3), (0, 1, 2, 3, 4), (0, 1, 2)]
    assert p.num_rows == 17 == p.layout.num_tokens
    assert p.rows() == tuple(range(17))
    assert p.early_exit is None and p.deviation is None and p.probe is None


@pytest.mark.parametrize("mode", [m for m in MODES if m != "full"])
def test_every_reuse_mode_serves_the_system_prefix_from_cache(mode: str) -> None:
    assert plan(mode).prefix_hit
    assert 0 not in resolved(plan(mode)).rows()
    config = dict(CONFIG, probe_max_cost=None)  # the prefix's rows keep the probe
    missed = plan(mode, config=config, prefix_hit=False)
    assert missed.num_rows == plan(mode, config=config).num_rows + 3


def resolved(p: RecomputePlan) -> RecomputePlan:
    """A probe plan resolved with attention rising along each chunk (last tokens read most)."""
    att = [
        None if c.variant is None else [t + 1.0 for t in range(c.slot.num_tokens)] for c in p.chunks
    ]
    return resolve_probe(p, att)


def test_prefix_mode_reuses_exact_leading_chunks() -> None:
    variants = {"A": [V_A], "B": [variant("B", ("A",), scores=B_SCORES)]}
    p = plan("prefix", variants)
    a, b, c = p.chunks
    assert a.variant is V_A and b.variant is not None and c.variant is None
    assert a.recompute == () and b.recompute == () and c.recompute == (0, 1, 2)
    assert (b.beta, b.gamma, b.beta_adj, b.cfo, b.cci) == (1.0, 0.0, 1.0, 0.0, 0.8)
    assert [c.is_exact for c in p.chunks] == [True, True, True]
    assert p.num_rows == 3 + 2
    assert p.rows() == (12, 13, 14, 15, 16)


def test_prefix_mode_stops_at_first_mismatch() -> None:
    # B's only variant was cached after (X, A): no exact match, so C's exact variant is unusable.
    variants = {"A": [V_A], "B": [V_B], "C": [variant("C", ("A", "B"))]}
    p = plan("prefix", variants)
    assert [c.is_hit for c in p.chunks] == [True, False, False]
    assert p.num_rows == 5 + 3 + 2


def test_prefix_mode_requires_the_same_prefix_key() -> None:
    variants = {"A": [variant("A", (), prefix="Q")]}
    p = plan("prefix", variants)
    assert not any(c.is_hit for c in p.chunks)
    assert p.num_rows == 14


def test_naive_recomputes_nothing_in_hits() -> None:
    p = plan("naive")
    assert [c.recompute for c in p.chunks] == [(), (), (0, 1, 2)]
    b = p.chunks[1]
    assert b.beta == pytest.approx(0.25) and b.gamma == 0.0 and b.cfo == pytest.approx(0.3)
    assert p.num_rows == 2 + 3
    assert p.early_exit is None


def test_cachecraft_paper_recomputes_ceil_cfo_n_top_scored_tokens() -> None:
    p = plan("cachecraft-paper")
    a, b, c = p.chunks
    assert a.cfo == 0.0 and a.recompute == ()
    assert b.cfo == pytest.approx(0.3)
    assert b.recompute == (1, 3)  # ceil(0.3 * 5) = 2 highest of B_SCORES
    assert c.variant is None and c.recompute == (0, 1, 2)
    assert p.num_rows == 2 + 0 + 2 + 3
    assert p.rows() == (8, 10, 12, 13, 14, 15, 16)
    assert p.early_exit is not None and (p.early_exit.layer, p.early_exit.threshold) == (10, 0.05)
    assert p.probe is None


def test_cachecraft_paper_early_termination_settings() -> None:
    assert plan("cachecraft-paper", config=dict(et_layer=5)).early_exit.layer == 5
    off = plan("cachecraft-paper", config=dict(early_termination=False))
    assert off.early_exit is None


def test_cachecraft_float_noise_does_not_add_a_token() -> None:
    # alpha * CCI * (1 - beta') = 0.6 * 0.5 * 1 = 0.3, and 0.3 * 10 is 3.0000000000000004 in floats
    lay = layout("A", "D")
    p = plan_request(
        lay, {"D": [variant("D", ())]}, *settings("cachecraft-paper", {"alpha": 0.6}), 30
    )
    assert p.chunks[1].num_recompute == 3


def test_novel_prefix_floor_applies_only_to_novel_prefixes() -> None:
    # B's new prefix (A) is inside its S_old (X, A); C's new prefix (A, B) holds B, absent from (A,).
    variants = {**VARIANTS, "C": [variant("C", ("A",))]}
    p = plan("cachecraft-paper", variants, config=dict(novel_prefix_min_fix=0.6))
    assert p.chunks[1].cfo == pytest.approx(0.3)
    assert p.chunks[2].cfo == 0.6 and p.chunks[2].num_recompute == 2  # ceil(0.6 * 3)


def test_huge_alpha_recomputes_every_token() -> None:
    # B first (beta 0: its S_old is gone), A after B (S_old empty, 'safe' rule: beta 0).
    for mode in ("cachecraft-paper", "cachecraft"):
        p = resolved(plan(mode, config=dict(alpha=1e9), lay=layout("B", "A")))
        assert [c.cfo for c in p.chunks] == [1.0, 1.0]
        assert [c.recompute for c in p.chunks] == [(0, 1, 2, 3, 4), (0, 1, 2, 3)]
        assert p.num_rows == p.layout.num_tokens - 3


def test_variant_choice_picks_lowest_cfo() -> None:
    exact = variant("B", ("A",), cci=0.9, prefix="Q")  # beta 1 -> CFO 0
    p = plan("cachecraft-paper", {"A": [V_A], "B": [V_B, exact]})
    assert p.chunks[1].variant is exact
    assert p.chunks[1].recompute == ()


def test_variant_choice_ties_prefer_larger_beta_adj_then_first() -> None:
    config = Scoring(min_fix=0.9, beta_rule="paper")  # every CFO clamps to 0.9
    low = variant("B", ("X",))  # beta 0
    high = variant("B", ("A",))  # beta 1
    assert choose_variant([low, high], ("A",), config).variant is high
    twin = variant("B", ("X",), cci=0.7)
    assert choose_variant([low, twin], ("A",), config).variant is low
    assert choose_variant([], ("A",), config) is None
    # honest: the CFO tie does not matter, the lower predicted error (CCI 0.7 x 1) wins
    assert choose_variant([low, twin], ("A",), HONEST, s_new_sizes=(4,)).variant is twin


def test_repeated_chunk_is_planned_per_occurrence() -> None:
    scores = (0.1, 0.9, 0.2, 0.3)
    variants = {"A": [variant("A", (), scores=scores)]}
    p = plan("cachecraft-paper", variants, lay=layout("A", "B", "A"))
    first, _, second = p.chunks
    assert first.cfo == 0.0 and first.recompute == ()
    # S_new = (A, B), S_old empty, 'safe' -> beta 0 -> CFO = 0.5 * 0.5 = 0.25 -> 1 token
    assert second.cfo == pytest.approx(0.25) and second.recompute == (1,)


def test_matched_budgets_for_baselines() -> None:
    budgets = matched_budgets(plan("cachecraft-paper"))
    assert budgets == [0, 2, None]
    for mode in ("random", "epic", "cacheblend"):
        p = plan(mode, budgets=budgets)
        assert counts(p) == [0, 2, 3], mode
    assert plan("epic", budgets=budgets).num_rows == plan("cachecraft-paper").num_rows
    p = resolved(plan("prophet", budgets=budgets))
    assert sum(c.num_recompute for c in p.chunks if c.is_hit) == 2


def test_matched_budgets_spread_extra_tokens_over_reused_chunks() -> None:
    # A (4 tokens, 0 planned) and B (5, 2 planned): 3 extra go 4:5 by size, within room.
    assert matched_budgets(plan("cachecraft-paper"), extra=3) == [1, 4, None]
    assert matched_budgets(plan("cachecraft-paper"), extra=99) == [4, 5, None]
    # a negative extra (a mode's own probe out of the same total) comes off the largest
    assert matched_budgets(plan("cachecraft-paper"), extra=-1) == [0, 1, None]
    assert matched_budgets(plan("cachecraft-paper"), extra=-9) == [0, 0, None]


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
    p = plan("epic", config=dict(epic_k=2))
    assert [c.recompute for c in p.chunks] == [(0, 1), (0, 1), (0, 1, 2)]
    assert [c.recompute for c in plan("epic", budgets=[1, 3, None]).chunks][:2] == [(0,), (0, 1, 2)]


def test_cacheblend_leaves_selection_to_the_runner() -> None:
    p = plan("cacheblend")
    a, b, c = p.chunks
    assert a.select == "deviation" and a.budget == 1  # ceil(0.15 * 4)
    assert a.recompute == (0, 1, 2, 3)  # every token is a candidate at the check
    assert b.select == "deviation" and b.budget == 1  # ceil(0.15 * 5)
    assert c.select == "planned" and c.recompute == (0, 1, 2)
    assert p.deviation is not None and p.deviation.layer == 1 and p.deviation.total is None
    assert p.early_exit is None
    assert p.num_rows == 2 + 4 + 5 + 3  # every reused token runs to the check layer
    g = plan("cacheblend", config=dict(cacheblend_global=True))
    assert g.deviation is not None and g.deviation.total == 2


def test_misses_are_computed_in_full_in_every_mode() -> None:
    for mode in MODES:
        p = plan(mode, variants={})
        assert all(c.variant is None for c in p.chunks), mode
        assert p.num_rows == 17 - 3 * p.prefix_hit, mode
        assert p.probe is None, mode


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


def test_a_vanished_variant_or_prefix_replans_as_computed() -> None:
    p = plan("cachecraft-paper")
    m = as_miss(p, 1)
    assert m.chunks[1].variant is None and m.chunks[1].reason == "vanished"
    assert m.chunks[1].recompute == (0, 1, 2, 3, 4) and m.num_rows == p.num_rows + 3
    assert m.chunks[0].is_exact and m.chunks[1].is_exact  # a miss after an exact chunk
    assert without_prefix_hit(p).num_rows == p.num_rows + 3
    assert without_prefix_hit(p).rows()[:3] == (0, 1, 2)


@pytest.mark.parametrize("check", [0.0, 3.0])
def test_probe_sink_ranks_each_chunks_first_tokens_first(check: float) -> None:
    """With attention rising along each chunk, the probe picks a chunk's last tokens; with
    probe_sink 1 each probed chunk's first token comes first (as a candidate of the check)."""
    base = dict(CONFIG, probe_check=check, probe_sink=0, probe_max_cost=None)
    plain = resolved(plan("cachecraft", config=base))
    sunk = resolved(plan("cachecraft", config=dict(base, probe_sink=1)))
    picked = [c for c in sunk.chunks if c.variant is not None and c.recompute]
    assert picked
    assert all(0 in c.recompute for c in picked)
    assert not any(0 in c.recompute for c in plain.chunks if c.variant is not None)
    assert sum(c.budget for c in sunk.chunks) == sum(c.budget for c in plain.chunks)


def test_a_judged_sink_is_a_candidate_weighed_by_its_own_attention() -> None:
    """probe_sink_kept False: the first token still becomes a check candidate, but the check
    weighs it by its own (lowest) attention, not by the lift; a check without a probe then
    lifts no first tokens."""
    base = dict(CONFIG, probe_check=3.0, probe_sink=1, probe_max_cost=None)
    kept = resolved(plan("cachecraft", config=base))
    judged = resolved(plan("cachecraft", config=dict(base, probe_sink_kept=False)))
    assert [c.recompute for c in kept.chunks] == [c.recompute for c in judged.chunks]
    assert kept.deviation is not None and judged.deviation is not None
    for k, j, c in zip(kept.deviation.weights, judged.deviation.weights, kept.chunks, strict=True):
        if k is None or 0 not in c.recompute:
            continue
        first = c.recompute.index(0)
        assert k[first] == max(k) and j[first] == min(j)  # attention rises along the chunk
    alone = dict(base, probe_max_cost=0.0, probe_trim=False)
    assert plan("cachecraft", config=alone).deviation.sink == 1  # type: ignore[union-attr]
    no_lift = plan("cachecraft", config=dict(alone, probe_sink_kept=False))
    assert no_lift.deviation is not None and no_lift.deviation.sink == 0
