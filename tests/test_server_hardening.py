"""Product hardening (the probes in docs/results/hardening.md, second pass): a real server on a
tiny random Llama, each test one defect found by probing it as an OpenAI client would."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from conftest import make_tiny_dir
from test_server_faults import CHAT, CTX, T, chat, openai_error, serving

from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.server.config import ServerConfig


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = make_tiny_dir(tmp_path_factory.mktemp("tiny-hardening"), max_position_embeddings=CTX)
    return load_model(str(path))


def test_a_request_cut_by_shutdown_gets_a_json_503(small: LoadedModel) -> None:
    """SIGTERM with a request still waiting past `shutdown_timeout_s`: uvicorn cancels it and
    used to answer a plain-text "Internal Server Error" 500."""
    got: dict[str, Any] = {}
    with serving(small, ServerConfig(shutdown_timeout_s=0.3)) as s:
        busy = s.engine.call(lambda: time.sleep(3))  # the engine cannot plan the request yet

        def ask() -> None:
            got["r"] = httpx.post(s.url + CHAT, json=chat(), timeout=T)

        client = threading.Thread(target=ask)
        client.start()
        time.sleep(1.0)  # the request is in its route, waiting for the busy engine
        assert not busy.done()
    client.join(T)
    err = openai_error(got["r"], 503)
    assert err["code"] == "shutting_down" and "shutting down" in err["message"]
