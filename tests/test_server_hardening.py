"""Product hardening (the probes in docs/results/hardening.md, second pass): a real server on a
tiny random Llama, each test one defect found by probing it as an OpenAI client would."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import make_tiny_dir
from test_server_faults import CHAT, CTX, T, chat, openai_error, serving

from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.server.config import ServerConfig
from cachecraft.server.launch import start_server
from cachecraft.store.config import StoreConfig


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = make_tiny_dir(tmp_path_factory.mktemp("tiny-hardening"), max_position_embeddings=CTX)
    return load_model(str(path))


def test_a_request_cut_by_shutdown_gets_a_json_503(small: LoadedModel) -> None:
    """SIGTERM with a request still waiting past `shutdown_timeout_s`: uvicorn cancels it and
    used to answer a plain-text "Internal Server Error" 500. The engine is held busy by an
    event (released once the client has its answer), never by a sleep that could end first."""
    got: dict[str, Any] = {}
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(T)

    with serving(small, ServerConfig(shutdown_timeout_s=0.3)) as s:
        busy = s.engine.call(hold)  # the engine cannot plan the request yet
        assert held.wait(T) and not s.engine.has_work()

        def ask() -> None:
            try:
                got["r"] = httpx.post(s.url + CHAT, json=chat(), timeout=T)
            finally:
                release.set()

        client = threading.Thread(target=ask)
        client.start()
        deadline = time.monotonic() + T
        while not s.engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)  # until the request waits for the held engine (a condition)
        assert s.engine.has_work() and not busy.done()
    client.join(T)
    err = openai_error(got["r"], 503)
    assert err["code"] == "shutting_down" and "shutting down" in err["message"]


def test_a_restarted_server_lists_deletes_and_pins_what_it_stored(
    small: LoadedModel, tmp_path: Path
) -> None:
    """The chunk registry lived in memory: after a restart on the same cache directory
    GET /v1/chunks was empty, DELETE said 404 and pins were gone, though the files served."""
    store = StoreConfig(cache_dir=str(tmp_path / "cache"), doorkeeper_threshold=1)
    docs = [
        {"id": "fr", "text": "Paris is the capital of France."},
        {"id": "de", "text": "Berlin is the capital of Germany."},
    ]
    with start_server("full", loaded=small, store=store) as url:
        r = httpx.post(url + "/v1/chunks", json={"documents": docs[:1], "pin": True}, timeout=T)
        assert r.status_code == 200 and r.json()["data"][0]["pinned"], r.text
        r = httpx.post(
            url + "/v1/chunks",
            json={"documents": docs[1:], "cache_namespace": "tenant"},
            timeout=T,
        )
        assert r.status_code == 200, r.text
        before = httpx.get(url + "/v1/chunks", timeout=T).json()
        tenant = httpx.get(url + "/v1/chunks?cache_namespace=tenant", timeout=T).json()
    assert [d["id"] for d in before["data"]] == ["fr"] and before["data"][0]["pinned"]
    assert [d["id"] for d in tenant["data"]] == ["de"]
    with start_server("full", loaded=small, store=store) as url:
        after = httpx.get(url + "/v1/chunks", timeout=T).json()
        assert after == before  # ids, keys, variants, the pin and the pinned bytes
        key = httpx.get(url + "/v1/chunks?cache_namespace=tenant", timeout=T).json()
        assert key == tenant
        de = tenant["data"][0]["chunk_key"]
        r = httpx.delete(f"{url}/v1/chunks/{de}?cache_namespace=tenant", timeout=T)
        assert r.status_code == 200 and r.json()["num_variants"] == 1, r.text
    with start_server("full", loaded=small, store=store) as url:  # the deletion stuck
        assert httpx.get(url + "/v1/chunks?cache_namespace=tenant", timeout=T).json()["data"] == []
        assert httpx.get(url + "/v1/chunks", timeout=T).json() == before


def test_models_retrieve_and_a_form_encoded_body(small: LoadedModel) -> None:
    """The official client's `models.retrieve` hit a 404 "no route"; `curl -d '{...}'` (form
    content type) was told "body: Input should be a valid dictionary", not what to change."""
    from openai import NotFoundError, OpenAI

    with serving(small, ServerConfig()) as s:
        client = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        served = client.models.list().data[0].id
        assert client.models.retrieve(served).id == served
        assert client.models.retrieve("cachecraft").id == served  # the alias
        try:
            client.models.retrieve("gpt-4")
            raise AssertionError("an unknown model was found")
        except NotFoundError as e:
            assert e.code == "model_not_found"
        body = '{"model": "cachecraft", "messages": [{"role": "user", "content": "hi"}]}'
        form = {"content-type": "application/x-www-form-urlencoded"}
        r = httpx.post(s.url + CHAT, content=body, headers=form, timeout=T)
        err = openai_error(r, 400)
        assert "Content-Type: application/json" in err["message"]
        assert "x-www-form-urlencoded" in err["message"]
        ok = httpx.post(s.url + CHAT, json=chat(), timeout=T)  # the same server still answers
        assert ok.status_code == 200, ok.text


def test_a_corrupt_registry_is_set_aside_and_registering_goes_on(
    small: LoadedModel, tmp_path: Path
) -> None:
    store = StoreConfig(cache_dir=str(tmp_path / "cache"), doorkeeper_threshold=1)
    doc = {"documents": [{"id": "fr", "text": "Paris is the capital of France."}]}
    with start_server("full", loaded=small, store=store) as url:
        assert httpx.post(url + "/v1/chunks", json=doc, timeout=T).status_code == 200
    registry = tmp_path / "cache" / "registry.sqlite"
    for part in registry.parent.glob("registry.sqlite-*"):
        part.unlink()
    registry.write_bytes(b"not a database" * 100)
    with start_server("full", loaded=small, store=store) as url:
        assert httpx.get(url + "/v1/chunks", timeout=T).json()["data"] == []  # its rows are lost
        assert httpx.post(url + "/v1/chunks", json=doc, timeout=T).status_code == 200
    with start_server("full", loaded=small, store=store) as url:  # registered again, and kept
        assert [d["id"] for d in httpx.get(url + "/v1/chunks", timeout=T).json()["data"]] == ["fr"]
    assert len(list(registry.parent.glob("registry.sqlite.corrupt-*"))) == 1


def test_nullable_fields_and_parallel_tool_calls_pass(small: LoadedModel) -> None:
    """OpenAI's schema makes `stream` nullable and defaults `parallel_tool_calls` to true;
    `"stream": null` was a 400 ("Input should be a valid boolean") on both routes, and so were
    `parallel_tool_calls: true` and null for our own `documents` / `ignore_eos`."""
    with serving(small, ServerConfig()) as s:
        for extra in (
            {"stream": None},
            {"parallel_tool_calls": True},
            {"parallel_tool_calls": False},
            {"documents": None, "ignore_eos": None},
        ):
            r = httpx.post(s.url + CHAT, json=chat(**extra), timeout=T)
            assert r.status_code == 200 and r.json()["object"] == "chat.completion", (extra, r.text)
        body = {"model": "cachecraft", "prompt": "hi", "max_tokens": 2, "stream": None}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=T)
        assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
        err = openai_error(httpx.post(s.url + CHAT, json=chat(stream="yes"), timeout=T), 400)
        assert err["param"] == "stream"  # a wrong type is still refused
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        r = httpx.post(s.url + CHAT, json=chat(tools=tools, parallel_tool_calls=True), timeout=T)
        assert openai_error(r, 400)["param"] == "tools"


def test_n_choices_streamed_and_not(small: LoadedModel) -> None:
    """`n` was refused above 1 ("n: Input should be less than or equal to 1"): the official
    client's n=2 now gets two choices, streamed or not, each with its index."""
    from openai import OpenAI

    with serving(small, ServerConfig()) as s:
        client = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "Name a colour."}]
        kw = {
            "model": "cachecraft",
            "messages": msgs,
            "max_tokens": 5,
            "extra_body": {"ignore_eos": True},
        }
        one = client.chat.completions.create(**kw)
        greedy = client.chat.completions.create(n=3, **kw)
        assert [c.index for c in greedy.choices] == [0, 1, 2]
        assert {c.message.content for c in greedy.choices} == {one.choices[0].message.content}
        assert greedy.usage.completion_tokens == 15
        assert greedy.usage.prompt_tokens == one.usage.prompt_tokens
        seeded = client.chat.completions.create(n=2, temperature=1.5, seed=7, **kw)
        again = client.chat.completions.create(n=2, temperature=1.5, seed=7, **kw)
        assert [c.message.content for c in seeded.choices] == [
            c.message.content for c in again.choices
        ]
        texts = ["", ""]
        finished = [None, None]
        stream = client.chat.completions.create(
            n=2, temperature=1.5, seed=7, stream=True, stream_options={"include_usage": True}, **kw
        )
        usage = None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                finished[c.index] = c.finish_reason or finished[c.index]
        assert texts == [c.message.content for c in seeded.choices]
        assert finished == ["length", "length"] and usage is not None
        assert usage.completion_tokens == 10
        comp = client.completions.create(model="cachecraft", prompt="Hi", max_tokens=3, n=2)
        assert [c.index for c in comp.choices] == [0, 1]
        assert s.engine.num_running == 0 and s.engine.num_waiting == 0


def test_batched_prompts_answer_each_prompt(small: LoadedModel) -> None:
    """A completion's list of prompts (LangChain's completion model sends them so) was a 400:
    now each prompt gets its `n` choices at p * n + i, each the answer it gets alone, streamed
    or not, and usage counts every prompt once."""
    from openai import OpenAI

    prompts = ["Name a colour.", "Name a river.", "Count to three."]
    kw = {"model": "cachecraft", "max_tokens": 4, "extra_body": {"ignore_eos": True}}
    with serving(small, ServerConfig()) as s:
        client = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        alone = [client.completions.create(prompt=p, **kw) for p in prompts]
        batch = client.completions.create(prompt=prompts, n=2, **kw)
        assert [c.index for c in batch.choices] == list(range(6))
        want = [a.choices[0].text for a in alone for _ in range(2)]  # greedy: n equal answers
        assert [c.text for c in batch.choices] == want
        assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert batch.usage.completion_tokens == 6 * 4
        texts = [""] * 3
        for chunk in client.completions.create(prompt=prompts, stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] += c.text
        assert texts == [a.choices[0].text for a in alone]
        empty = httpx.post(
            s.url + "/v1/completions", json={"prompt": [], "max_tokens": 2}, timeout=T
        )
        assert "at least one" in openai_error(empty, 400)["message"]
        assert s.engine.num_running == 0 and s.engine.num_waiting == 0


def test_a_client_leaving_an_n_stream_frees_every_choice(small: LoadedModel) -> None:
    body = chat(n=3, max_tokens=400, ignore_eos=True, stream=True)
    with serving(small, ServerConfig()) as s:
        with httpx.stream("POST", s.url + CHAT, json=body, timeout=T) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i > 8:
                    break  # leave mid-stream
        deadline = time.monotonic() + T
        while s.engine.num_running + s.engine.num_waiting and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.engine.num_running == 0 and s.engine.num_waiting == 0
        metrics = httpx.get(s.url + "/metrics", timeout=T).text
        assert "cachecraft_requests_aborted_total 3.0" in metrics  # each choice freed early
        assert httpx.post(s.url + CHAT, json=chat(), timeout=T).status_code == 200


def test_messages_a_client_may_send(small: LoadedModel) -> None:
    """A body without `model` was a 400 (vLLM serves its model); a `tool` message was dropped
    without a word (and a last one, the result of a call for the question, was a 400); an image part and a token-id prompt got pydantic's "Input should be a valid
    string" for every branch of the union instead of what was wrong (token ids are served now,
    read as given, as vLLM reads them; a list mixing strings and ids is named); a blank
    document or a conversation of system messages only got messages that named neither."""
    with serving(small, ServerConfig()) as s:
        body = chat()
        del body["model"]
        r = httpx.post(s.url + CHAT, json=body, timeout=T)
        assert r.status_code == 200 and r.json()["model"] == small.name, r.text

        def prompt_tokens(*messages: dict[str, str]) -> int:
            r = httpx.post(s.url + CHAT, json=chat(messages=list(messages)), timeout=T)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        ask, hi = {"role": "user", "content": "weather?"}, {"role": "user", "content": "hi"}
        tool = {"role": "tool", "content": "sunny and 21 degrees", "tool_call_id": "1"}
        assert prompt_tokens(ask, tool, hi) > prompt_tokens(ask, hi)  # the tool result is read
        assert prompt_tokens(ask, tool) == prompt_tokens(tool, ask)  # a result for the question

        image = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
        content = [{"type": "text", "text": "what is this?"}, image]
        r = httpx.post(s.url + CHAT, json=chat(content=content), timeout=T)  # type: ignore[arg-type]
        err = openai_error(r, 400)
        assert err["param"] == "messages.0.content" and "'image_url'" in err["message"], err
        assert "valid string" not in err["message"]
        r = httpx.post(s.url + CHAT, json=chat(content=[{"type": "text"}]), timeout=T)  # type: ignore[arg-type]
        err = openai_error(r, 400)  # the list failed inside: its part is named, not its type
        assert err["message"] == "messages.0.content.0.text: Field required", err
        assert err["param"] == "messages.0.content.0.text", err

        body = {"model": "cachecraft", "prompt": [1, 2, 3], "max_tokens": 2}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=T)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3, r.text
        body["prompt"] = ["hi", [1, 2]]
        err = openai_error(httpx.post(s.url + "/v1/completions", json=body, timeout=T), 400)
        assert err["param"] == "prompt" and "not a mix" in err["message"], err
        assert "valid string" not in err["message"]

        system = {"role": "system", "content": "be brief"}
        r = httpx.post(s.url + CHAT, json=chat(messages=[system]), timeout=T)
        assert "no user message" in openai_error(r, 400)["message"]
        body = chat(documents=[{"text": "Paris is in France."}, {"text": " \n "}])
        err = openai_error(httpx.post(s.url + CHAT, json=body, timeout=T), 400)
        assert err["param"] == "documents.1.text" and "whitespace" in err["message"], err
