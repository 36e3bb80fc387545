"""The second stage (`probe_second`): what it recomputes, what it costs, where the first
token's logits come from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from plan_helpers import make_layout
from store_helpers import make_meta

from cachecraft.engine.sampling import SamplingParams
from cachecraft.engine.second_stage import _picked
from cachecraft.llm import LLM
from cachecraft.model.step import SeqWork
from cachecraft.request import Chunk, RagRequest
from cachecraft.reuse.plan import ChunkPlan, RecomputePlan
from cachecraft.store.memory import MemoryStore

DOCS = [
    "The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889.",
    "Mount Everest is the highest mountain above sea level, in the Himalayas.",
    "The Great Wall of China is a series of fortifications across northern China.",
]
NEW = "The Amazon is the largest rainforest on Earth, spanning nine countries."
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def _req(order: list[int]) -> RagRequest:
    return RagRequest("Which one is tallest?", [Chunk(DOCS[i], id=f"d{i}") for i in order])


def _llm(tiny_dir: Path, **kw: object) -> LLM:
    store = MemoryStore(2 << 30, storage_dtype="float32")
    llm = LLM(str(tiny_dir), store=store, focus_threshold=0.0, probe_max_cost=None, **kw)
    llm.generate(_req([0, 1, 2]), GREEDY, mode="cachecraft")  # every chunk a variant
    return llm


def test_the_budget_is_split_and_the_second_stage_pays_its_rows(tiny_dir: Path) -> None:
    one = _llm(tiny_dir).generate(_req([2, 1, 0]), GREEDY, mode="cachecraft")[0].report
    two = _llm(tiny_dir, probe_second=0.5).generate(_req([2, 1, 0]), GREEDY, "cachecraft")[0]
    rep = two.report
    assert all(c.is_hit for c in rep.chunks)
    budget = sum(c.tokens_recomputed for c in one.chunks)
    assert sum(c.tokens_recomputed for c in rep.chunks) == budget  # the same tokens in all
    question = one.probe_tokens
    # its probe and the question computed again; the prefill measured what the second reads
    assert rep.probe_tokens == 2 * question
    assert rep.probe_cost == pytest.approx(2 * question)
    assert rep.computed_fraction > one.computed_fraction


def test_a_prefill_collecting_statistics_probes_the_question_again(tiny_dir: Path) -> None:
    chunks = [*(Chunk(d, id=f"d{i}") for i, d in enumerate(DOCS)), Chunk(NEW, id="new")]
    request = RagRequest("Which one is tallest?", chunks)
    one = _llm(tiny_dir).generate(request, GREEDY, mode="cachecraft")[0].report
    two = _llm(tiny_dir, probe_second=0.5).generate(request, GREEDY, "cachecraft")[0].report
    assert [c.is_hit for c in two.chunks] == [True, True, True, False]  # the new one: a miss
    assert two.probe_tokens == 3 * one.probe_tokens  # the question probed once more


def test_the_first_token_comes_from_the_cache_the_second_stage_fixed(tiny_dir: Path) -> None:
    llm = _llm(tiny_dir, probe_second=0.5)
    job, outcome = llm.runner.prefill(_req([2, 1, 0]), llm.strategies.resolve("cachecraft"))
    layout, stage = job.plan.layout, job.plan.second
    assert stage is not None and job.plan.probe is not None
    whole = stage.tokens + job.plan.probe.total  # the request's budget, split in two halves
    assert stage.tokens == -(-whole // 2)
    assert outcome.rows is not None and outcome.rows_last_layer is not None
    assert outcome.rows.shape == outcome.rows_last_layer.shape
    assert outcome.result is not None  # the first stage's pass
    first = outcome.result.logits[-1]
    assert (first - outcome.first_logits).abs().max() > 1e-4  # the second stage changed it
    # the question run once more over the request's cache gives the same logits
    question = torch.arange(layout.question_start, layout.num_tokens)
    again = SeqWork(job.kv, torch.tensor(layout.question_ids), question)
    logits = llm.loaded.model.forward_step([again])[0].logits[-1]
    assert (logits - outcome.first_logits).abs().max() < 1e-4
    # every position the report counts once, the second stage's at every layer
    rows = outcome.rows.tolist()
    assert rows == sorted(set(rows))
    top = llm.loaded.arch.num_layers - 1
    recomputed = sum(c.tokens_recomputed for c in outcome.report.chunks)
    in_chunks = [
        layer
        for row, layer in zip(rows, outcome.rows_last_layer.tolist(), strict=True)
        if layout.chunks[0].start <= row < layout.question_start
    ]
    assert sum(layer == top for layer in in_chunks) == recomputed


def test_the_second_stage_picks_the_most_read_tokens_not_yet_recomputed() -> None:
    layout = make_layout(("a", "b"), {"a": 4, "b": 4}, "p")
    a, b = layout.chunks
    plans = (
        ChunkPlan(a, make_meta("a", num_tokens=4), (), 0, "cfo"),  # reused
        ChunkPlan(b, None, (0, 1, 2, 3), 4, "miss"),  # computed in full: never picked
    )
    plan = RecomputePlan("cachecraft", layout, plans, prefix_hit=True)
    mass = torch.zeros(layout.question_start)
    mass[a.start : a.end] = torch.tensor([0.1, 0.4, 0.3, 0.4])
    mass[b.start : b.end] = 1.0
    top = 3
    # the prefill ran offset 1 through every layer and stopped offset 3 at the check
    rows = torch.tensor([a.start + 1, a.start + 3, *range(b.start, b.end)])
    last = torch.tensor([top, 1, *[top] * b.num_tokens])
    assert _picked(plan, rows, last, mass, top, 2).tolist() == [a.start + 2, a.start + 3]
    everything = _picked(plan, rows, last, mass, top, 10).tolist()
    assert everything == [a.start, a.start + 2, a.start + 3]
