"""Our server in a child process, as `bench serve` runs it: `python -m cachecraft.cli serve` on
a free loopback port, memory tier only, started in a fresh directory of its own.

Why a process: the load generator is Python too. With our server in its process (a thread for
uvicorn, one for the engine), every streamed token of every request took the GIL from the
engine's step loop on both ends; vLLM, the peer, always ran in processes of its own. A
deployment never shares an interpreter with its clients either.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from cachecraft.env import child_env, tuned_child_env
from cachecraft_bench.peer_vllm import free_port, stop_session, wait_healthy

STARTUP_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0


def server_command(mode: str, port: int, extra_args: Sequence[str] = ()) -> list[str]:
    """The child's command line: this interpreter, our CLI, `mode`, memory tier only."""
    return [
        sys.executable,
        "-m",
        "cachecraft.cli",
        "serve",
        "--mode",
        mode,
        "--port",
        str(port),
        "--cache-dir",
        "",
        "--log-level",
        "warning",
        *extra_args,
    ]


def _env(tuned: bool | None) -> dict[str, str]:
    env = child_env(str(Path(__file__).resolve().parents[2]))  # holds cachecraft/
    return env if tuned is None else tuned_child_env(env, tuned)


@contextlib.contextmanager
def server_process(
    mode: str,
    extra_args: Sequence[str] = (),
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    tuned: bool | None = None,
) -> Iterator[str]:
    """Start `cachecraft serve` in `mode` (plus `extra_args`) in a child process and yield its
    base URL once /health answers 200; stop it (SIGINT, then SIGKILL after a grace period)
    on exit. A child that exits or stays unhealthy is an error carrying its log's tail.
    `tuned`: our OpenMP and allocator tuning (True) or none (False), as every system of the
    comparison gets (`tuned_child_env`); None leaves the environment as it is."""
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="cachecraft-bench-server-"))
    log_path = tmp / "server.log"
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            server_command(mode, port, extra_args),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp,
            env=_env(tuned),
            start_new_session=True,
        )
    try:
        wait_healthy(proc, url, log_path, startup_timeout_s, f"our server ({' '.join(proc.args)})")
        yield url
    finally:
        stop_session(proc, signal.SIGINT, STOP_GRACE_S)
        shutil.rmtree(tmp, ignore_errors=True)
