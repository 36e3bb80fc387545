"""The engine's KV pool: decodes batched over pool slots answer exactly as decodes alone, a
request the pool cannot hold decodes alone in the same steps, and every slot comes back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from page_helpers import resident

from cachecraft.engine.engine import Engine, EngineConfig
from cachecraft.engine.handle import Failed, Finished
from cachecraft.engine.offline import Submission, run_requests
from cachecraft.engine.runner import Runner
from cachecraft.engine.sampling import SamplingParams
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.request import Chunk, RagRequest
from cachecraft.reuse.strategies import STRATEGIES
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
    subs = [Submission(r, greedy, STRATEGIES.get("cachecraft")) for r in requests]
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


def _resident(t: torch.Tensor) -> list[bool]:
    """Per page under contiguous t, whether the OS has mapped it."""
    return resident(t.data_ptr(), t.numel() * t.element_size())


def test_touch_pages_writes_one_zero_byte_in_every_page_of_every_row() -> None:
    from cachecraft.model.kv import PAGE_BYTES, touch_pages

    raw = torch.full((3, 4, 20000), 0x11, dtype=torch.uint8)  # no zero byte anywhere
    x = raw.view(torch.float32)  # [3, 4, 5000]
    touch_pages(x[:, 1, 100:4500])  # rows of 4,400 floats, 17,600 bytes, none page-aligned
    zeros = (raw == 0).nonzero().tolist()
    rows = {(a, b) for a, b, _ in zeros}
    assert rows == {(a, 1) for a in range(3)}  # the view's rows only, not a copy of them
    offsets = sorted({c - 400 for _, _, c in zeros})  # from the row's first byte
    assert offsets == [*range(0, 17600, PAGE_BYTES), 17599]


def test_warm_step_maps_free_slots_and_leaves_every_value_as_it_was(
    tiny_model: LoadedModel,
) -> None:
    from cachecraft.model.kv_pool import KVPool

    arch = tiny_model.arch
    pool = KVPool(arch, 3, torch.float32, "cpu", 64 << 20, warm_positions=300)
    assert pool.num_unwarmed == 3 and pool.capacity == 0
    live = pool.acquire(400)  # slot 0, whose first 40 positions a sequence writes
    assert live is not None and live.slot == 0
    assert not any(_resident(pool.v[0, 0, 0, 40:300]))  # handed out unmapped
    live.k[:, :, :40] = 1.0
    live.v[:, :, :40] = 2.0
    live.length = 40
    untouched = pool.v[0, 1, 0, :300]  # slot 1's values, layer 0, head 0
    assert not any(_resident(untouched))
    steps = 0
    while pool.warm_step():
        steps += 1
    assert steps == 2 * arch.num_layers  # the two free slots, a layer a call
    assert pool.num_unwarmed == 0 and all(_resident(untouched))
    assert all(_resident(pool.v[arch.num_layers - 1, 2, -1, :300]))
    assert not any(_resident(pool.v[0, 1, 0, 1200:]))  # past warm_positions: left alone
    assert float(live.k[:, :, :40].min()) == 1.0 and float(live.v[:, :, :40].min()) == 2.0
    assert float(pool.k.abs().sum()) == live.k[:, :, :40].numel()  # zeros elsewhere
    pool.release(live)
    assert pool.num_unwarmed == 1  # slot 0 was written (mapped) to 40 positions only
    while pool.warm_step():
        pass
    assert pool.num_unwarmed == 0 and float(pool.v[:, 0, :, :40].min()) == 2.0  # kept
    cold = KVPool(arch, 2, torch.float32, "cpu", 64 << 20)  # warm_positions 0: nothing
    assert not cold.warm_step() and cold.capacity == 0


def test_an_idle_engine_warms_its_pool_and_answers_as_one_that_does_not(
    tiny_model: LoadedModel,
) -> None:
    import time

    requests = [_request(i, n) for i, n in enumerate((5, 40, 12))]
    want, _ = _answers(tiny_model, EngineConfig(max_running=4, kv_warm_positions=0), requests)
    config = EngineConfig(max_running=4, kv_warm_positions=128)
    engine = Engine(Runner(tiny_model, MemoryStore(1 << 28)), config).start()
    try:
        pool = engine.pool
        assert pool is not None
        deadline = time.monotonic() + 30
        while pool.num_unwarmed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.num_unwarmed == 0 and pool.capacity >= 128
        greedy = SamplingParams(max_tokens=6, ignore_eos=True)
        for request, tokens in zip(requests, want, strict=True):
            handle = engine.submit(request, greedy, STRATEGIES.get("cachecraft"))
            event = handle.get(timeout=60)
            while not isinstance(event, Finished | Failed):
                event = handle.get(timeout=60)
            assert isinstance(event, Finished) and event.output_ids == tokens
    finally:
        engine.stop()
