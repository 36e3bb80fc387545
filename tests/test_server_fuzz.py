"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (issue 13).

Bodies are drawn with hypothesis from the schemas FastAPI publishes (`openapi_strategies`:
the fuzz follows the API as it changes), then also broken on purpose: a field replaced by any JSON
value or dropped, lone surrogates, raw bytes, odd query strings and path keys. The invariant
for every case: no 5xx, an OpenAI-shaped error for every 4xx, and the server still healthy and
answering afterwards. Generated max_tokens are capped at 16 (cost only: every other field is
as drawn). CI size by default (50 cases per test, derandomized, so `make test` is repeatable);
CACHECRAFT_FUZZ_EXAMPLES=N runs N cases per test, and CACHECRAFT_FUZZ_REPORT=path writes the
count of cases per route and status there (the issue's measurement table).
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from conftest import make_tiny_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_strategies import ANY_JSON, TEXT, from_schema

from cachecraft.engine.engine import EngineConfig
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.server.app import create_app
from cachecraft.server.config import ServerConfig
from cachecraft.server.launch import build_stack, close_stack, serve_app
from cachecraft_bench.modes import LAB_MODES as MODES

EXAMPLES = int(os.environ.get("CACHECRAFT_FUZZ_EXAMPLES", "50"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="CACHECRAFT_FUZZ_EXAMPLES" not in os.environ,
    database=None,
    suppress_health_check=list(HealthCheck),
)
KEY = {"Authorization": "Bearer fuzz-key"}
CONFIG = ServerConfig(
    api_keys=("fuzz-key",), max_documents=4, max_document_chars=2000, max_prompt_chars=4000
)
SEEN: collections.Counter[tuple[str, int]] = collections.Counter()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    path = make_tiny_dir(tmp_path_factory.mktemp("tiny-fuzz"), max_position_embeddings=256)
    loaded: LoadedModel = load_model(str(path))
    stack = build_stack("cachecraft", loaded=loaded, engine=EngineConfig(max_queue=8))
    try:
        app = create_app(stack.engine, stack.store, CONFIG)
        with serve_app(app) as url:
            yield url, app.openapi()
    finally:
        close_stack(stack)
        report = os.environ.get("CACHECRAFT_FUZZ_REPORT")
        if report:
            rows = [{"route": r, "status": s, "cases": n} for (r, s), n in sorted(SEEN.items())]
            with open(report, "w") as fh:
                json.dump(rows, fh, indent=1)


def bodies(spec: dict[str, Any], name: str) -> st.SearchStrategy[Any]:
    """Schema-valid bodies; most name our model and a known mode (a random `model` is a
    404 every time, and the point is to reach generation with everything else drawn)."""
    schema = spec["components"]["schemas"][name]

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        body = draw(from_schema(schema, spec))
        if "model" in body:
            body["model"] = "cachecraft"
        if isinstance(body.get("messages"), list) and draw(st.booleans()):
            body["messages"].append({"role": "user", "content": draw(st.text(max_size=30))})
        if body.get("cachecraft_mode") is not None and draw(st.booleans()):
            body["cachecraft_mode"] = draw(st.sampled_from(MODES))
        return body

    return build()


def capped(body: Any) -> Any:
    if isinstance(body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(field), int) and body[field] > 16:
                body[field] = 16
    return body


JSON = ANY_JSON
WILD_TEXT = st.text(TEXT, max_size=40)  # surrogates included


def broken(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A valid body with one field replaced by any JSON / wild text, or dropped."""

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        body = draw(valid)
        if not isinstance(body, dict) or not body:
            return body
        key = draw(st.sampled_from(sorted(body)))
        how = draw(st.sampled_from(["replace", "wild", "drop"]))
        if how == "drop":
            del body[key]
        else:
            body[key] = draw(JSON if how == "replace" else WILD_TEXT)
        return body

    return build()


def check(url: str, route: str, response: httpx.Response) -> None:
    SEEN[(route, response.status_code)] += 1
    assert response.status_code < 500, (route, response.status_code, response.text[:500])
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        assert "server_error" not in response.text, response.text[:500]
    else:
        response.json()
    health = httpx.get(url + "/health", timeout=30)
    assert health.status_code == 200, health.text


def post(url: str, route: str, body: Any) -> None:
    data = json.dumps(capped(body)).encode()  # ensure_ascii: surrogates travel as \\u escapes
    headers = {**KEY, "content-type": "application/json"}
    check(url, route, httpx.post(url + route, content=data, headers=headers, timeout=60))


ROUTES = [
    ("/v1/chat/completions", "ChatCompletionRequest"),
    ("/v1/completions", "CompletionRequest"),
    ("/v1/responses", "ResponsesRequest"),
    ("/v1/chunks", "ChunksRequest"),
    ("/tokenize", "TokenizeRequest"),
    ("/detokenize", "DetokenizeRequest"),
]


def test_openapi_operation_ids_are_unique(server: tuple[str, dict]) -> None:
    """Clients generated from the schema name a method per operation ID: two the same break
    them (GET and HEAD of /health once shared one)."""
    _, spec = server
    ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert ids and len(ids) == len(set(ids))
    assert {"get", "head"} <= set(spec["paths"]["/health"])
    assert {"get", "post"} <= set(spec["paths"]["/ping"])


@pytest.mark.parametrize("route, schema", ROUTES)
def test_schema_valid_bodies(server: tuple[str, dict], route: str, schema: str) -> None:
    url, spec = server

    @FUZZ
    @given(body=bodies(spec, schema))
    def case(body: Any) -> None:
        post(url, route, body)

    case()


@pytest.mark.parametrize("route, schema", ROUTES)
def test_broken_bodies(server: tuple[str, dict], route: str, schema: str) -> None:
    url, spec = server

    @FUZZ
    @given(body=broken(bodies(spec, schema)) | JSON)
    def case(body: Any) -> None:
        post(url, route, body)

    case()


def test_raw_bytes_and_queries(server: tuple[str, dict]) -> None:
    url, _ = server

    @FUZZ
    @given(
        raw=st.binary(max_size=64), text=WILD_TEXT, route=st.sampled_from([r for r, _ in ROUTES])
    )
    def case(raw: bytes, text: str, route: str) -> None:
        headers = {**KEY, "content-type": "application/json"}
        check(url, route, httpx.post(url + route, content=raw, headers=headers, timeout=60))
        q = quote(text.encode("utf-8", "surrogatepass"), safe="")
        check(
            url,
            "GET /v1/chunks?",
            httpx.get(f"{url}/v1/chunks?cache_namespace={q}", headers=KEY, timeout=60),
        )
        r = httpx.delete(f"{url}/v1/chunks/{q}", headers=KEY, timeout=60)
        check(url, "DELETE /v1/chunks/{key}", r)

    case()


def test_alive_and_answering_after_the_fuzz(server: tuple[str, dict]) -> None:
    url, _ = server
    body = {
        "model": "cachecraft",
        "messages": [{"role": "user", "content": "ok?"}],
        "max_tokens": 4,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=KEY, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    assert sum(SEEN.values()) > 0
