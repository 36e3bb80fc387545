"""Our float32 attention kernel: the exact masked attention (with the fused span statistics)
for every row layout, each row computed as the full prefill computes it, the model's forward
unchanged by it, and torch's SDPA wherever it is switched off or cannot be built."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_helpers import greedy_run
from safetensors.torch import load_file
from test_model_attention import CASES, _brute, _operands

from cachecraft.env import cxx_compiler
from cachecraft.model import row_kernel
from cachecraft.model.attention import causal_attention, row_span_mass, span_onehot
from cachecraft.model.kv import KVCache
from cachecraft.model.llama import LlamaModel
from cachecraft.model.loader import LoadedModel
from cachecraft.model.step import SeqWork


@pytest.fixture
def kernel() -> row_kernel.RowKernel:
    """The kernel as the model loads it: this machine has a compiler, so it must build."""
    got = row_kernel.load_row_kernel()
    assert got is not None, "the row-attention kernel did not build (see the log)"
    return got


@pytest.fixture
def fresh_loader() -> Iterator[None]:
    """`load_row_kernel` forgets its result before and after the test."""
    row_kernel.load_row_kernel.cache_clear()
    yield
    row_kernel.load_row_kernel.cache_clear()


def _wide_operands(q_pos: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    """SmolLM2's head shape: q [9, n, 64], k, v [3, ctx, 64]."""
    g = torch.Generator().manual_seed(seed)
    ctx = int(q_pos[-1]) + 1
    q = 2 * torch.randn(9, len(q_pos), 64, generator=g)
    return q, 2 * torch.randn(3, ctx, 64, generator=g), torch.randn(3, ctx, 64, generator=g)


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_equals_brute_force_with_and_without_statistics(
    kernel: row_kernel.RowKernel, case: str, head_dim: int
) -> None:
    q_pos, window = CASES[case]
    q, k, v = (_operands if head_dim == 16 else _wide_operands)(q_pos, seed=3)
    ctx = k.shape[1]
    bounds = torch.tensor([(0, 5), (5, 17), (17, 30), (30, ctx)])
    ref, probs = _brute(q, k, v, q_pos, window)
    plain, none = causal_attention(q, k, v, q_pos, window, kernel=kernel)
    assert none is None and (plain - ref).abs().max() < 2e-5
    dest = torch.full((len(q_pos), q.shape[0], head_dim), float("nan"))
    onehot = span_onehot(bounds, ctx, q.dtype)
    out, mass = causal_attention(q, k, v, q_pos, window, onehot, None, dest, kernel)
    assert out.data_ptr() == dest.data_ptr()
    assert torch.equal(out, plain)  # the indicator columns leave V's own columns alone
    assert mass is not None and mass.shape == (len(q_pos), 4)
    by_span = torch.stack([probs[..., a:b].sum(-1) for a, b in bounds.tolist()], -1).mean(0)
    assert (mass - by_span).abs().max() < 1e-5
    assert (mass - row_span_mass(q, k, q_pos, bounds, window)).abs().max() < 1e-5


@pytest.mark.parametrize("window", [None, 200])
def test_kernel_rows_come_out_bit_for_bit_as_in_the_full_prefill(
    kernel: row_kernel.RowKernel, window: int | None
) -> None:
    """Each row's result depends on its own position only, not on which other rows are
    computed beside it: a partial prefill reproduces the full prefill's rows exactly."""
    ctx = 700
    q, k, v = _wide_operands(torch.arange(ctx), seed=4)
    full, _ = causal_attention(q, k, v, torch.arange(ctx), window, kernel=kernel)
    g = torch.Generator().manual_seed(5)
    for rows in (
        torch.arange(33, ctx),  # after a cached prefix
        torch.sort(torch.randperm(ctx, generator=g)[:150]).values,  # scattered (cachecraft)
        torch.tensor([ctx - 1]),  # one row at the end
    ):
        part, _ = causal_attention(q[:, rows], k, v, rows, window, kernel=kernel)
        assert torch.equal(part, full[:, rows])


def test_kernel_takes_keys_stored_transposed(kernel: row_kernel.RowKernel) -> None:
    """A pool slot stores keys transposed ([Hkv, D, ctx] memory): the kernel reads that view."""
    q_pos = torch.arange(10, 300)
    q, k, v = _wide_operands(q_pos, seed=6)
    stored = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert stored.stride(-1) != 1
    want, _ = causal_attention(q, k, v, q_pos, None, kernel=kernel)
    got, _ = causal_attention(q, stored, v, q_pos, None, kernel=kernel)
    assert torch.equal(got, want)


def test_kernel_refuses_rows_out_of_order(kernel: row_kernel.RowKernel) -> None:
    q, k, v = _wide_operands(torch.arange(20), seed=7)
    out = torch.empty(3, 9, 64)
    with pytest.raises(RuntimeError, match="ascending positions"):
        kernel(q[:, :3], k, v, torch.tensor([4, 2, 9]), 0, 0.125, out)
    with pytest.raises(RuntimeError, match="within the keys"):
        kernel(q[:, :3], k, v, torch.tensor([4, 9, 20]), 0, 0.125, out)


def test_model_with_the_kernel_answers_as_with_sdpa(
    kernel: row_kernel.RowKernel, tiny: LoadedModel, tiny_dir: Path
) -> None:
    """A prefill and greedy decode steps: same tokens, logits within float rounding."""
    state = load_file(str(tiny_dir / "model.safetensors"))
    models = [LlamaModel(tiny.arch, tiny.hf_config, state, row_kernel=use) for use in (False, True)]
    assert models[0].row_kernel is None and models[1].row_kernel is kernel
    ids = torch.randint(3, 1000, (150,), generator=torch.Generator().manual_seed(8))
    (tokens, logits), (tokens_k, logits_k) = (greedy_run(m, ids, 10) for m in models)
    assert tokens == tokens_k
    assert (logits - logits_k).abs().max() < 1e-4


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_switched_off_the_model_runs_on_sdpa(
    fresh_loader: None,
    monkeypatch: pytest.MonkeyPatch,
    tiny: LoadedModel,
    tiny_dir: Path,
    value: str,
) -> None:
    monkeypatch.setenv("CACHECRAFT_ROW_KERNEL", value)
    assert row_kernel.load_row_kernel() is None
    state = load_file(str(tiny_dir / "model.safetensors"))
    assert LlamaModel(tiny.arch, tiny.hf_config, state).row_kernel is None


def test_a_failed_build_falls_back_to_sdpa_with_a_warning(
    fresh_loader: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    tiny: LoadedModel,
    tiny_dir: Path,
) -> None:
    """A compiler that fails (here `false`) leaves no library behind and the model working."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached build to find
    monkeypatch.setenv("CXX", "false")
    with caplog.at_level(logging.WARNING, logger="cachecraft.model.row_kernel"):
        assert row_kernel.load_row_kernel() is None
    assert "SDPA" in caplog.text
    assert not list((tmp_path / "cachecraft" / "kernels").glob("*.so"))
    state = load_file(str(tiny_dir / "model.safetensors"))
    model = LlamaModel(tiny.arch, tiny.hf_config, state)
    assert model.row_kernel is None
    kv = KVCache(model.arch, 20, torch.float32, "cpu")
    res = model.forward_step([SeqWork(kv, torch.arange(3, 20), torch.arange(17))])[0]
    assert torch.isfinite(res.logits).all()


def test_the_build_is_cached_per_source_torch_and_cpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A second build (another process, another compiler) finds the library the first made."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = cxx_compiler()
    assert compiler is not None
    built = row_kernel.build(compiler)
    assert built.parent == tmp_path / "cachecraft" / "kernels" and built.stat().st_size > 0
    stamp = built.stat().st_mtime_ns
    assert row_kernel.build("false") == built  # a rebuild would fail
    assert built.stat().st_mtime_ns == stamp
    # no partial file left; the hash beside the library
    assert sorted(p.name for p in built.parent.iterdir()) == [built.name, built.name + ".sha256"]


KERNEL_LOADS = """
import torch
from cachecraft.model.row_kernel import load_row_kernel
kernel = load_row_kernel()
assert kernel is not None, "no kernel"
q, k, v = torch.randn(2, 3, 16), torch.randn(1, 3, 16), torch.randn(1, 3, 16)
out = torch.empty(3, 2, 16)  # [rows, query heads, head_dim]
kernel(q, k, v, torch.arange(3), 0, 0.25, out)
assert torch.isfinite(out).all()
"""


def test_a_truncated_library_is_rebuilt_never_loaded(tmp_path: Path) -> None:
    """Issue 56, defect 4: `head -c 5000` of the built library made every start die with
    SIGBUS (exit 135). A process loading it now (its own, as a server start would) finds it
    fails its hash, rebuilds it and exits 0. (Zeroed, garbage and empty files fail the same
    check: the test below.)"""
    compiler = cxx_compiler()
    assert compiler is not None
    cached = row_kernel.build(compiler)  # the suite's own build, copied: one build here
    kernels = tmp_path / "cachecraft" / "kernels"
    kernels.mkdir(parents=True)
    built = kernels / cached.name
    built.write_bytes(cached.read_bytes()[:5000])
    shutil.copy(cached.with_name(cached.name + ".sha256"), kernels)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", KERNEL_LOADS], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "rebuilding" in done.stderr
    assert row_kernel.is_sound(built) and built.stat().st_size > 5000


def test_garbage_empty_or_unrecorded_libraries_are_not_sound(tmp_path: Path) -> None:
    lib = tmp_path / "row_attention-x.so"
    lib.write_bytes(b"\x7fELF garbage")
    assert not row_kernel.is_sound(lib)  # no hash recorded (built by an older version)
    (tmp_path / "row_attention-x.so.sha256").write_text(hashlib.sha256(b"whole").hexdigest())
    for data in (b"\x7fELF garbage", b"", b"whol"):
        lib.write_bytes(data)
        assert not row_kernel.is_sound(lib)
    lib.write_bytes(b"whole")
    assert row_kernel.is_sound(lib)
