"""One request path: LLM.generate runs the server's engine (caller-driven) and answers as the
old single-request path did (prefill, then one plain forward step per token)."""

from __future__ import annotations

import copy
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from cachecraft.engine.engine import Engine, EngineConfig
from cachecraft.engine.sampling import SamplingParams
from cachecraft.llm import LLM
from cachecraft.model.loader import LoadedModel
from cachecraft.model.reference import greedy_tokens
from cachecraft.model.step import SeqWork
from cachecraft.request import Chunk, RagRequest
from cachecraft.reuse.strategies import STRATEGIES
from cachecraft.store.config import StoreConfig

DOCS = [
    "The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889.",
    "Mount Everest is the highest mountain above sea level, in the Himalayas.",
    "The Great Wall of China is a series of fortifications across northern China.",
]
STEPS = 7


def _req(order: list[int], question: str = "Which one is tallest?") -> RagRequest:
    return RagRequest(question, [Chunk(DOCS[i], id=f"d{i}") for i in order])


def _old_answer(llm: LLM, request: RagRequest, mode: str, forced: list[int]) -> tuple:
    """The single-request path the engine replaced: prefill, teacher-force after the prompt,
    then greedy decoding one forward step per token, then commit."""
    runner = llm.runner
    job, outcome = runner.prefill(request, STRATEGIES.get(mode), extra_capacity=STEPS + len(forced))
    n = outcome.report.prompt_tokens
    pos = torch.arange(n, n + len(forced))
    work = SeqWork(job.kv, torch.tensor(forced), pos, logits_for="all")
    step = runner.loaded.model.forward_step([work])[0].logits
    job.kv.length = n
    forced_logits = torch.cat([outcome.first_logits[None], step[:-1]])
    tokens = greedy_tokens(runner.loaded, job.kv, outcome.first_logits, STEPS)
    runner.commit(outcome)
    return tokens, outcome.first_logits, forced_logits, outcome.report


@pytest.mark.parametrize("mode", ["full", "cachecraft", "prefix"])
def test_generate_over_the_engine_equals_the_old_answers(tiny_dir: Path, mode: str) -> None:
    old, new = LLM(str(tiny_dir)), LLM(str(tiny_dir))  # same model, two stores, same history
    greedy = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    forced = [5, 17, 99]
    for order in ([0, 1, 2], [2, 0, 1], [0, 1, 2]):  # cold, reordered hits, an exact repeat
        request = _req(order)
        tokens, first, tf, report = _old_answer(old, request, mode, forced)
        out = new.generate(request, greedy, mode, teacher_force=[forced], keep_logits=True)[0]
        assert out.token_ids == tokens
        assert (out.first_token_logits - first).abs().max() < 1e-4
        assert (out.teacher_forced_logits - tf).abs().max() < 1e-4
        assert out.report.tokens_computed == report.tokens_computed
        assert [c.is_hit for c in out.report.chunks] == [c.is_hit for c in report.chunks]
    assert isinstance(new.engine, Engine) and new.engine.caller_driven
    assert new.engine.num_steps > 0  # it really ran through the engine's steps


def test_requests_given_together_are_batched_and_equal_alone(tiny_dir: Path) -> None:
    llm = LLM(str(tiny_dir))
    greedy = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    requests = [_req([0]), _req([1, 2], "Where is it?"), _req([2, 1, 0], "What is it?")]
    alone = [llm.generate(r, greedy, "full")[0].token_ids for r in requests]
    steps_before = llm.engine.num_steps
    together = llm.generate(requests, greedy, "full")
    assert [o.token_ids for o in together] == alone
    # one prefill step for all three, then one batched decode step per token
    assert llm.engine.num_steps - steps_before == STEPS
    assert max(s.num_decodes for s in llm.engine.recent_steps) == 3


@pytest.mark.parametrize("mode", ["prefix", "cachecraft"])
def test_a_chunk_being_computed_is_waited_for_not_computed_twice(tiny_dir: Path, mode: str) -> None:
    """Requests given together that miss the same chunks: the first computes them, the others
    start one step later and reuse what it stored (exactly: same place, same chunks in front),
    answering as a full prefill does. `full` never waits."""
    greedy = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    requests = [_req([0, 1], q) for q in ("Which one?", "Where is it?", "How old is it?")]
    alone = [LLM(str(tiny_dir)).generate(r, greedy, "full")[0].token_ids for r in requests]
    exact = StoreConfig(storage_dtype="float32")  # exact reuse splices bit-identical K/V
    outs = LLM(str(tiny_dir), store=exact).generate(requests, greedy, mode)
    assert [o.token_ids for o in outs] == alone
    first, *later = (o.report for o in outs)
    assert not any(c.is_hit for c in first.chunks)
    for report in later:
        assert all(c.is_hit and c.is_exact and c.tokens_recomputed == 0 for c in report.chunks)
        assert report.tokens_computed < first.tokens_computed
    plain = LLM(str(tiny_dir)).generate(requests, greedy, "full")
    assert all(not any(c.is_hit for c in o.report.chunks) for o in plain)


def test_a_bad_request_in_a_batch_leaves_the_engine_empty(tiny_dir: Path) -> None:
    from cachecraft.errors import BadRequestError

    llm = LLM(str(tiny_dir))
    greedy = SamplingParams(max_tokens=2, ignore_eos=True)
    with pytest.raises(BadRequestError, match="unknown mode"):
        llm.generate([_req([0]), _req([1])], greedy, mode="nope")
    assert not llm.engine.has_work()
    assert len(llm.generate([_req([0]), _req([1])], greedy, "full")) == 2


def test_a_request_failing_in_the_engine_raises_after_the_others_finished(tiny_dir: Path) -> None:
    llm = LLM(str(tiny_dir))
    greedy = SamplingParams(max_tokens=2, ignore_eos=True)
    with pytest.raises(ValueError, match="budgets"):  # planning fails inside the engine
        llm.generate([_req([0]), _req([1])], greedy, "epic", budgets=[None, [1, 2, 3]])
    assert not llm.engine.has_work() and llm.engine.num_running == 0


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: RagRequest("\ud800?", []), "the question is not valid Unicode"),
        (lambda: Chunk("a \udfff b"), "chunk text is not valid Unicode"),
        (lambda: RagRequest("q", [], system="\ud83d"), "system is not valid Unicode"),
    ],
)
def test_lone_surrogates_are_refused_before_the_tokenizer(make: object, needle: str) -> None:
    """The server refused them with a 400; the Python API let them reach the tokenizer, which
    raised `TypeError: TextEncodeInput must be Union[...]` from inside generate."""
    from cachecraft.errors import BadRequestError

    with pytest.raises(BadRequestError, match=needle):
        make()  # type: ignore[operator]


def test_generate_names_a_wrong_argument_type(tiny_dir: Path) -> None:
    """A dict for sampling failed inside the engine's admission (AttributeError, and a logged
    'request failed'); None or a number for the requests raised 'not iterable'."""
    from cachecraft.errors import BadRequestError

    llm = LLM(str(tiny_dir))
    with pytest.raises(BadRequestError, match="sampling must be a SamplingParams"):
        llm.generate(_req([0]), {"max_tokens": 2})  # type: ignore[arg-type]
    for bad in (None, 5, "a question"):
        with pytest.raises(BadRequestError, match="expected"):
            llm.generate(bad)  # type: ignore[arg-type]
    assert not llm.engine.has_work()
    out = llm.generate(_req([0]), SamplingParams(max_tokens=2, ignore_eos=True), "full")
    assert len(out[0].token_ids) == 2


def test_an_unknown_device_is_a_model_load_error(tiny_dir: Path) -> None:
    """LLM(device="tpu") raised torch's RuntimeError listing every device type."""
    from cachecraft.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="unknown device 'tpu'"):
        LLM(str(tiny_dir), device="tpu")
    # a device type torch knows but this build cannot use raised a RuntimeError from RoPE
    with pytest.raises(ModelLoadError, match="'mps': cachecraft runs on cpu or cuda"):
        LLM(str(tiny_dir), device="mps")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        with pytest.raises(ModelLoadError, match=f"has {count} CUDA device"):
            LLM(str(tiny_dir), device=f"cuda:{count}")
    else:
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            LLM(str(tiny_dir), device="cuda")


def test_generate_from_several_threads_answers_as_alone(tiny_dir: Path) -> None:
    """Two step loops driving one engine from two threads mixed the requests' tokens up (and
    some forward steps failed); calls from several threads now run one after another."""
    import threading

    llm = LLM(str(tiny_dir))
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    reqs = [_req([i % 3, (i + 1) % 3], f"Question {i}?") for i in range(6)]
    alone = [llm.generate(r, greedy, "full")[0].token_ids for r in reqs]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(reqs))

    def ask(i: int) -> None:
        try:
            start.wait(30)
            got[i] = llm.generate(reqs[i], greedy, "full")[0].token_ids
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert [got[i] for i in range(len(reqs))] == alone
    assert not llm.engine.has_work()


def test_aligned_kernels_are_warmed_on_the_thread_that_steps(tiny: LoadedModel) -> None:
    """With aligned rows (bf16's default) the engine warms every aligned step size once, in its
    first step on the stepping thread, not where it was made; the answer is unchanged."""
    model = copy.copy(tiny.model)
    model.row_align = 16
    warm = model.warm_kernels
    calls: list[tuple[str, int]] = []

    def spy(max_rows: int) -> int:
        calls.append((threading.current_thread().name, max_rows))
        return warm(max_rows)

    model.warm_kernels = spy  # type: ignore[method-assign]
    config = EngineConfig(token_budget=64, max_running=4)
    aligned = LLM(dataclasses.replace(tiny, model=model), engine=config)
    assert calls == []
    greedy = SamplingParams(max_tokens=4)
    request = _req([0, 1])
    with ThreadPoolExecutor(1, thread_name_prefix="caller") as pool:
        out = pool.submit(aligned.generate, [request], greedy).result()[0]
    assert [name for name, _ in calls] == ["caller_0"] and calls[0][1] == 68
    assert warm(68) == 0  # every count up to a step's most rows is warm
    aligned.generate([request], greedy)
    assert len(calls) == 1
    plain = LLM(tiny, engine=config).generate([request], greedy)[0]
    assert out.token_ids == plain.token_ids
