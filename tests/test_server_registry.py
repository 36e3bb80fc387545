"""The chunk registry (`registry.sqlite`) against the store and against other replicas: real
servers on a tiny random Llama over real cache directories, the real `cachecraft chunks` CLI."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import make_tiny_dir
from test_server_faults import CTX, T, openai_error

from cachecraft.engine.engine import EngineConfig
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.server.app import create_app
from cachecraft.server.launch import build_stack, close_stack, serve_app, start_server
from cachecraft.server.registry import REGISTRY_FILE, ChunkRegistry, open_registry
from cachecraft.store.base import ChunkStore
from cachecraft.store.cli import chunks_command
from cachecraft.store.config import StoreConfig
from cachecraft.store.redis_server import RedisServer

FR = {"id": "fr", "text": "Paris is the capital of France."}
DE = {"id": "de", "text": "Berlin is the capital of Germany."}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = make_tiny_dir(tmp_path_factory.mktemp("tiny-registry"), max_position_embeddings=CTX)
    return load_model(str(path))


def store_in(tmp_path: Path) -> StoreConfig:
    return StoreConfig(cache_dir=str(tmp_path / "cache"), doorkeeper_threshold=1)


def cli(*args: str) -> None:
    """The real `cachecraft` command, in its own process."""
    done = subprocess.run(
        [sys.executable, "-m", "cachecraft.cli", *args], capture_output=True, text=True, timeout=T
    )
    assert done.returncode == 0, done.stderr


def post(url: str, documents: list[dict[str, str]], **extra: Any) -> list[dict[str, Any]]:
    r = httpx.post(url + "/v1/chunks", json={"documents": documents, **extra}, timeout=T)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def listed(url: str, query: str = "") -> dict[str, Any]:
    r = httpx.get(url + "/v1/chunks" + query, timeout=T)
    assert r.status_code == 200, r.text
    return r.json()


def ids(url: str, query: str = "") -> list[str]:
    return [d["id"] for d in listed(url, query)["data"]]


@contextlib.contextmanager
def replica_stack(small: LoadedModel, store: StoreConfig) -> Iterator[tuple[str, ChunkStore]]:
    """One server process's app (engine, store, registry) over a shared cache directory:
    its URL and its store."""
    stack = build_stack("full", loaded=small, store=store, engine=EngineConfig(mode="full"))
    registry = open_registry(store)
    try:
        with serve_app(create_app(stack.engine, stack.store, None, registry)) as url:
            yield url, stack.store
    finally:
        close_stack(stack)
        registry.close()


@contextlib.contextmanager
def replica(small: LoadedModel, store: StoreConfig) -> Iterator[str]:
    with replica_stack(small, store) as (url, _):
        yield url


def test_chunks_removed_by_the_cli_are_not_listed_after_a_restart(
    small: LoadedModel, tmp_path: Path
) -> None:
    """`cachecraft chunks rm` / `clear` removed the files but not the registry rows: a
    restarted server listed the chunks (num_variants 0) and DELETE said it deleted them."""
    store = store_in(tmp_path)
    cache_dir = str(tmp_path / "cache")
    with start_server("full", loaded=small, store=store) as url:
        fr = post(url, [FR], pin=True)[0]
        de = post(url, [DE])[0]
        post(url, [FR], cache_namespace="tenant")
    cli("chunks", "rm", de["chunk_key"], "--cache-dir", cache_dir)
    with start_server("full", loaded=small, store=store) as url:
        assert ids(url) == ["fr"] and listed(url)["data"][0]["pinned"]
        r = httpx.delete(f"{url}/v1/chunks/{de['chunk_key']}", timeout=T)
        assert "not found" in openai_error(r, 404)["message"]
    cli("chunks", "clear", "--cache-dir", cache_dir)
    with start_server("full", loaded=small, store=store) as url:
        assert listed(url)["data"] == [] and listed(url)["stats"]["num_pinned"] == 0
        assert listed(url, "?cache_namespace=tenant")["data"] == []
        r = httpx.delete(f"{url}/v1/chunks/{fr['chunk_key']}", timeout=T)
        openai_error(r, 404)
        assert post(url, [FR])[0]["stored"]  # registering goes on as before
        assert ids(url) == ["fr"] and not listed(url)["data"][0]["pinned"]


def test_delete_removes_every_variant_it_counts(small: LoadedModel, tmp_path: Path) -> None:
    """DELETE /v1/chunks/{key}: the files and index rows go, the answer counts them, a second
    DELETE is a 404, and a restart does not bring the chunk back."""
    store = store_in(tmp_path)
    cache_dir = str(tmp_path / "cache")
    with start_server("full", loaded=small, store=store) as url:
        key = post(url, [FR], pin=True)[0]["chunk_key"]
        post(url, [DE])
        on_disk = [r["chunk_key"] for r in chunks_command("ls", cache_dir)]  # type: ignore[union-attr]
        assert key in on_disk
        r = httpx.delete(f"{url}/v1/chunks/{key}", timeout=T)
        assert r.status_code == 200, r.text
        assert r.json() == {"chunk_key": key, "deleted": True, "num_variants": on_disk.count(key)}
        assert key not in [r["chunk_key"] for r in chunks_command("ls", cache_dir)]  # type: ignore[union-attr]
        assert len(list(Path(cache_dir).glob("*.safetensors"))) == len(on_disk) - on_disk.count(key)
        openai_error(httpx.delete(f"{url}/v1/chunks/{key}", timeout=T), 404)
        assert ids(url) == ["de"] and listed(url)["stats"]["num_pinned"] == 0
    with start_server("full", loaded=small, store=store) as url:
        assert ids(url) == ["de"]


def test_two_replicas_on_one_directory_list_delete_and_pin_alike(
    small: LoadedModel, tmp_path: Path
) -> None:
    """Replicas read registry.sqlite once, at start: a chunk precomputed (and pinned) through
    A was not listed by B, B answered 404 to deleting it, and a deletion through A left B
    listing it."""
    store = store_in(tmp_path)
    with replica(small, store) as a, replica(small, store) as b:
        fr = post(a, [FR], pin=True)[0]
        post(b, [DE], cache_namespace="tenant")
        assert ids(b) == ["fr"] and listed(b)["data"][0]["pinned"]
        assert listed(b)["data"] == listed(a)["data"]
        assert ids(a, "?cache_namespace=tenant") == ["de"]
        r = httpx.delete(f"{b}/v1/chunks/{fr['chunk_key']}", timeout=T)
        assert r.status_code == 200 and r.json()["num_variants"] >= 1, r.text
        assert listed(a)["data"] == [] and listed(b)["data"] == []
        openai_error(httpx.delete(f"{a}/v1/chunks/{fr['chunk_key']}", timeout=T), 404)
        post(b, [FR], pin=True)  # pinned again through B: A lists it pinned
        assert ids(a) == ["fr"] and listed(a)["data"][0]["pinned"]
    with replica(small, store) as c:  # and what they did together outlives them
        assert ids(c) == ["fr"] and listed(c)["data"][0]["pinned"]
        assert ids(c, "?cache_namespace=tenant") == ["de"]


def test_a_pin_deleted_through_another_replica_frees_this_ones_allowance(
    small: LoadedModel, tmp_path: Path
) -> None:
    """Each replica pins in its own memory: after a chunk pinned through B was deleted through
    A, B kept it pinned (and counted against the namespace's cap) until restarted, so B refused
    every new pin with "unpin chunks (DELETE /v1/chunks/{chunk_key})" while that DELETE said 404.
    And A never pinned what B pinned, so A's disk could evict the file a restart pins from."""
    store = dataclasses.replace(store_in(tmp_path), max_pinned_bytes_per_namespace=6000)
    with replica_stack(small, store) as (a, a_store), replica_stack(small, store) as (b, b_store):
        fr = post(b, [FR], pin=True)[0]  # 4,096 bytes: one pin fits under the cap
        assert ids(a) == ["fr"] and a_store.pinned().chunk_keys() == {fr["chunk_key"]}
        assert httpx.delete(f"{a}/v1/chunks/{fr['chunk_key']}", timeout=T).status_code == 200
        de = post(b, [DE], pin=True)[0]  # B's allowance is free again
        assert b_store.pinned().chunk_keys() == {de["chunk_key"]}
        assert ids(a) == ["de"] and a_store.pinned().chunk_keys() == {de["chunk_key"]}


def test_a_read_only_registry_still_lists_and_registers_in_memory(
    small: LoadedModel, tmp_path: Path
) -> None:
    """A registry file this process cannot write: what it holds is still listed and pinned,
    and new chunks are listed from memory (never a 500, never lost listings)."""
    if shutil.which("chattr") is None:
        pytest.skip("needs chattr to make a file read-only for every user")
    store = store_in(tmp_path)
    with start_server("full", loaded=small, store=store) as url:
        post(url, [FR], pin=True)
    registry = tmp_path / "cache" / REGISTRY_FILE
    parts = [registry, *registry.parent.glob(REGISTRY_FILE + "-*")]
    made = subprocess.run(["chattr", "+i", *map(str, parts)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"chattr +i: {made.stderr.decode().strip()}")
    try:
        with start_server("full", loaded=small, store=store) as url:
            assert ids(url) == ["fr"] and listed(url)["data"][0]["pinned"]
            post(url, [DE])
            assert sorted(ids(url)) == ["de", "fr"]
            key = next(d["chunk_key"] for d in listed(url)["data"] if d["id"] == "fr")
            assert httpx.delete(f"{url}/v1/chunks/{key}", timeout=T).status_code == 200
            assert ids(url) == ["de"]
    finally:
        subprocess.run(["chattr", "-i", *map(str, parts)], check=True)


def test_a_registration_made_while_another_process_held_the_lock_is_kept(
    small: LoadedModel, tmp_path: Path
) -> None:
    """A registry write waits at most 1 s for another process's lock; one that gave up was
    kept in this process's memory only, so the chunk was not listed after a restart (nor by
    other replicas). It now stays pending and is written once the lock is free."""
    store = store_in(tmp_path)
    with start_server("full", loaded=small, store=store) as url:
        other = sqlite3.connect(tmp_path / "cache" / REGISTRY_FILE, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another replica in a long write
        try:
            post(url, [FR], pin=True)
            assert ids(url) == ["fr"] and listed(url)["data"][0]["pinned"]  # from memory
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert ids(url) == ["fr"]
    with start_server("full", loaded=small, store=store) as url:
        assert ids(url) == ["fr"] and listed(url)["data"][0]["pinned"]


def test_while_redis_is_down_nothing_is_deleted_or_forgotten_halfway(
    small: LoadedModel, tmp_path: Path, redis_server: RedisServer
) -> None:
    """With Redis unreachable, DELETE removed the local copies, skipped Redis's and answered
    `deleted: true` (the chunk came back from Redis later); and a server starting then saw no
    variant of a chunk kept only in Redis and dropped its registry row for good."""
    store = dataclasses.replace(store_in(tmp_path), redis_url=redis_server.url)
    cache_dir = str(tmp_path / "cache")
    with start_server("full", loaded=small, store=store) as url:
        fr, de = post(url, [FR])[0], post(url, [DE])[0]  # memory, disk and Redis
    cli("chunks", "rm", de["chunk_key"], "--cache-dir", cache_dir)  # Redis keeps its copy
    redis_server.stop()
    with start_server("full", loaded=small, store=store) as url:
        r = httpx.delete(f"{url}/v1/chunks/{fr['chunk_key']}", timeout=T)
        err = openai_error(r, 503)
        assert err["code"] == "tier_unreachable" and "redis" in err["message"].lower()
        assert ids(url) == ["fr"]  # nothing was removed: still listed, still on disk
        assert [r["chunk_key"] for r in chunks_command("ls", cache_dir)] == [fr["chunk_key"]]  # type: ignore[union-attr]
    registry = sqlite3.connect(tmp_path / "cache" / REGISTRY_FILE)
    rows = {key for (key,) in registry.execute("SELECT chunk_key FROM chunks")}
    registry.close()
    assert rows == {fr["chunk_key"], de["chunk_key"]}  # de's row waits for Redis to come back


def test_a_pin_past_the_cap_names_the_document_and_what_was_pinned(
    small: LoadedModel, tmp_path: Path
) -> None:
    """Several documents with `pin` where one passes the namespace's cap: the 400 did not say
    which document, nor that the ones before it had been precomputed and pinned."""
    store = dataclasses.replace(store_in(tmp_path), max_pinned_bytes_per_namespace=6000)
    with start_server("full", loaded=small, store=store) as url:
        body = {"documents": [FR, DE], "pin": True}
        err = openai_error(httpx.post(url + "/v1/chunks", json=body, timeout=T), 400)
        assert err["param"] == "documents.1" and err["code"] == "pin_limit"
        assert "max_pinned_bytes_per_namespace" in err["message"]
        assert "precomputed but not pinned" in err["message"]
        assert "documents.0 was precomputed and pinned" in err["message"]
        assert sorted(ids(url)) == ["de", "fr"]  # both precomputed, only fr pinned
        assert [d["id"] for d in listed(url)["data"] if d["pinned"]] == ["fr"]


def test_a_chunk_deleted_through_one_replica_is_not_served_by_another(
    small: LoadedModel, tmp_path: Path
) -> None:
    """DELETE through A removed the files and A's memory copies; B kept the copy its last
    request had read into memory and served the next request from it (a hit right after
    `deleted: true`)."""

    def ask(url: str) -> bool:
        body = {
            "model": "cachecraft",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "Which city?"}],
            "documents": [FR],
            "cachecraft_mode": "cachecraft",
        }
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=T)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["cachecraft"]["chunks"][0]["is_hit"]

    store = store_in(tmp_path)
    with replica_stack(small, store) as (a, _), replica_stack(small, store) as (b, b_store):
        key = post(a, [FR])[0]["chunk_key"]
        assert ask(b)  # B read it from the shared disk into its memory
        assert httpx.delete(f"{a}/v1/chunks/{key}", timeout=T).status_code == 200
        assert b_store.variants(key) != []  # B's memory copy, until B hears of the DELETE
        assert not ask(b)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Another process creating the file `path` (not yet in WAL mode, where an exclusive lock
    keeps readers out too) in a long transaction, held for the block."""
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    other.execute("CREATE TABLE IF NOT EXISTS other (x)")
    try:
        yield
    finally:
        other.execute("ROLLBACK")
        other.close()


def test_a_registry_opened_while_a_replica_starts_beside_it_waits_for_the_file(
    tmp_path: Path,
) -> None:
    """A replica that found the file locked past 1 s at start (another one creating it on a
    busy machine) kept its listings in memory only, for good: it now waits as long as the
    disk tier's index does."""
    path = tmp_path / REGISTRY_FILE
    with _locked(path):
        opening = ThreadPoolExecutor(1).submit(ChunkRegistry, path)
        time.sleep(1.5)  # the open waits past the 1 s a write waits
        assert not opening.done()
    registry = opening.result(timeout=30)
    registry.add("ns", "k1", "doc", 7)
    assert _row(path, "SELECT label, num_tokens FROM chunks") == ("doc", 7)
    registry.close()


class _QuickRetry(ChunkRegistry):
    RETRY_S = 0.2


def test_a_registry_that_could_not_open_its_file_opens_it_later_and_writes_what_it_kept(
    tmp_path: Path,
) -> None:
    path = tmp_path / REGISTRY_FILE
    with _locked(path):
        late = _QuickRetry(path, open_wait_s=0.1)  # gives up while the lock is held
        late.add("ns", "k1", "doc", 7)
        late.pin("ns", "k1", "v1")
        assert late.keys("ns") == {"k1": ("doc", 7)}  # the memory view answers meanwhile
    assert _row(path, "SELECT COUNT(*) FROM sqlite_master WHERE name='chunks'") == (0,)
    other = ChunkRegistry(path)
    other.record_removal("gone")  # after `late` started: it must still hear of it
    time.sleep(_QuickRetry.RETRY_S)
    assert late.keys("ns") == {"k1": ("doc", 7)}
    assert _row(path, "SELECT label, num_tokens FROM chunks") == ("doc", 7)
    assert late.pins() == {"v1": ("ns", "k1")}
    assert late.removals() == ["gone"]
    for r in (late, other):
        r.close()


def _row(db: Path, sql: str) -> tuple | None:
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
        return conn.execute(sql).fetchone()
