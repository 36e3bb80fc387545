"""The engine's KV pool: decodes batched over pool slots answer exactly as decodes alone, a
request the pool cannot hold decodes alone in the same steps, and every slot comes back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachecraft.engine.engine import Engine, EngineConfig
from cachecraft.engine.offline import Submission, run_requests
from cachecraft.engine.runner import Runner
from cachecraft.engine.sampling import SamplingParams
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.request import Chunk, RagRequest
from cachecraft.store.memory import MemoryStore

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def _request(i: int, num_words: int) -> RagRequest:
    text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(num_words))
    return RagRequest(f"What comes after {WORDS[i]}?", [Chunk(text, id=f"c{i}")])


def _answers(m: LoadedModel, config: EngineConfig, requests: list[RagRequest]) -> list:
    engine = Engine(Runner(m, MemoryStore(1 << 28)), config, caller_driven=True)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    subs = [Submission(r, greedy, "cachecraft") for r in requests]
    outs = run_requests(engine, subs)
    if engine.pool is not None:
        engine.pool.check_integrity()
        assert engine.pool.num_free == engine.pool.num_slots  # every slot came back
    return [o.token_ids for o in outs], engine


@pytest.fixture(scope="module")
def tiny_model(tiny_dir: Path) -> LoadedModel:
    return load_model(str(tiny_dir))


def test_pooled_decodes_answer_as_decodes_alone(tiny_model: LoadedModel) -> None:
    # mixed prompt lengths, more requests than slots: slots are reused as requests end
    requests = [_request(i, n) for i, n in enumerate((5, 40, 12, 90, 25, 60, 8))]
    alone, _ = _answers(tiny_model, EngineConfig(max_running=4, kv_pool_mib=0), requests)
    pooled, engine = _answers(tiny_model, EngineConfig(max_running=4), requests)
    assert pooled == alone
    assert engine.pool is not None and engine.pool.capacity > 0
    assert max(s.num_decodes for s in engine.recent_steps) == 4


def test_variants_stored_from_pool_slots_equal_plain_ones(tiny_model: LoadedModel) -> None:
    requests = [_request(i, n) for i, n in enumerate((30, 70))]
    _, plain = _answers(tiny_model, EngineConfig(kv_pool_mib=0), requests)
    _, pooled = _answers(tiny_model, EngineConfig(max_running=4), requests)
    for request in requests:
        [chunk] = pooled.runner.layout(request).chunks
        [meta] = pooled.runner.store.variants(chunk.key)
        [want] = plain.runner.store.variants(chunk.key)
        got, ref = (
            pooled.runner.store.load(meta.variant_id),
            plain.runner.store.load(want.variant_id),
        )
        assert got is not None and ref is not None
        assert torch.equal(got.keys, ref.keys) and torch.equal(got.values, ref.values)


def test_a_request_the_pool_cannot_hold_decodes_alone_beside_it(tiny_model: LoadedModel) -> None:
    requests = [_request(0, 10), _request(1, 200), _request(2, 15)]
    alone, _ = _answers(tiny_model, EngineConfig(kv_pool_mib=0), requests)
    # room for 256 positions per slot: the 200-word prompt gets its own cache
    small = EngineConfig(max_running=4, kv_pool_mib=1)
    tokens, engine = _answers(tiny_model, small, requests)
    assert tokens == alone
    assert engine.pool is not None and engine.pool.capacity == 256  # reserved at once
    assert engine.runner.layout(requests[1]).num_tokens > 256


def test_lazy_zeros_are_zero_aligned_and_writable() -> None:
    from cachecraft.model.kv import lazy_zeros

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = lazy_zeros((2, 3, 5, 4), dtype, "cpu")
        assert x.dtype == dtype and x.shape == (2, 3, 5, 4) and x.is_contiguous()
        assert x.data_ptr() % 4096 == 0 and not bool(x.any())
        x[1, 2] = 1.5
        assert float(x.sum()) == 1.5 * 20
    assert lazy_zeros((0, 4), torch.float32, "cpu").numel() == 0
