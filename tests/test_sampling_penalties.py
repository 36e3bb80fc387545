"""Penalties, logit bias, stop token ids and min_tokens (engine/sampling.py `penalize`), alone
and through the server."""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import make_tiny_dir
from test_server_faults import CHAT, CTX, chat, openai_error, serving

from cachecraft.api import chat_request
from cachecraft.engine.sampling import SamplingParams, penalize, sample
from cachecraft.errors import BadRequestError
from cachecraft.llm import LLM
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.server.config import ServerConfig


def test_presence_and_frequency_count_the_answer_only() -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = penalize(torch.zeros(5), params, output_ids=[1, 1, 2], prompt_ids=[3])
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0, 0.0]


def test_repetition_scales_prompt_and_answer_tokens_toward_zero() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 4.0])
    out = penalize(logits, SamplingParams(repetition_penalty=2.0), [1], [0])
    assert out.tolist() == [1.0, -4.0, 1.0, 4.0]
    assert logits.tolist() == [2.0, -2.0, 1.0, 4.0]  # the caller's logits are left alone


def test_logit_bias_steers_greedy_and_ignores_ids_past_the_vocabulary() -> None:
    logits = torch.tensor([3.0, 0.0, 0.0])
    assert sample(logits, SamplingParams(logit_bias={2: 5.0, 99: 100.0}), None) == 2
    assert sample(logits, SamplingParams(presence_penalty=2.0), None, [0]) == 0  # 3 - 2 > 0
    assert sample(logits, SamplingParams(frequency_penalty=2.0), None, [0, 0]) in (1, 2)
    # no stop token before min_tokens
    assert sample(logits, SamplingParams(min_tokens=2), None, [7], stops={0}) == 1
    assert sample(logits, SamplingParams(min_tokens=2), None, [7, 7], stops={0}) == 0
    for bad in (
        {"presence_penalty": 3.0},
        {"repetition_penalty": 0.0},
        {"logit_bias": {1: 101}},
        {"min_tokens": -1},
        {"stop_token_ids": (-3,)},
    ):
        with pytest.raises(BadRequestError):
            SamplingParams(**bad)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = make_tiny_dir(tmp_path_factory.mktemp("tiny-penalties"), max_position_embeddings=CTX)
    return load_model(str(path))


def test_the_server_applies_them(small: LoadedModel) -> None:
    with serving(small, ServerConfig()) as s:
        base = chat(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
        plain = httpx.post(s.url + CHAT, json=base, timeout=60).json()
        tokens = [e["token"] for e in plain["choices"][0]["logprobs"]["content"]]
        forced_id = small.tokenizer.convert_tokens_to_ids(small.tokenizer.tokenize(" blue"))[0]
        biased = {**base, "logit_bias": {str(forced_id): 100}}
        out = httpx.post(s.url + CHAT, json=biased, timeout=60).json()
        got = [e["token"] for e in out["choices"][0]["logprobs"]["content"]]
        assert got == [small.tokenizer.decode([forced_id])] * 6 != tokens
        varied = {**base, "frequency_penalty": 2.0, "presence_penalty": 2.0}
        out = httpx.post(s.url + CHAT, json=varied, timeout=60).json()
        got = [e["token"] for e in out["choices"][0]["logprobs"]["content"]]
        assert len(set(got)) == 6  # a penalty of 2 + 2 per repeat: every token a new one
        for field in ("logit_bias", "stop_token_ids"):
            vocab = small.arch.vocab_size
            value = {str(vocab): 1} if field == "logit_bias" else [vocab]
            err = openai_error(
                httpx.post(s.url + CHAT, json={**base, field: value}, timeout=60), 400
            )
            assert err["param"] == field and "vocabulary" in err["message"]


def test_stop_token_ids_end_the_answer_and_min_tokens_holds_them_off(small: LoadedModel) -> None:
    with serving(small, ServerConfig()) as s:
        base = chat(max_tokens=6, temperature=0, ignore_eos=True)
        messages = base["messages"]
        alone = LLM(small).generate(chat_request(messages), SamplingParams(max_tokens=1))[0]
        first = alone.token_ids[0]  # the greedy first token
        stopped = httpx.post(s.url + CHAT, json={**base, "stop_token_ids": [first]}, timeout=60)
        body = stopped.json()
        assert body["choices"][0]["finish_reason"] == "stop"
        assert (
            body["usage"]["completion_tokens"] == 1
            and body["choices"][0]["message"]["content"] == ""
        )
        held = {**base, "stop_token_ids": [first], "min_tokens": 3, "logprobs": True}
        body = httpx.post(s.url + CHAT, json=held, timeout=60).json()
        tokens = [e["token"] for e in body["choices"][0]["logprobs"]["content"]]
        assert body["usage"]["completion_tokens"] >= 3
        assert small.tokenizer.decode([first]) not in tokens[:3]
