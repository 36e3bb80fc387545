"""Fault isolation in the engine's step loop (issue 13, defects 1, 2, 5): an error while
admitting, sampling or loading one request fails that request only; the step thread and the
other requests of the batch go on. Real model forwards (tiny random Llama), a real disk store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cachecraft.engine.engine import Engine, EngineConfig, EngineStopped
from cachecraft.engine.handle import Failed, Finished, RequestHandle
from cachecraft.engine.runner import Runner
from cachecraft.engine.sampling import SamplingParams, sample
from cachecraft.errors import BadRequestError
from cachecraft.llm import reuse_config
from cachecraft.model.loader import LoadedModel
from cachecraft.request import Chunk, RagRequest
from cachecraft.reuse.cachecraft import CachecraftParams, CachecraftStrategy
from cachecraft.store.config import StoreConfig
from cachecraft.store.memory import MemoryStore
from cachecraft.store.store import make_store

DOCS = [
    "Saturn is the sixth planet from the Sun and has a prominent ring system.",
    "Jupiter is the largest planet in the Solar System, a gas giant.",
]
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


def run(handle: RequestHandle, timeout: float = 60.0) -> Finished | Failed:
    """Events until the last one (a hang fails through queue.Empty)."""
    while True:
        event = handle.get(timeout=timeout)
        if isinstance(event, Finished | Failed):
            return event


@pytest.fixture
def engine(tiny: LoadedModel) -> Iterator[Engine]:
    e = Engine(Runner(tiny, MemoryStore(1 << 30)), EngineConfig(mode="full")).start()
    yield e
    e.stop()


def bypassing_checks(params: SamplingParams, **fields: object) -> SamplingParams:
    """SamplingParams with fields set past its own validation (what the probe's inputs did
    before the checks existed): the engine must survive them anyway."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def test_sampling_params_refuse_what_torch_cannot_take() -> None:
    with pytest.raises(BadRequestError, match="seed"):
        SamplingParams(temperature=0.7, seed=2**64)
    with pytest.raises(BadRequestError, match="seed"):
        SamplingParams(temperature=0.7, seed=-(2**63) - 1)
    with pytest.raises(BadRequestError, match="temperature"):
        SamplingParams(temperature=1e-300)
    with pytest.raises(BadRequestError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(BadRequestError, match="top_p"):
        SamplingParams(top_p=float("nan"))
    with pytest.raises(BadRequestError, match="top_k"):
        SamplingParams(top_k=-5)
    with pytest.raises(BadRequestError, match="min_p"):
        SamplingParams(min_p=1.5)
    SamplingParams(temperature=0.7, seed=2**64 - 1)  # the edges are fine
    SamplingParams(temperature=0.7, seed=-(2**63))


def test_top_k_and_min_p_sample_only_the_likely_tokens() -> None:
    logits = torch.tensor([3.0, 2.9, 2.8, 0.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    hot = SamplingParams(temperature=100.0)  # nearly uniform without the filters
    assert set(sample(logits, hot, gen) for _ in range(300)) == set(range(5))
    two = SamplingParams(temperature=100.0, top_k=2)
    assert set(sample(logits, two, gen) for _ in range(300)) == {0, 1}
    assert set(
        sample(logits, SamplingParams(temperature=1.0, top_k=1), gen) for _ in range(50)
    ) == {0}
    # min_p 0.5 at temperature 1: e^-0.2 = 0.82 and e^-3 = 0.05 of the top token's probability
    likely = SamplingParams(temperature=1.0, min_p=0.5)
    assert set(sample(logits, likely, gen) for _ in range(300)) == {0, 1, 2}
    assert set(
        sample(logits, SamplingParams(temperature=1.0, top_k=-1), gen) for _ in range(300)
    ) == set(range(5))


def test_sample_never_fails_on_non_finite_logits() -> None:
    logits = torch.zeros(10)
    logits[3] = float("inf")
    params = SamplingParams(temperature=0.5, seed=1)
    gen = torch.Generator().manual_seed(1)
    assert sample(logits, params, gen) == 3  # inf/inf = nan probabilities: greedy fallback
    logits = torch.full((10,), float("nan"))
    logits[7] = 1.0
    assert sample(logits, params, gen) == 7
    assert sample(logits, SamplingParams(), None) == 7  # greedy ignores nan too


def test_admission_error_fails_only_that_request(engine: Engine) -> None:
    bad = bypassing_checks(SamplingParams(temperature=0.7, max_tokens=3), seed=2**64)
    h_bad = engine.submit(RagRequest("q", []), bad)
    assert isinstance(run(h_bad), Failed)
    ok = run(engine.submit(RagRequest("next?", []), GREEDY))
    assert isinstance(ok, Finished) and len(ok.output_ids) == 5
    assert engine.liveness().is_alive and engine.liveness().num_failed_requests == 1


def test_overflowing_temperature_samples_greedy_and_others_go_on(engine: Engine) -> None:
    tiny = bypassing_checks(SamplingParams(max_tokens=5, ignore_eos=True), temperature=1e-300)
    tiny = bypassing_checks(tiny, seed=3)
    h_tiny = engine.submit(RagRequest("a question", []), tiny)
    h_other = engine.submit(RagRequest("a question", []), GREEDY)
    got, ref = run(h_tiny), run(h_other)
    assert isinstance(got, Finished) and isinstance(ref, Finished)
    assert got.output_ids == ref.output_ids  # logits / 1e-300 overflow: the greedy fallback
    assert engine.num_steps < 50  # no error loop


def test_stopping_fails_pending_requests_instead_of_hanging(engine: Engine) -> None:
    handles = [engine.submit(RagRequest(f"q{i}", []), GREEDY) for i in range(3)]
    engine.stop()
    for h in handles:  # each ends, one way or the other
        assert isinstance(run(h, timeout=30), Finished | Failed)
    with pytest.raises(EngineStopped):
        engine.submit(RagRequest("late", []), GREEDY)
    assert not engine.liveness().is_alive


class WithoutPrefetch:
    """The real tiered store whose `prefetch` does nothing (the contract allows a store that
    never prefetches). A prefetch reads and checks a whole file while the request waits, so
    bytes that rot after it (or a store that never prefetches) are first seen corrupt inside
    the forward step."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def prefetch(self, variant_ids: list[str]) -> None:
        """Never prefetches."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_corrupt_chunk_in_a_batched_step_fails_nobody(tiny: LoadedModel, tmp_path: Path) -> None:
    # memory tier off: every hit is read layer by layer from disk, inside the forward step
    store = make_store(StoreConfig(cache_dir=str(tmp_path), memory_bytes=0, doorkeeper_threshold=1))
    reuse = reuse_config(alpha=1e9, min_fix=1.0)
    runner = Runner(tiny, WithoutPrefetch(store), reuse)  # type: ignore[arg-type]
    everything = CachecraftStrategy(CachecraftParams(early_termination=False))
    engine = Engine(runner, EngineConfig(mode="cachecraft"), strategy=everything).start()
    try:
        rag = RagRequest("Which planet has rings?", [Chunk(d) for d in DOCS])
        assert isinstance(run(engine.submit(rag, GREEDY)), Finished)  # stores both chunks
        store.flush()  # disk writes end in the background, after the answer
        files = sorted(tmp_path.glob("*.safetensors"))
        assert len(files) == 2
        data = bytearray(files[0].read_bytes())
        data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)  # same size, bad K/V bytes
        files[0].write_bytes(bytes(data))

        # both admitted in the same loop turn, so they share one forward step
        def submit_both() -> tuple[RequestHandle, RequestHandle]:
            return engine.submit(rag, GREEDY), engine.submit(
                RagRequest("No documents?", []), GREEDY
            )

        h_docs, h_plain = engine.call(submit_both).result(60)
        plain, docs = run(h_plain), run(h_docs)
        assert isinstance(plain, Finished), plain
        assert isinstance(docs, Finished), docs  # planned again: the bad chunk became a miss
        assert docs.report is not None
        assert [c.is_hit for c in docs.report.chunks].count(False) == 1
        assert store.stats().evictions["disk:corrupt"] == 1
        store.check_integrity()
    finally:
        engine.stop()
        store.close()


class FailsBatchedProbes:
    """The real model, except that a forward of several probe passes at once raises (what
    one bad request in the step's shared probe pass would do to the others)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_failed = 0

    def forward_step(self, works: list[Any]) -> Any:
        if len(works) > 1 and all(w.meter is not None for w in works):
            self.num_failed += 1
            raise RuntimeError("a probe of this pass failed")
        return self.inner.forward_step(works)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_failed_shared_probe_pass_runs_each_probe_alone(tiny: LoadedModel) -> None:
    model = FailsBatchedProbes(tiny.model)
    loaded = dataclasses.replace(tiny, model=model)
    engine = Engine(
        # probes run whatever their cost, so both requests probe (not a check instead)
        Runner(loaded, MemoryStore(1 << 30, storage_dtype="float32")),
        EngineConfig(mode="cachecraft"),
        strategy=CachecraftStrategy(CachecraftParams(probe_max_cost=None)),
    ).start()
    try:
        rag = RagRequest("Which planet has rings?", [Chunk(d) for d in DOCS])
        assert isinstance(run(engine.submit(rag, GREEDY)), Finished)  # stores both chunks
        swapped = [  # reused out of place: both probe the question first
            RagRequest(q, [Chunk(d) for d in reversed(DOCS)])
            for q in ("Which planet is largest?", "Which planet has rings?")
        ]

        def submit_both() -> tuple[RequestHandle, RequestHandle]:  # one loop turn: one step
            return engine.submit(swapped[0], GREEDY), engine.submit(swapped[1], GREEDY)

        handles = engine.call(submit_both).result(60)
        events = [run(h) for h in handles]
        assert model.num_failed == 1  # the shared pass failed once, each probe then ran alone
        for event in events:
            assert isinstance(event, Finished), event
            assert event.report is not None and event.report.probe_tokens > 0
            assert all(c.is_hit for c in event.report.chunks)
        assert engine.is_alive and engine.num_failed == 0
    finally:
        engine.stop()
