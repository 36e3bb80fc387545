"""Reuse modes end to end on the tiny model: exactness limits, totals, keys, bad requests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachecraft.api import chat_request
from cachecraft.engine.sampling import SamplingParams
from cachecraft.errors import BadRequestError, ContextLengthError
from cachecraft.llm import LLM
from cachecraft.model.kv import KVCache
from cachecraft.request import DEFAULT_SYSTEM, Chunk, RagRequest
from cachecraft.reuse.layout import QUESTION_BLOCK, QUESTION_KEEP, build_layout, template_parts
from cachecraft.reuse.plan import RecomputePlan
from cachecraft.reuse.strategies import STRATEGIES
from cachecraft.store.memory import MemoryStore
from cachecraft_bench.modes import LAB_MODES as MODES

DOCS = [
    "The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889.",
    "Mount Everest is the highest mountain above sea level, in the Himalayas.",
    "The Great Wall of China is a series of fortifications across northern China.",
    "The Amazon is the largest rainforest on Earth, spanning nine countries.",
]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _req(order: list[int], question: str = "Which one is tallest?", **kw) -> RagRequest:
    return RagRequest(question, [Chunk(DOCS[i], id=f"d{i}") for i in order], **kw)


def _run(llm: LLM, request: RagRequest, mode: str):
    return llm.generate(request, GREEDY, mode=mode, keep_logits=True)[0]


@pytest.fixture
def llm(tiny_dir: Path) -> LLM:
    return LLM(str(tiny_dir), store=MemoryStore(2 << 30, storage_dtype="float32"))


@pytest.fixture
def probing_llm(tiny_dir: Path) -> LLM:
    """`llm` that always probes (these short questions cost over half their budgets)."""
    store = MemoryStore(2 << 30, storage_dtype="float32")
    return LLM(str(tiny_dir), store=store, probe_max_cost=None)


def test_cachecraft_with_cfo_one_equals_full(tiny_dir: Path) -> None:
    # alpha alone cannot force CFO = 1 where beta' = 1 (alpha * 0); min_fix = 1 can.
    llm = LLM(str(tiny_dir), alpha=1e9, min_fix=1.0, early_termination=False)
    _run(llm, _req([0, 1, 2]), "cachecraft")  # warm: every chunk becomes a variant
    request = _req([2, 0, 3, 1])
    full = _run(llm, request, "full")
    cc = _run(llm, request, "cachecraft")
    assert [c.is_hit for c in cc.report.chunks] == [True, True, False, True]
    assert cc.report.prefix_cached > 0
    assert cc.report.tokens_computed == cc.report.prompt_tokens - cc.report.prefix_cached
    assert all(c.cfo == 1.0 for c in cc.report.chunks if c.is_hit)
    assert (cc.first_token_logits - full.first_token_logits).abs().max() < 1e-4
    assert cc.token_ids == full.token_ids


def test_naive_equals_full_when_cached_in_the_same_context(llm: LLM) -> None:
    request = _req([0, 1, 2])
    _run(llm, request, "cachecraft")
    full = _run(llm, request, "full")
    naive = _run(llm, request, "naive")
    assert all(c.is_hit for c in naive.report.chunks)
    in_chunks = sum(c.num_tokens for c in naive.report.chunks)
    question = naive.report.prompt_tokens - naive.report.prefix_cached - in_chunks
    assert naive.report.tokens_computed == question  # only the question is computed
    assert (naive.first_token_logits - full.first_token_logits).abs().max() < 1e-4
    assert naive.token_ids == full.token_ids


def test_prefix_mode_reuses_only_leading_exact_chunks(llm: LLM) -> None:
    _run(llm, _req([0, 1, 2]), "prefix")
    out = _run(llm, _req([0, 1, 3]), "prefix")
    assert [c.is_hit for c in out.report.chunks] == [True, True, False]
    out = _run(llm, _req([1, 0, 3]), "prefix")  # different order: nothing leads exactly
    assert [c.is_hit for c in out.report.chunks] == [False, False, False]
    full = _run(llm, _req([0, 1, 3]), "full")
    again = _run(llm, _req([0, 1, 3]), "prefix")
    assert (again.first_token_logits - full.first_token_logits).abs().max() < 1e-4


@pytest.mark.parametrize("mode", MODES)
def test_totals_add_up(llm: LLM, mode: str) -> None:
    _run(llm, _req([0, 1, 2]), "cachecraft" if mode == "full" else mode)
    out = _run(llm, _req([2, 3, 0, 1]), mode)
    rep = out.report
    assert rep.tokens_computed + rep.tokens_reused == rep.prompt_tokens
    in_chunks = sum(c.tokens_recomputed for c in rep.chunks)
    prefix_len = rep.chunks[0].num_tokens and rep.prompt_tokens - sum(
        c.num_tokens for c in rep.chunks
    )
    assert rep.tokens_computed >= in_chunks
    assert rep.tokens_computed <= in_chunks + prefix_len
    for c in rep.chunks:
        assert 0 <= c.tokens_recomputed <= c.num_tokens
        if not c.is_hit:
            assert c.tokens_recomputed == c.num_tokens
    if mode == "full":
        assert rep.tokens_computed == rep.prompt_tokens
    if mode == "naive":
        assert all(c.tokens_recomputed == 0 for c in rep.chunks if c.is_hit)


def _ceil_cfo(c) -> int:
    return min(c.num_tokens, -int(-(c.cfo * c.num_tokens - 1e-9) // 1))


def _pooled_cfo(chunks) -> int:
    """cachecraft's budget across chunks: the sum of CFO x |C|, rounded up once."""
    return -int(-(sum(c.cfo * c.num_tokens for c in chunks) - 1e-9) // 1)


def test_cachecraft_paper_recomputes_ceil_cfo_tokens(llm: LLM) -> None:
    _run(llm, _req([0, 1, 2]), "cachecraft-paper")
    out = _run(llm, _req([2, 1, 0]), "cachecraft-paper")
    for c in out.report.chunks:
        assert c.is_hit and c.cfo is not None
        assert c.tokens_recomputed == _ceil_cfo(c)
    assert out.report.probe_tokens == 0


def test_cachecraft_spends_the_summed_cfo_budget_where_the_question_looks(tiny_dir: Path) -> None:
    store = MemoryStore(2 << 30, storage_dtype="float32")
    # default: global split, candidates through the check layer; a probe whatever it costs
    llm = LLM(str(tiny_dir), store=store, focus_threshold=0.0, probe_max_cost=None)
    _run(llm, _req([0, 1, 2]), "cachecraft")
    out = _run(llm, _req([2, 1, 0]), "cachecraft")
    chunks = out.report.chunks
    assert all(c.is_hit and c.reason == "cfo+global+check" for c in chunks)
    assert sum(c.tokens_recomputed for c in chunks) == _pooled_cfo(chunks)
    assert out.report.probe_tokens > 0  # the question, probed over the spliced cache
    rep = out.report
    assert rep.probe_cost == rep.probe_tokens  # the probe ran every layer
    assert rep.computed_fraction == (rep.tokens_computed + rep.probe_tokens) / rep.prompt_tokens


def test_a_probe_dearer_than_its_budget_is_replaced_by_a_check_of_every_token(
    tiny_dir: Path,
) -> None:
    def run(max_cost: float | None, **kw):
        store = MemoryStore(2 << 30, storage_dtype="float32")
        llm = LLM(
            str(tiny_dir),
            store=store,
            focus_threshold=0.0,
            probe_max_cost=max_cost,
            probe_skip_wide=False,  # the probe's candidates would be every token here
            **kw,
        )
        _run(llm, _req([0, 1, 2]), "cachecraft")
        return _run(llm, _req([2, 1, 0]), "cachecraft").report

    probed = run(None)
    budget = _pooled_cfo(probed.chunks)
    question = (
        probed.prompt_tokens - probed.prefix_cached - sum(c.num_tokens for c in probed.chunks)
    )
    assert probed.probe_tokens == question > 0
    assert 0 < budget / 2 < question  # the probe costs more than half the recompute it steers
    rep = run(0.5, probe_trim=False)
    assert rep.probe_tokens == 0 and rep.probe_cost == 0.0
    assert all(c.reason == "cfo+check" for c in rep.chunks)
    reused = sum(c.num_tokens for c in rep.chunks)
    spent = sum(c.tokens_recomputed for c in rep.chunks)
    assert spent == min(budget + question, reused) < reused
    # the same computed tokens as the probe's plan, without a second pass over the question
    assert rep.tokens_computed == probed.tokens_computed + question
    # Trimmed instead: the question's last budget / 2 rows probe; the tokens left out of
    # the probe are spent (probe_skip_share 1) or saved (0).
    rows = budget // 2
    for share, spend in ((1.0, budget + question - rows), (0.0, budget)):
        rep = run(0.5, probe_skip_share=share)  # probe_trim: the default
        assert rep.probe_tokens == rows and rep.probe_cost == rows
        assert all(c.reason == "cfo+global+check" for c in rep.chunks)
        assert sum(c.tokens_recomputed for c in rep.chunks) == min(spend, reused)


def test_max_recompute_bounds_a_real_request_probe_included(tiny_dir: Path) -> None:
    def run(**kw):
        llm = LLM(str(tiny_dir), store=MemoryStore(2 << 30, storage_dtype="float32"), **kw)
        _run(llm, _req([0, 1, 2]), "cachecraft")
        return _run(llm, _req([2, 1, 0]), "cachecraft").report

    free = dict(focus_threshold=0.0, alpha=2.0, probe_skip_wide=False, probe_max_cost=None)
    rep = run(**free)
    reused = sum(c.num_tokens for c in rep.chunks)
    spent = sum(c.tokens_recomputed for c in rep.chunks) + rep.probe_cost
    assert spent > 0.5 * reused  # uncapped, this request spends more than the ceiling below
    capped = run(**free, max_recompute=0.5)
    recomputed = sum(c.tokens_recomputed for c in capped.chunks)
    assert capped.probe_tokens > 0  # the probe still runs, paid out of the same ceiling
    assert 0 < recomputed + capped.probe_cost <= 0.5 * reused


def test_a_shallow_probe_costs_its_rows_times_the_layers_it_ran(tiny_dir: Path) -> None:
    store = MemoryStore(2 << 30, storage_dtype="float32")
    llm = LLM(str(tiny_dir), store=store, probe_depth=0.5, probe_skip_wide=False)
    _run(llm, _req([0, 1, 2]), "cachecraft")
    out = _run(llm, _req([2, 1, 0]), "cachecraft")
    rep = out.report
    assert rep.probe_tokens > 0
    assert rep.probe_cost == pytest.approx(rep.probe_tokens * 2 / 4)  # layers 0-1 of 4
    assert rep.computed_fraction == pytest.approx(
        (rep.tokens_computed + rep.probe_tokens / 2) / rep.prompt_tokens
    )


def test_early_termination_stops_unfocused_chunks(tiny_dir: Path) -> None:
    llm = LLM(str(tiny_dir), alpha=1e9, et_layer=1, focus_threshold=1.1)  # all unfocused
    _run(llm, _req([0, 1, 2]), "cachecraft-paper")
    out = _run(llm, _req([2, 1, 0]), "cachecraft-paper")
    assert [c.last_layer for c in out.report.chunks] == [1, 1, 1]
    assert out.report.layer_fraction < 1.0
    llm0 = LLM(str(tiny_dir), alpha=1e9, et_layer=1, focus_threshold=0.0)  # none unfocused
    _run(llm0, _req([0, 1, 2]), "cachecraft-paper")
    out0 = _run(llm0, _req([2, 1, 0]), "cachecraft-paper")
    full = _run(llm0, _req([2, 1, 0]), "full")
    assert [c.last_layer for c in out0.report.chunks] == [3, 3, 3]
    assert (out0.first_token_logits - full.first_token_logits).abs().max() < 1e-2


def test_cacheblend_epic_random_use_the_given_budget(llm: LLM) -> None:
    for mode in ("cacheblend", "epic", "random"):
        _run(llm, _req([0, 1, 2]), mode)
        out = llm.generate(_req([2, 1, 0]), GREEDY, mode=mode, budgets=[[3, 0, 5]])[0]
        assert [c.tokens_recomputed for c in out.report.chunks] == [3, 0, 5], mode


def test_same_text_two_ids_share_one_cache(llm: LLM) -> None:
    _run(llm, RagRequest("q?", [Chunk(DOCS[0], id="a")]), "cachecraft")
    out = _run(llm, RagRequest("q?", [Chunk(DOCS[0], id="b")]), "cachecraft")
    assert out.report.chunks[0].is_hit and out.report.chunks[0].label == "b"
    changed = _run(llm, RagRequest("q?", [Chunk(DOCS[0] + " More.", id="b")]), "cachecraft")
    assert not changed.report.chunks[0].is_hit
    other = _run(llm, RagRequest("q?", [Chunk(DOCS[0], id="a")], namespace="t2"), "cachecraft")
    assert not other.report.chunks[0].is_hit
    assert other.report.chunks[0].key != out.report.chunks[0].key


def test_precompute_makes_variants_with_context(llm: LLM) -> None:
    ids = llm.precompute([DOCS[1]], context=[DOCS[0]])
    assert len(ids) == 1
    out = _run(llm, _req([0, 1]), "cachecraft")
    hit = out.report.chunks[1]
    assert hit.is_hit and hit.beta == 1.0 and hit.variant_id == ids[0]
    assert hit.s_old == [out.report.chunks[0].key]


def test_bad_requests_are_clear(llm: LLM) -> None:
    with pytest.raises(BadRequestError, match="question is empty"):
        RagRequest("  ", [DOCS[0]])
    with pytest.raises(BadRequestError, match="must be a string"):
        RagRequest("q?", [Chunk(123)])  # type: ignore[arg-type]
    with pytest.raises(BadRequestError, match="unknown mode"):
        _run(llm, _req([0]), "magic")
    with pytest.raises(BadRequestError, match="unknown option"):
        LLM.__init__(llm, str(llm.loaded.source), not_an_option=1)
    with pytest.raises(BadRequestError, match="stop: give non-empty strings"):
        SamplingParams(stop=("ok", ""))
    assert SamplingParams(stop="END").stop == ("END",)
    long_doc = "word " * 5000
    with pytest.raises(ContextLengthError, match=r"\d+ tokens but the model's context is 4096"):
        _run(llm, RagRequest("q?", [long_doc]), "cachecraft")
    assert RagRequest("q?").chunks == ()  # no chunks is fine
    out = _run(llm, RagRequest("q?"), "cachecraft")
    assert out.report.chunks == []


def test_teacher_forced_logits_of_full_follow_its_own_answer(llm: LLM) -> None:
    request = _req([0, 1])
    full = _run(llm, request, "full")
    again = llm.generate(request, GREEDY, mode="full", teacher_force=[full.token_ids])[0]
    tf = again.teacher_forced_logits
    assert tf.shape[0] == len(full.token_ids)
    assert tf.argmax(-1).tolist() == full.token_ids
    assert again.token_ids == full.token_ids
    assert torch.isfinite(tf).all()


def test_a_store_setting_given_as_a_reuse_option_is_an_error(tiny_dir: Path) -> None:
    from cachecraft.errors import BadRequestError

    with pytest.raises(BadRequestError, match="storage_dtype: a store setting"):
        LLM(str(tiny_dir), storage_dtype="float32")
    with pytest.raises(BadRequestError, match="max_variants_per_chunk"):
        LLM(str(tiny_dir), max_variants_per_chunk=2)


# ---- v2: every mode reduces to full, the probe, exactness on a shared store ---------------------

EVERYTHING = dict(
    alpha=1e9,
    min_fix=1.0,
    early_termination=False,
    prophet_ratio=1.0,
    epic_k=10_000,
    cacheblend_ratio=1.0,
)


TOLD_TO_COMPUTE_EVERYTHING = [
    ("cachecraft", {}),
    ("cachecraft", {"probe_split": "need", "probe_check": 0.0}),
    ("cachecraft", {"probe_check_score": "deviation"}),
    ("cachecraft", {"probe_blend": 1.0, "probe_last_layer": 1}),
    ("cachecraft", {"probe_depth": 0.5}),
    ("cachecraft", {"probe_from": 0.5}),
    ("cachecraft", {"probe_max_cost": 0.0}),  # the check instead of the probe
    ("cachecraft-paper", {}),
    ("prophet", {}),
    ("epic", {}),
    ("random", {}),
    ("cacheblend", {}),
    ("cacheblend", {"cacheblend_global": True}),
    ("naive", {}),  # told nothing: it recomputes no reused token (checked below)
    ("prefix", {}),
    ("full", {}),
]


def test_compute_everything_covers_every_registered_strategy() -> None:
    assert {m for m, _ in TOLD_TO_COMPUTE_EVERYTHING} == set(STRATEGIES.names())


@pytest.mark.parametrize("mode,extra", TOLD_TO_COMPUTE_EVERYTHING)
def test_every_mode_told_to_compute_everything_equals_full(
    tiny_dir: Path, mode: str, extra: dict
) -> None:
    exact = MemoryStore(2 << 30, storage_dtype="float32")
    llm = LLM(str(tiny_dir), store=exact, **{**EVERYTHING, **extra})
    _run(llm, _req([0, 1, 2]), "naive")  # warm: every chunk becomes a variant
    request = _req([2, 0, 3, 1])
    full = _run(llm, request, "full")
    out = _run(llm, request, mode)
    strategy = STRATEGIES.get(mode)
    if mode == "naive":  # nothing recomputed: the reused chunks' K/V are stale
        assert [c.is_hit for c in out.report.chunks] == [True, True, False, True]
        assert all(c.tokens_recomputed == 0 for c in out.report.chunks if c.is_hit)
        return
    reuses = strategy.reads_store and not strategy.exact_only  # nothing here is exact
    assert [c.is_hit for c in out.report.chunks] == [reuses, reuses, False, reuses]
    assert all(c.tokens_recomputed == c.num_tokens for c in out.report.chunks)
    assert (out.first_token_logits - full.first_token_logits).abs().max() < 1e-4
    assert out.token_ids == full.token_ids


@pytest.mark.parametrize("mode", ["cachecraft", "cacheblend", "prefix"])
def test_a_bfloat16_model_told_to_compute_everything_matches_its_full_prefill(
    tiny_dir: Path, mode: str
) -> None:
    """`serve --dtype bfloat16`: the same contract in the model's own dtype (variants kept in
    it too). bf16 rounds differently on the partial path (other kernels, other row counts),
    so "equal" is: the same tokens, and logits within a small multiple of bf16's rounding,
    ten times closer than reusing the stale K/V without recomputing gets."""
    store = MemoryStore(2 << 30, storage_dtype="bfloat16")
    llm = LLM(str(tiny_dir), dtype="bfloat16", store=store, **EVERYTHING)
    assert llm.loaded.model.dtype == torch.bfloat16
    _run(llm, _req([0, 1, 2]), "naive")  # warm: every chunk becomes a variant
    request = _req([1, 0, 3])  # reused in another order: stale K/V unless recomputed
    full = _run(llm, request, "full")
    stale = _run(llm, request, "naive")
    out = _run(llm, request, mode)
    assert [c.is_hit for c in stale.report.chunks][:2] == [True, True]
    assert all(c.tokens_recomputed == c.num_tokens for c in out.report.chunks)
    gap = (out.first_token_logits - full.first_token_logits).abs().max()
    naive_gap = (stale.first_token_logits - full.first_token_logits).abs().max()
    assert gap < 0.01 and gap * 10 < naive_gap
    assert out.token_ids == full.token_ids


def _spliced(llm: LLM, request: RagRequest):
    """A cachecraft plan for `request` and its KV with every reused layer filled."""
    from cachecraft.engine.layer_loader import LayerLoader
    from cachecraft.model.kv import KVCache

    runner = llm.runner
    plan = runner.plan(request, llm.strategies.get("cachecraft"))
    m, layout = llm.loaded, plan.layout
    kv = KVCache(m.arch, layout.num_tokens, m.model.dtype, m.model.device)
    prefix = runner.prefix_cache.get(layout.prefix_key)
    assert prefix is not None and plan.prefix_hit
    kv.write(0, *prefix)
    loader = LayerLoader(kv, m.model.rope)
    for cp in plan.chunks:
        assert runner._splice(loader, cp)
    loader.fill_all()
    loader.close()
    return plan, kv


def _question_span_mass(llm: LLM, plan: RecomputePlan, kv: KVCache) -> torch.Tensor:
    """The model's own span statistics of the question rows over `kv` (written to):
    [rows, chunks], each row's attention mass on each chunk, mean over heads and layers."""
    from cachecraft.model.step import SeqWork

    layout = plan.layout
    rows = torch.arange(layout.question_start, layout.num_tokens)
    bounds = torch.tensor([(c.slot.start, c.slot.end) for c in plan.chunks])
    ids = torch.tensor(layout.question_ids)
    work = SeqWork(kv, ids, rows, span_bounds=bounds, logits_for="none")
    return llm.loaded.model.forward_step([work])[0].row_span_mass


def test_probe_changes_no_reused_kv_and_measures_question_attention(probing_llm: LLM) -> None:
    from cachecraft.engine.probe import probe_attention

    llm = probing_llm

    _run(llm, _req([0, 1, 2]), "naive")
    plan, kv = _spliced(llm, _req([2, 1, 0]))  # every chunk reused: probe positions are real
    assert plan.probe is not None
    k0, v0 = kv.k.clone(), kv.v.clone()
    att = probe_attention(llm.loaded.model, kv, plan)
    # Nothing moved, so it ran in place: it wrote only where the prefill computes (question).
    qs = plan.layout.question_start
    assert torch.equal(kv.k[:, :, :qs], k0[:, :, :qs])
    assert torch.equal(kv.v[:, :, :qs], v0[:, :, :qs])
    assert [len(a) for a in att] == [c.slot.num_tokens for c in plan.chunks]
    # Same numbers from the model's own span statistics: the question rows over a copy.
    kv.k, kv.v = k0.clone(), v0.clone()
    per_row = _question_span_mass(llm, plan, kv)
    w = plan.probe.last_row  # the last row's share; the mean over rows the rest
    per_chunk = (1 - w) * per_row.mean(0) + w * per_row[-1]  # [chunks]
    got = torch.tensor([sum(a) for a in att])
    assert torch.allclose(got, per_chunk, atol=1e-5)


def test_a_probe_weighs_the_last_row_as_it_is_told_to(probing_llm: LLM) -> None:
    from dataclasses import replace

    from cachecraft.engine.probe import probe_attention

    llm = probing_llm
    _run(llm, _req([0, 1, 2]), "naive")
    plan, kv = _spliced(llm, _req([2, 1, 0]))
    assert plan.probe is not None and plan.probe.last_row == 0.5  # the default
    k0, v0 = kv.k.clone(), kv.v.clone()
    got = {}
    for share in (0.0, 0.5, 1.0):
        kv.k, kv.v = k0.clone(), v0.clone()
        weighed = replace(plan, probe=replace(plan.probe, last_row=share))
        got[share] = torch.tensor([sum(a) for a in probe_attention(llm.loaded.model, kv, weighed)])
    kv.k, kv.v = k0.clone(), v0.clone()
    per_row = _question_span_mass(llm, plan, kv)
    every, last = per_row.mean(0), per_row[-1]
    assert not torch.allclose(every, last, atol=1e-3)
    assert torch.allclose(got[0.0], every, atol=1e-5)
    assert torch.allclose(got[1.0], last, atol=1e-5)
    assert torch.allclose(got[0.5], (every + last) / 2, atol=1e-5)


@pytest.mark.parametrize("order", [[2, 1, 0], [3, 1, 0]])  # in place; a scratch cache
def test_a_trimmed_probe_measures_as_a_question_of_its_last_rows(
    probing_llm: LLM, order: list[int]
) -> None:
    from dataclasses import replace

    from cachecraft.engine.probe import probe_attention

    llm = probing_llm
    _run(llm, _req([0, 1, 2]), "naive")
    plan, kv = _spliced(llm, _req(order))
    assert plan.probe is not None
    k0, v0 = kv.k.clone(), kv.v.clone()
    question = plan.layout.question_ids
    assert len(question) > 3
    trimmed = replace(plan, probe=replace(plan.probe, question_rows=3))
    assert trimmed.num_probe_rows == 3 and plan.num_probe_rows == len(question)
    got = probe_attention(llm.loaded.model, kv, trimmed)
    qs = plan.layout.question_start
    assert torch.equal(kv.k[:, :, :qs], k0[:, :, :qs])  # reused K/V untouched
    kv.k, kv.v = k0.clone(), v0.clone()
    short = replace(plan, layout=replace(plan.layout, question_ids=question[-3:]))
    want = probe_attention(llm.loaded.model, kv, short)
    kv.k, kv.v = k0.clone(), v0.clone()
    whole = probe_attention(llm.loaded.model, kv, plan)
    for g, w, a in zip(got, want, whole, strict=True):
        assert (g is None) == (w is None) == (a is None)
        if g is not None:
            assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-6)
    flat = [torch.tensor(g) for g in got if g is not None]
    full = [torch.tensor(a) for a in whole if a is not None]
    assert not torch.allclose(torch.cat(flat), torch.cat(full), atol=1e-4)  # it did trim


def test_probe_leaves_out_chunks_without_kv(probing_llm: LLM) -> None:
    from cachecraft.engine.probe import probe_attention

    llm = probing_llm

    _run(llm, _req([0, 1, 2]), "naive")
    plan, kv = _spliced(llm, _req([3, 1, 0]))  # chunk 3 is new: no K/V before the prefill
    assert [c.is_hit for c in plan.chunks] == [False, True, True]
    k0, v0 = kv.k.clone(), kv.v.clone()
    att = probe_attention(llm.loaded.model, kv, plan)
    assert torch.equal(kv.k, k0) and torch.equal(kv.v, v0)  # moved keys: a scratch copy
    assert att[0] is None and all(a is not None and min(a) >= 0 for a in att[1:])
    assert 0 < sum(sum(a) for a in att[1:]) < 1
    # The same as a probe where the reused chunks really sit at the probe's positions.
    plan2, kv2 = _spliced(llm, _req([1, 0]))
    att2 = probe_attention(llm.loaded.model, kv2, plan2)
    got, want = torch.tensor(att[1] + att[2]), torch.tensor(att2[0] + att2[1])
    assert torch.allclose(got, want, atol=1e-6)


def test_probes_run_together_measure_what_each_measures_alone(probing_llm: LLM) -> None:
    from cachecraft.engine.probe import probe_work

    llm = probing_llm

    _run(llm, _req([0, 1, 2]), "naive")
    requests = [_req([2, 1, 0]), _req([3, 1, 0], "Which one is oldest?")]  # in place; scratch
    alone, together = [], []
    for request in requests:
        plan, kv = _spliced(llm, request)
        probe = probe_work(llm.loaded.model, kv, plan)
        alone.append(probe.scores(llm.loaded.model.forward_step([probe.work])[0]))
    probes = []
    for request in requests:
        plan, kv = _spliced(llm, request)
        probes.append(probe_work(llm.loaded.model, kv, plan))
    results = llm.loaded.model.forward_step([p.work for p in probes])
    together = [p.scores(r) for p, r in zip(probes, results, strict=True)]
    for a, t in zip(alone, together, strict=True):
        assert [x is None for x in a] == [x is None for x in t]
        for x, y in zip(a, t, strict=True):
            if x is not None:
                assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-6)


def test_a_reused_scratch_cache_measures_what_a_fresh_one_does(probing_llm: LLM) -> None:
    """A probe over a scratch cache kept from an earlier request (its old contents poisoned
    with NaN) measures exactly what one over a fresh cache does: every position it reads is
    written first. The runner keeps the scratch once the probe ran, the store of kept ones
    stays within its bytes, and `take` hands back the smallest kept one that fits."""
    from cachecraft.engine.probe import ScratchCaches, probe_work

    llm, model = probing_llm, probing_llm.loaded.model
    _run(llm, _req([0, 1, 2]), "naive")
    request = _req([3, 1, 0], "Which one is oldest?")  # a miss before reused chunks: scratch
    plan, kv = _spliced(llm, request)
    fresh = probe_work(model, kv, plan)
    assert fresh.scratch is not None
    want = fresh.scores(model.forward_step([fresh.work])[0])
    scratches = ScratchCaches()
    old = scratches.take(model, 5 * len(plan.layout.token_ids), kv)
    old.k.fill_(float("nan"))
    old.v.fill_(float("nan"))
    scratches.give(old)
    plan, kv = _spliced(llm, request)
    reused = probe_work(model, kv, plan, scratches)
    assert reused.scratch is old and scratches.num_kept == 0
    got = reused.scores(model.forward_step([reused.work])[0])
    assert [x is None for x in got] == [x is None for x in want]
    for a, b in zip(got, want, strict=True):
        if a is not None:
            assert torch.equal(torch.tensor(a), torch.tensor(b))
    before = llm.runner.scratches.num_kept
    _run(llm, request, "cachecraft")  # the engine's probe gives its scratch back to the runner
    assert llm.runner.scratches.num_kept >= max(before, 1)
    small = ScratchCaches()
    big = small.take(model, 2 * old.k.shape[2], kv)
    small.max_bytes = big.k.nbytes + big.v.nbytes
    small.give(old)
    small.give(big)  # both pass the byte budget: the larger one alone is kept
    assert small.num_kept == 1 and small.take(model, 1, kv) is big
    small.give(old)
    assert small.take(model, old.k.shape[2] + 1, kv) is not old  # too small: a new one


def test_mixed_modes_on_one_store_never_serve_approximate_kv_as_exact(llm: LLM) -> None:
    store = llm.runner.store
    _run(llm, _req([0, 1, 2]), "prefix")  # exact variants 0@(), 1@(0), 2@(0, 1)
    naive = _run(llm, _req([1, 3]), "naive")  # 1 reused out of place; 3 computed after it
    assert [c.is_hit for c in naive.report.chunks] == [True, False]
    assert [c.is_exact for c in naive.report.chunks] == [False, False]
    key3 = naive.report.chunks[1].key
    (approx,) = store.variants(key3)
    assert not approx.is_exact and approx.s_old == (naive.report.chunks[0].key,)
    _run(llm, _req([1]), "prefix")  # an exact variant of 1 at the front
    out = _run(llm, _req([1, 3]), "prefix")
    assert [c.is_hit for c in out.report.chunks] == [True, False]  # 3's only variant: approximate
    assert all(c.is_exact for c in out.report.chunks)
    full = _run(llm, _req([1, 3]), "full")
    assert (out.first_token_logits - full.first_token_logits).abs().max() < 1e-4
    exact = [v for v in store.variants(key3) if v.is_exact]
    assert len(exact) == 1 and exact[0].variant_id != approx.variant_id  # stored side by side
    again = _run(llm, _req([1, 3]), "prefix")
    assert [c.is_hit for c in again.report.chunks] == [True, True]
    assert again.report.chunks[1].variant_id == exact[0].variant_id
    assert (again.first_token_logits - full.first_token_logits).abs().max() < 1e-4


def test_filling_every_layer_at_once_equals_filling_layer_by_layer(tiny) -> None:
    from cachecraft.engine.layer_loader import LayerLoader
    from cachecraft.model.kv import KVCache
    from cachecraft.store.layers import TensorLayerReader

    g = torch.Generator().manual_seed(0)
    arch, rope = tiny.arch, tiny.model.rope
    shape = (arch.num_layers, arch.num_kv_heads, 7, arch.head_dim)
    chunks = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in "ab"]
    caches = [KVCache(arch, 30, torch.float32, "cpu") for _ in "ab"]
    loaders = [LayerLoader(kv, rope) for kv in caches]
    for loader in loaders:
        for (k, v), start in zip(chunks, (3, 20), strict=True):
            loader.add(TensorLayerReader(k, v), start, start + 7)
    loaders[0].fill_all()
    for layer in range(arch.num_layers):
        loaders[1].fill_layer(layer)
    assert torch.allclose(caches[0].k, caches[1].k, atol=1e-6)
    assert torch.equal(caches[0].v, caches[1].v)
    # keys rotated to where each chunk now sits, values as stored
    want = rope.rotate(chunks[1][0], torch.arange(20, 27))
    assert torch.allclose(caches[0].k[:, :, 20:27], want, atol=1e-6)
    assert torch.equal(caches[0].v[:, :, 3:10], chunks[0][1])


LONG_QUESTION = " ".join(DOCS) * 4 + " Which of these is the oldest?"


def test_a_long_question_lends_its_leading_blocks_to_chunk_slots(llm: LLM) -> None:
    """Cut at token boundaries: the prompt's tokens are the ones a whole question gives."""
    tokenizer = llm.loaded.tokenizer
    layout = build_layout(_req([0], LONG_QUESTION), tokenizer, fingerprint="f")
    parts = template_parts(tokenizer, DEFAULT_SYSTEM)
    whole = tokenizer(f"Question: {LONG_QUESTION}{parts.tail}", add_special_tokens=False)
    whole_ids = tuple(whole["input_ids"])
    assert len(whole_ids) >= 2 * QUESTION_BLOCK + QUESTION_KEEP  # so at least two blocks
    blocks = layout.chunks[1:]
    assert [b.label for b in blocks] == [
        f"question[{a}:{a + QUESTION_BLOCK}]"
        for a in range(0, len(blocks) * QUESTION_BLOCK, QUESTION_BLOCK)
    ]
    assert sum((b.token_ids for b in blocks), ()) + layout.question_ids == whole_ids
    assert QUESTION_KEEP <= len(layout.question_ids) < QUESTION_KEEP + QUESTION_BLOCK
    short = build_layout(_req([0]), tokenizer, fingerprint="f")
    assert len(short.chunks) == 1  # a short question lends nothing


@pytest.mark.parametrize("mode", ["prefix", "cachecraft"])
def test_a_long_prompt_sent_again_reuses_its_question_blocks_exactly(llm: LLM, mode: str) -> None:
    request = _req([1, 0], LONG_QUESTION)
    full = _run(llm, request, "full")
    _run(llm, request, mode)
    again = _run(llm, request, mode)
    blocks = [c for c in again.report.chunks if (c.label or "").startswith("question[")]
    assert len(blocks) >= 2 and all(c.is_hit and c.tokens_recomputed == 0 for c in blocks)
    # the question's last tokens only
    assert again.report.tokens_computed < QUESTION_KEEP + QUESTION_BLOCK
    assert (again.first_token_logits - full.first_token_logits).abs().max() < 1e-4
    assert again.token_ids == full.token_ids


@pytest.mark.parametrize("mode", ["prefix", "cachecraft"])
def test_context_in_the_system_message_is_reused(llm: LLM, mode: str) -> None:
    """System chunks are chunk-caches like any other: sent again, reused exactly (the
    template's end of the system turn too); in a new order, reused with a recompute, and
    with every token recomputed the answer is the full prefill's."""
    request = RagRequest("Which one is tallest?", system="Use these.", system_chunks=DOCS[:3])
    full = _run(llm, request, "full")
    _run(llm, request, mode)
    again = _run(llm, request, mode)
    assert len(again.report.chunks) == 4
    assert all(c.is_hit and c.tokens_recomputed == 0 for c in again.report.chunks)
    layout = build_layout(request, llm.loaded.tokenizer, "f")
    assert again.report.tokens_computed == len(layout.question_ids)
    assert (again.first_token_logits - full.first_token_logits).abs().max() < 1e-4
    assert again.token_ids == full.token_ids
    moved = RagRequest("Which one is tallest?", system="Use these.", system_chunks=DOCS[2::-1])
    everything = [[c.num_tokens for c in build_layout(moved, llm.loaded.tokenizer, "f").chunks]]
    out = llm.generate(moved, GREEDY, mode="cachecraft", budgets=everything, keep_logits=True)[0]
    assert [c.is_hit for c in out.report.chunks] == [True, True, True, True]
    want = _run(llm, moved, "full")
    assert (out.first_token_logits - want.first_token_logits).abs().max() < 1e-4


@pytest.mark.parametrize("mode", ["prefix", "cachecraft"])
def test_a_long_turn_reuses_its_question_blocks_in_the_next_turn(llm: LLM, mode: str) -> None:
    """A long one-paragraph user message lends blocks as the question; in the chat's next
    request it is history, laid out as it was, so those blocks are hits with nothing
    recomputed and the answer is the full prefill's."""
    turn = [{"role": "user", "content": LONG_QUESTION}]
    first = chat_request(turn)
    asked = [c.key for c in _run(llm, first, mode).report.chunks]
    chat = [
        *turn,
        {"role": "assistant", "content": "The pyramids."},
        {"role": "user", "content": "Why?"},
    ]
    later = chat_request(chat)
    assert [c.as_question for c in later.chunks] == [True, False]
    again = _run(llm, later, mode)
    blocks = [c for c in again.report.chunks if c.key in asked]
    assert len(blocks) >= 2 and all(c.is_hit and c.tokens_recomputed == 0 for c in blocks)
    full = _run(llm, later, "full")
    assert (again.first_token_logits - full.first_token_logits).abs().max() < 1e-4


@pytest.mark.parametrize("refresh", [True, False])
def test_a_repeated_prompt_is_refreshed_then_reused_exactly(tiny_dir: Path, refresh: bool) -> None:
    """Chunks reused from other contexts are recomputed in part; the same prompt sent again
    computes them in full (exact variants), and from then on it computes only the question
    and answers as the full prefill does. With refresh_repeats off it never gets exact."""
    llm = LLM(
        str(tiny_dir),
        store=MemoryStore(2 << 30, storage_dtype="float32"),
        refresh_repeats=refresh,
    )
    _run(llm, _req([0, 1, 2]), "cachecraft")
    moved = _req([2, 0, 1])
    # its first sighting, twice at once (as a request's `n` choices): neither is a repeat
    together = llm.generate([moved, moved], GREEDY, mode="cachecraft")
    assert all(c.is_hit and c.reason != "refresh" for o in together for c in o.report.chunks)
    again = _run(llm, moved, "cachecraft")
    third = _run(llm, moved, "cachecraft")
    if refresh:
        assert [c.reason for c in again.report.chunks] == ["refresh"] * 3  # computed in full
        assert all(c.is_hit and c.tokens_recomputed == 0 for c in third.report.chunks)
        full = _run(llm, moved, "full")
        assert (third.first_token_logits - full.first_token_logits).abs().max() < 1e-4
    else:
        assert all(c.is_hit for c in again.report.chunks + third.report.chunks)
        assert sum(c.tokens_recomputed for c in third.report.chunks) > 0
