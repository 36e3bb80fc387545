"""Admission inside a step (EngineConfig.admit_in_step): a request that arrives while a step's
forward runs is planned and queued before that step reads its results, and answers exactly as
it does when admitted at the next step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cachecraft.engine.engine import Engine, EngineConfig
from cachecraft.engine.handle import Finished, Planned, RequestHandle, Token
from cachecraft.engine.runner import Runner
from cachecraft.engine.sampling import SamplingParams
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.request import Chunk, RagRequest
from cachecraft.store.memory import MemoryStore

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
FIRST = RagRequest("Which colour?", [Chunk("red green blue " * 12, id="a")])
LATE = RagRequest("Which animal?", [Chunk("cat dog bird " * 12, id="b"), FIRST.chunks[0]])


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> LoadedModel:
    return load_model(str(tiny_dir))


def _drain(engine: Engine, handle: RequestHandle) -> tuple[list[Any], list[int]]:
    """Step until `handle` finishes: (its events, its tokens)."""
    events: list[Any] = []
    while not any(isinstance(e, Finished) for e in events):
        engine.step()
        while (event := handle.poll()) is not None:
            events.append(event)
    return events, [e.token_id for e in events if isinstance(e, Token)]


def _arrives_during_forward(engine: Engine, leaves: bool = False) -> list[RequestHandle]:
    """LATE is submitted (and with `leaves` aborted at once) while the engine's first forward
    runs: the list holds its handle from then on."""
    forward = engine.batches.forward
    late: list[RequestHandle] = []

    def forward_then_arrive(batch: Any) -> Any:
        out = forward(batch)
        if not late:
            late.append(engine.submit(LATE, GREEDY))
            if leaves:
                late[0].abort()  # queued while it is being admitted
        return out

    engine.batches.forward = forward_then_arrive  # type: ignore[method-assign]
    return late


def _late_arrival(model: LoadedModel, admit_in_step: bool) -> tuple[bool, list[int], Engine]:
    """FIRST runs; LATE is submitted while FIRST's first forward runs. (Was LATE planned
    within that step, LATE's tokens, the engine.)"""
    config = EngineConfig(admit_in_step=admit_in_step, kv_pool_mib=0)
    engine = Engine(Runner(model, MemoryStore(1 << 28)), config, caller_driven=True)
    assert engine.admit_in_step is admit_in_step  # given, whatever the device
    first = engine.submit(FIRST, GREEDY)
    late = _arrives_during_forward(engine)
    engine.step()
    planned_in_step = isinstance(late[0].poll(), Planned)
    _drain(engine, first)
    _, tokens = _drain(engine, late[0])
    return planned_in_step, tokens, engine


def test_a_request_arriving_during_the_forward_is_admitted_in_that_step(
    model: LoadedModel,
) -> None:
    planned, tokens, engine = _late_arrival(model, admit_in_step=True)
    assert planned and engine.num_waiting == 0 and engine.num_failed == 0
    later, later_tokens, _ = _late_arrival(model, admit_in_step=False)
    assert not later  # without it, the next step admits it
    assert tokens == later_tokens and len(tokens) == GREEDY.max_tokens


def test_an_abort_of_a_request_admitted_in_the_step_finishes_it(model: LoadedModel) -> None:
    engine = Engine(
        Runner(model, MemoryStore(1 << 28)), EngineConfig(admit_in_step=True), caller_driven=True
    )
    first = engine.submit(FIRST, GREEDY)
    late = _arrives_during_forward(engine, leaves=True)
    _drain(engine, first)
    events, tokens = _drain(engine, late[0])
    assert isinstance(events[0], Planned) and not tokens
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "abort"
    assert engine.num_aborted == 1 and not engine.has_work()
