"""`bench serve` runs our server as a deployment does: `cachecraft serve` in a child process
(the tiny random Llama here), healthy before it is used, stopped with the block, and a child
that cannot start is one error carrying its log."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from cachecraft.errors import CachecraftError
from cachecraft_bench.own_server import server_process


def test_a_child_server_answers_then_stops(tiny_dir: Path) -> None:
    with server_process("cachecraft", ["--model", str(tiny_dir), "--dtype", "bfloat16"]) as url:
        assert httpx.get(f"{url}/health", timeout=10).json()["dtype"] == "bfloat16"
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Which planet has rings?"}],
            "documents": [{"text": "Saturn has rings."}, {"text": "Mars is red."}],
            "max_tokens": 3,
        }
        res = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert res.status_code == 200, res.text
        assert res.json()["usage"]["completion_tokens"] == 3
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)


def test_a_child_that_cannot_start_reports_its_log(tiny_dir: Path) -> None:
    with (
        pytest.raises(CachecraftError, match="(?s)exited with code 2.*token_budget must be >= 1"),
        server_process("cachecraft", ["--model", str(tiny_dir), "--token-budget", "0"]),
    ):
        pass


def test_a_child_server_gets_the_tuning_every_system_gets() -> None:
    from cachecraft_bench import own_server

    assert own_server._env(False)["CACHECRAFT_TUNING"] == "off"
    assert "OMP_WAIT_POLICY" not in own_server._env(False)
    assert own_server._env(True)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert own_server._env(True)["PYTHONPATH"].startswith(str(Path(own_server.__file__).parents[2]))
