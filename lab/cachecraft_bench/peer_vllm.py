"""The real peer: vLLM's OpenAI server with automatic prefix caching, run from its own venv.

`VllmServer` starts it as a subprocess on a free loopback port (fp32, 32-token blocks, its
OpenMP threads bound to as many cores as ours use, a `PeerConfig`: eager or compiled, its
batched-token limit, a core reserved for its front end or none) and stops it; `prefix_cache_stats`
reads its prefix-cache counters from /metrics. The venv comes from `make peer-vllm`, never
from `make setup`; nothing here imports vllm.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cachecraft.env import tuned_child_env
from cachecraft.errors import CachecraftError

logger = logging.getLogger(__name__)

DEFAULT_PEER_PYTHON = Path(".peer-venv/bin/python")
SERVED_MODEL_NAME = "cachecraft-peer"
# counters (tokens) in vLLM 0.32's /metrics; the parser drops the `_total` suffix of families
PREFIX_CACHE_METRICS = {
    "queries": "vllm:prefix_cache_queries",
    "hits": "vllm:prefix_cache_hits",
}


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """The settings of vLLM a fair comparison tries (`peer_tuning`); the defaults are the ones
    first used here."""

    enforce_eager: bool = True
    """Eager PyTorch (start-up ~30 s) or vLLM's compiled graphs (minutes to start)."""
    max_num_batched_tokens: int | None = 2048
    """Prompt and decode tokens per step: ours (`EngineConfig.token_budget`) or None for
    vLLM's default."""
    reserved_cpus: int = 0
    """Cores kept for vLLM's front end (its default on CPU is one); the rest compute."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def label(self) -> str:
        eager = "eager" if self.enforce_eager else "compiled"
        tokens = self.max_num_batched_tokens or "default"
        return f"{eager}, batched tokens {tokens}, reserved cores {self.reserved_cpus}"


class PeerError(CachecraftError):
    """The peer server is not installed, did not start, or answered nonsense."""


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal the process group `pgid` (a session leader's pid); gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_session(proc: subprocess.Popen, sig: signal.Signals, grace_s: float) -> bool:
    """Stop a child started with `start_new_session`: `sig` to its whole group, up to
    `grace_s` for the leader to exit, then SIGKILL to whatever of the group is left (children
    may outlive their leader). False if the leader did not exit within the grace period."""
    signal_group(proc.pid, sig)
    try:
        proc.wait(grace_s)
        stopped = True
    except subprocess.TimeoutExpired:
        stopped = False
    signal_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    return stopped


def vllm_env(
    num_threads: int,
    kvcache_gib: float,
    cache_root: Path,
    tuned: bool = False,
    reserved_cpus: int = 0,
) -> dict[str, str]:
    """The environment of a vLLM child process: our environment plus the settings that make
    the comparison fair on this CPU (`num_threads` cores, `reserved_cpus` of them kept for
    its front end, a fixed KV space, a private cache directory), without our PYTHONPATH (never
    leak our venv's packages into the peer), and with exactly the OpenMP and allocator tuning
    every system of the comparison gets (`tuned`: ours, else none: `tuned_child_env`).

    vLLM's CPU worker ignores OMP_NUM_THREADS: by default it binds one OpenMP thread to every
    core of its NUMA node. So the thread count is given as its bind list, the first
    `num_threads` CPUs we may run on (a list the caller set in VLLM_CPU_OMP_THREADS_BIND is
    kept). Before this, `bench decode --threads 1` set one of our threads against two of
    vLLM's."""
    workers = max(1, num_threads - reserved_cpus)
    env = {
        **tuned_child_env(dict(os.environ), tuned),
        "OMP_NUM_THREADS": str(workers),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved_cpus),
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
        "VLLM_CACHE_ROOT": str(cache_root),
    }
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind_list(workers))
    env.pop("PYTHONPATH", None)
    return env


def bind_list(num_threads: int) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND for `num_threads` threads: the lowest CPU ids this
    process may run on, e.g. "0,1"; "nobind" (OMP_NUM_THREADS alone decides) where the
    platform cannot say which CPUs those are."""
    if not hasattr(os, "sched_getaffinity"):
        return "nobind"
    cpus = sorted(os.sched_getaffinity(0))[: max(1, num_threads)]
    return ",".join(str(c) for c in cpus)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _log_tail(path: Path, num_lines: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-num_lines:])


def wait_healthy(
    proc: subprocess.Popen,
    base_url: str,
    log_path: Path,
    timeout_s: float,
    name: str,
    error: type[CachecraftError] = CachecraftError,
) -> None:
    """Poll `base_url`/health until it answers 200. A child that exits first, or stays
    unhealthy for `timeout_s`, is an `error` carrying the tail of its log; `name` says whose."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise error(
                f"{name} exited with code {proc.returncode} while starting; "
                f"last lines of its log:\n{_log_tail(log_path)}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise error(
        f"{name} not healthy after {timeout_s:g} s; last lines of its log:\n{_log_tail(log_path)}"
    )


class VllmServer:
    """`with VllmServer(model_dir) as srv: srv.base_url` runs vLLM for the block's duration."""

    def __init__(
        self,
        model_dir: str | Path | None = None,
        python: str | Path = DEFAULT_PEER_PYTHON,
        num_threads: int = 2,
        kvcache_gib: int = 2,
        block_size: int = 32,
        startup_timeout_s: float = 600.0,
        extra_args: Sequence[str] = (),
        dtype: str = "float32",
        config: PeerConfig | None = None,
        tuned: bool = False,
    ) -> None:
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.python = Path(python).absolute()  # absolute, not resolved: keep the venv symlink
        self.num_threads = num_threads
        self.kvcache_gib = kvcache_gib
        self.block_size = block_size
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = tuple(extra_args)
        self.dtype = dtype
        self.config = config or PeerConfig()
        self.tuned = tuned
        self.model_name = SERVED_MODEL_NAME
        self.port: int | None = None
        self.startup_s: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: Path | None = None

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise PeerError("the vLLM server is not running")
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path | None:
        return None if self._tmp is None else self._tmp / "vllm.log"

    def command(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--block-size",
            str(self.block_size),
            "--enable-prefix-caching",
            *(["--enforce-eager"] if self.config.enforce_eager else []),
            *(
                ["--max-num-batched-tokens", str(self.config.max_num_batched_tokens)]
                if self.config.max_num_batched_tokens
                else []
            ),
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
            *self.extra_args,
        ]

    def start(self) -> VllmServer:
        if not self.python.exists():
            raise PeerError(f"no peer venv at {self.python}: run `make peer-vllm` first")
        if self.model_dir is None:
            from cachecraft.api import resolve_model_dir

            self.model_dir = resolve_model_dir(None)
        self.port = free_port()
        self._tmp = Path(tempfile.mkdtemp(prefix="cachecraft-vllm-"))
        env = vllm_env(
            self.num_threads,
            self.kvcache_gib,
            self._tmp / "cache",
            self.tuned,
            self.config.reserved_cpus,
        )
        logger.info("starting vLLM on port %d (log %s)", self.port, self.log_path)
        t0 = time.perf_counter()
        try:
            with self.log_path.open("wb") as log:  # type: ignore[union-attr]
                self._proc = subprocess.Popen(
                    self.command(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self._tmp,
                    start_new_session=True,
                )
            assert self.log_path is not None
            wait_healthy(
                self._proc, self.base_url, self.log_path, self.startup_timeout_s, "vLLM", PeerError
            )
        except OSError as e:  # the interpreter itself could not be run
            self.stop()
            raise PeerError(f"cannot run {self.python}: {e}") from None
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        logger.info("vLLM ready in %.1f s", self.startup_s)
        return self

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop vLLM and every process it started (its own session: the API server, engine
        core and workers), SIGTERM then SIGKILL after `grace_s`; removes the temp dir (log
        included). Our caller runs this on SIGTERM too: `cachecraft.cli` turns SIGTERM into
        KeyboardInterrupt so `with VllmServer(...)` blocks unwind."""
        proc, self._proc = self._proc, None
        # Children left in the group (vLLM's API server may exit before its workers do) are
        # killed whether or not the leader stopped in time.
        if proc is not None and not stop_session(proc, signal.SIGTERM, grace_s):
            logger.warning("vLLM did not stop in %.0f s; killed it", grace_s)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self.port = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def parse_prefix_cache_stats(metrics_text: str) -> dict[str, float]:
    """{"queries", "hits"} in tokens, summed over label sets, from Prometheus text; a counter
    the text lacks raises PeerError."""
    found: dict[str, float] = {}
    wanted = {name: key for key, name in PREFIX_CACHE_METRICS.items()}
    for family in text_string_to_metric_families(metrics_text):
        key = wanted.get(family.name)
        if key is None:
            continue
        found[key] = found.get(key, 0.0) + sum(
            s.value for s in family.samples if s.name == f"{family.name}_total"
        )
    missing = sorted(set(PREFIX_CACHE_METRICS) - set(found))
    if missing:
        names = ", ".join(PREFIX_CACHE_METRICS[k] + "_total" for k in missing)
        raise PeerError(f"/metrics has no {names}")
    return found


def prefix_cache_stats(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """vLLM's prefix-cache counters now: {"queries", "hits"} (prompt tokens looked up / found)."""
    resp = httpx.get(f"{base_url}/metrics", timeout=timeout_s)
    resp.raise_for_status()
    return parse_prefix_cache_stats(resp.text)
