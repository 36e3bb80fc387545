"""Raw prompts (no chat template: a completion's text or token ids, read as given) and prompt
log-probabilities, on the tiny random Llama: exact against a plain full forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachecraft.engine.engine import EngineConfig
from cachecraft.engine.sampling import SamplingParams, prompt_token_logprobs
from cachecraft.errors import BadRequestError
from cachecraft.llm import LLM
from cachecraft.model.reference import prefill
from cachecraft.request import Chunk, RagRequest
from cachecraft.reuse.layout import QUESTION_BLOCK, QUESTION_KEEP, build_layout
from cachecraft.store.memory import MemoryStore
from cachecraft_bench.modes import LAB_MODES as MODES

TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889. "
    "Mount Everest is the highest mountain above sea level, in the Himalayas. "
) * 5 + "Which of these is the oldest?"
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture
def llm(tiny_dir: Path) -> LLM:
    return LLM(str(tiny_dir), store=MemoryStore(2 << 30, storage_dtype="float32"))


def test_a_raw_prompt_is_its_own_tokens_in_blocks(llm: LLM) -> None:
    tokenizer = llm.loaded.tokenizer
    layout = build_layout(RagRequest(TEXT, raw=True), tokenizer, "f")
    want = tuple(tokenizer(TEXT)["input_ids"])  # no template, no "Question: "
    assert layout.token_ids == want and layout.prefix_ids == ()
    assert len(layout.chunks) >= 2
    assert [c.label for c in layout.chunks][:2] == [
        f"prompt[0:{QUESTION_BLOCK}]",
        f"prompt[{QUESTION_BLOCK}:{2 * QUESTION_BLOCK}]",
    ]
    assert QUESTION_KEEP <= len(layout.question_ids) < QUESTION_KEEP + QUESTION_BLOCK
    ids = RagRequest("", prompt_ids=list(want))
    assert ids.raw and build_layout(ids, tokenizer, "f").token_ids == want
    short = build_layout(RagRequest("Hi", prompt_ids=[5, 6, 7]), tokenizer, "f")
    assert short.chunks == () and short.question_ids == (5, 6, 7)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_on_a_raw_prompt_answers_as_a_plain_forward(llm: LLM, mode: str) -> None:
    """The empty prefix and the lent blocks change nothing: the first logits are a plain
    prefill's of the same ids, whatever the mode (nothing cached yet: all computed)."""
    request = RagRequest(TEXT, raw=True)
    ids = torch.tensor(build_layout(request, llm.loaded.tokenizer, "f").token_ids)
    want, _ = prefill(llm.loaded, ids)
    out = llm.generate(request, GREEDY, mode=mode, keep_logits=True)[0]
    assert out.report.prompt_tokens == len(ids)
    assert (out.first_token_logits - want[-1]).abs().max() < 1e-4


@pytest.mark.parametrize("mode", ["prefix", "cachecraft"])
def test_a_raw_prompt_sent_again_reuses_its_blocks_exactly(llm: LLM, mode: str) -> None:
    request = RagRequest(TEXT, raw=True)
    full = llm.generate(request, GREEDY, mode="full", keep_logits=True)[0]
    llm.generate(request, GREEDY, mode=mode)
    again = llm.generate(request, GREEDY, mode=mode, keep_logits=True)[0]
    assert all(c.is_hit and c.tokens_recomputed == 0 for c in again.report.chunks)
    assert again.report.tokens_computed < QUESTION_KEEP + QUESTION_BLOCK
    assert (again.first_token_logits - full.first_token_logits).abs().max() < 1e-4
    assert again.token_ids == full.token_ids


@pytest.mark.parametrize("token_budget", [2048, 48])  # whole, and in pieces over 3+ steps
def test_prompt_logprobs_are_a_plain_forwards(tiny_dir: Path, token_budget: int) -> None:
    store = MemoryStore(2 << 30, storage_dtype="float32")
    llm = LLM(str(tiny_dir), store=store, engine=EngineConfig(token_budget=token_budget))
    request = RagRequest(TEXT, raw=True)
    llm.generate(request, GREEDY, mode="cachecraft")  # its blocks are cached now
    sampling = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    out = llm.generate(request, sampling, mode="cachecraft", keep_logits=True)[0]
    ids = torch.tensor(build_layout(request, llm.loaded.tokenizer, "f").token_ids)
    logits, _ = prefill(llm.loaded, ids, all_logits=True)
    want = prompt_token_logprobs(logits[:-1], ids[1:], 2)
    got = out.prompt_logprobs
    assert out.report.mode == "full" and out.report.tokens_computed == len(ids)
    assert got is not None and len(got) == len(ids) and got[0] is None
    assert [g.logprob for g in got[1:]] == pytest.approx([w.logprob for w in want], abs=1e-4)
    assert [[t for t, _ in g.top] for g in got[1:]] == [[t for t, _ in w.top] for w in want]
    assert (out.first_token_logits - logits[-1]).abs().max() < 1e-4
    plain = llm.generate(request, GREEDY, mode="cachecraft")[0]
    assert plain.prompt_logprobs is None


def test_prompt_token_logprobs_are_the_log_softmax_and_its_top() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, -1.0, 5.0]])
    got = prompt_token_logprobs(logits, torch.tensor([2, 0]), 1)
    want = torch.log_softmax(logits, -1)
    assert [g.logprob for g in got] == pytest.approx([float(want[0, 2]), float(want[1, 0])])
    assert [g.top[0][0] for g in got] == [1, 2]
    assert prompt_token_logprobs(logits, torch.tensor([0, 0]), 0)[0].top == ()
    with pytest.raises(BadRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_bad_raw_prompts_are_clear(llm: LLM) -> None:
    with pytest.raises(BadRequestError, match="no chunks"):
        RagRequest("Hi", [Chunk("a passage")], raw=True)
    with pytest.raises(BadRequestError, match="token ids >= 0"):
        RagRequest("", prompt_ids=[1, -2])
    with pytest.raises(BadRequestError, match="question is empty"):
        RagRequest(" ", raw=True)
    vocab = llm.loaded.arch.vocab_size
    with pytest.raises(BadRequestError, match=f"token {vocab} is not in the vocabulary"):
        llm.generate(RagRequest("", prompt_ids=[1, vocab]), GREEDY)
