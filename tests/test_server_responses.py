"""OpenAI's Responses API (`POST /v1/responses`) against the official openai client: the same
answer as the chat path, streamed or not, errors named by the Responses fields, and
chunk-caches reused through it (tiny random Llama)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import make_tiny_dir
from test_server_faults import CTX, Served, openai_error, serving
from test_server_raw import post

from cachecraft.model.loader import load_model
from cachecraft.server.config import ServerConfig

PASSAGE = "The Eiffel Tower stands in Paris and was finished in 1889 for a world fair. " * 6


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = make_tiny_dir(tmp_path_factory.mktemp("tiny-responses"), max_position_embeddings=CTX)
    with serving(load_model(str(path)), ServerConfig()) as s:
        yield s


def sdk(s: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)


def chat(s: Served, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": max_tokens, "ignore_eos": True}
    return post(s.url, body, "/v1/chat/completions").json()


def test_the_answer_is_the_chat_answer(srv: Served) -> None:
    want = chat(
        srv,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell a story"}],
        6,
    )
    got = sdk(srv).responses.create(
        model="cachecraft",  # the alias, as on the chat path
        instructions="Be brief.",
        input="Tell a story",
        max_output_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert got.output_text == want["choices"][0]["message"]["content"]
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    assert got.id.startswith("resp_") and got.object == "response"
    assert got.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert got.usage.output_tokens == 6
    assert got.usage.total_tokens == got.usage.input_tokens + 6

    text = got.output_text
    stop = text[2:4]  # a stop string the greedy answer meets: it ends before its length
    short = sdk(srv).responses.create(
        instructions="Be brief.",
        input="Tell a story",
        max_output_tokens=6,
        extra_body={"ignore_eos": True, "stop": stop},
    )
    assert short.status == "completed" and short.incomplete_details is None
    assert short.output_text == text[: text.find(stop)].rstrip()


def test_the_stream_carries_the_same_answer(srv: Served) -> None:
    messages = [{"role": "user", "content": "Count with me"}]
    want = chat(srv, messages, 5)["choices"][0]["message"]["content"]
    stream = sdk(srv).responses.create(
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Count with me"}]}],
        max_output_tokens=5,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want == events[-4].text
    final = events[-1].response
    assert final.output_text == want and final.usage.output_tokens == 5


def test_a_stream_left_early_frees_its_request(srv: Served) -> None:
    body = {"input": "Count.", "max_output_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while "output_text.delta" not in next(lines):
            pass  # generating now
    deadline = time.monotonic() + 30
    while srv.engine.num_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.engine.num_running == 0 and srv.engine.num_waiting == 0


def test_documents_are_reused_through_it(srv: Served) -> None:
    body = {
        "input": "When was it finished?",
        "documents": [{"text": PASSAGE}],
        "max_output_tokens": 1,
        "cachecraft_mode": "prefix",
    }
    seen = [post(srv.url, body, "/v1/responses").json() for _ in range(3)]
    cached = [r["usage"]["input_tokens_details"]["cached_tokens"] for r in seen]
    assert cached[0] == 0 and cached[-1] > 0
    assert seen[-1]["usage"]["cachecraft"]["mode"] == "prefix"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"role": "user", "content": "  "}], "instructions": "x"}, "input.0.content"),
        ({"input": "  "}, "input"),
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "Hi", "text": {"format": {"type": "json_object"}}}, "text"),
        ({"input": "Hi", "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ],
)
def test_errors_name_the_responses_fields(srv: Served, body: dict[str, Any], param: str) -> None:
    err = openai_error(post(srv.url, body, "/v1/responses"), 400)
    assert err["param"] == param
    assert "messages." not in err["message"] and "max_tokens" not in err["message"]


def test_function_call_outputs_are_the_chat_tool_results(srv: Served) -> None:
    """An agent's last turn: the question, the call the model made, the client's result of it,
    tools offered with no call asked for; answered as the chat path answers those turns."""
    tools = [{"type": "function", "name": "search", "parameters": {}}]
    got = sdk(srv).responses.create(
        model="cachecraft",
        input=[
            {"role": "user", "content": "Where is the tower?"},
            {"type": "function_call", "call_id": "c1", "name": "search", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": PASSAGE},
        ],
        tools=tools,  # type: ignore[arg-type]
        tool_choice="none",
        max_output_tokens=6,
        extra_body={"ignore_eos": True},
    )
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    want = chat(
        srv,
        [
            {"role": "user", "content": "Where is the tower?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": PASSAGE},
        ],
        6,
    )
    assert got.output_text == want["choices"][0]["message"]["content"]
    assert got.usage.input_tokens == want["usage"]["prompt_tokens"]

    bad = {"input": [{"type": "function_call_output", "call_id": "c1"}]}  # no output
    err = openai_error(post(srv.url, bad, "/v1/responses"), 400)
    assert "input.0.function_call_output.output: Field required" in err["message"], err
    assert "InputMessage" not in err["message"] and "FunctionCall" not in err["message"]
    # a list is not "a valid string": only what is wrong inside it is named
    assert err["message"].startswith("input.0.") and "valid string" not in err["message"], err
    assert err["param"] == "input.0.function_call_output.output", err


def test_a_prompt_over_the_cap_names_input(srv: Served) -> None:
    body = {"input": "Hi", "instructions": "x" * 40_000}  # max_prompt_chars: 32,000
    err = openai_error(post(srv.url, body, "/v1/responses"), 413)
    assert err["param"] == "input" and err["message"].startswith("input: 40002 characters")


def test_fields_with_no_effect_pass(srv: Served) -> None:
    body = {
        "input": "Hi",
        "max_output_tokens": 2,
        "store": True,
        "metadata": {"user": "a"},
        "tool_choice": "auto",
        "tools": [],
        "parallel_tool_calls": True,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
    }
    out = post(srv.url, body, "/v1/responses")
    assert out.status_code == 200
    assert out.json()["metadata"] == {"user": "a"} and out.json()["store"] is False
