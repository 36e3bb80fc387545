"""vLLM's request fields a client switching from vLLM sends: `prompt_logprobs` (served in
vLLM's shape, checked against a plain forward), `include_stop_str_in_output`, `cache_salt`
(requests share cached K/V only within one salt), `skip_special_tokens`,
`continuous_usage_stats`, `GET /version`, and the fields of what this server does not do
(structured output, beam search, ...), refused by name rather than ignored (tiny random
Llama)."""

from __future__ import annotations

import importlib.metadata
import json
from typing import Any

import httpx
import pytest
import torch
from conftest import make_tiny_dir
from test_server_faults import CTX, openai_error, serving
from test_server_raw import post

from cachecraft.engine.sampling import prompt_token_logprobs
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.model.reference import prefill
from cachecraft.server.config import ServerConfig

PASSAGE = "The Eiffel Tower stands in Paris and was finished in 1889 for a world fair. " * 6


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = make_tiny_dir(tmp_path_factory.mktemp("tiny-vllm"), max_position_embeddings=CTX)
    return load_model(str(path))


def test_prompt_logprobs_in_vllms_shape(small: LoadedModel) -> None:
    ids = small.tokenizer("The capital of France is Paris")["input_ids"]
    logits, _ = prefill(small, torch.tensor(ids), all_logits=True)
    want = prompt_token_logprobs(logits[:-1], torch.tensor(ids[1:]), 3)
    logp = torch.log_softmax(logits[:-1].float(), -1)
    with serving(small, ServerConfig()) as s:
        body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 3, "logprobs": 1}
        out = post(s.url, {**body, "echo": True}).json()
        choice = out["choices"][0]
        got = choice["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        for j, (token, entry) in enumerate(zip(ids[1:], got[1:], strict=True)):
            mine = entry[str(token)]
            assert mine["logprob"] == pytest.approx(want[j].logprob, abs=1e-4)
            assert mine["rank"] == int((logp[j] > logp[j, token]).sum()) + 1
            assert mine["decoded_token"] == small.tokenizer.decode([token])
            top = sorted((v["rank"], int(t)) for t, v in entry.items() if int(t) != token)
            assert [r for r, _ in top] == [r for r in (1, 2, 3) if r != mine["rank"]][: len(top)]
            assert len(entry) == 3 + (mine["rank"] > 3)  # the prompt's token, then the top 3
        # `echo` with `logprobs: 1` keeps its own one alternative per token
        assert all(len(t) == 1 for t in choice["logprobs"]["top_logprobs"][1 : len(ids)])
        assert out["usage"]["cachecraft"]["mode"] == "full"

        plain = post(s.url, {**body, "prompt_logprobs": 0}).json()["choices"][0]
        assert plain["logprobs"]["tokens"] and len(plain["logprobs"]["tokens"]) == 1  # no echo
        assert all(len(e) == 1 for e in plain["prompt_logprobs"][1:])  # the token's own only
        assert post(s.url, {"prompt": ids, "max_tokens": 1}).json()["choices"][0].keys() == {
            "index",
            "text",
            "logprobs",
            "finish_reason",
        }

        messages = [{"role": "user", "content": "Hi"}]
        chat = post(
            s.url,
            {"messages": messages, "max_tokens": 1, "prompt_logprobs": True},
            "/v1/chat/completions",
        ).json()
        assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]  # the template too
        assert all(len(e) in (1, 2) for e in chat["prompt_logprobs"][1:])  # `true` is 1

        streamed = {"messages": messages, "prompt_logprobs": 1, "stream": True}
        err = openai_error(post(s.url, streamed, "/v1/chat/completions"), 400)
        assert err["param"] == "prompt_logprobs"
        err = openai_error(post(s.url, {"prompt": ids, "prompt_logprobs": 21}), 400)
        assert err["param"] == "prompt_logprobs"


def test_include_stop_str_in_output(small: LoadedModel) -> None:
    with serving(small, ServerConfig()) as s:
        free = post(s.url, {"prompt": "Hello", "max_tokens": 12, "ignore_eos": True}).json()
        text = free["choices"][0]["text"]
        assert len(text) > 3
        stop = text[2:4]  # a stop string the greedy answer is bound to meet
        body = {"prompt": "Hello", "max_tokens": 12, "ignore_eos": True, "stop": stop}
        cut = post(s.url, body).json()["choices"][0]
        kept = post(s.url, {**body, "include_stop_str_in_output": True}).json()["choices"][0]
        assert cut["finish_reason"] == kept["finish_reason"] == "stop"
        head = text[: text.find(stop)]
        assert cut["text"] == head.rstrip()
        assert kept["text"] == head + stop


def test_cache_salt_keeps_caches_apart(small: LoadedModel) -> None:
    body = {
        "messages": [{"role": "user", "content": "When was it finished?"}],
        "documents": [{"text": PASSAGE}],
        "max_tokens": 1,
        "cachecraft_mode": "prefix",
    }

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        out = post(s.url, {**body, **extra}, "/v1/chat/completions").json()
        return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])

    with serving(small, ServerConfig()) as s:
        for _ in range(3):  # seen often enough for any admission policy to keep it
            last = cached("tenant-a")
        assert last > 0
        assert cached("tenant-b") == 0  # not even the template's prefix is shared
        assert cached(None) == 0
        assert cached("tenant-a") == last


def test_skip_special_tokens_false_keeps_them_in_the_text(small: LoadedModel) -> None:
    special = small.tokenizer.convert_tokens_to_ids("<|im_start|>")  # not a stop token
    body = {
        "prompt": "Hello",
        "max_tokens": 3,
        "ignore_eos": True,
        "logit_bias": {str(special): 100.0},  # every token the special one
    }
    with serving(small, ServerConfig()) as s:
        hidden = post(s.url, body).json()["choices"][0]
        shown = post(s.url, {**body, "skip_special_tokens": False}).json()["choices"][0]
        default = post(s.url, {**body, "skip_special_tokens": None}).json()["choices"][0]
    assert hidden["text"] == default["text"] == ""
    assert shown["text"] == "<|im_start|>" * 3


def _events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_continuous_usage_stats_on_every_chunk(small: LoadedModel) -> None:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Count to five"}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "n": 2,
    }
    with serving(small, ServerConfig()) as s:
        options = {"include_usage": True, "continuous_usage_stats": True}
        events = _events(s.url, {**body, "stream_options": options})
        plain = _events(s.url, {**body, "stream_options": {"include_usage": True}})
        alone = _events(s.url, {**body, "stream_options": {"continuous_usage_stats": True}})
        version = httpx.get(s.url + "/version", timeout=10).json()
    chunks, last = events[:-1], events[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10  # 2 choices x 5
    prompt = last["usage"]["prompt_tokens"]
    made: dict[int, list[int]] = {0: [], 1: []}
    for e in chunks:
        (choice,) = e["choices"]
        u = e["usage"]
        assert u["prompt_tokens"] == prompt
        assert u["total_tokens"] == prompt + u["completion_tokens"]
        made[choice["index"]].append(u["completion_tokens"])
    for counts in made.values():  # per choice: 0 with the role, rising to 5 at the end
        assert counts[0] == 0 and counts[-1] == 5 and counts == sorted(counts)
    assert all("usage" not in e for e in plain[:-1]) and "usage" in plain[-1]
    assert all("usage" not in e for e in alone)  # continuous needs include_usage, as in vLLM
    assert version == {"version": importlib.metadata.version("cachecraft")}


@pytest.mark.parametrize(
    "field",
    [
        {"guided_json": {"type": "object"}},
        {"guided_choice": ["yes", "no"]},
        {"guided_regex": "[0-9]+"},
        {"structured_outputs": {"choice": ["a"]}},
        {"use_beam_search": True},
        {"truncate_prompt_tokens": 16},
        {"continue_final_message": True},
        {"add_generation_prompt": False},
        {"return_tokens_as_token_ids": True},
        {"bad_words": ["Paris"]},
    ],
)
def test_vllm_fields_this_server_cannot_honour_are_named(
    small: LoadedModel, field: dict[str, Any]
) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with serving(small, ServerConfig()) as s:
        err = openai_error(
            post(s.url, {"messages": messages, **field}, "/v1/chat/completions"), 400
        )
        assert err["param"] == next(iter(field)) and err["code"] == "unsupported_field"
        harmless = {"use_beam_search": False, "add_generation_prompt": True, "bad_words": []}
        ok = post(
            s.url, {"messages": messages, "max_tokens": 1, **harmless}, "/v1/chat/completions"
        )
        assert ok.status_code == 200


def test_an_empty_question_names_its_field(small: LoadedModel) -> None:
    with serving(small, ServerConfig()) as s:
        for prompt in ("", "  \n"):
            err = openai_error(post(s.url, {"prompt": prompt, "max_tokens": 1}), 400)
            assert err["param"] == "prompt" and "empty" in err["message"]
        history = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": None},
        ]
        err = openai_error(post(s.url, {"messages": history}, "/v1/chat/completions"), 400)
        assert err["param"] == "messages.2.content"
        err = openai_error(post(s.url, {"messages": history[:2]}, "/v1/chat/completions"), 400)
        assert err["param"] == "messages"  # ends with the assistant's turn
