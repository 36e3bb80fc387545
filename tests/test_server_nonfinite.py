"""Issue 56 defect 3: a non-finite log-probability never reaches a client as `NaN` (invalid
JSON) or as a 500 "Out of range float values". The tiny random Llama with one weight of its
final norm set to NaN: its K/V stay finite, every logit is NaN. A request asking for
log-probabilities then fails cleanly: a JSON 500 in OpenAI's shape, or (streaming) an error
event; every body parses as strict JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from conftest import make_tiny_dir
from test_server_faults import CHAT, CTX, Served, T, serving

from cachecraft.engine.sampling import TokenLogprobs
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.server.config import ServerConfig
from cachecraft.server.logprobs import (
    MIN_LOGPROB,
    NonFiniteOutput,
    chat_logprobs,
    vllm_prompt_logprobs,
)


def strict(text: str) -> Any:
    """json.loads that refuses NaN and infinities, as a strict client's parser does."""

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in a JSON body: {text[:300]}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = make_tiny_dir(tmp_path_factory.mktemp("tiny-nan"), max_position_embeddings=CTX)
    loaded: LoadedModel = load_model(str(path))
    with torch.no_grad():
        loaded.model.norm[0] = float("nan")  # the last norm: logits NaN, K/V finite
    with serving(loaded, ServerConfig()) as s:
        yield s


BODY = {
    "model": "cachecraft",
    "messages": [{"role": "user", "content": "Name a colour."}],
    "max_tokens": 3,
    "ignore_eos": True,
    "logprobs": True,
    "top_logprobs": 2,
}


def clean_failure(r: httpx.Response) -> None:
    """A JSON error in OpenAI's shape that says what went wrong (not a serializer's words)."""
    assert r.status_code == 500, r.text
    err = strict(r.text)["error"]
    assert err["type"] == "server_error" and err["message"]
    assert "Out of range float" not in err["message"], err


def test_non_streaming_logprobs_fail_cleanly(poisoned: Served) -> None:
    clean_failure(poisoned.post(CHAT, BODY))
    completion = {"model": "cachecraft", "prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 2}
    clean_failure(poisoned.post("/v1/completions", completion))
    scored = {**completion, "echo": True, "max_tokens": 0}  # the prompt's log-probabilities
    clean_failure(poisoned.post("/v1/completions", scored))
    prompt_lp = {**completion, "prompt_logprobs": 1}  # vLLM's
    clean_failure(poisoned.post("/v1/completions", prompt_lp))
    assert poisoned.get("/health").status_code == 200  # the server goes on


def test_a_stream_never_carries_nan(poisoned: Served) -> None:
    body = {**BODY, "stream": True}
    with httpx.stream("POST", poisoned.url + CHAT, json=body, timeout=T) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    events = [strict(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"]
    assert lines[-1] == "data: [DONE]"  # the error event, then the end every OpenAI stream has
    assert "error" in events[-1] and events[-1]["error"]["type"] == "server_error"
    for e in events[:-1]:  # nothing before the error carries a log-probability of a NaN token
        for choice in e.get("choices", []):
            assert not (choice.get("logprobs") or {}).get("content"), e


def test_minus_infinity_is_openais_stand_in_and_nan_raises() -> None:
    class Tok:
        def decode(self, ids: list[int]) -> str:
            return f"t{ids[0]}"

    ruled_out = TokenLogprobs(-math.inf, ((1, -0.1), (2, -math.inf)), 3)  # rank 3
    out = chat_logprobs(Tok(), [(2, ruled_out)])["content"][0]
    assert out["logprob"] == MIN_LOGPROB and out["top_logprobs"][1]["logprob"] == MIN_LOGPROB
    strict(json.dumps(out))
    prompt = vllm_prompt_logprobs(Tok(), [1, 2], [ruled_out], 2)
    assert prompt[1] is not None and prompt[1]["2"]["logprob"] == MIN_LOGPROB
    for bad in (math.nan, math.inf):
        with pytest.raises(NonFiniteOutput, match="non-finite"):
            chat_logprobs(Tok(), [(2, TokenLogprobs(bad, (), 1))])
