"""The HTTP server against the official openai client, on a tiny random Llama (fast).

Live servers on free loopback ports (`start_server`); answers are checked against sequential
greedy runs of the same model (`LLM.answer`), token for token through the text.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import make_tiny_dir

from cachecraft.config import ReuseConfig
from cachecraft.engine.engine import EngineConfig
from cachecraft.engine.sampling import SamplingParams
from cachecraft.engine.text import TextStream
from cachecraft.llm import LLM
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.request import Chunk, RagRequest
from cachecraft.server.config import ServerConfig
from cachecraft.server.launch import start_server
from cachecraft.store.config import StoreConfig
from cachecraft.store.memory import MemoryStore

CTX = 512
DOCS = [
    "Paris is the capital of France and sits on the Seine.",
    "The Nile flows north through Egypt into the Mediterranean.",
    "Mount Everest is the highest mountain above sea level.",
    "Python was created by Guido van Rossum in 1991.",
]
LIMITS = ServerConfig(max_documents=4, max_document_chars=400)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny random Llama with a 512-token context (context errors are cheap to hit)."""
    path = make_tiny_dir(tmp_path_factory.mktemp("tiny-ctx"), max_position_embeddings=CTX)
    return load_model(str(path))


@pytest.fixture(scope="module")
def url(small: LoadedModel) -> Iterator[str]:
    with start_server("full", loaded=small, server=LIMITS) as base:
        yield base


def client(base: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)


def question(i: int) -> tuple[str, list[dict[str, str]]]:
    docs = [{"id": f"d{j}", "text": DOCS[j]} for j in (i % 4, (i + 1) % 4)]
    return f"What does document {i} say?", docs


def reference(small: LoadedModel, i: int, max_tokens: int = 8) -> str:
    """The sequential greedy answer, one request at a time (the offline path)."""
    q, docs = question(i)
    request = RagRequest(q, [Chunk(d["text"], d["id"]) for d in docs])
    llm = LLM(small, store=MemoryStore(1 << 30))
    return llm.answer(request, SamplingParams(max_tokens=max_tokens), "full").text


def ask(
    base: str, i: int, max_tokens: int = 8, **extra: object
) -> openai.types.chat.ChatCompletion:
    q, docs = question(i)
    return client(base).chat.completions.create(
        model="cachecraft",
        messages=[{"role": "user", "content": q}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"documents": docs, **extra},
    )


def test_chat_with_documents_usage_and_report(url: str, small: LoadedModel) -> None:
    out = ask(url, 0)
    assert out.choices[0].message.content == reference(small, 0)
    assert out.choices[0].finish_reason in ("stop", "length")
    usage = out.usage
    assert usage is not None and usage.completion_tokens >= 1
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0  # mode full reuses nothing
    report = usage.model_extra["cachecraft"]
    assert report["mode"] == "full" and report["prompt_tokens"] == usage.prompt_tokens
    assert [c["label"] for c in report["chunks"]] == ["d0", "d1"]


def test_documents_as_bare_strings_and_with_vllm_titles(url: str) -> None:
    """A bare string is a document's text; vLLM's `{"title", "text"}` reads the title as the
    passage's first line: both answer and report exactly like the spelled-out document."""
    q, docs = question(2)
    title, text = "Atlas", docs[0]["text"]

    def answer(documents: list[object]) -> openai.types.chat.ChatCompletion:
        return client(url).chat.completions.create(
            model="cachecraft",
            messages=[{"role": "user", "content": q}],
            max_tokens=8,
            temperature=0,
            extra_body={"documents": documents},
        )

    spelled = answer([{"text": f"{title}\n{text}"}, {"text": docs[1]["text"]}])
    got = answer([{"title": title, "text": text}, docs[1]["text"]])
    assert got.choices[0].message.content == spelled.choices[0].message.content
    assert got.usage is not None and spelled.usage is not None
    assert got.usage.prompt_tokens == spelled.usage.prompt_tokens
    chunks = got.usage.model_extra["cachecraft"]["chunks"]
    assert [c["key"] for c in chunks] == [
        c["key"] for c in spelled.usage.model_extra["cachecraft"]["chunks"]
    ]
    assert [c["label"] for c in chunks] == [title, None]  # no id: the title names it
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": q}], "documents": [{"title": "t"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents.0.text"


def test_streaming_matches_non_streaming(url: str) -> None:
    q, docs = question(1)
    stream = client(url).chat.completions.create(
        model="cachecraft",
        messages=[{"role": "user", "content": q}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"documents": docs},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == ask(url, 1).choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_models_and_completions(url: str, small: LoadedModel) -> None:
    models = client(url).models.list()
    assert [m.id for m in models.data] == [small.name]
    out = client(url).completions.create(model=small.name, prompt="Say hello.", max_tokens=4)
    assert out.usage is not None and out.usage.completion_tokens >= 1
    assert isinstance(out.choices[0].text, str)


def test_metrics_lists_everything(url: str) -> None:
    ask(url, 2)
    text = httpx.get(url + "/metrics").text
    for name in (
        "cachecraft_requests_total",
        "cachecraft_ttft_seconds_bucket",
        "cachecraft_request_latency_seconds_bucket",
        "cachecraft_prompt_tokens_computed_total",
        "cachecraft_prompt_tokens_reused_total",
        "cachecraft_chunk_hits_total",
        "cachecraft_chunk_misses_total",
        "cachecraft_store_bytes",
        "cachecraft_store_evictions",
        "cachecraft_queue_length",
    ):
        assert name in text, name
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_stop_strings_end_the_answer_before_them(url: str, small: LoadedModel) -> None:
    full = ask(url, 3, max_tokens=24, ignore_eos=True).choices[0].message.content
    words = full.split()
    assert len(words) >= 3, full
    stop = words[len(words) // 2]  # a word in the middle: the answer must end just before it
    cut = full.index(stop)
    out = ask(url, 3, max_tokens=24, ignore_eos=True, stop=[stop, "\u2603never"])
    assert out.choices[0].message.content == full[:cut].rstrip()
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 24  # the engine stopped decoding, not just the text
    q, docs = question(3)
    stream = client(url).chat.completions.create(
        model="cachecraft",
        messages=[{"role": "user", "content": q}],
        max_tokens=24,
        stream=True,
        stop=stop,
        extra_body={"documents": docs, "ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full[:cut] and stop not in text
    assert chunks[-1].choices[0].finish_reason == "stop"

    # the offline path (LLM.generate / LLM.answer) cuts the same way
    q, docs = question(3)
    request = RagRequest(q, [Chunk(d["text"], d["id"]) for d in docs])
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=stop)
    offline = LLM(small, store=MemoryStore(1 << 30)).answer(request, params, "full")
    assert offline.text == full[:cut].rstrip() and offline.finish_reason == "stop"
    assert len(offline.token_ids) == out.usage.completion_tokens < 24


def test_text_stream_holds_back_a_possible_stop_string(small: LoadedModel) -> None:
    tok = small.tokenizer
    ids = tok.encode("The river flows north. END of story", add_special_tokens=False)
    stream = TextStream(tok, ("END", "north!"))
    deltas = [stream.add(i) for i in ids]
    assert "".join(deltas) == "The river flows north. " and stream.stopped
    assert stream.final_text() == "The river flows north." and stream.flush() == ""
    plain = TextStream(tok, ("north!",))
    shown = "".join(plain.add(i) for i in tok.encode("flows north", add_special_tokens=False))
    assert shown == "flows "  # "north" may begin the stop string "north!": held back
    assert shown + plain.flush() == "flows north" and not plain.stopped


BAD = [
    ("{not json", 400, "malformed JSON"),
    ('{"model": "cachecraft"}', 400, "messages"),
    ('{"model": "cachecraft", "messages": [{"role": "user", "content": 3}]}', 400, "content"),
    ('{"model": "cachecraft", "messages": [{"role": "user", "content": "q"}], "max_tokens": "9"}', 400, "max_tokens"),
    ('{"model": "cachecraft", "messages": [{"role": "user", "content": "q"}], "n": 9}', 400, "n"),
    ('{"model": "nope", "messages": [{"role": "user", "content": "q"}]}', 404, "nope"),
    ('{"model": "cachecraft", "messages": [{"role": "user", "content": " "}]}', 400, "question"),
    ('{"model": "cachecraft", "messages": [{"role": "user", "content": "q"}], "cachecraft_mode": "x"}', 400, "cachecraft_mode"),
    ('{"model": "cachecraft", "messages": [{"role": "user", "content": "q"}], "documents": [{"txt": "a"}]}', 400, "documents"),
    ('[1, 2]', 400, "body"),
    ('{"model": "cachecraft", "messages": [{"role": "user", "content": "q"}], "stop": ["a", ""]}', 400, "stop"),
    ('{"model": "cachecraft", "messages": [{"role": "user", "content": "q"}], "stop": 7}', 400, "stop"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "needle"), BAD)
def test_bad_input(url: str, body: str, status: int, needle: str) -> None:
    r = httpx.post(
        url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_limits_and_context(url: str) -> None:
    c = client(url)
    msgs = [{"role": "user", "content": "q"}]
    with pytest.raises(openai.BadRequestError, match="at most 4"):
        c.chat.completions.create(
            model="cachecraft", messages=msgs, extra_body={"documents": [{"text": "x"}] * 5}
        )
    with pytest.raises(openai.APIStatusError, match="at most 400") as too_large:
        c.chat.completions.create(
            model="cachecraft", messages=msgs, extra_body={"documents": [{"text": "x" * 401}]}
        )
    assert too_large.value.status_code == 413
    long = " ".join(["word"] * 700)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="cachecraft", messages=[{"role": "user", "content": long}])
    assert f"context is {CTX} tokens" in str(info.value) and "prompt needs" in str(info.value)
    # a max_tokens past the room the prompt leaves is cut to that room, not refused
    near = " ".join(["word"] * 480)
    out = c.chat.completions.create(
        model="cachecraft",
        messages=[{"role": "user", "content": near}],
        max_tokens=10_000,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == CTX + 1
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4", prompt="hi")
    assert ask(url, 3).choices[0].message.content is not None  # still alive


def test_concurrent_clients_match_sequential(url: str, small: LoadedModel) -> None:
    refs = [reference(small, i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: ask(url, i).choices[0].message.content, range(8)))
    assert outs == refs


def test_cfo_one_answers_like_full(small: LoadedModel) -> None:
    # float32 storage: the one exact reuse (first chunk) then splices bit-identical K/V
    forced = ReuseConfig(alpha=1e9)
    exact = StoreConfig(storage_dtype="float32")
    with start_server("cachecraft", loaded=small, reuse=forced, store=exact) as base:
        r = httpx.post(base + "/v1/chunks", json={"documents": [{"text": t} for t in DOCS]})
        assert r.status_code == 200 and all(row["stored"] for row in r.json()["data"])
        for i in range(4):
            out = ask(base, i)
            report = out.usage.model_extra["cachecraft"]
            assert report["mode"] == "cachecraft"
            assert all(c["is_hit"] for c in report["chunks"]), report
            # the first chunk sits where it was cached (after the system prompt only): an exact
            # reuse, CFO 0; every later chunk has a new prefix and is recomputed in full
            later = report["chunks"][1:]
            assert all(c["tokens_recomputed"] == c["num_tokens"] for c in later), report
            assert out.choices[0].message.content == reference(small, i)


def test_api_keys_and_namespaces(small: LoadedModel) -> None:
    keys = ServerConfig(api_keys=("k1", "k2"))
    with start_server("cachecraft", loaded=small, server=keys) as base:
        with pytest.raises(openai.AuthenticationError):
            client(base, "wrong").models.list()
        assert httpx.get(base + "/v1/models").status_code == 401
        assert len(client(base, "k1").models.list().data) == 1
        h1, h2 = ({"authorization": f"Bearer {k}"} for k in ("k1", "k2"))
        body = {"documents": [{"id": "p", "text": DOCS[0]}], "pin": True}
        row = httpx.post(base + "/v1/chunks", json=body, headers=h1).json()["data"][0]
        key = row["chunk_key"]
        assert row["pinned"]
        listed = httpx.get(base + "/v1/chunks", headers=h1).json()
        assert [c["chunk_key"] for c in listed["data"]] == [key]
        assert listed["data"][0]["num_variants"] == 1 and listed["stats"] is not None
        assert httpx.get(base + "/v1/chunks", headers=h2).json()["data"] == []
        assert httpx.delete(f"{base}/v1/chunks/{key}", headers=h2).status_code == 404
        assert httpx.delete(f"{base}/v1/chunks/{key}", headers=h1).json()["num_variants"] >= 1
        assert httpx.get(base + "/v1/chunks", headers=h1).json()["data"] == []


def test_pin_cap_per_namespace(small: LoadedModel) -> None:
    llm = LLM(small, store=MemoryStore(1 << 30))
    (one,) = llm.precompute([Chunk(DOCS[0], "p")])
    loaded = llm.store.load(one)
    assert loaded is not None
    cap = loaded.nbytes * 3 // 2  # one of these documents fits, two do not
    keys = ServerConfig(api_keys=("k1", "k2"))
    store = StoreConfig(max_pinned_bytes_per_namespace=cap)
    with start_server("cachecraft", loaded=small, server=keys, store=store) as base:
        h1, h2 = ({"authorization": f"Bearer {k}"} for k in ("k1", "k2"))

        def pin(doc: str, headers: dict[str, str]) -> httpx.Response:
            body = {"documents": [{"id": "p", "text": doc}], "pin": True}
            return httpx.post(base + "/v1/chunks", json=body, headers=headers, timeout=60)

        assert pin(DOCS[0], h1).json()["data"][0]["pinned"]
        refused = pin(DOCS[1], h1)
        assert refused.status_code == 400
        message = refused.json()["error"]["message"]
        assert "max_pinned_bytes_per_namespace" in message and "Traceback" not in message
        assert pin(DOCS[1], h2).json()["data"][0]["pinned"]  # k2 is another tenant
        listed = httpx.get(base + "/v1/chunks", headers=h1).json()
        assert listed["stats"]["num_pinned"] == 1


def test_backpressure_and_disconnect(small: LoadedModel) -> None:
    tight = EngineConfig(token_budget=512, max_running=1, max_queue=1)
    with start_server("full", loaded=small, engine=tight) as base:
        body = {
            "model": "cachecraft",
            "messages": [{"role": "user", "content": "Count."}],
            "max_tokens": 5000,  # clamped to the context left: ~480 tokens
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.Client(base_url=base, timeout=60) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: ")  # running now
                waiter = threading.Thread(target=lambda: ask(base, 0, max_tokens=2))
                waiter.start()
                wait_until(lambda: http.get("/health").json()["num_waiting"] == 1)
                r = http.post("/v1/chat/completions", json={**body, "stream": False})
                assert r.status_code == 429 and r.headers["retry-after"] == "1"
            # the stream is closed mid-answer: its request is freed and the waiter runs
            waiter.join(60)
            assert not waiter.is_alive()
            wait_until(lambda: http.get("/health").json()["num_running"] == 0)
            assert "cachecraft_requests_aborted_total 1.0" in http.get("/metrics").text


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_setting_given_twice_is_an_error() -> None:
    from cachecraft.server.launch import build_stack

    with pytest.raises(ValueError, match="mode given twice"):
        build_stack("full", engine=EngineConfig(mode="prefix"))
    with pytest.raises(ValueError, match="give the model once"):
        build_stack(model="x", loaded=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        EngineConfig(512, 1, 1)  # type: ignore[misc]  # keyword only


def test_a_conversation_reuses_its_earlier_turns_exactly(small: LoadedModel) -> None:
    """Earlier turns are chunk-caches (server/generation.py `history_chunks`): the third request
    of a chat finds the turns the second one computed, in the same place after the same
    system prompt, and reuses them exactly; its answer is the one a full prefill gives."""
    exact = StoreConfig(storage_dtype="float32")  # exact reuse splices bit-identical K/V
    long_turn = " ".join(DOCS) * 3  # >= 512 characters: laid out as the question, in blocks
    chat = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": long_turn},
        {"role": "assistant", "content": "Those are four facts."},
        {"role": "user", "content": "Which river?"},
        {"role": "assistant", "content": "The Nile."},
        {"role": "user", "content": "And the mountain?"},
    ]
    with (
        start_server("cachecraft", loaded=small, store=exact) as base,
        start_server("full", loaded=small) as full,
    ):

        def turn(url: str, n: int) -> openai.types.chat.ChatCompletion:
            return client(url).chat.completions.create(
                model="cachecraft", messages=chat[:n], max_tokens=6, temperature=0
            )

        second = turn(base, 4).usage.model_extra["cachecraft"]
        labels = [c["label"] for c in second["chunks"]]
        # the long turn alone (its 64-token blocks and the rest), then the reply
        assert len(labels) >= 3 and labels[-1] == "messages[2]"
        assert all(label.startswith("messages[1][") for label in labels[:-1])
        assert not any(c["is_hit"] for c in second["chunks"]) and second["chunks"][0]["is_exact"]
        third = turn(base, 6)
        report = third.usage.model_extra["cachecraft"]
        # the short reply was the last, open chunk: it now holds the turns after it as well
        assert [c["label"] for c in report["chunks"]] == [*labels[:-1], "messages[2:5]"]
        *before, rest = report["chunks"]
        assert all(c["is_hit"] and c["is_exact"] and c["tokens_recomputed"] == 0 for c in before)
        assert not rest["is_hit"] and rest["is_exact"]
        reused = sum(c["num_tokens"] for c in before)
        assert third.usage.prompt_tokens_details.cached_tokens >= reused
        assert third.choices[0].message.content == turn(full, 6).choices[0].message.content


def test_a_tool_result_after_the_question_is_read_as_its_context(small: LoadedModel) -> None:
    """Retrieval as a tool: the user asks, the assistant calls a tool, the tool returns the
    passages, and the answer is asked for with the tool's result last. The result's passages
    are chunk-caches read before the question, as when the client sends the same turns with
    the question last; a passage a tool returned again for another question is reused."""
    passages = "\n\n".join(f"{d} " * 6 for d in DOCS[:2])  # two passages >= 256 characters
    ask = {"role": "user", "content": "Which river flows north?"}
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "search"}}],
    }
    result = {"role": "tool", "tool_call_id": "1", "content": passages}
    with start_server("cachecraft", loaded=small) as base:

        def send(*messages: dict[str, object]) -> dict[str, object]:
            body = {"messages": list(messages), "max_tokens": 6, "temperature": 0}
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        tool_last = send(ask, call, result)
        labels = [c["label"] for c in tool_last["usage"]["cachecraft"]["chunks"]]
        assert "messages[2].paragraphs[0]" in labels, labels  # a passage the tool returned
        question_last = send(call, result, ask)  # the same prompt, laid out the same way
        assert tool_last["usage"]["prompt_tokens"] == question_last["usage"]["prompt_tokens"]
        answer = tool_last["choices"][0]["message"]["content"]
        assert answer == question_last["choices"][0]["message"]["content"]
        other = send({"role": "user", "content": "What is the capital?"}, call, result)
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

        for tail in ([ask, call], [ask, result, {"role": "assistant", "content": "Well"}]):
            r = httpx.post(
                base + "/v1/chat/completions", json={"messages": tail, "max_tokens": 2}, timeout=60
            )
            assert r.status_code == 400 and "'assistant'" in r.json()["error"]["message"], r.text


def test_tokenize_counts_what_usage_counts_and_detokenize_inverts_it(url: str) -> None:
    """vLLM's /tokenize and /detokenize: the prompt a request would prefill (template and
    documents included), so its count is the request's `usage.prompt_tokens`."""
    q, docs = question(1)
    messages = [{"role": "user", "content": q}]
    body = {"messages": messages, "documents": docs}
    tok = httpx.post(url + "/tokenize", json=body, timeout=60).json()
    out = httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=60)
    assert tok["count"] == len(tok["tokens"]) == out.json()["usage"]["prompt_tokens"]
    assert tok["max_model_len"] == CTX and tok["token_strs"] is None
    text = httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]}, timeout=60).json()
    assert q in text["prompt"] and DOCS[1] in text["prompt"]
    one = httpx.post(url + "/tokenize", json={"prompt": q, "return_token_strs": True}, timeout=60)
    comp = httpx.post(url + "/v1/completions", json={"prompt": q, "max_tokens": 2}, timeout=60)
    assert one.json()["count"] == comp.json()["usage"]["prompt_tokens"]
    assert (
        "".join(one.json()["token_strs"])
        == httpx.post(
            url + "/detokenize", json={"tokens": one.json()["tokens"]}, timeout=60
        ).json()["prompt"]
    )
    for bad in ({}, {"prompt": q, "messages": messages}):
        assert httpx.post(url + "/tokenize", json=bad, timeout=60).status_code == 400
    r = httpx.post(url + "/detokenize", json={"tokens": [10**9]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
