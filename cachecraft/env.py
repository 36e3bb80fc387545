"""Every environment variable cachecraft reads or sets, and the one process-wide allocator
setting it makes, in one place. Nothing else in the library touches `os.environ` (the vLLM
peer benchmark passes the environment on to its child, with or without our tuning:
`tuned_child_env`).

* `XDG_CACHE_HOME` (read): where converted models are cached, `$XDG_CACHE_HOME/cachecraft`
  (default `~/.cache/cachecraft`).
* `OMP_WAIT_POLICY` (set by the `cachecraft` command to `PASSIVE` unless already set, before
  torch loads OpenMP): OpenMP's long active waiting starves our own threads
  (docs/performance.md).
* `GOMP_SPINCOUNT` (set by the `cachecraft` command to `SPIN_COUNT` unless already set): with
  PASSIVE alone a worker sleeps right after every operation and the next one pays for waking
  it (a full prefill took 10% longer); a short spin keeps the workers awake between the
  operations of one forward without holding a core for long.
* `CACHECRAFT_ROW_KERNEL` (read): `0` (or false, no, off) keeps float32 attention on torch's
  SDPA instead of our kernel (model/row_kernel.py); for comparisons and as a way out.
* `CXX` (read): the C++ compiler that builds that kernel (default `g++`, else `c++`).
* `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_` (read): set by the user, they win over
  `tune_allocator`.
* `CACHECRAFT_TUNING` (read): `off` (or 0, false, no) makes `set_passive_openmp` and
  `tune_allocator` do nothing: the libraries' own defaults, as a benchmark that runs every
  system untuned needs (`tuned_child_env`).

One OpenMP team computes (`torch_threads`): each thread that runs a parallel torch operation
gets its own team of OpenMP workers, and once the workers of all teams outnumber the cores,
GNU OpenMP stops spinning between operations (with PASSIVE, not at all), so every operation of
the forward pays for waking its workers. The model is loaded on one thread, so the loading
thread keeps no workers, and the engine's step thread sets the thread count of the thread
that made the engine. Helper threads (layer read-ahead, store prefetch) are left alone: giving
them one thread with `torch.set_num_threads(1)` made a served burst ~1.6x slower (not pinned
down; that call also clears oneDNN's primitive cache and lowers the count every new thread
starts with).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""What `set_passive_openmp` sets (`tuned_child_env` gives them to other processes or not)."""

SPIN_COUNT = 20000
"""Spins before an idle OpenMP worker sleeps (GNU OpenMP's own default is 300,000)."""

MMAP_THRESHOLD = 32 << 20
"""Blocks below this come from the heap, not a fresh mmap (glibc's upper limit)."""

TRIM_THRESHOLD = 1 << 30
"""Free heap kept mapped before glibc gives it back to the system."""

_M_TRIM_THRESHOLD = -1  # mallopt parameters, glibc's malloc.h
_M_MMAP_THRESHOLD = -3


def cache_home() -> Path:
    """`$XDG_CACHE_HOME/cachecraft`, else `~/.cache/cachecraft`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cachecraft"


def row_kernel_enabled() -> bool:
    """Whether float32 CPU attention may use our kernel: `CACHECRAFT_ROW_KERNEL` is not one of
    0, false, no, off (any case)."""
    value = os.environ.get("CACHECRAFT_ROW_KERNEL", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def cxx_compiler() -> str | None:
    """`$CXX`, else `g++` or `c++` on the PATH; None when there is none."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def child_env(python_path: str) -> dict[str, str]:
    """This process's environment for a child Python, with `python_path` first on its
    PYTHONPATH (a child started in another directory then imports the same package)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": python_path + (os.pathsep + path if path else "")}


TUNING_VAR = "CACHECRAFT_TUNING"
MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def tuning_enabled() -> bool:
    """False when `CACHECRAFT_TUNING` is 0, false, no or off (any case)."""
    value = os.environ.get(TUNING_VAR, "on").strip().lower()
    return value not in ("0", "false", "no", "off")


def tuned_child_env(base: dict[str, str], tuned: bool) -> dict[str, str]:
    """`base` (a child's environment) with our OpenMP and allocator tuning given as variables
    any process honours (glibc reads the MALLOC_ ones at start; a `cachecraft` child sees them
    set and keeps them), or, with `tuned` False, without any of them and with
    `CACHECRAFT_TUNING=off`: the same settings for every system of a comparison either way."""
    env = {k: v for k, v in base.items() if k not in (*OPENMP_WAIT_VARS, *MALLOC_VARS)}
    if not tuned:
        env[TUNING_VAR] = "off"
        return env
    env.pop(TUNING_VAR, None)
    env.update(
        OMP_WAIT_POLICY="PASSIVE",
        GOMP_SPINCOUNT=str(SPIN_COUNT),
        MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD),
        MALLOC_TRIM_THRESHOLD_=str(TRIM_THRESHOLD),
    )
    return env


def set_passive_openmp() -> None:
    """OMP_WAIT_POLICY=PASSIVE with a short spin, unless the user chose otherwise or turned
    tuning off; call before importing torch."""
    if not tuning_enabled():
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))


def tune_allocator() -> bool:
    """Keep glibc from handing every large tensor a fresh mmap that the kernel must zero and
    fault in page by page, then unmap on free: a forward allocates hundreds of activations
    of 0.5-5 MB, and on this CPU their page faults made a full prefill of 800 tokens ~10%
    slower (elementwise operations ran at half speed). Process-wide and idempotent; True when
    applied (glibc on Linux, and the user set neither MALLOC_ variable)."""
    if not sys.platform.startswith("linux") or not tuning_enabled():
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    return mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Run the block with `num_threads` torch threads on this thread, then restore its count.
    Loading the model under `torch_threads(1)` keeps the loading thread from starting OpenMP
    workers that would outlive the load: once the workers of all teams outnumber the cores,
    GNU OpenMP stops spinning and every operation of the engine's step pays to wake its
    workers (docs/performance.md)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
