"""The vLLM peer wrapper without vLLM: metrics parsing and the start-up failure paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cachecraft.env import MMAP_THRESHOLD, SPIN_COUNT
from cachecraft_bench.peer_vllm import (
    PeerConfig,
    PeerError,
    VllmServer,
    parse_prefix_cache_stats,
    vllm_env,
)

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


def test_peer_gets_the_same_tuning_as_every_system_or_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Untuned (the default), the OpenMP waiting and allocator settings our command chose for
    itself do not reach vLLM; tuned, vLLM gets exactly ours. Either way it gets its thread
    count, KV space and cache directory, and never our PYTHONPATH."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "20000")
    monkeypatch.setenv("PYTHONPATH", "/ours")
    env = vllm_env(2, 3, tmp_path)
    assert not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MALLOC_MMAP_THRESHOLD_"} & set(env)
    assert "PYTHONPATH" not in env
    assert (env["OMP_NUM_THREADS"], env["VLLM_CPU_KVCACHE_SPACE"]) == ("2", "3")
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path)
    tuned = vllm_env(2, 3, tmp_path, tuned=True)
    assert tuned["OMP_WAIT_POLICY"] == "PASSIVE"
    assert tuned["GOMP_SPINCOUNT"] == str(SPIN_COUNT)
    assert tuned["MALLOC_MMAP_THRESHOLD_"] == str(MMAP_THRESHOLD)


def test_a_reserved_front_end_core_leaves_the_rest_to_compute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = vllm_env(2, 2, tmp_path, reserved_cpus=1)
    assert (env["VLLM_CPU_NUM_OF_RESERVED_CPU"], env["OMP_NUM_THREADS"]) == ("1", "1")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(sorted(os.sched_getaffinity(0))[0])


def test_peer_config_sets_the_command_line(tmp_path: Path) -> None:
    default = VllmServer(tmp_path, python=tmp_path / "python").command()
    assert "--enforce-eager" in default
    assert default[default.index("--max-num-batched-tokens") + 1] == "2048"
    free = VllmServer(
        tmp_path,
        python=tmp_path / "python",
        config=PeerConfig(enforce_eager=False, max_num_batched_tokens=None),
    ).command()
    assert "--enforce-eager" not in free and "--max-num-batched-tokens" not in free
    assert PeerConfig(reserved_cpus=1).label() == "eager, batched tokens 2048, reserved cores 1"


def test_peer_gets_as_many_cores_as_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU worker binds a thread to every core unless told which: the bind list
    carries the thread count (one thread: one core we may run on); a list the user set stays."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    ours = sorted(os.sched_getaffinity(0))
    env = vllm_env(1, 2, tmp_path)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(ours[0])
    many = vllm_env(len(ours) + 4, 2, tmp_path)["VLLM_CPU_OMP_THREADS_BIND"]
    assert [int(c) for c in many.split(",")] == ours
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert vllm_env(1, 2, tmp_path)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


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
    bf16 = VllmServer(tmp_path, python="py", dtype="bfloat16")
    bf16.port = 1234
    assert bf16.command()[bf16.command().index("--dtype") + 1] == "bfloat16"


# A stand-in for vLLM: answers /health, and starts a child of its own (as vLLM starts its
# engine core and workers) that outlives it unless its whole process group is stopped.
FAKE_VLLM = """\
import http.server, os, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(os.environ["FAKE_VLLM_PIDS"], "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

BENCH = """\
import sys, time
from cachecraft_bench.peer_vllm import VllmServer
from cachecraft.cli import stop_on_sigterm
stop_on_sigterm()
with VllmServer(sys.argv[1], python=sys.argv[2], startup_timeout_s=60):
    print("ready", flush=True)
    time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"  # a zombie has stopped; only its parent's reaping is left


def test_sigterm_stops_vllm_and_every_process_it_started(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "fake_vllm.py").write_text(FAKE_VLLM)
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "fake_vllm.py"}" "$@"\n')
    os.chmod(fake, 0o755)
    pid_file = tmp_path / "pids"
    env = {**os.environ, "FAKE_VLLM_PIDS": str(pid_file)}
    bench = subprocess.Popen(
        [sys.executable, "-c", BENCH, str(tmp_path), str(fake)],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    pids: list[int] = []
    try:
        assert bench.stdout is not None and bench.stdout.readline().strip() == "ready"
        pids = [int(p) for p in pid_file.read_text().split()]
        assert all(_alive(p) for p in pids)
        bench.send_signal(signal.SIGTERM)  # what `timeout` sends
        assert bench.wait(30) != 0
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "processes outlived their parent"
    finally:
        for pid in [bench.pid, *pids]:  # only what this test started
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
