"""The vLLM peer wrapper without vLLM: metrics parsing and the start-up failure paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cachecraft.bench.peer_vllm import PeerError, VllmServer, parse_prefix_cache_stats

# the shape vLLM 0.32 writes (two engines here, to check label sets are summed)
METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="cachecraft-peer"} 3310.0
vllm:prefix_cache_queries_total{engine="1",model_name="cachecraft-peer"} 10.0
vllm:prefix_cache_queries_created{engine="0",model_name="cachecraft-peer"} 1.79e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="cachecraft-peer"} 1632.0
vllm:prefix_cache_hits_created{engine="0",model_name="cachecraft-peer"} 1.79e+09
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="cachecraft-peer"} 99.0
"""


def test_parse_prefix_cache_stats() -> None:
    assert parse_prefix_cache_stats(METRICS) == {"queries": 3320.0, "hits": 1632.0}


def test_missing_counter_is_a_clear_error() -> None:
    text = METRICS.split("# HELP vllm:prefix_cache_hits_total")[0]
    with pytest.raises(PeerError, match="vllm:prefix_cache_hits_total"):
        parse_prefix_cache_stats(text)


def test_missing_peer_venv_says_make_peer_vllm(tmp_path: Path) -> None:
    server = VllmServer(tmp_path, python=tmp_path / "nope" / "python")
    with pytest.raises(PeerError, match="make peer-vllm"):
        server.start()


def test_server_that_dies_reports_its_log_tail(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\necho 'loading model'\necho 'ValueError: no such model' >&2\nexit 3\n"
    )
    os.chmod(fake, 0o755)
    server = VllmServer(tmp_path, python=fake, startup_timeout_s=30)
    with pytest.raises(PeerError, match=r"(?s)code 3.*no such model"):
        server.start()
    assert server.port is None and server.log_path is None  # stopped and cleaned up


def test_unrunnable_interpreter_is_a_peer_error(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("not a program")  # exists, not executable
    server = VllmServer(tmp_path, python=fake)
    with pytest.raises(PeerError, match="cannot run"):
        server.start()
    assert server.log_path is None


def test_command_has_the_fair_comparison_settings(tmp_path: Path) -> None:
    server = VllmServer(tmp_path, python="py")
    server.port = 1234
    cmd = server.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enable-prefix-caching", "--enforce-eager", "--enable-prompt-tokens-details"):
        assert flag in cmd
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    assert cmd[cmd.index("--block-size") + 1] == "32"
    assert cmd[cmd.index("--model") + 1] == str(tmp_path)
