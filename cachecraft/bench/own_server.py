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
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from cachecraft.bench.peer_vllm import free_port, signal_group
from cachecraft.env import child_env
from cachecraft.errors import CachecraftError

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


def _tail(path: Path, num_lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def server_process(
    mode: str,
    extra_args: Sequence[str] = (),
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> Iterator[str]:
    """Start `cachecraft serve` in `mode` (plus `extra_args`) in a child process and yield its
    base URL once /health answers 200; stop it (SIGINT, then SIGKILL after a grace period)
    on exit. A child that exits or stays unhealthy is an error carrying its log's tail."""
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
            env=child_env(str(Path(__file__).resolve().parents[2])),  # holds cachecraft/
            start_new_session=True,
        )
    try:
        _wait_healthy(proc, url, log_path, startup_timeout_s)
        yield url
    finally:
        signal_group(proc.pid, signal.SIGINT)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CachecraftError(
                f"our server ({' '.join(proc.args)}) exited with code {proc.returncode} while "
                f"starting; last lines of its log:\n{_tail(log_path)}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise CachecraftError(
        f"our server not healthy after {timeout_s:g} s; last lines of its log:\n{_tail(log_path)}"
    )
