"""Reuse modes end to end on the tiny model: exactness limits, totals, keys, bad requests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachecraft.config import MODES
from cachecraft.engine.sampling import SamplingParams
from cachecraft.errors import BadRequestError, ContextLengthError
from cachecraft.llm import LLM
from cachecraft.request import Chunk, RagRequest
from cachecraft.store.memory import MemoryStore

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


def test_cachecraft_recomputes_ceil_cfo_tokens(llm: LLM) -> None:
    _run(llm, _req([0, 1, 2]), "cachecraft")
    out = _run(llm, _req([2, 1, 0]), "cachecraft")
    for c in out.report.chunks:
        assert c.is_hit and c.cfo is not None
        expected = min(c.num_tokens, -int(-(c.cfo * c.num_tokens - 1e-9) // 1))
        assert c.tokens_recomputed == expected


def test_early_termination_stops_unfocused_chunks(tiny_dir: Path) -> None:
    llm = LLM(str(tiny_dir), alpha=1e9, et_layer=1, focus_threshold=1.1)  # all unfocused
    _run(llm, _req([0, 1, 2]), "cachecraft")
    out = _run(llm, _req([2, 1, 0]), "cachecraft")
    assert [c.last_layer for c in out.report.chunks] == [1, 1, 1]
    assert out.report.layer_fraction < 1.0
    llm0 = LLM(str(tiny_dir), alpha=1e9, et_layer=1, focus_threshold=0.0)  # none unfocused
    _run(llm0, _req([0, 1, 2]), "cachecraft")
    out0 = _run(llm0, _req([2, 1, 0]), "cachecraft")
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
