"""Completions read as given, as vLLM serves them, for scoring clients (lm-evaluation-harness):
token-id prompts, `echo` with prompt log-probabilities, `--raw-completions`, `/tokenize` and
`/tokenizer_info` (tiny random Llama; checked against a plain forward of the same ids)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch
from conftest import make_tiny_dir
from pydantic import ValidationError
from test_server_faults import CTX, openai_error, serving

from cachecraft.engine.sampling import prompt_token_logprobs
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.model.reference import prefill
from cachecraft.server.config import ServerConfig
from cachecraft.server.protocol import MAX_PROMPT_IDS, CompletionRequest

TEXT = "The Eiffel Tower stands in Paris. Mount Everest is the highest mountain. " * 8


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = make_tiny_dir(tmp_path_factory.mktemp("tiny-raw"), max_position_embeddings=CTX)
    return load_model(str(path))


def post(url: str, body: dict[str, Any], route: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + route, json={"model": "cachecraft", **body}, timeout=120)


def test_a_token_id_prompt_is_read_as_given_and_reused(small: LoadedModel) -> None:
    ids = small.tokenizer(TEXT)["input_ids"]
    want, _ = prefill(small, torch.tensor(ids))
    with serving(small, ServerConfig()) as s:
        body = {"prompt": ids, "max_tokens": 1, "logprobs": 1, "ignore_eos": True}
        first = post(s.url, {**body, "cachecraft_mode": "cachecraft"}).json()
        assert first["usage"]["prompt_tokens"] == len(ids)  # no template
        lp = first["choices"][0]["logprobs"]["token_logprobs"][0]
        assert lp == pytest.approx(float(torch.log_softmax(want[-1], -1).max()), abs=1e-4)
        post(s.url, {**body, "cachecraft_mode": "cachecraft"})  # stored at its 2nd sighting
        again = post(s.url, {**body, "cachecraft_mode": "cachecraft"}).json()
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 64  # its leading blocks, as a prefix cache reuses them
        assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_echo_with_logprobs_scores_the_prompt(small: LoadedModel) -> None:
    """What lm-evaluation-harness sends for a log-likelihood (token ids, `echo`, `logprobs`
    1, `max_tokens` 1, a batch of prompts), and `max_tokens` 0: every prompt token's entry
    is a plain forward's log-softmax, the first one null."""
    ctx = small.tokenizer("The capital of France is")["input_ids"]
    conts = [small.tokenizer(" Paris")["input_ids"], small.tokenizer(" Berlin")["input_ids"]]
    prompts = [ctx + c for c in conts]
    with serving(small, ServerConfig()) as s:
        out = post(
            s.url,
            {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0},
        ).json()
        choices = sorted(out["choices"], key=lambda c: c["index"])
        assert len(choices) == 2
        for ids, choice in zip(prompts, choices, strict=True):
            logits, _ = prefill(small, torch.tensor(ids), all_logits=True)
            want = prompt_token_logprobs(logits[:-1], torch.tensor(ids[1:]), 1)
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt, then the answer
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(
                [w.logprob for w in want], abs=1e-4
            )
            assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
            assert choice["text"].startswith(small.tokenizer.decode(ids))
            assert lp["text_offset"][0] == 0
            # lm-eval's reading: the continuation's summed log-probability
            assert sum(lp["token_logprobs"][len(ctx) : -1]) == pytest.approx(
                sum(w.logprob for w in want[len(ctx) - 1 :]), abs=1e-3
            )
        nullable = post(s.url, {"prompt": "Hi", "echo": None, "max_tokens": 1}).json()
        assert not nullable["choices"][0]["text"].startswith("Hi")  # null: no echo
        alone = post(s.url, {"prompt": TEXT, "echo": True, "max_tokens": 0, "logprobs": 0}).json()
        choice = alone["choices"][0]
        assert choice["text"] == TEXT and choice["finish_reason"] == "length"
        assert alone["usage"]["completion_tokens"] == 0
        n = alone["usage"]["prompt_tokens"]
        assert n == len(small.tokenizer(TEXT)["input_ids"])  # echo reads the prompt raw
        assert len(choice["logprobs"]["token_logprobs"]) == n
        assert choice["logprobs"]["top_logprobs"][1] == {}


def test_echo_streams_the_prompt_first(small: LoadedModel) -> None:
    with serving(small, ServerConfig()) as s:
        body = {"prompt": "Hello there", "echo": True, "max_tokens": 3, "stream": True}
        with httpx.stream(
            "POST", s.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=60
        ) as r:
            events = [
                json.loads(line[6:])
                for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        texts = [e["choices"][0]["text"] for e in events if e["choices"]]
        assert texts[0] == "Hello there"
        whole = post(s.url, {**body, "stream": False, "ignore_eos": True}).json()
        assert "".join(texts) == whole["choices"][0]["text"]


def test_raw_completions_read_text_as_given(small: LoadedModel) -> None:
    raw_ids = small.tokenizer(TEXT)["input_ids"]
    with serving(small, ServerConfig(raw_completions=True)) as s:
        out = post(s.url, {"prompt": TEXT, "max_tokens": 2}).json()
        assert out["usage"]["prompt_tokens"] == len(raw_ids)
        tokens = post(s.url, {"prompt": TEXT}, "/tokenize").json()["tokens"]
        assert tokens == raw_ids
        bare = post(s.url, {"prompt": TEXT, "add_special_tokens": False}, "/tokenize").json()
        assert bare["tokens"] == small.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
        info = httpx.get(s.url + "/tokenizer_info", timeout=30).json()
        assert info["eos_token"] == small.tokenizer.eos_token
        assert info["chat_template"] and info["model_max_length"] == CTX
        chat = post(
            s.url,
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            "/v1/chat/completions",
        )
        assert chat.status_code == 200  # chats keep their template
    with serving(small, ServerConfig()) as s:  # by default a text prompt is a chat turn
        out = post(s.url, {"prompt": TEXT, "max_tokens": 2}).json()
        assert out["usage"]["prompt_tokens"] > len(raw_ids)
        assert post(s.url, {"prompt": TEXT}, "/tokenize").json()["count"] > len(raw_ids)
        err = openai_error(httpx.get(s.url + "/tokenizer_info", timeout=30), 404)
        assert "--raw-completions" in err["message"]


def test_bad_raw_prompts_are_named(small: LoadedModel) -> None:
    vocab = small.arch.vocab_size
    with serving(small, ServerConfig()) as s:
        err = openai_error(post(s.url, {"prompt": [1, vocab], "max_tokens": 1}), 400)
        assert err["param"] == "prompt" and f"token {vocab}" in err["message"]
        err = openai_error(post(s.url, {"prompt": ["a", [1, 2]], "max_tokens": 1}), 400)
        assert "not a mix" in err["message"]
        err = openai_error(post(s.url, {"prompt": [[1, 2], []], "max_tokens": 1}), 400)
        assert "empty" in err["message"]
        for prompt in ([1, -2], [[3], [1, -2]]):
            err = openai_error(post(s.url, {"prompt": prompt, "max_tokens": 1}), 400)
            assert err["param"] == "prompt" and "never negative; got -2" in err["message"], err
            assert "valid string" not in err["message"]
        err = openai_error(post(s.url, {"prompt": "Hi", "max_tokens": 0}), 400)
        assert "echo" in err["message"]
        docs = [{"text": "A passage."}]
        err = openai_error(post(s.url, {"prompt": [5, 6], "documents": docs}), 400)
        assert "documents" in err["message"]
    with serving(small, ServerConfig(raw_completions=True)) as s:
        err = openai_error(post(s.url, {"prompt": "Hi", "documents": docs}, "/tokenize"), 400)
        assert "documents" in err["message"]
        chat = {"messages": [{"role": "user", "content": "Hi"}], "echo": True}
        err = openai_error(post(s.url, chat, "/v1/chat/completions"), 400)
        assert err["param"] == "echo"
        long = [1] * (CTX + 1)
        err = openai_error(post(s.url, {"prompt": long, "max_tokens": 1}), 400)
        assert "context" in err["message"]


def test_token_id_prompts_are_capped_in_all() -> None:
    half = MAX_PROMPT_IDS // 2
    assert len(CompletionRequest(prompt=[[1] * half, [2] * half]).prompts()) == 2  # at the cap
    for prompt in ([1] * (MAX_PROMPT_IDS + 1), [[1] * half, [2] * (half + 1)]):
        with pytest.raises(ValidationError, match=f"at most {MAX_PROMPT_IDS} token ids in all"):
            CompletionRequest(prompt=prompt)
    assert CompletionRequest(prompt=["a prompt"] * 3).prompts() == ["a prompt"] * 3
