"""Issue 13's probes as regression tests: no request stops the service, every error has
OpenAI's shape, limits answer 413, /health tells a dead or stuck engine, tenants see only
their own figures. A live server on the tiny random Llama; raw HTTP (httpx / http.client)
where the openai client would hide what is on the wire. Every call has a timeout, so a hang
fails the test instead of stalling the suite.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from conftest import make_tiny_dir

from cachecraft.engine.engine import Engine, EngineConfig
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.server.app import create_app
from cachecraft.server.config import ServerConfig
from cachecraft.server.launch import build_stack, close_stack, serve_app

CTX = 512
LIMITS = ServerConfig(
    max_documents=4,
    max_document_chars=400,
    max_prompt_chars=2000,
    max_request_bytes=64 * 1024,
    watchdog_s=0.5,
    api_keys=("key-a", "key-b"),
    admin_keys=("key-admin",),
)
A = {"Authorization": "Bearer key-a"}
ADMIN = {"Authorization": "Bearer key-admin"}
B = {"Authorization": "Bearer key-b"}
T = 60.0  # seconds: far beyond any answer here; reaching it means a hang
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = make_tiny_dir(tmp_path_factory.mktemp("tiny-faults"), max_position_embeddings=CTX)
    return load_model(str(path))


class Served:
    """A live server plus its engine and app (for fault injection and liveness checks)."""

    def __init__(self, url: str, engine: Engine, app: Any) -> None:
        self.url, self.engine, self.app = url, engine, app

    def post(self, path: str, body: Any = None, headers: dict | None = None) -> httpx.Response:
        h = {**A, **(headers or {})}
        if isinstance(body, bytes | str):
            h.setdefault("content-type", "application/json")
            return httpx.post(self.url + path, content=body, headers=h, timeout=T)
        return httpx.post(self.url + path, json=body, headers=h, timeout=T)

    def get(self, path: str, headers: dict | None = None) -> httpx.Response:
        return httpx.get(self.url + path, headers={**A, **(headers or {})}, timeout=T)

    def ok(self) -> None:
        """A plain request still gets its answer (the engine steps for everyone)."""
        r = self.post(CHAT, chat("still alive?"))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@contextlib.contextmanager
def serving(small: LoadedModel, config: ServerConfig = LIMITS, **kw: Any) -> Iterator[Served]:
    stack = build_stack("full", loaded=small, engine=EngineConfig(mode="full"), **kw)
    try:
        app = create_app(stack.engine, stack.store, config)
        with serve_app(app) as url:
            yield Served(url, stack.engine, app)
    finally:
        close_stack(stack)


@pytest.fixture(scope="module")
def srv(small: LoadedModel) -> Iterator[Served]:
    with serving(small) as s:
        yield s


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    body = {"model": "cachecraft", "messages": [{"role": "user", "content": content}]}
    return {**body, "max_tokens": 4, **extra}


def openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    """Assert the status and OpenAI's error shape; return the error object."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


# ---- defect 1: a huge seed ------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_out_of_range_seed_is_400_and_engine_lives(srv: Served, seed: int) -> None:
    err = openai_error(srv.post(CHAT, chat(temperature=0.7, seed=seed)), 400)
    assert "seed" in err["message"] and err["param"] == "seed"
    srv.ok()
    assert srv.get("/health").status_code == 200


def test_edge_seeds_are_served(srv: Served) -> None:
    for seed in (2**64 - 1, -(2**63), 0):
        r = srv.post(CHAT, chat(temperature=0.7, seed=seed))
        assert r.status_code == 200, r.text


# ---- defect 2: a tiny temperature -----------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-300, 1e-39, 1e-5])
def test_tiny_temperature_is_400_and_engine_lives(srv: Served, temperature: float) -> None:
    err = openai_error(srv.post(CHAT, chat(temperature=temperature)), 400)
    assert "temperature" in err["message"]
    srv.ok()


# ---- defect 3: lone surrogates --------------------------------------------------------------
SURROGATE_BODIES = {
    "message": '{"model":"cachecraft","max_tokens":2,"messages":[{"role":"user","content":"a\\ud800"}]}',
    "system": '{"model":"cachecraft","max_tokens":2,"messages":[{"role":"system","content":"\\udfff"},{"role":"user","content":"q"}]}',
    "part": '{"model":"cachecraft","max_tokens":2,"messages":[{"role":"user","content":[{"type":"text","text":"\\ud800"}]}]}',
    "doc_text": '{"model":"cachecraft","max_tokens":2,"messages":[{"role":"user","content":"q"}],"documents":[{"text":"\\ud800"}]}',
    "doc_id": '{"model":"cachecraft","max_tokens":2,"messages":[{"role":"user","content":"q"}],"documents":[{"id":"\\ud800","text":"t"}]}',
    "stream": '{"model":"cachecraft","max_tokens":2,"stream":true,"messages":[{"role":"user","content":"\\ud800"}]}',
    "stop": '{"model":"cachecraft","max_tokens":2,"stop":"\\ud800","messages":[{"role":"user","content":"q"}]}',
    "namespace": '{"model":"cachecraft","max_tokens":2,"cache_namespace":"\\ud800","messages":[{"role":"user","content":"q"}]}',
}


@pytest.mark.parametrize("field", sorted(SURROGATE_BODIES))
def test_lone_surrogates_are_400_on_chat(srv: Served, field: str) -> None:
    err = openai_error(srv.post(CHAT, SURROGATE_BODIES[field]), 400)
    # our check names the surrogate; a length-checked field fails inside pydantic first
    assert "surrogate" in err["message"] or "unicode string" in err["message"]


def test_lone_surrogates_are_400_on_completions_and_chunks(srv: Served) -> None:
    prompt = '{"model":"cachecraft","max_tokens":2,"prompt":"x\\ud800"}'
    openai_error(srv.post("/v1/completions", prompt), 400)
    for doc in ('{"text":"\\ud800"}', '{"id":"\\udc00","text":"fine"}'):
        openai_error(srv.post("/v1/chunks", '{"documents":[' + doc + "]}"), 400)
    openai_error(srv.post("/v1/chunks", '{"documents":[{"text":"t"}],"system":"\\ud800"}'), 400)
    # nothing half-stored: listing the namespace still works
    r = srv.get("/v1/chunks")
    assert r.status_code == 200 and all(
        d["id"] is None or d["id"].isprintable() for d in r.json()["data"]
    )
    srv.ok()


# ---- defect 4: a 500 keeps the connection --------------------------------------------------
def test_a_500_keeps_the_keep_alive_connection(small: LoadedModel) -> None:
    with serving(small, ServerConfig()) as s:

        def boom(_: Any) -> Any:
            raise RuntimeError("injected tokenizer fault")

        s.engine.runner.layout = boom  # type: ignore[method-assign]  # fault injection
        u = urlparse(s.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=T)
        body = json.dumps(chat())
        headers = {"content-type": "application/json"}
        conn.request("POST", CHAT, body, headers)
        first = conn.getresponse()
        data = json.loads(first.read())
        assert first.status == 500 and data["error"]["type"] == "server_error"
        assert "injected tokenizer fault" in data["error"]["message"]
        sock = conn.sock
        conn.request("GET", "/health")  # same connection: it must still be open
        second = conn.getresponse()
        second.read()
        assert second.status == 200 and conn.sock is sock
        conn.close()


# ---- defect 8: caps answer 413, before any work ---------------------------------------------
def test_caps_answer_413(srv: Served) -> None:
    err = openai_error(srv.post(CHAT, chat("x" * 2001)), 413)
    assert err["code"] == "prompt_too_large" and "max_prompt_chars" in err["message"]
    err = openai_error(
        srv.post("/v1/completions", {"model": "cachecraft", "prompt": "y" * 2001}), 413
    )
    assert err["param"] == "prompt"
    doc = {"documents": [{"text": "z" * 401}]}
    assert openai_error(srv.post(CHAT, chat(**doc)), 413)["code"] == "document_too_large"
    assert openai_error(srv.post("/v1/chunks", doc), 413)["code"] == "document_too_large"
    chunk_sys = {"documents": [{"text": "t"}], "system": "s" * 2001}
    assert openai_error(srv.post("/v1/chunks", chunk_sys), 413)["param"] == "system"
    # a body over max_request_bytes: refused by its Content-Length, and while streaming in
    big = json.dumps(chat("w" * 70_000))
    assert openai_error(srv.post(CHAT, big), 413)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192].encode()

    r = httpx.post(
        srv.url + CHAT,
        content=chunks(),
        headers={**A, "content-type": "application/json"},
        timeout=T,
    )
    assert openai_error(r, 413)["code"] == "request_too_large"
    srv.ok()


def test_tokenization_runs_off_the_engine_thread(
    srv: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = srv.engine.runner.loaded.tokenizer
    threads: list[str] = []
    real = type(tokenizer).__call__

    def spy(self: Any, *args: Any, **kw: Any) -> Any:
        import threading

        threads.append(threading.current_thread().name)
        return real(self, *args, **kw)

    monkeypatch.setattr(type(tokenizer), "__call__", spy)
    doc = {"documents": [{"id": "d", "text": "The Nile flows north."}]}
    assert srv.post(CHAT, chat("q?", **doc)).status_code == 200
    assert srv.post("/v1/chunks", doc).status_code == 200
    assert threads, "the spy saw no tokenization"
    assert not [t for t in threads if t == "cachecraft-engine"], threads


# ---- defect 9: liveness ----------------------------------------------------------------------
def test_health_says_503_while_the_engine_is_stuck(
    srv: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One unit of work that holds the step thread until released (an event, not a sleep),
    the watchdog's clock moved by hand: within watchdog_s /health stays 200, past it 503."""
    assert srv.get("/health").status_code == 200
    now = [1000.0]
    monkeypatch.setattr(srv.engine, "clock", lambda: now[0])
    started, release = threading.Event(), threading.Event()

    def stuck() -> None:
        started.set()
        assert release.wait(T)

    future = srv.engine.call(stuck)
    assert started.wait(T)
    now[0] += 0.4  # busy, within watchdog_s (0.5)
    assert srv.get("/health").status_code == 200
    now[0] += 0.2  # past it
    r = srv.get("/health")
    assert r.status_code == 503 and "busy" in r.json()["reason"]
    probes = [("HEAD", "/health"), ("GET", "/ping"), ("POST", "/ping")]  # uptime checkers, vLLM
    assert [httpx.request(m, srv.url + p, timeout=T).status_code for m, p in probes] == [503] * 3
    release.set()
    future.result(T)
    assert srv.get("/health").status_code == 200
    answers = [httpx.request(m, srv.url + p, timeout=T) for m, p in probes]
    assert [r.status_code for r in answers] == [200] * 3
    assert answers[0].content == b"" and answers[1].json()["status"] == "ok"


def test_health_says_503_and_requests_end_when_the_engine_is_dead(small: LoadedModel) -> None:
    with serving(small, ServerConfig()) as s:
        s.ok()
        s.engine.stop()
        r = s.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        openai_error(s.post(CHAT, chat()), 503)
        openai_error(s.post("/v1/chunks", {"documents": [{"text": "t"}]}), 503)


# ---- defect 10: tenants --------------------------------------------------------------------
def test_metrics_need_the_admin_key_unless_public(srv: Served, small: LoadedModel) -> None:
    openai_error(httpx.get(srv.url + "/metrics", timeout=T), 401)
    err = openai_error(srv.get("/metrics"), 403)  # a tenant's key: store-wide figures are not its
    assert "admin" in err["message"] and err["code"] == "admin_key_required"
    assert srv.get("/metrics", headers=ADMIN).status_code == 200
    public = ServerConfig(api_keys=("k",), metrics_public=True)
    with serving(small, public) as s:
        assert httpx.get(s.url + "/metrics", timeout=T).status_code == 200


def test_chunk_stats_cover_only_the_callers_namespace(srv: Served) -> None:
    pinned = {"documents": [{"id": "a-doc", "text": "Only tenant A knows this."}], "pin": True}
    rows = srv.post("/v1/chunks", pinned).json()["data"]
    assert rows[0]["pinned"] and rows[0]["stored"]
    mine = srv.get("/v1/chunks").json()["stats"]
    theirs = srv.get("/v1/chunks", headers=B).json()
    assert mine["pinned_bytes"] > 0 and mine["num_pinned"] >= 1
    assert theirs["data"] == [] and theirs["stats"]["pinned_bytes"] == 0
    assert theirs["stats"]["num_chunks"] == 0


# ---- defect 11: API edges ------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [
        ("top_logprobs", 3),  # without logprobs: true
        ("top_logprobs", 21),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("response_format", {"type": "json_object"}),
        ("logit_bias", {"x": 5}),
        ("logit_bias", {"42": 101}),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
    ],
)
def test_unsupported_or_invalid_chat_fields_are_named(srv: Served, field: str, value: Any) -> None:
    err = openai_error(srv.post(CHAT, chat(**{field: value})), 400)
    assert err["param"] == field and field in err["message"]


def test_tools_offered_with_tool_choice_none_are_answered_without_a_call(srv: Served) -> None:
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    plain = srv.post(CHAT, chat(max_tokens=4, temperature=0)).json()
    got = srv.post(CHAT, chat(max_tokens=4, temperature=0, tools=tools, tool_choice="none"))
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    for extra in ({"tool_choice": "auto"}, {}):
        err = openai_error(srv.post(CHAT, chat(tools=tools, **extra)), 400)
        assert err["param"] == "tools", err


@pytest.mark.parametrize(
    "field, value", [("best_of", 2), ("suffix", "end"), ("logprobs", 21), ("tools", [{}])]
)
def test_unsupported_completion_fields_are_named(srv: Served, field: str, value: Any) -> None:
    body = {"model": "cachecraft", "prompt": "p", "max_tokens": 2, field: value}
    err = openai_error(srv.post("/v1/completions", body), 400)
    assert err["param"] == field


@pytest.mark.parametrize("field, value", [("top_k", -5), ("top_k", 1.5), ("min_p", 2.0)])
def test_bad_vllm_sampling_fields_are_named(srv: Served, field: str, value: Any) -> None:
    err = openai_error(srv.post(CHAT, chat(**{field: value})), 400)
    assert err["param"] == field


def test_top_k_one_samples_the_greedy_answer(srv: Served) -> None:
    greedy = srv.post(CHAT, chat(max_tokens=6, temperature=0, ignore_eos=True)).json()
    for seed in (1, 2):
        hot = chat(max_tokens=6, temperature=2.0, top_k=1, seed=seed, ignore_eos=True)
        got = srv.post(CHAT, hot).json()
        assert got["choices"][0]["message"] == greedy["choices"][0]["message"]


def test_harmless_defaults_of_unsupported_fields_pass(srv: Served) -> None:
    extra = {"logprobs": False, "presence_penalty": 0, "response_format": {"type": "text"}}
    assert srv.post(CHAT, chat(**extra, user="u1")).status_code == 200


def test_framework_errors_have_the_openai_shape(srv: Served) -> None:
    err = openai_error(srv.post(CHAT, b"\xff\xfe{not utf-8"), 400)
    assert err["type"] == "invalid_request_error"
    openai_error(srv.post(CHAT, b'{"model": '), 400)
    assert openai_error(srv.get("/v1/nothing-here"), 404)["code"] == "not_found"
    assert openai_error(srv.get(CHAT), 405)["code"] == "method_not_allowed"
    r = httpx.delete(srv.url + "/v1/chunks/", headers=A, timeout=T)
    assert r.status_code in (404, 405) and "error" in r.json()  # never a 307 elsewhere
    r = httpx.get(
        srv.url + "/v1/chunks", params={"cache_namespace": "n" * 129}, headers=A, timeout=T
    )
    assert openai_error(r, 400)["param"] == "cache_namespace"
    openai_error(httpx.get(srv.url + "/v1/models", timeout=T), 401)
