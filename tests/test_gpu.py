"""The CPU suite's contracts on a CUDA device (skipped where there is none, as in CI): every
mode told to compute everything equals a full prefill; requests given together answer as
alone (batched decode over mixed context lengths); a CUDA model answers as the CPU model does;
a partial prefill attends in one call there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_reuse_runner import EVERYTHING, GREEDY, _req, _run

from cachecraft.llm import LLM
from cachecraft.store.memory import MemoryStore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "mode,extra",
    [
        ("cachecraft", {}),
        ("cachecraft", {"probe_max_cost": 0.0}),  # the check instead of the probe
        ("cachecraft-paper", {}),
        ("prophet", {}),
        ("epic", {}),
        ("random", {}),
        ("cacheblend", {"cacheblend_global": True}),
    ],
)
def test_every_mode_told_to_compute_everything_equals_full_on_cuda(
    tiny_dir: Path, mode: str, extra: dict
) -> None:
    store = MemoryStore(2 << 30, storage_dtype="float32")
    llm = LLM(str(tiny_dir), device="cuda", dtype="float32", store=store, **{**EVERYTHING, **extra})
    _run(llm, _req([0, 1, 2]), "naive")  # warm: every chunk becomes a variant
    request = _req([2, 0, 3, 1])
    full = _run(llm, request, "full")
    out = _run(llm, request, mode)
    assert [c.is_hit for c in out.report.chunks] == [True, True, False, True]
    assert all(c.tokens_recomputed == c.num_tokens for c in out.report.chunks)
    assert (out.first_token_logits - full.first_token_logits).abs().max() < 1e-4
    assert out.token_ids == full.token_ids


@pytest.mark.parametrize("mode", ["full", "prefix", "naive", "cachecraft"])
def test_a_cuda_model_answers_as_the_cpu_model(tiny_dir: Path, mode: str) -> None:
    """The same requests (cold, then the chunks reused in another order, then an exact
    repeat) on both devices: the same chunks hit, the same tokens come out, and the first
    token's logits agree to float32 rounding across kernels."""
    cpu = LLM(str(tiny_dir), store=MemoryStore(2 << 30, storage_dtype="float32"))
    store = MemoryStore(2 << 30, storage_dtype="float32")
    gpu = LLM(str(tiny_dir), device="cuda", dtype="float32", store=store)
    assert gpu.loaded.model.device.type == "cuda"
    hits = []
    for order in ([0, 1, 2], [2, 0, 1], [2, 0, 1]):
        a, b = _run(cpu, _req(order), mode), _run(gpu, _req(order), mode)
        hits.append([c.is_hit for c in b.report.chunks])
        assert [c.is_hit for c in a.report.chunks] == hits[-1]
        assert a.token_ids == b.token_ids
        gap = (a.first_token_logits.float().cpu() - b.first_token_logits.float().cpu()).abs()
        assert gap.max() < 1e-3
    assert any(hits[1] + hits[2]) == (mode != "full")  # reordered or repeated: reused


def test_a_model_on_cuda_is_bfloat16_unless_told(tiny_dir: Path) -> None:
    assert LLM(str(tiny_dir), device="cuda").loaded.model.dtype == torch.bfloat16
    assert LLM(str(tiny_dir), device="cuda", dtype="float32").loaded.model.dtype == torch.float32


def test_requests_given_together_on_cuda_equal_alone(tiny_dir: Path) -> None:
    llm = LLM(str(tiny_dir), device="cuda", dtype="float32")
    requests = [_req([0]), _req([1, 2], "Where is it?"), _req([2, 1, 0, 3], "What is it?")]
    alone = [_run(llm, r, "full").token_ids for r in requests]
    together = llm.generate(requests, GREEDY, "full")
    assert [o.token_ids for o in together] == alone
    assert max(s.num_decodes for s in llm.engine.recent_steps) == 3


def test_a_bfloat16_cuda_model_told_to_compute_everything_matches_its_full_prefill(
    tiny_dir: Path,
) -> None:
    store = MemoryStore(2 << 30, storage_dtype="bfloat16")
    llm = LLM(str(tiny_dir), device="cuda", dtype="bfloat16", store=store, **EVERYTHING)
    _run(llm, _req([0, 1, 2]), "naive")
    request = _req([1, 0, 3])
    full = _run(llm, request, "full")
    stale = _run(llm, request, "naive")
    out = _run(llm, request, "cachecraft")
    assert all(c.tokens_recomputed == c.num_tokens for c in out.report.chunks)
    gap = (out.first_token_logits - full.first_token_logits).abs().max()
    naive_gap = (stale.first_token_logits - full.first_token_logits).abs().max()
    assert gap < 0.01 and gap * 10 < naive_gap
    assert out.token_ids == full.token_ids


def test_a_partial_prefill_on_cuda_attends_in_one_call() -> None:
    """Row blocks keep a CPU's caches warm; on a GPU each call costs a launch and cuDNN a
    plan per new shape, so scattered rows take one masked call there."""
    from cachecraft.model.attention import ROW_BLOCK, plan_rows

    rows = torch.arange(0, 3 * ROW_BLOCK * 2, 2)  # scattered: no causal call
    assert len(plan_rows(rows, None, torch.float32).blocks) == 3
    (block,) = plan_rows(rows.cuda(), None, torch.float32).blocks
    assert block[:3] == (0, rows.numel(), int(rows[-1]) + 1) and block[3].is_cuda


def test_a_server_on_cuda_reuses_chunks_from_its_gpu_memory_tier(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """`cachecraft serve --device cuda`: the weights, the forward and the store's memory tier
    on the GPU (host RAM and disk behind it); a chunk computed once is a hit the second time
    and answers as a full prefill."""
    from test_replicas import DOC, _hits, _text, ask

    from cachecraft.server.launch import start_server
    from cachecraft.store.config import StoreConfig

    store = StoreConfig(
        device="cuda", cache_dir=str(tmp_path / "cache"), storage_dtype="float32",
        doorkeeper_threshold=1,
    )  # fmt: skip
    server = start_server(
        "cachecraft", model=str(tiny_dir), device="cuda", dtype="float32", store=store
    )
    with server as url:
        full = ask(url, [DOC], "full")
        first, second = ask(url, [DOC]), ask(url, [DOC])
        assert _hits(first) == [False] and _hits(second) == [True]
        assert _text(first) == _text(second) == _text(full)


def test_a_cachecraft_hit_on_cuda_never_synchronises_inside_the_layer_loop(
    tiny_dir: Path,
) -> None:
    """tests/test_host_sync.py's contract under CUDA's own check: while a layer runs, any
    synchronising call (a read back, `nonzero`, a blocking copy) raises. The chunk-caches sit
    in the GPU's memory tier, as `cachecraft serve --device cuda` keeps them. The same rows and
    first token as the same request unguarded."""
    from cachecraft.config import ReuseConfig
    from cachecraft.engine.sampling import SamplingParams
    from cachecraft.request import Chunk, RagRequest
    from cachecraft.store.config import StoreConfig

    def answers(guarded: bool) -> tuple[list[list[int]], list[list[int]]]:
        store = StoreConfig(memory_bytes=1 << 30, device="cuda", storage_dtype="float32")
        llm = LLM(
            str(tiny_dir),
            device="cuda",
            dtype="float32",
            store=store,
            config=ReuseConfig(probe_check_layer=1),
        )
        m = llm.loaded
        words = ["river", "harbor", "tower", "garden", "castle", "meadow"]
        chunks = [
            Chunk(" ".join(f"{words[(i + j) % 6]}{j % 7}" for j in range(48)), id=f"c{i}")
            for i in range(4)
        ]
        four = SamplingParams(max_tokens=4)
        llm.generate(RagRequest("Which passage names a tower?", chunks), four, "cachecraft")
        model = m.model
        if guarded:
            for name in ("_layer", "_compact"):
                inner = getattr(model, name)

                def run(*args, _inner=inner, **kwargs):  # type: ignore[no-untyped-def]
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        return _inner(*args, **kwargs)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")

                setattr(model, name, run)
        try:
            # one token: the prefill's loop (decode steps are not held to it here)
            one = SamplingParams(max_tokens=1)
            outs = llm.generate(RagRequest("Where is the castle?", chunks[::-1]), one, "cachecraft")
        finally:
            torch.cuda.set_sync_debug_mode("default")
            for name in ("_layer", "_compact"):
                vars(model).pop(name, None)
        out = outs[0]
        assert all(c.is_hit for c in out.report.chunks) and out.report.probe_tokens > 0
        return [[c.tokens_recomputed for c in out.report.chunks]], [out.token_ids]

    assert answers(guarded=True) == answers(guarded=False)
