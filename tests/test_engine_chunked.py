"""Chunked prefill: a long prompt's prefill runs in pieces over several steps while another
request keeps decoding, and answers (tokens, first logits, the variants it stores with their
statistics) exactly as the same prefill run whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachecraft.engine.engine import Engine, EngineConfig
from cachecraft.engine.handle import Finished, Token
from cachecraft.engine.options import RequestOptions
from cachecraft.engine.runner import Runner
from cachecraft.engine.sampling import SamplingParams
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.request import Chunk, RagRequest
from cachecraft.reuse.strategies import STRATEGIES
from cachecraft.store.memory import MemoryStore

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _long_request() -> RagRequest:
    words = [
        "river",
        "stone",
        "cloud",
        "ember",
        "quiet",
        "lantern",
        "harbor",
        "meadow",
        "copper",
        "violet",
    ]
    chunks = [
        Chunk(" ".join(words[(c * 3 + i) % len(words)] for i in range(60)), id=f"doc{c}")
        for c in range(3)
    ]
    return RagRequest("Which word comes most often?", chunks)


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> LoadedModel:
    return load_model(str(tiny_dir))


def _run(model: LoadedModel, config: EngineConfig) -> tuple[list[int], torch.Tensor, Engine]:
    """A short request decodes; then the long one arrives and prefills beside it."""
    engine = Engine(Runner(model, MemoryStore(1 << 28)), config, caller_driven=True)
    short = engine.submit(RagRequest("Hi?", []), SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.step()  # the short one is decoding now
    handle = engine.submit(
        _long_request(), GREEDY, STRATEGIES.get("cachecraft"), options=RequestOptions(())
    )
    tokens: list[int] = []
    extras = None
    while True:
        engine.step()
        while (event := handle.poll()) is not None:
            if isinstance(event, Token):
                tokens.append(event.token_id)
            elif isinstance(event, Finished):
                extras = event.extras
        if extras is not None:
            break
    short.abort()
    while engine.has_work():
        engine.step()
    assert extras is not None
    return tokens, extras.first_logits, engine


def test_chunked_prefill_interleaves_decodes_and_equals_a_whole_prefill(
    model: LoadedModel,
) -> None:
    whole_tokens, whole_logits, whole = _run(model, EngineConfig(chunked_prefill=False))
    config = EngineConfig(token_budget=64, max_running=4, chunked_prefill=True)
    tokens, logits, chunked = _run(model, config)
    # the long prefill (~200 rows) ran in pieces of at most 63 rows, each beside a decode
    pieces = [s for s in list(chunked.recent_steps)[1:] if s.num_prefills == 1]
    assert len(pieces) >= 3
    assert all(s.num_decodes == 1 and s.num_prefill_rows <= 63 for s in pieces)
    assert max(s.num_prefill_rows for s in whole.recent_steps) > 150  # whole: one step
    assert tokens == whole_tokens
    assert (logits - whole_logits).abs().max() < 1e-4
    # the variants it stored carry the same statistics (merged over the pieces)
    for chunk in _long_request().chunks:
        key = (
            chunked.runner.plan(RagRequest("?", [chunk]), STRATEGIES.get("cachecraft"))
            .layout.chunks[0]
            .key
        )
        got, want = chunked.runner.store.variants(key), whole.runner.store.variants(key)
        assert len(got) == len(want) == 1
        assert got[0].cci == pytest.approx(want[0].cci, abs=1e-4)
    for engine in (whole, chunked):
        assert engine.pool is not None and engine.pool.num_free == engine.pool.num_slots
