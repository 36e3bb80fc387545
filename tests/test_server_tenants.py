"""Issue 56's tenancy defects as regression tests, on a live server over the tiny random Llama:
5, one API key pins within one budget whatever namespaces it uses; 6, store-wide figures,
/metrics and the API's docs are the operator's (a caller without a key learns only whether
the server is up); 7, a pin that will not outlive a restart says `durable: false`, a
completion's prompt list has a count cap, OpenAI fields are honoured or refused by name and
`logit_bias` keys that are not token ids are named."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import make_tiny_dir
from test_server_faults import CHAT, CTX, Served, T, chat, openai_error, serving

from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.server.config import ServerConfig
from cachecraft.server.launch import start_server
from cachecraft.store.config import StoreConfig
from cachecraft.store.redis_server import RedisServer

KEYS = ServerConfig(api_keys=("key-a", "key-b"), admin_keys=("key-admin",))
B = {"Authorization": "Bearer key-b"}
ADMIN = {"Authorization": "Bearer key-admin"}
FR = {"id": "fr", "text": "Paris is the capital of France."}
DE = {"id": "de", "text": "Berlin is the capital of Germany."}
PIN_CAP = 6000  # one of FR's or DE's chunk-caches (4,096 bytes each) fits, two do not


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = make_tiny_dir(tmp_path_factory.mktemp("tiny-tenants"), max_position_embeddings=CTX)
    return load_model(str(path))


@pytest.fixture(scope="module")
def srv(small: LoadedModel) -> Iterator[Served]:
    with serving(small, KEYS, store=StoreConfig(max_pinned_bytes_per_namespace=PIN_CAP)) as s:
        yield s


def pin(s: Served, doc: dict[str, str], headers: dict | None = None, **extra: Any):
    return s.post("/v1/chunks", {"documents": [doc], "pin": True, **extra}, headers)


# ---- defect 5: one tenant, one budget --------------------------------------------------------
def test_a_key_pins_within_one_budget_across_its_namespaces(srv: Served) -> None:
    first = pin(srv, FR, cache_namespace="team-1")
    assert first.status_code == 200 and first.json()["data"][0]["pinned"], first.text
    err = openai_error(pin(srv, DE, cache_namespace="team-2"), 400)  # another namespace
    assert err["code"] == "pin_limit" and err["param"] == "documents.0"
    openai_error(pin(srv, DE), 400)  # nor its default namespace
    other = pin(srv, DE, B, cache_namespace="team-2")  # key-b is another tenant
    assert other.status_code == 200 and other.json()["data"][0]["pinned"], other.text


# ---- defect 6: store-wide figures are the operator's -----------------------------------------
def test_health_without_a_key_says_only_whether_the_server_is_up(srv: Served) -> None:
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        r = httpx.request(method, srv.url + path, timeout=T)
        assert r.status_code == 200 and r.json() == {"status": "ok", "reason": None}, r.text
    assert httpx.head(srv.url + "/health", timeout=T).status_code == 200


def test_a_tenant_sees_its_own_figures_and_the_operator_the_stores(srv: Served) -> None:
    assert pin(srv, FR, B, cache_namespace="b-only").status_code in (200, 400)
    mine = srv.get("/health").json()
    assert mine["status"] == "ok" and mine["model"]
    assert not {"tiers", "num_waiting", "num_running", "num_steps"} & set(mine), mine
    theirs = srv.get("/health", headers=B).json()["tenant"]
    assert theirs["num_pinned"] >= 1 and theirs["pinned_bytes"] > 0
    assert mine["tenant"]["pinned_bytes"] <= PIN_CAP
    admin = srv.get("/health", headers=ADMIN).json()
    assert {"tiers", "num_waiting", "num_running"} <= set(admin), admin
    openai_error(httpx.get(srv.url + "/metrics", timeout=T), 401)
    assert openai_error(srv.get("/metrics"), 403)["code"] == "admin_key_required"
    assert "cachecraft_store_bytes" in srv.get("/metrics", headers=ADMIN).text
    openai_error(srv.post(CHAT, chat(), ADMIN), 401)  # the admin key is not a tenant's


def test_docs_are_off_while_keys_are_set_unless_asked(small: LoadedModel, srv: Served) -> None:
    for path in ("/openapi.json", "/docs", "/redoc"):
        openai_error(srv.get(path, ADMIN), 404)
    with serving(small, ServerConfig(api_keys=("k",), public_docs=True)) as s:
        assert httpx.get(s.url + "/openapi.json", timeout=T).json()["paths"]
        assert httpx.get(s.url + "/docs", timeout=T).status_code == 200


def test_health_says_degraded_while_a_tier_is_unreachable(small: LoadedModel) -> None:
    with RedisServer() as redis:
        store = StoreConfig(redis_url=redis.url)
        with serving(small, KEYS, store=store) as s:
            assert httpx.get(s.url + "/health", timeout=T).json()["status"] == "ok"
            redis.stop()
            r = httpx.get(s.url + "/health", timeout=T)
            assert r.status_code == 200 and r.json()["status"] == "degraded", r.text
            assert set(r.json()) == {"status", "reason"}  # no tier named to a caller without a key
            s.ok()  # requests are still answered


# ---- defect 7: the smaller ones --------------------------------------------------------------
def test_a_pin_that_will_not_survive_a_restart_says_so(small: LoadedModel, tmp_path: Path) -> None:
    roomy = StoreConfig(cache_dir=str(tmp_path / "roomy"), doorkeeper_threshold=1)
    with start_server("full", loaded=small, store=roomy) as url:
        row = httpx.post(url + "/v1/chunks", json={"documents": [FR], "pin": True}, timeout=T)
        assert row.json()["data"][0]["durable"] is True, row.text
    # a disk too small for the chunk-cache: pinned in memory, not on disk
    tight = StoreConfig(cache_dir=str(tmp_path / "tight"), doorkeeper_threshold=1, disk_bytes=1000)
    with start_server("full", loaded=small, store=tight) as url:
        row = httpx.post(url + "/v1/chunks", json={"documents": [FR], "pin": True}, timeout=T)
        data = row.json()["data"][0]
        assert data["pinned"] is True and data["durable"] is False, row.text
    with start_server("full", loaded=small, store=tight) as url:  # and it is gone: as said
        listed = httpx.get(url + "/v1/chunks", timeout=T).json()["data"]
        assert not any(d["pinned"] for d in listed), listed
    with start_server("full", loaded=small) as url:  # no disk tier: nothing outlives a restart
        row = httpx.post(url + "/v1/chunks", json={"documents": [DE], "pin": True}, timeout=T)
        assert row.json()["data"][0]["durable"] is False, row.text


def test_a_prompt_list_has_a_count_cap(srv: Served) -> None:
    many = {"model": "cachecraft", "prompt": ["x"] * 32000, "max_tokens": 1}
    err = openai_error(srv.post("/v1/completions", many), 400)
    assert err["param"] == "prompt" and err["code"] == "too_many_prompts"
    assert "max_prompts" in err["message"]
    few = {"model": "cachecraft", "prompt": ["x", "y"], "max_tokens": 1}
    assert len(srv.post("/v1/completions", few).json()["choices"]) == 2


@pytest.mark.parametrize(
    "field, value",
    [
        ("web_search_options", {}),
        ("reasoning_effort", "low"),
        ("service_tier", "flex"),
        ("store", True),
        ("metadata", {"k": "v"}),
        ("verbosity", "low"),
    ],
)
def test_openai_fields_this_server_cannot_honour_are_named(
    srv: Served, field: str, value: Any
) -> None:
    err = openai_error(srv.post(CHAT, chat(**{field: value})), 400)
    assert err["param"] == field and err["code"] == "unsupported_field", err


def test_openai_fields_with_nothing_to_do_are_accepted(srv: Served) -> None:
    harmless = {
        "store": False,
        "service_tier": "auto",
        "metadata": {},
        "user": "u-1",
        "safety_identifier": "s-1",
        "prompt_cache_key": "c-1",
    }
    body = chat(**harmless)
    body["messages"][0]["name"] = "alice"
    assert srv.post(CHAT, body).status_code == 200


@pytest.mark.parametrize("where", ["user", "name", "extra", "nested_extra"])
def test_lone_surrogates_in_ignored_fields_are_refused(srv: Served, where: str) -> None:
    body = chat()
    if where == "user":
        body["user"] = "\ud800"
    elif where == "name":
        body["messages"][0]["name"] = "\ud800"
    elif where == "extra":
        body["x_client_tag"] = "a\udfffb"
    else:
        body["messages"][0]["tool_calls"] = [{"id": "\ud800"}]
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as a \\u escape
    err = openai_error(srv.post(CHAT, raw), 400)
    assert "lone surrogate" in err["message"], err


@pytest.mark.parametrize("key", ["²", "x", "-1", "1.5", " 7"])
def test_a_logit_bias_key_must_be_a_token_id(srv: Served, key: str) -> None:
    err = openai_error(srv.post(CHAT, chat(logit_bias={key: 1})), 400)
    assert "must be a token id" in err["message"] and err["param"] == "logit_bias", err
