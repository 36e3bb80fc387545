"""Our forward on the qwen2 architecture (q/k/v bias, no rope scaling) against HF transformers,
on a tiny random Qwen2 whose biases are made non-zero (HF initialises them to zero)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from cachecraft.model.kv import KVCache
from cachecraft.model.loader import LoadedModel, load_model, resolve_model_dir
from cachecraft.model.reference import greedy_tokens
from cachecraft.model.step import SeqWork

TINY_QWEN2 = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=True,
    use_sliding_window=False,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.mul_(4.0)
            if name.endswith("proj.bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    for f in resolve_model_dir(None).iterdir():  # the bundled tokenizer: ids only matter here
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def qwen2(qwen2_dir: Path) -> tuple[LoadedModel, Qwen2ForCausalLM]:
    hf = Qwen2ForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()
    return load_model(str(qwen2_dir)), hf


def test_qwen2_bias_is_loaded(qwen2: tuple[LoadedModel, Qwen2ForCausalLM]) -> None:
    ours, hf = qwen2
    assert ours.arch.model_type == "qwen2" and ours.arch.attention_bias
    assert hf.model.layers[0].self_attn.q_proj.bias.abs().max() > 0.1


def test_qwen2_logits_and_greedy_match_hf(qwen2: tuple[LoadedModel, Qwen2ForCausalLM]) -> None:
    ours, hf = qwen2
    ids = torch.randint(3, 1000, (150,), generator=torch.Generator().manual_seed(4))
    kv = KVCache(ours.arch, len(ids) + 24, torch.float32, "cpu")
    res = ours.model.forward_step([SeqWork(kv, ids, torch.arange(len(ids)), logits_for="all")])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (res[0].logits - ref).abs().max() < 1e-4
    got = greedy_tokens(ours, kv, res[0].logits[-1], 20)
    want = hf.generate(
        ids[None], max_new_tokens=20, min_new_tokens=20, do_sample=False, eos_token_id=None
    )[0, len(ids) :].tolist()
    assert got == want
