"""Log-probabilities through the server (OpenAI's chat and completion shapes) on the tiny
random Llama, checked against the model's own first-token distribution."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from conftest import make_tiny_dir
from openai import OpenAI
from test_server_faults import CTX, serving

from cachecraft.api import chat_request
from cachecraft.engine.sampling import SamplingParams, token_logprobs
from cachecraft.errors import BadRequestError
from cachecraft.llm import LLM
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.server.config import ServerConfig


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = make_tiny_dir(tmp_path_factory.mktemp("tiny-logprobs"), max_position_embeddings=CTX)
    return load_model(str(path))


MESSAGES = [{"role": "user", "content": "Name a colour."}]
KW = {"model": "cachecraft", "max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_token_logprobs_are_the_log_softmax_and_its_top() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    lp = token_logprobs(logits, 2, 2)
    want = torch.log_softmax(logits, -1)
    assert lp.logprob == pytest.approx(float(want[2]))
    assert [t for t, _ in lp.top] == [1, 2]
    assert [v for _, v in lp.top] == pytest.approx([float(want[1]), float(want[2])])
    assert token_logprobs(logits, 0, 0).top == ()
    assert SamplingParams(logprobs=0).logprobs == 0
    nan = token_logprobs(torch.tensor([float("nan"), 1.0]), 1, 1)  # never raises
    assert math.isnan(nan.logprob)
    with pytest.raises(BadRequestError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_chat_logprobs_streamed_and_not(small: LoadedModel) -> None:
    with serving(small, ServerConfig()) as s:
        client = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, **KW)
        content = out.choices[0].logprobs.content
        assert len(content) == out.usage.completion_tokens == 5
        assert "".join(c.token for c in content).strip() == out.choices[0].message.content
        for c in content:
            tops = [t.logprob for t in c.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
            assert c.top_logprobs[0].token == c.token  # greedy: the most likely token
            assert c.logprob == pytest.approx(tops[0])
            assert bytes(c.bytes).decode() == c.token
        # the first token's log-probability is the model's, from a full prefill; the Python
        # API gives the same ones
        llm = LLM(small)
        sampling = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3)
        ref = llm.generate(chat_request(MESSAGES), sampling, "full", keep_logits=True)[0]
        want = torch.log_softmax(ref.first_token_logits.float(), -1)[ref.token_ids[0]]
        assert content[0].logprob == pytest.approx(float(want), abs=1e-4)
        assert ref.logprobs is not None and len(ref.logprobs) == 5
        assert [lp.logprob for lp in ref.logprobs] == pytest.approx(
            [c.logprob for c in content], abs=1e-4
        )
        streamed = []
        for chunk in client.chat.completions.create(
            messages=MESSAGES, logprobs=True, top_logprobs=3, stream=True, **KW
        ):
            for c in chunk.choices:
                if c.logprobs is not None:
                    streamed.extend(c.logprobs.content)
                    if c.delta.content:  # an entry goes with the text of its own token
                        assert "".join(e.token for e in c.logprobs.content).strip()
        assert [e.token for e in streamed] == [c.token for c in content]
        assert [e.logprob for e in streamed] == pytest.approx(
            [c.logprob for c in content], abs=1e-3
        )
        plain = client.chat.completions.create(messages=MESSAGES, **KW)
        assert plain.choices[0].logprobs is None


def test_completion_logprobs_have_the_legacy_shape(small: LoadedModel) -> None:
    with serving(small, ServerConfig()) as s:
        client = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(prompt="Name a colour.", logprobs=2, **KW)
        lp = out.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert all(len(top) == 2 for top in lp.top_logprobs)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
        assert all(
            max(top.values()) == pytest.approx(v)
            for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
        )
        r = httpx.post(
            s.url + "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 2, "logprobs": 0},
            timeout=60,
        )
        assert r.json()["choices"][0]["logprobs"]["top_logprobs"] == [{}, {}]
