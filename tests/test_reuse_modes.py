"""Plans of the v2 rules as pure data (no torch): honest beta with new chunks in front, the
prefix-key penalty, exactness, refresh, the question probe's selection and the prophet mode.

Layout as in test_planner: prefix (3) | chunks | question (2); sizes A 4, B 5, C 3, X 6, Y 6.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from plan_helpers import make_layout, settings

from cachecraft.reuse.cachecraft import CachecraftParams
from cachecraft.reuse.plan import PromptLayout, RecomputePlan
from cachecraft.reuse.planner import plan_request, resolve_probe
from cachecraft.reuse.stats import Scoring
from cachecraft.reuse.variant_choice import choose_variant, honest_overlap
from cachecraft.store.meta import VariantMeta

SIZES = {"A": 4, "B": 5, "C": 3, "X": 6, "Y": 6}


def layout(*keys: str, prefix: str = "P") -> PromptLayout:
    return make_layout(keys, SIZES, prefix)


def variant(key, s_old=(), inter=(), cci=0.8, prefix="P", exact=True, scores=None) -> VariantMeta:
    inter = inter or tuple(1.0 for _ in s_old)
    return VariantMeta(
        chunk_key=key,
        prefix_key=prefix,
        s_old=tuple(s_old),
        s_old_sizes=tuple(SIZES[k] for k in s_old),
        num_tokens=SIZES[key],
        num_layers=1,
        inter=tuple((m,) for m in inter),
        intra=(1.0,),
        token_scores=scores or tuple(0.0 for _ in range(SIZES[key])),
        cci=cci if s_old else 0.5,
        is_exact=exact,
    )


def plan(mode, variants, lay, config=None, budgets=None) -> RecomputePlan:
    # These chunks are a few tokens, so a probe's candidates would be all of them and
    # probe_skip_wide would skip every probe: the probe's tests keep it (its own test says).
    if mode == "cachecraft":
        config = {"probe_skip_wide": False, **(config or {})}
    strategy, reuse = settings(mode, config)
    return plan_request(lay, variants, strategy, reuse, 30, budgets)


def test_modes_never_import_torch() -> None:
    code = "import sys, cachecraft.reuse.modes, cachecraft.reuse.selectors; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- honest beta and variant choice -------------------------------------------------------------


def test_new_chunks_in_front_lower_honest_beta_but_not_paper_beta() -> None:
    # B cached after (A) alone; reused after (X, Y, A): X, Y (12 tokens) were never in S_old.
    v = variant("B", ("A",), (2.0,))
    s_new, sizes = ("X", "Y", "A"), (6, 6, 4)
    # paper: all of S_old's mass is still in front -> beta 1, CFO 0, nothing recomputed
    paper = choose_variant([v], s_new, Scoring(beta_rule="paper"))
    assert paper.beta == 1.0 and paper.cfo == 0.0
    # honest: 2.0 mass on 4 old tokens -> 0.5 per token -> 6.0 expected on 12 new tokens
    assert honest_overlap(v, s_new, sizes, "safe") == pytest.approx(2.0 / (2.0 + 6.0))
    honest = choose_variant([v], s_new, Scoring(), s_new_sizes=sizes)
    assert honest.beta == pytest.approx(0.25)
    assert honest.error == pytest.approx(0.8 * 0.75) and honest.cfo == pytest.approx(0.3)


def test_stale_variant_loses_to_one_with_more_context_in_front() -> None:
    stale = variant("B", ("A",), cci=0.6)  # paper: beta 1 after (X, A), CFO 0 -> preferred
    fresh = variant("B", ("X", "A"), cci=0.9, exact=False)
    s_new, sizes = ("X", "A"), (6, 4)
    assert choose_variant([stale, fresh], s_new, Scoring(beta_rule="paper")).variant is stale
    got = choose_variant([stale, fresh], s_new, Scoring(), s_new_sizes=sizes)
    assert got.variant is fresh and got.error == 0.0
    assert not got.is_exact_here  # its K/V were made after reused chunks: right context only


def test_prefix_key_mismatch_is_penalised() -> None:
    same = variant("B", ("A",), cci=0.8)
    other = variant("B", ("A",), cci=0.8, prefix="Q")
    config = Scoring(prefix_mismatch_penalty=0.5)
    s_new = ("A",)
    assert choose_variant([same], s_new, config, s_new_sizes=(4,), prefix_key="P").error == 0.0
    got = choose_variant([other], s_new, config, s_new_sizes=(4,), prefix_key="P")
    assert got.beta_adj == pytest.approx(0.5) and got.error == pytest.approx(0.4)
    assert got.cfo == pytest.approx(0.5 * 0.8 * 0.5)
    # listed first, the mismatched one still loses to the matching one
    both = choose_variant([other, same], s_new, config, s_new_sizes=(4,), prefix_key="P")
    assert both.variant is same


def test_variant_choice_prefers_exact_at_equal_error() -> None:
    approx = variant("B", ("A",), exact=False)
    exact = variant("B", ("A",), exact=True)
    got = choose_variant([approx, exact], ("A",), Scoring(), s_new_sizes=(4,))
    assert got.variant is exact and got.is_exact_here


# ---- exactness ---------------------------------------------------------------------------------


def test_exactness_follows_exact_context_only() -> None:
    lay = layout("A", "B", "C")
    variants = {"A": [variant("A")], "B": [variant("B", ("A",), exact=False)]}
    p = plan("naive", variants, lay)
    # A: exact variant at its exact place; B: right context but approximate K/V; C: a miss
    # after an approximate chunk -> its K/V (and the variant made from them) are approximate.
    assert [c.is_exact for c in p.chunks] == [True, False, False]
    p = plan("prefix", variants, lay)
    assert [c.is_hit for c in p.chunks] == [True, False, False]
    assert [c.is_exact for c in p.chunks] == [True, True, True]


def test_prefix_mode_never_uses_approximate_variants() -> None:
    lay = layout("A", "B")
    approx_a = variant("A", exact=False)
    p = plan("prefix", {"A": [approx_a]}, lay)
    assert not p.chunks[0].is_hit and p.chunks[0].is_exact
    assert plan("naive", {"A": [approx_a]}, lay).chunks[0].is_hit  # other modes may reuse it


def test_exact_and_approximate_variants_have_different_ids() -> None:
    assert variant("A", exact=True).variant_id != variant("A", exact=False).variant_id


# ---- cachecraft: refresh, probe, need ------------------------------------------------------------


def test_refresh_computes_a_stale_chunk_in_full() -> None:
    lay = layout("X", "B")
    variants = {"B": [variant("B", ("A",), cci=0.9)]}  # after X instead of A: error 0.9
    p = plan("cachecraft", variants, lay, dict(refresh_error=0.5))
    b = p.chunks[1]
    assert b.variant is None and b.reason == "refresh" and b.error == pytest.approx(0.9)
    assert b.recompute == tuple(range(5)) and p.probe is None
    probed = dict(refresh_error=0.95, probe_max_cost=None)
    kept = plan("cachecraft", variants, lay, probed).chunks[1]
    assert kept.is_hit and kept.select == "probe"


def test_inherit_error_passes_a_stale_chunk_in_front_down() -> None:
    # B was cached after (X, A) with equal mass on each; now after (A) alone.
    b = variant("B", ("X", "A"), cci=0.9, exact=False)  # honest beta after (A): 1 / 2
    inherit = dict()  # the default
    assert CachecraftParams().inherit_error
    # A reused in a new context (cached after Y): its predicted error 0.8 x (1 - 0) = 0.8
    stale_a = {"A": [variant("A", ("Y",), cci=0.8)], "B": [b]}
    no_inherit = dict(inherit_error=False)
    plain = plan("cachecraft", stale_a, layout("A", "B"), no_inherit).chunks[1]
    passed = plan("cachecraft", stale_a, layout("A", "B"), inherit).chunks[1]
    assert plain.beta == pytest.approx(0.5) and plain.error == pytest.approx(0.45)
    # A's share 1/2 counts by (1 - 0.8): beta 0.5 - 0.5 x 0.8 = 0.1
    assert passed.beta == pytest.approx(0.1) and passed.error == pytest.approx(0.9 * 0.9)
    assert passed.cfo > plain.cfo
    # A computed in full (no variant) or refreshed passes nothing on
    for variants, config in (({"B": [b]}, inherit), (stale_a, {**inherit, "refresh_error": 0.5})):
        got = plan("cachecraft", variants, layout("A", "B"), config).chunks
        assert not got[0].is_hit and got[1].beta == pytest.approx(0.5)


def _att(p: RecomputePlan, per_chunk: dict[int, list[float]]) -> list:
    return [per_chunk.get(i) if c.is_hit else None for i, c in enumerate(p.chunks)]


def test_cachecraft_probe_spends_cfo_budget_by_need() -> None:
    # A after (X) cached after (Y): beta 0; B after (X, A) cached after (C): beta 0.
    lay = layout("X", "A", "B")
    variants = {"A": [variant("A", ("Y",), cci=0.8)], "B": [variant("B", ("C",), cci=0.6)]}
    config = dict(alpha=1.0, focus_threshold=0.0, probe_split="need", probe_check=0.0, probe_sink=0)
    p = plan("cachecraft", variants, lay, config)
    a, b = p.chunks[1], p.chunks[2]
    assert (a.select, b.select) == ("probe", "probe")
    assert (a.budget, b.budget) == (4, 3)  # ceil(0.8 * 4), ceil(0.6 * 5)
    assert p.probe is not None and p.probe.total == 7 and p.probe.split == "need"
    assert p.num_rows == 6 + 7 + 2  # X in full, the budget, the question
    with pytest.raises(ValueError, match="resolve"):
        p.rows()
    att = _att(p, {1: [0.0, 0.0, 0.1, 0.0], 2: [0.3, 0.2, 0.1, 0.05, 0.4]})
    r = resolve_probe(p, att)
    # priority = error x attention: A 0.8 x (0, 0, 0.1, 0) = 0.08 at offset 2; B 0.6 x att
    # = (.18, .12, .06, .03, .24): B's five and A's 2 lead, then A's zeros by offset (A0).
    assert r.chunks[1].recompute == (0, 2) and r.chunks[2].recompute == (0, 1, 2, 3, 4)
    assert r.is_resolved and r.chunks[2].reason == "cfo+need"
    att = _att(p, {1: [0.01, 0.0, 0.0, 0.0], 2: [0.9, 0.8, 0.7, 0.6, 0.5]})
    r = resolve_probe(p, att)  # B is read much more: the budget moves there
    assert r.chunks[2].recompute == (0, 1, 2, 3, 4) and len(r.chunks[1].recompute) == 2
    assert r.num_rows == p.num_rows and len(r.rows()) == r.num_rows


def test_unfocused_chunks_get_no_budget() -> None:
    lay = layout("X", "A", "B")
    variants = {"A": [variant("A", ("Y",))], "B": [variant("B", ("C",))]}
    need = {"probe_split": "need", "probe_check": 0.0}
    p = plan("cachecraft", variants, lay, dict(alpha=1.0, focus_threshold=0.2, **need))
    r = resolve_probe(p, _att(p, {1: [0.01] * 4, 2: [0.5] * 5}))  # A's share < 0.2
    assert r.chunks[1].recompute == () and len(r.chunks[2].recompute) == 5
    p = plan("cachecraft", variants, lay, dict(alpha=1.0, early_termination=False, **need))
    r = resolve_probe(p, _att(p, {1: [0.01] * 4, 2: [0.5] * 5}))
    assert len(r.chunks[1].recompute) > 0


def test_probe_blend_keeps_question_attention_when_stored_scores_are_zero() -> None:
    lay = layout("X", "B")
    variants = {"B": [variant("B", ("C",), scores=(0.0,) * 5)]}
    config = dict(
        alpha=0.4, probe_blend=1.0, probe_check=0.0, probe_sink=0, probe_max_cost=None
    )  # ceil(0.4 * 0.8 * 5) = 2 tokens
    p = plan("cachecraft", variants, lay, config)
    r = resolve_probe(p, _att(p, {1: [0.1, 0.0, 0.5, 0.0, 0.3]}))
    assert r.chunks[1].recompute == (2, 4)


def test_a_budget_split_across_chunks_rounds_cfo_up_once() -> None:
    # CFO x |C| = 0.55 x 4 = 2.2 for A and 0.44 x 5 = 2.2 for B: per chunk 3 + 3, pooled 5.
    lay = layout("X", "A", "B")
    variants = {"A": [variant("A", ("Y",), cci=0.55)], "B": [variant("B", ("C",), cci=0.44)]}
    for split, total in (("global", 5), ("need", 5), ("chunk", 6)):
        p = plan("cachecraft", variants, lay, dict(alpha=1.0, probe_split=split))
        assert [c.budget for c in p.chunks[1:]] == [3, 3]
        assert p.probe is not None and p.probe.total == total, split
    given = plan("cachecraft", variants, lay, dict(alpha=1.0), budgets=[None, 1, None])
    assert given.probe is not None and given.probe.total == 1 + 3  # given 1, B's 2.2 rounded up


def test_probe_splits_chunk_and_global() -> None:
    lay = layout("X", "A", "B")
    variants = {"A": [variant("A", ("Y",))], "B": [variant("B", ("X",), cci=0.6)]}
    att = {1: [0.9, 0.8, 0.0, 0.0], 2: [0.1, 0.1, 0.1, 0.2, 0.1]}
    chunk = plan(
        "cachecraft",
        variants,
        lay,
        dict(probe_split="chunk", probe_check=0.0, probe_max_cost=None),
    )
    r = resolve_probe(chunk, _att(chunk, att))
    assert [c.num_recompute for c in r.chunks[1:]] == [c.budget for c in chunk.chunks[1:]]
    glob = plan(
        "cachecraft",
        variants,
        lay,
        dict(probe_split="global", probe_check=0.0, probe_max_cost=None),
    )
    total = glob.probe.total
    r = resolve_probe(glob, _att(glob, att))
    assert r.chunks[1].recompute == (0, 1)[: min(2, total)]
    assert sum(c.num_recompute for c in r.chunks[1:]) == total


def test_probe_check_makes_candidates_weighted_by_question_attention() -> None:
    lay = layout("X", "A", "B")
    variants = {"A": [variant("A", ("Y",))], "B": [variant("B", ("C",), cci=0.6)]}
    cfg = dict(alpha=0.5, probe_check=1.5, probe_sink=0, probe_check_power=1.0)
    p = plan("cachecraft", variants, lay, cfg)
    assert p.probe is not None and p.probe.check == 1.5 and p.probe.split == "global"
    total = p.probe.total
    assert total == 2 + 2  # ceil(0.5 * 0.8 * 4), ceil(0.5 * 0.6 * 5)
    att = {1: [0.9, 0.0, 0.0, 0.8], 2: [0.1, 0.7, 0.2, 0.3, 0.6]}
    r = resolve_probe(p, _att(p, att))
    a, b = r.chunks[1], r.chunks[2]
    # 1.5 x 4 candidates: the top 6 by question attention (0.9, 0.8, 0.7, 0.6, 0.3, 0.2)
    assert (a.select, b.select) == ("deviation", "deviation")
    assert a.recompute == (0, 3) and b.recompute == (1, 2, 3, 4)
    assert a.reason == "cfo+global+check"
    check = r.deviation
    assert check is not None and check.total == total and check.layer == 3  # the default
    assert check.weights == (None, (0.9, 0.8), (0.7, 0.2, 0.3, 0.6))
    assert r.num_rows == 6 + 6 + 2 and len(r.rows()) == r.num_rows  # X, candidates, question
    assert sum(c.num_recompute for c in r.chunks[1:]) == total  # what goes on past the check
    flat = plan(
        "cachecraft",
        variants,
        lay,
        dict(alpha=0.5, probe_check_score="deviation", probe_sink=0),
    )
    r = resolve_probe(flat, _att(flat, att))
    assert r.deviation.weights == (None, (1.0,) * 4, (1.0,) * 5)  # 3 x 4 > 9: all


@pytest.mark.parametrize("power", [0.0, 0.5, 1.0])
def test_probe_check_power_tempers_the_question_attention(power: float) -> None:
    lay = layout("X", "A", "B")
    variants = {"A": [variant("A", ("Y",))], "B": [variant("B", ("C",), cci=0.6)]}
    cfg = dict(probe_check=1.5, probe_sink=0, probe_check_power=power)
    p = plan("cachecraft", variants, lay, cfg)
    att = {1: [0.9, 0.0, 0.0, 0.8], 2: [0.1, 0.7, 0.2, 0.3, 0.6]}
    r = resolve_probe(p, _att(p, att))
    # the same candidates whatever the power: it only weighs the deviation at the check
    assert (r.chunks[1].recompute, r.chunks[2].recompute) == ((0, 3), (1, 2, 3, 4))
    none, a, b = r.deviation.weights
    assert none is None and a == pytest.approx((0.9**power, 0.8**power))
    assert b == pytest.approx(tuple(x**power for x in (0.7, 0.2, 0.3, 0.6)))
    with pytest.raises(ValueError, match="probe_check_power"):
        plan("cachecraft", variants, lay, dict(probe_check_power=-1.0))


def test_probe_check_everything_when_the_budget_is_everything() -> None:
    lay = layout("X", "A")
    variants = {"A": [variant("A", ("Y",))]}
    p = plan("cachecraft", variants, lay, budgets=[None, 4])
    r = resolve_probe(p, _att(p, {1: [0.0, 0.1, 0.0, 0.2]}))
    assert r.chunks[1].recompute == (0, 1, 2, 3) and r.deviation.total == 4
    none = plan("cachecraft", variants, lay, budgets=[None, 0])
    r = resolve_probe(none, _att(none, {1: [0.0, 0.1, 0.0, 0.2]}))
    assert r.deviation is None and r.chunks[1].recompute == ()


def test_prophet_is_one_global_budget_of_question_attention() -> None:
    lay = layout("X", "A", "B")
    variants = {"A": [variant("A", ("X",))], "B": [variant("B", ("X", "A"))]}
    p = plan("prophet", variants, lay, dict(prophet_ratio=0.3))
    assert p.probe is not None and p.probe.total == 3  # ceil(0.3 * 9)
    assert p.probe.split == "global" and p.probe.focus_threshold == 0.0
    r = resolve_probe(p, _att(p, {1: [0.0, 0.5, 0.0, 0.0], 2: [0.4, 0.0, 0.0, 0.0, 0.3]}))
    assert r.chunks[1].recompute == (1,) and r.chunks[2].recompute == (0, 4)
    given = plan("prophet", variants, lay, budgets=[None, 1, 0])
    assert given.probe.total == 1
    sink4 = dict(probe=CachecraftParams(probe_sink=4))
    assert plan("prophet", variants, lay, sink4).probe.sink == 0  # relevance
    assert plan("prophet", {}, lay).probe is None  # nothing reused, nothing to probe


def test_attention_alone_is_prophets_rule_at_cachecraft_s_budget() -> None:
    # No check and no first tokens lifted (the cachecraft-no-check ablation without its sink):
    # cachecraft recomputes what prophet, given the same total, recomputes; with the sink
    # lifted each chunk's first tokens go first.
    lay = layout("X", "A", "B")
    variants = {"A": [variant("A", ("Y",))], "B": [variant("B", ("C",), cci=0.6)]}
    rule = dict(alpha=0.6, probe_check=0.0, probe_sink=0, probe_max_cost=None)
    ours = plan("cachecraft", variants, lay, rule)
    total = ours.probe.total
    assert ours.probe.check == 0 and 1 < total < 9  # some of A's and B's 9 tokens, not all
    theirs = plan(
        "prophet", variants, lay, dict(probe=CachecraftParams(probe_max_cost=None)),
        budgets=[None, total, 0],
    )  # fmt: skip
    att = {1: [0.0, 0.5, 0.1, 0.0], 2: [0.4, 0.0, 0.2, 0.0, 0.3]}
    a, b = resolve_probe(ours, _att(ours, att)), resolve_probe(theirs, _att(theirs, att))
    assert a.deviation is None and b.deviation is None
    assert [c.recompute for c in a.chunks] == [c.recompute for c in b.chunks]
    sunk = plan("cachecraft", variants, lay, dict(rule, probe_sink=1))
    r = resolve_probe(sunk, _att(sunk, att))
    assert 0 in r.chunks[1].recompute and 0 in r.chunks[2].recompute  # each chunk's first


def test_probe_layers_are_clamped() -> None:
    lay = layout("X", "A")
    variants = {"A": [variant("A", ("Y",))]}
    p = plan(
        "cachecraft",
        variants,
        lay,
        dict(probe_first_layer=50, probe_last_layer=99, probe_max_cost=None),
    )
    assert (p.probe.first_layer, p.probe.last_layer) == (29, 29)
    p = plan("cachecraft", variants, lay, dict(probe_last_layer=9, probe_max_cost=None))
    assert (p.probe.first_layer, p.probe.last_layer) == (0, 9)


def test_probe_from_sets_the_first_measured_layer_not_the_cost() -> None:
    lay = layout("X", "A")
    variants = {"A": [variant("A", ("Y",))]}
    every = plan("cachecraft", variants, lay, dict(probe_from=0.0, probe_max_cost=None))
    half = plan("cachecraft", variants, lay, dict(probe_from=0.5, probe_max_cost=None))
    assert (every.probe.first_layer, half.probe.first_layer) == (0, 15)  # 30 layers
    assert half.probe.last_layer == 29 and half.probe_cost == every.probe_cost  # all still run
    short = plan("cachecraft", variants, lay, dict(probe_from=0.5, probe_depth=0.3))
    assert (short.probe.first_layer, short.probe.last_layer) == (8, 8)  # never past the last
    given = plan("cachecraft", variants, lay, dict(probe_from=0.5, probe_first_layer=3))
    assert given.probe.first_layer == 3  # an explicit first layer wins


def test_probe_depth_sets_the_last_layer_and_the_cost() -> None:
    lay = layout("X", "A")
    variants = {"A": [variant("A", ("Y",))]}
    full = plan("cachecraft", variants, lay, dict(probe_max_cost=None))
    assert full.probe.last_layer == 29 and full.probe.layer_share == 1.0
    assert full.probe_cost == full.num_probe_rows  # every layer: one row each
    half = plan("cachecraft", variants, lay, dict(probe_depth=0.5, probe_max_cost=None))
    assert half.probe.last_layer == 14 and half.probe.layer_share == 0.5
    assert half.num_probe_rows == full.num_probe_rows
    assert half.probe_cost == pytest.approx(full.num_probe_rows * 15 / 30)
    third = plan("cachecraft", variants, lay, dict(probe_depth=1 / 3, probe_max_cost=None))
    assert third.probe.last_layer == 9
    tiny = plan("cachecraft", variants, lay, dict(probe_depth=0.0, probe_max_cost=None))
    assert tiny.probe.last_layer == 0  # at least layer 0
    given = plan(
        "cachecraft",
        variants,
        lay,
        dict(probe_depth=0.5, probe_last_layer=20, probe_max_cost=None),
    )
    assert given.probe.last_layer == 20  # an explicit last layer wins
    assert plan("naive", variants, lay).probe_cost == 0.0


def test_a_probe_dearer_than_its_budget_gives_its_rows_to_a_check_of_every_token() -> None:
    # X in full; A after (Y) reused after (X): beta 0, CFO 0.5 x 0.8 -> ceil(0.4 x 4) = 2.
    lay = layout("X", "A")
    variants = {"A": [variant("A", ("Y",))]}
    skip = dict(probe_trim=False)  # skipped, not trimmed (see the next tests)
    probed = plan("cachecraft", variants, lay, dict(probe_max_cost=None))
    assert probed.probe is not None and probed.probe.total == 2 and probed.probe_cost == 2.0
    kept = plan("cachecraft", variants, lay, dict(probe_max_cost=1.0))
    assert kept.probe == probed.probe  # the probe costs its budget: it still runs
    p = plan("cachecraft", variants, lay, dict(probe_max_cost=0.5, probe_trim=False))
    a = p.chunks[1]
    assert p.probe is None and p.probe_cost == 0.0
    assert (a.select, a.recompute, a.reason) == ("deviation", (0, 1, 2, 3), "cfo+check")
    assert p.deviation is not None and p.deviation.weights is None  # CacheBlend's rank
    assert p.deviation.total == 2 + 2 == a.budget  # the budget plus the probe's rows
    assert p.deviation.layer == 3 and p.is_resolved  # the default
    assert p.deviation.sink == 4  # each chunk's first tokens first, as the probe ranks them
    assert p.num_rows == 6 + 4 + 2  # X, every A token to the check layer, the question
    # a shallow model checks below its top layer, where a check could still stop candidates
    for num_layers, want in ((4, 2), (3, 1), (1, 0)):
        at_budget = dict(probe_max_cost=1.0, probe_skip_wide=False)
        shallow = plan_request(lay, variants, *settings("cachecraft", at_budget), num_layers, None)
        assert shallow.probe is not None and shallow.probe.check_layer == want
        cheap = dict(probe_max_cost=0.5, probe_trim=False)
        shallow = plan_request(lay, variants, *settings("cachecraft", cheap), num_layers, None)
        assert shallow.deviation is not None and shallow.deviation.layer == want
    # Without the prefix cache the probe would also run the 3 prefix rows: 5 > 2 x 1.0.
    miss = plan_request(lay, variants, *settings("cachecraft", skip), 30, None, False)
    assert miss.probe is None and miss.deviation is not None
    assert miss.deviation.total == 4  # 2 + 5, at most A's 4 tokens
    two = plan("cachecraft", {**variants, "B": [variant("B", ("Y",))]}, layout("X", "A", "B"), skip)
    assert two.probe is not None  # 2 question rows steer 2 + 2 tokens
    two = plan(
        "cachecraft",
        {**variants, "B": [variant("B", ("Y",))]},
        layout("X", "A", "B"),
        dict(probe_max_cost=0.0, probe_trim=False),
    )
    assert two.deviation is not None and two.deviation.total == 2 + 2 + 2
    assert [c.budget for c in two.chunks[1:]] == [3, 3]  # 6 spread over A (4) and B (5)
    with pytest.raises(ValueError, match="probe_max_cost"):
        plan("cachecraft", variants, lay, dict(probe_max_cost=-1.0))


def test_a_probe_that_would_rank_nothing_out_gives_its_rows_to_a_check_of_every_token() -> None:
    # As above: budget 2 over A's 4 tokens, a probe costing 2.0 rows (under its cap here).
    # With probe_check 3 its candidates (6) would be all of A anyway: probe_skip_wide skips it.
    lay = layout("X", "A")
    variants = {"A": [variant("A", ("Y",))]}
    assert CachecraftParams().probe_skip_wide  # the default (plan() here turns it off)
    base = dict(probe_max_cost=1.0)  # the probe's cost (2.0) is within its cap
    assert plan("cachecraft", variants, lay, base).probe is not None
    wide = dict(base, probe_skip_wide=True)
    uncapped = plan("cachecraft", variants, lay, dict(wide, probe_max_cost=None))
    assert uncapped.probe is not None  # no cap: the probe always runs
    p = plan("cachecraft", variants, lay, wide)
    a = p.chunks[1]
    assert p.probe is None and p.deviation is not None and p.probe_cost == 0.0
    assert (a.select, a.recompute) == ("deviation", (0, 1, 2, 3))
    assert p.deviation.total == 2 + 2 == a.budget  # the budget plus the probe's rows
    assert p.deviation.layer == 3  # probe_check_layer, unless check_alone_layer says
    assert plan("cachecraft", variants, lay, dict(wide, check_alone_layer=2)).deviation.layer == 2
    # a probe whose candidates leave some of A out still runs: 1 x 2 < 4
    narrow = plan("cachecraft", variants, lay, dict(wide, probe_check=1.0))
    assert narrow.probe is not None and narrow.deviation is None
    # ... and so does one with no check (probe_check 0: the probe alone picks)
    alone = plan("cachecraft", variants, lay, dict(wide, probe_check=0.0))
    assert alone.probe is not None and alone.deviation is None


def test_max_recompute_caps_the_budget_and_the_probe_together() -> None:
    # Budget 2 over A's 4 tokens, a probe of 2 question rows: 4 tokens' worth in all.
    lay = layout("X", "A")
    variants = {"A": [variant("A", ("Y",))]}
    roomy = dict(probe_max_cost=2.0)  # the probe may cost twice its budget: it stays whole

    def spent(p: RecomputePlan) -> tuple[int, float]:
        total = p.probe.total if p.probe is not None else p.deviation.total
        return total, p.probe_cost

    assert spent(plan("cachecraft", variants, lay, roomy)) == (2, 2.0)
    # a ceiling above what the plan spends changes nothing
    assert plan("cachecraft", variants, lay, dict(roomy, max_recompute=1.0)) == plan(
        "cachecraft", variants, lay, roomy
    )
    # 0.75 of A's 4 tokens is 3: the probe's 2 rows leave 1 token to recompute
    assert spent(plan("cachecraft", variants, lay, dict(roomy, max_recompute=0.75))) == (1, 2.0)
    # 0.5 leaves the probe no budget to steer: a check of every token spends the 2 instead
    half = plan("cachecraft", variants, lay, dict(roomy, max_recompute=0.5))
    assert half.probe is None and spent(half) == (2, 0.0)
    assert half.chunks[1].budget == 2 and half.chunks[1].select == "deviation"
    # 0 recomputes nothing and runs no probe
    none = plan("cachecraft", variants, lay, dict(roomy, max_recompute=0.0))
    assert none.probe is None and none.deviation is None and none.chunks[1].budget == 0
    # a trimmed probe's rows left out go to the budget, within the ceiling: at probe_max_cost
    # 1.0 and a ceiling of 3, one row fits (cost 1 <= 1 x 1); the row left out makes it 2
    trimmed = plan("cachecraft", variants, lay, dict(probe_max_cost=1.0, max_recompute=0.75))
    assert trimmed.probe is not None and trimmed.probe.question_rows == 1
    assert spent(trimmed) == (2, 1.0)
    # budgets a caller gives (a matched baseline's, or everything) are spent as given
    given = plan("cachecraft", variants, lay, dict(roomy, max_recompute=0.25), budgets=[None, 4])
    assert spent(given) == (4, 2.0)
    with pytest.raises(ValueError, match="max_recompute"):
        plan("cachecraft", variants, lay, dict(max_recompute=1.5))


def test_a_check_without_a_probe_leaves_exact_chunks_alone() -> None:
    # A made after this very prefix (exact here) and B reused after another chunk: the check
    # of every reused token takes B's tokens only (A's K/V are a full prefill's already).
    lay = layout("A", "B")
    variants = {"A": [variant("A")], "B": [variant("B", ("Y",))]}
    p = plan("cachecraft", variants, lay, dict(probe_max_cost=0.0, probe_trim=False))
    a, b = p.chunks
    assert p.probe is None and p.deviation is not None
    assert a.is_exact and a.recompute == () and a.select == "planned"
    assert b.select == "deviation" and b.recompute == tuple(range(SIZES["B"]))
    assert p.deviation.total == b.budget > 0


def test_a_skipped_probe_gives_the_share_of_its_rows_it_is_told_to() -> None:
    # As above: budget 2, a probe costing 2.0 rows, skipped at probe_max_cost 0.5.
    lay = layout("X", "A")
    variants = {"A": [variant("A", ("Y",))]}
    for share, total in ((1.0, 2 + 2), (0.5, 2 + 1), (0.0, 2)):
        p = plan("cachecraft", variants, lay, dict(probe_skip_share=share, probe_trim=False))
        assert p.probe is None and p.deviation is not None
        assert p.deviation.total == total == p.chunks[1].budget
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="probe_skip_share"):
            plan("cachecraft", variants, lay, dict(probe_skip_share=bad))


def test_a_trimmed_probe_runs_the_last_question_rows_that_fit() -> None:
    # As above: budget 2, a 2-row question; at probe_max_cost 0.5 one row fits (cost 1.0).
    lay = layout("X", "A")
    variants = {"A": [variant("A", ("Y",))]}
    for share, total in ((1.0, 2 + 1), (0.0, 2)):
        config = dict(probe_trim=True, probe_skip_share=share)
        p = plan("cachecraft", variants, lay, config)
        assert p.probe is not None and p.deviation is None
        assert p.probe.question_rows == 1 and p.num_probe_rows == 1 and p.probe_cost == 1.0
        assert p.probe.total == total  # the budget, plus the share of the row left out
    whole = plan("cachecraft", variants, lay, dict(probe_trim=True, probe_max_cost=1.0))
    assert whole.probe is not None and whole.probe.question_rows is None  # it fits: untrimmed
    assert whole.num_probe_rows == 2
    # Not one row fits (no cost at all; or the 3 uncached prefix rows alone cost more): the
    # check instead, as without trimming.
    none = plan("cachecraft", variants, lay, dict(probe_trim=True, probe_max_cost=0.0))
    assert none.probe is None and none.deviation is not None
    trim = dict(probe_trim=True)
    miss = plan_request(lay, variants, *settings("cachecraft", trim), 30, None, False)
    assert miss.probe is None and miss.deviation is not None and miss.deviation.total == 4


def test_a_zero_budget_runs_no_probe() -> None:
    # A cached after (X) reused after (X): beta 1, CFO 0: nothing to recompute, nothing to probe.
    lay = layout("X", "A")
    p = plan("cachecraft", {"A": [variant("A", ("X",), exact=False)]}, lay)
    a = p.chunks[1]
    assert a.is_hit and a.select == "planned" and a.recompute == () and a.budget == 0
    assert p.probe is None and p.deviation is None and p.probe_cost == 0.0
    assert p.num_rows == 6 + 2


def test_resolve_rejects_attention_of_the_wrong_shape() -> None:
    lay = layout("X", "A")
    p = plan("cachecraft", {"A": [variant("A", ("Y",))]}, lay, dict(probe_max_cost=None))
    with pytest.raises(ValueError):
        resolve_probe(p, [None])
    with pytest.raises(ValueError):
        resolve_probe(p, [None, [0.1, 0.2]])


@pytest.mark.parametrize(
    "bad",
    [
        {"beta_rule": "magic"},
        {"probe_split": "half"},
        {"prefix_mismatch_penalty": 1.5},
        {"prophet_ratio": -0.1},
        {"refresh_error": -1.0},
        {"probe_blend": -1.0},
        {"probe_check": -1.0},
        {"probe_check_score": "magic"},
        {"probe_last_row": 1.5},
        {"probe_last_row": -0.1},
    ],
)
def test_bad_settings_are_clear_errors(bad: dict) -> None:
    mode = "prophet" if "prophet_ratio" in bad else "cachecraft"
    with pytest.raises(ValueError, match=next(iter(bad))):
        plan(mode, {}, layout("A"), dict(**bad))


def test_a_vanished_probed_chunk_leaves_the_probe_budget() -> None:
    from cachecraft.reuse.planner import as_miss

    lay = layout("X", "A", "B")
    variants = {"A": [variant("A", ("Y",))], "B": [variant("B", ("C",))]}
    p = plan("cachecraft", variants, lay, dict(alpha=1.0))
    a_budget = p.chunks[1].budget
    q = as_miss(p, 1)
    assert q.chunks[1].reason == "vanished" and q.probe.total == p.probe.total - a_budget
    assert as_miss(q, 2).probe is None  # nothing left to probe


def test_prophets_probe_is_trimmed_as_cachecraft_s() -> None:
    # As in the trimmed-probe test: a reused A at budget 2 and a 2-row question; at
    # probe_max_cost 0.5 one question row fits. prophet, given the same budget, trims to it too.
    lay = layout("X", "A")
    variants = {"A": [variant("A", ("Y",))]}
    ours = plan("cachecraft", variants, lay, dict(probe_trim=True, probe_skip_share=0.0))
    theirs = plan("prophet", variants, lay, budgets=[None, 2])
    assert ours.probe is not None and theirs.probe is not None
    assert theirs.probe.question_rows == ours.probe.question_rows == 1
    assert theirs.probe_cost == ours.probe_cost == 1.0
    untrimmed = dict(probe=CachecraftParams(probe_trim=False))
    whole = plan("prophet", variants, lay, untrimmed, budgets=[None, 2])
    assert whole.probe is not None and whole.probe.question_rows is None
    assert whole.num_probe_rows == 2
    # not one row fits the cap: prophet, which has no check to fall back on, keeps one row
    none = dict(probe=CachecraftParams(probe_max_cost=0.0))
    assert plan("prophet", variants, lay, none, budgets=[None, 2]).probe.question_rows == 1
