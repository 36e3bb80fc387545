"""Two live `cachecraft serve` processes (replicas of one model) on one embedded Valkey: a
chunk computed through one is a hit through the other, with the answer of a full prefill; the
doorkeeper counts sightings across both; killing the shared server degrades both to their
local tiers without an error to clients, and /health says which tier is down."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import make_tiny_dir

from cachecraft.store.redis_server import RedisServer

DOC = {"id": "fr", "text": "Paris is the capital of France. It lies on the Seine river."}
OTHER = {"id": "de", "text": "Berlin is the capital of Germany. It lies on the Spree river."}


def ask(url: str, docs: list[dict[str, str]], mode: str = "cachecraft") -> dict:
    """One chat over `docs` in `mode` (8 tokens); the 200 response's body."""
    body = {
        "model": "cachecraft",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Which river?"}],
        "documents": docs,
        "cachecraft_mode": mode,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


class Replica:
    """One `cachecraft serve` child process; its log goes to a file. Its disk tier is
    `cache_dir` (default: its own directory under root); `redis_url` None: no shared tier."""

    def __init__(
        self,
        name: str,
        model: Path,
        root: Path,
        redis_url: str | None,
        cache_dir: Path | None = None,
    ) -> None:
        self.log = root / f"{name}.log"
        args = [
            sys.executable, "-m", "cachecraft.cli", "serve", "--model", str(model),
            "--port", "0", "--cache-dir", str(cache_dir or root / name),
            "--storage-dtype", "float32", "--log-level", "info", "--admit-all-below", "0",
        ]  # fmt: skip
        if redis_url is not None:
            args += ["--redis-url", redis_url]
        self.proc = subprocess.Popen(args, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        self.url = ""

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", self.log.read_text())
            if found:
                self.url = found.group(1)
                return
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            time.sleep(0.2)
        raise AssertionError(f"replica did not start: {self.log.read_text()[-3000:]}")

    def ask(self, docs: list[dict[str, str]], mode: str = "cachecraft") -> dict:
        return ask(self.url, docs, mode)

    def health(self) -> dict:
        r = httpx.get(self.url + "/health", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def replicas(tmp_path: Path, redis_server: RedisServer) -> Iterator[tuple[Replica, Replica]]:
    model = make_tiny_dir(tmp_path / "model")
    pair = (
        Replica("a", model, tmp_path, redis_server.url),
        Replica("b", model, tmp_path, redis_server.url),
    )
    try:
        for r in pair:
            r.wait_ready()
        yield pair
    finally:
        for r in pair:
            r.stop()


def _hits(out: dict) -> list[bool]:
    return [c["is_hit"] for c in out["usage"]["cachecraft"]["chunks"]]


def _text(out: dict) -> str:
    return out["choices"][0]["message"]["content"]


def test_two_replicas_share_one_store(
    replicas: tuple[Replica, Replica], redis_server: RedisServer
) -> None:
    a, b = replicas
    full = _text(a.ask([DOC], mode="full"))
    first = a.ask([DOC])  # sighting 1 of the chunk (shared count): the doorkeeper refuses it
    assert _hits(first) == [False]
    second = b.ask([DOC])  # sighting 2, seen on the other replica: admitted and written through
    assert _hits(second) == [False]
    third = a.ask([DOC])  # computed through b, a hit through a (from the shared tier)
    assert _hits(third) == [True]
    assert _text(first) == _text(second) == _text(third) == full
    assert all(h["tiers"]["redis"]["is_reachable"] for h in (a.health(), b.health()))

    redis_server.stop()  # the shared server dies: both replicas go on from local tiers
    for r in (a, b):
        out = r.ask([OTHER])
        assert _hits(out) == [False] and _text(out)
        health = r.health()
        assert health["status"] == "degraded" and health["tiers"]["redis"]["is_reachable"] is False
        assert health["tiers"]["memory"]["is_reachable"] is True
    again = b.ask([DOC])  # b admitted the chunk: still a hit from its own memory
    assert _hits(again) == [True] and _text(again) == full
