"""Models of a named real shape with random weights: `load_model("shape:llama-8b")`.

Timing a model needs its shape, not its trained weights, and a benchmark host may reach no
network (no weights can be brought there). A shape is a Llama config over the bundled model's
tokenizer (49,152 tokens); its weights are drawn on the target device from a seeded generator
(no file is written or read), so a GPU holds an 8B model seconds after start. Answers from such
a model are noise: use it for speed, never for quality.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from cachecraft.errors import ModelLoadError

SHAPE_PREFIX = "shape:"

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "llama-3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}
"""Llama shapes (`tiny` for tests; SmolLM2-135M's, Llama 3.2 1B's and 3B's, Llama 3.1 8B's)."""

VOCAB_SIZE = 49152
"""The bundled tokenizer's vocabulary: every shape's embedding has this many rows."""

INIT_STD = 0.02
"""Standard deviation of the random weights (HF's `initializer_range` for Llama)."""


def shape_name(spec: str | None) -> str | None:
    """The shape a `load_model` spec names (`shape:NAME`), None for any other spec; an unknown
    name is a ModelLoadError listing the known ones."""
    if spec is None or not spec.startswith(SHAPE_PREFIX):
        return None
    name = spec.removeprefix(SHAPE_PREFIX)
    if name not in SHAPES:
        raise ModelLoadError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    return name


def shape_config(name: str) -> Any:
    """The HF LlamaConfig of shape `name` (the bundled tokenizer's special tokens)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **SHAPES[name],
    )


def random_state_dict(
    config: Any, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """HF-named weights of `config` drawn on `device` in `dtype`: N(0, INIT_STD) for every
    matrix, ones for the RMSNorm weights (as a fresh HF model is initialized)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(INIT_STD)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    state = {"model.embed_tokens.weight": normal(config.vocab_size, hidden)}
    state["model.norm.weight"] = ones(hidden)
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = normal(config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        state[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        state[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        state[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        state[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        state[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        state[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        state[p + "input_layernorm.weight"] = ones(hidden)
        state[p + "post_attention_layernorm.weight"] = ones(hidden)
    return state


def shape_fingerprint(name: str, seed: int = 0) -> str:
    """The cache keys' model fingerprint of a shape: its config and the seed of its weights."""
    text = json.dumps({"shape": name, "config": SHAPES[name], "seed": seed}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
