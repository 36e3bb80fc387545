"""Models of a named shape with random weights (`load_model("shape:NAME")`): the shape's
config, weights drawn from a seed (the same model every load), the bundled tokenizer, and a
clear error for a name that is not a shape."""

from __future__ import annotations

import pytest
import torch

from cachecraft.errors import ModelLoadError
from cachecraft.model.loader import default_dtype, load_model
from cachecraft.model.reference import prefill
from cachecraft.model.shapes import SHAPES


def test_a_shape_loads_with_its_config_and_the_same_weights_every_time() -> None:
    a, b = load_model("shape:tiny"), load_model("shape:tiny")
    want = SHAPES["tiny"]
    assert a.arch.num_layers == want["num_hidden_layers"]
    assert a.arch.num_kv_heads == want["num_key_value_heads"]
    assert a.arch.hidden_size == want["hidden_size"]
    ids = torch.tensor(a.tokenizer("a river and a tower", add_special_tokens=False)["input_ids"])
    first, second = prefill(a, ids)[0], prefill(b, ids)[0]
    assert torch.isfinite(first).all()
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert a.fingerprint == b.fingerprint and "random weights" in a.name


def test_an_unknown_shape_names_the_known_ones() -> None:
    with pytest.raises(ModelLoadError, match="llama-8b"):
        load_model("shape:llama-80b")


def test_the_dtype_follows_the_device_unless_given() -> None:
    assert default_dtype("cpu") == "float32"
    assert default_dtype("cuda:1") == "bfloat16"  # a name: no CUDA needed to resolve it
    assert load_model("shape:tiny").model.dtype == torch.float32
    assert load_model("shape:tiny", "bfloat16").model.dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="unknown device"):
        load_model("shape:tiny", device="tpu:x")
