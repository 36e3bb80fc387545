"""Issue 56, defects 1-3 end to end through the offline LLM over a disk tier: a chunk file
damaged and re-indexed is a miss recomputed (the full prefill's answer), never served; nothing
computed over it is stored; a non-finite forward fails its request and commits nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from cachecraft.engine.sampling import SamplingParams
from cachecraft.errors import NonFiniteError
from cachecraft.llm import LLM
from cachecraft.model.loader import LoadedModel
from cachecraft.request import Chunk, RagRequest
from cachecraft.server.app import create_app
from cachecraft.server.config import ServerConfig
from cachecraft.server.launch import build_stack, close_stack, serve_app
from cachecraft.store import codec
from cachecraft.store.cli import chunks_command
from cachecraft.store.config import StoreConfig
from cachecraft.store.disk import QUARANTINE
from cachecraft.store.disk_index import INDEX
from cachecraft.store.store import make_store

DOCS = [
    "Saturn is the sixth planet from the Sun and has a prominent ring system.",
    "Jupiter is the largest planet in the Solar System, a gas giant.",
    "Mercury is the smallest planet and the closest to the Sun.",
]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
REQUEST = RagRequest("Which planet has rings?", [Chunk(d) for d in DOCS])


def disk_llm(tiny_dir: Path, cache_dir: Path) -> LLM:
    """A process over `cache_dir` (memory tier off: every hit is read from the files)."""
    config = StoreConfig(cache_dir=str(cache_dir), memory_bytes=0, doorkeeper_threshold=1)
    return LLM(str(tiny_dir), store=make_store(config))


def overwrite_middle(path: Path, num_bytes: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + num_bytes] = b"\xff" * num_bytes  # 0xff bytes: NaN floats
    path.write_bytes(bytes(data))


def assert_all_stored_sound(cache_dir: Path) -> None:
    """Every file the directory indexes verifies against its own header and is finite."""
    for path in cache_dir.glob("*.safetensors"):
        codec.from_bytes(path.read_bytes())  # raises if not


def test_a_damaged_reindexed_chunk_is_a_miss_with_the_full_answer(
    tiny_dir: Path, tmp_path: Path
) -> None:
    warm = disk_llm(tiny_dir, tmp_path)
    warm.generate(REQUEST, GREEDY, mode="cachecraft")
    chunk_key = warm.runner.layout(REQUEST).chunks[0].key
    (meta,) = warm.store.variants(chunk_key)
    warm.store.close()
    victim = tmp_path / f"{meta.variant_id}.safetensors"
    overwrite_middle(victim)
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / (INDEX + suffix)).unlink(missing_ok=True)
    chunks_command("reindex", str(tmp_path))
    assert (tmp_path / QUARANTINE / victim.name).exists()

    again = disk_llm(tiny_dir, tmp_path)  # restarted
    out = again.generate(REQUEST, GREEDY, mode="naive")[0]  # reuses whatever is stored as is
    first = out.report.chunks[0]
    assert first.key == chunk_key and not first.is_hit
    assert [c.is_hit for c in out.report.chunks[1:]] == [True, True]
    full = again.generate(REQUEST, GREEDY, mode="full")[0]
    assert out.token_ids == full.token_ids
    assert_all_stored_sound(tmp_path)
    again.store.close()
    # what the second process stored serves a third one the same answer
    third = disk_llm(tiny_dir, tmp_path)
    out = third.generate(REQUEST, GREEDY, mode="naive")[0]
    assert all(c.is_hit for c in out.report.chunks)
    assert out.token_ids == full.token_ids
    third.store.close()


class PoisonedHead:
    """Wraps the model's LM head: one vocabulary entry's logit is NaN in every row."""

    def __init__(self, head: object) -> None:
        self.head = head

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(x)  # type: ignore[operator]
        out[:, 5] = float("nan")
        return out


def test_a_non_finite_forward_fails_cleanly_and_commits_nothing(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(tiny_dir), store=StoreConfig(doorkeeper_threshold=1))
    model = llm.runner.loaded.model
    with monkeypatch.context() as patch:
        patch.setattr(model, "lm_head", PoisonedHead(model.lm_head))
        with pytest.raises(NonFiniteError, match="non-finite"):
            llm.generate(REQUEST, GREEDY, mode="cachecraft")
    assert len(llm.store) == 0 and len(llm.runner.prefix_cache) == 0
    out = llm.generate(REQUEST, GREEDY, mode="cachecraft")[0]  # the engine goes on
    assert len(out.token_ids) == GREEDY.max_tokens and len(llm.store) == 3
    assert len(llm.runner.prefix_cache) == 1


def strict_json(text: str) -> Any:
    """json.loads that refuses NaN and infinities (Python's accepts them; JSON does not)."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} in a JSON body")

    return json.loads(text, parse_constant=refuse)


def test_a_non_finite_forward_is_a_clean_server_error(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 56, defect 3: a NaN log-probability answered 500 "Out of range float values" and a
    stream sent `"logprob": NaN`. Now: 500 with a message, or an error event then [DONE]."""
    body = {
        "model": "cachecraft",
        "messages": [{"role": "user", "content": "Which planet has rings?"}],
        "documents": DOCS,
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 2,
    }
    stack = build_stack("cachecraft", loaded=tiny, store=StoreConfig(doorkeeper_threshold=1))
    try:
        app = create_app(stack.engine, stack.store, ServerConfig())
        with serve_app(app) as url, monkeypatch.context() as patch:
            patch.setattr(tiny.model, "lm_head", PoisonedHead(tiny.model.lm_head))
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 500
            error = strict_json(r.text)["error"]
            assert error["type"] == "server_error" and "non-finite" in error["message"]
            with httpx.stream(
                "POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
            ) as s:
                lines = [x[6:] for x in s.iter_lines() if x.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            events = [strict_json(x) for x in lines[:-1]]
            assert "non-finite" in events[-1]["error"]["message"]
            assert len(stack.store) == 0  # nothing of either request was stored
            patch.undo()
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200 and strict_json(r.text)["choices"][0]["logprobs"]
    finally:
        close_stack(stack)
