"""Linear layers through oneDNN-packed weights equal F.linear; the MLP block equals its
definition in both its forms; a model with packed weights answers as one with plain weights
(greedy tokens, logits within 1e-4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from model_helpers import greedy_run
from safetensors.torch import load_file

import cachecraft.model.llama as llama
from cachecraft.model.kv import KVCache
from cachecraft.model.linear import (
    PACKED_BF16_MAX_ROWS,
    PLAIN_MAX_ROWS,
    Linear,
    can_pack,
    packed_is_faster,
)
from cachecraft.model.llama import LlamaModel
from cachecraft.model.loader import LoadedModel
from cachecraft.model.mlp import FUSED_MIN_ROWS, ROW_BLOCK, Mlp
from cachecraft.model.step import SeqWork

needs_onednn = pytest.mark.skipif(
    not can_pack(torch.float32, torch.device("cpu")), reason="no oneDNN in this torch build"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 17, 300])
def test_packed_linear_equals_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=g)
    bias = torch.randn(96, generator=g)
    x = torch.randn(rows, 40, generator=g)
    lin = Linear(weight.clone(), bias, pack=True)
    assert lin.is_packed and lin.weight is None  # the packed copy replaced the plain one
    want = F.linear(x, weight, bias)
    assert (lin(x) - want).abs().max() <= 1e-5 * want.abs().max()
    strided = torch.randn(rows, 80, generator=g)[:, ::2]  # a non-contiguous input
    assert (lin(strided) - F.linear(strided, weight, bias)).abs().max() <= 1e-5 * 40


@needs_onednn
def test_a_kept_plain_weight_serves_one_or_two_rows() -> None:
    g = torch.Generator().manual_seed(5)
    weight, x = torch.randn(96, 40, generator=g), torch.randn(4, 40, generator=g)
    lin = Linear(weight, None, pack=True, keep_plain=True)
    assert lin.is_packed and lin.weight is weight
    for n in range(1, PLAIN_MAX_ROWS + 1):  # few rows: the plain weight
        assert torch.equal(lin(x[:n]), F.linear(x[:n], weight))
    packed = Linear(weight, None, pack=True)
    assert torch.equal(lin(x), packed(x))  # more rows: the packed one


def _ran_packed(lin: Linear, x: torch.Tensor) -> bool:
    """Whether lin(x) ran oneDNN's packed product (seen by the profiler); its value is
    F.linear's within bf16 rounding either way. `lin` keeps its plain weight."""
    with torch.profiler.profile() as prof:
        got = lin(x)
    want = F.linear(x, lin.weight).float()
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()
    return any("_linear_pointwise" in e.name for e in prof.events())


def test_bf16_packs_for_small_products_and_keeps_plain_for_long_ones() -> None:
    """Where oneDNN computes bf16 natively (AVX512-BF16 / AMX); on a CPU without it (an AVX2
    machine) packing fails cleanly and every product is F.linear's."""
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(96, 40, generator=g).bfloat16()
    x = torch.randn(PACKED_BF16_MAX_ROWS + 3, 40, generator=g).bfloat16()
    lin = Linear(weight, None, pack=True, keep_plain=True)
    if not can_pack(torch.bfloat16, torch.device("cpu")):
        assert not lin.is_packed and lin.weight is weight
        assert not _ran_packed(lin, x[:1]) and not _ran_packed(lin, x)
        return
    assert lin.is_packed and lin.weight is weight
    for n in (1, 2, 17, PACKED_BF16_MAX_ROWS):  # small products: the packed weight
        assert _ran_packed(lin, x[:n])
    assert not _ran_packed(lin, x)  # a long one: the plain weight
    fp32 = Linear(weight.float(), None, pack=True, keep_plain=True)  # fp32: the other way
    assert not _ran_packed(fp32, x[:1].float()) and _ran_packed(fp32, x.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_equals_its_definition(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    gate_up = torch.randn(2 * 48, 40, generator=g) * 0.2
    down = torch.randn(40, 48, generator=g) * 0.2
    pack = can_pack(dtype, torch.device("cpu"))
    mlp = Mlp(gate_up.to(dtype), down.to(dtype), pack, keep_plain=True)
    # bf16 fuses SiLU, the product and the residual into oneDNN's GEMMs wherever it packs
    assert (mlp.fused is not None) == (pack and dtype == torch.bfloat16)
    # without plain copies (a large model) the fused form serves every product, no second copy
    lean = Mlp(gate_up.to(dtype), down.to(dtype), pack, keep_plain=False)
    assert (lean.gate_up is None) == (lean.fused is not None)
    tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    # below FUSED_MIN_ROWS: the first form in `mlp`; past ROW_BLOCK: products in blocks
    for n in (1, 3, FUSED_MIN_ROWS, 300, 2 * ROW_BLOCK + 3):
        x = torch.randn(n, 40, generator=g).to(dtype)
        h = torch.randn(n, 40, generator=g).to(dtype)
        gate, up = (x.float() @ gate_up.to(dtype).float().T).chunk(2, dim=-1)
        want = h.float() + (F.silu(gate) * up) @ down.to(dtype).float().T
        for m in (mlp, lean):
            got = m(x, h.clone()).float()
            assert (got - want).abs().max() <= tol * want.abs().max()


def test_plain_linear_when_not_packed() -> None:
    weight = torch.randn(8, 4)
    lin = Linear(weight, None, pack=False)
    x = torch.randn(2, 4)
    assert not lin.is_packed and torch.equal(lin(x), F.linear(x, weight))


@needs_onednn
def test_packed_model_answers_as_plain_model(tiny: LoadedModel, tiny_dir: Path) -> None:
    state = load_file(str(tiny_dir / "model.safetensors"))
    plain = LlamaModel(tiny.arch, tiny.hf_config, state, pack=False)
    packed = tiny.model
    assert packed.layers[0].qkv.is_packed and not plain.layers[0].qkv.is_packed
    assert packed.layers[0].qkv.weight is not None  # small: a plain copy for one-row decodes
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 1000, (120,), generator=g)
    (tokens, logits), (tokens_p, logits_p) = (greedy_run(m, ids, 12) for m in (plain, packed))
    assert tokens == tokens_p
    assert (logits - logits_p).abs().max() < 1e-4


@needs_onednn
def test_a_model_over_the_cap_keeps_only_the_packed_weights(
    tiny: LoadedModel, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llama, "PLAIN_COPY_MAX_BYTES", 0)
    state = load_file(str(tiny_dir / "model.safetensors"))
    model = LlamaModel(tiny.arch, tiny.hf_config, state)
    assert model.layers[0].qkv.is_packed and model.layers[0].qkv.weight is None
    assert model.lm_head.weight is model.embed or not tiny.arch.tie_word_embeddings


@needs_onednn
def test_pack_only_lets_the_plain_weight_go_and_keeps_the_product() -> None:
    g = torch.Generator().manual_seed(8)
    weight, bias = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    lin = Linear(weight, bias, pack=True, keep_plain=True)
    x = torch.randn(3, 40, generator=g)
    for packed in (False, True):  # either weight on request, the same product
        assert (lin.product(x, packed) - F.linear(x, weight, bias)).abs().max() <= 1e-5 * 40
    bare = Linear(weight, None, pack=True, keep_plain=True)
    assert _ran_packed(bare, x) and not _ran_packed(bare, x[:1])
    lin.pack_only()
    assert lin.weight is None and lin.packed_rows == (0, float("inf"))
    for n in (1, 2, 3):  # every product now the packed weight's
        assert (lin(x[:n]) - F.linear(x[:n], weight, bias)).abs().max() <= 1e-5 * 40
    with pytest.raises(ValueError, match="pack_only needs"):
        Linear(weight, None, pack=False).pack_only()
    with pytest.raises(ValueError, match="keep both weights"):
        packed_is_faster([lin])


@needs_onednn
def test_a_large_model_times_its_short_products_and_keeps_one_form(
    tiny: LoadedModel, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model over TIME_SHORT_PRODUCTS_BYTES times one- and two-row products both ways at
    load: every Linear then keeps its plain weight for them or none does, and the model
    answers as the plain model does either way. The test model sits below the threshold, so
    its products never change from one load to the next."""
    assert tiny.model.layers[0].qkv.weight is not None  # below: not timed, plain kept
    state = load_file(str(tiny_dir / "model.safetensors"))
    plain = LlamaModel(tiny.arch, tiny.hf_config, state, pack=False)
    for faster in (True, False):
        monkeypatch.setattr(llama, "TIME_SHORT_PRODUCTS_BYTES", 0)
        monkeypatch.setattr(llama, "packed_is_faster", lambda linears, f=faster: f)
        model = LlamaModel(tiny.arch, tiny.hf_config, state)
        kept = {lin.weight is not None for lin in model.linears()}
        assert kept == {not faster}
        assert len(model.linears()) == 4 * tiny.arch.num_layers + 1
        ids = torch.randint(3, 1000, (1,), generator=torch.Generator().manual_seed(4))
        got, want = (
            m.forward_step(
                [SeqWork(KVCache(m.arch, 4, torch.float32, "cpu"), ids, torch.arange(1))]
            )[0].logits
            for m in (model, plain)
        )
        assert (got - want).abs().max() < 1e-4
    monkeypatch.undo()
    both = [Linear(torch.randn(64, 32), None, pack=True, keep_plain=True) for _ in range(3)]
    assert isinstance(packed_is_faster(both, rounds=1), bool)  # the real timing runs
    assert all(lin.weight is not None for lin in both)  # and changes nothing by itself
