"""Our float32 CPU attention kernel (`csrc/row_attention.cpp`): built for this machine on first
use, cached, and loaded as the torch operator `torch.ops.cachecraft.row_attention`.

Why a kernel of our own: torch's CPU SDPA runs float32 attention far below its GEMMs' speed,
and a kernel like vLLM's CPU one does the same attention in well under half the time
(figures: docs/performance.md). It reads each K/V tile once for all the query heads of its KV
group, keeps scores for one tile of keys at a time, and takes each row's own causal limit
from its position, so scattered rows of a partial prefill need no mask tensor.

The build needs a C++ compiler (`$CXX`, else `g++`, else `c++`); it runs once per
machine, torch version and source (~0.1 MB; earlier builds are left in place, as another
checkout may use them), and lands in `cache_home()/kernels` (env.py), with the library's
SHA-256 in a sidecar (`<name>.so.sha256`) written after it. The library is loaded only when
its bytes match that hash: loading a truncated library (a partial copy, a full disk) killed
the process with SIGBUS, so a file that fails (truncated, garbage, empty, zeroed, or built
without a sidecar) is rebuilt once, and where that fails too attention runs on SDPA with a
warning. Where it cannot be built or loaded, or `CACHECRAFT_ROW_KERNEL=0` (env.py),
`load_row_kernel` returns None and attention runs on torch's SDPA (model/attention.py), with
the same results to float rounding.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_extension

from cachecraft.env import cache_home, cxx_compiler, row_kernel_enabled

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "row_attention.cpp"

VALUE_WIDTH = 16
"""The kernel's V (and output) width must be a multiple of this (one AVX-512 vector)."""

BUILD_TIMEOUT_S = 300
"""A compiler that has not finished by then is given up on (SDPA then)."""

RowKernel = Callable[..., None]
"""`kernel(q, k, v, q_pos, window, scale, out)`: see csrc/row_attention.cpp."""


def _cpu_signature() -> str:
    """What the build depends on besides source and torch: the CPU's instruction set
    (the build targets -march=native, so a cache shared between machines must not mix)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                flags += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


def _command(compiler: str, out: Path) -> list[str]:
    """The compiler command that builds SOURCE into `out` against this torch."""
    include = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    rpath = [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    # at::parallel_for is inlined OpenMP where torch was built with it: it needs -fopenmp here,
    # and resolves to the libgomp torch already loaded.
    openmp = ["-fopenmp"] if "OpenMP" in torch.__config__.parallel_info() else []
    return [
        compiler,
        "-O3",
        "-march=native",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-w",
        abi,
        *openmp,
        *include,
        str(SOURCE),
        "-o",
        str(out),
        *libs,
        "-lc10",
        "-ltorch_cpu",
        *rpath,
    ]


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def is_sound(target: Path) -> bool:
    """Whether the library's bytes match the hash recorded when it was built (False without
    a record: it cannot be told whole)."""
    try:
        return _sidecar(target).read_text().strip() == _digest(target)
    except OSError:
        return False


def build(compiler: str) -> Path:
    """The compiled library for this source, torch and CPU: from the cache when it matches its
    recorded hash, else built now (written under a temporary name, then renamed: concurrent
    builds never see a partial one; the hash's sidecar is written the same way, after it).
    Raises RuntimeError if the build fails or its result does not match its own hash."""
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(torch.__version__.encode())
    key.update(_cpu_signature().encode())
    key.update(" ".join(_command(compiler, Path("x"))[1:]).encode())  # the flags, not the compiler
    target = cache_home() / "kernels" / f"row_attention-{key.hexdigest()[:16]}.so"
    if is_sound(target):
        return target
    if target.exists():
        log.warning(
            "row-attention kernel %s does not match its recorded hash (damaged, truncated or "
            "built without one): rebuilding it",
            target,
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the row-attention kernel (once per machine and torch; ~6 s)")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        done = subprocess.run(
            _command(compiler, partial), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-2000:] or f"exit status {done.returncode}")
        digest = _digest(partial)
        os.replace(partial, target)
        record = Path(tmp) / "sha256"
        record.write_text(digest + "\n")
        os.replace(record, _sidecar(target))
    if not is_sound(target):  # another process replaced it meanwhile with a different build
        raise RuntimeError(f"the rebuilt kernel {target} does not match its hash")
    return target


@functools.cache
def load_row_kernel() -> RowKernel | None:
    """The kernel, built and loaded once per process; None (attention runs on SDPA) where it
    is switched off, no compiler is found, or the build or load fails (logged once)."""
    if not row_kernel_enabled():
        return None
    compiler = cxx_compiler()
    if compiler is None:
        log.warning("no C++ compiler found: attention runs on torch's SDPA (slower in float32)")
        return None
    try:
        path = build(compiler)
        if not hasattr(torch.ops.cachecraft, "row_attention"):  # one registration per process
            torch.ops.load_library(str(path))
        return torch.ops.cachecraft.row_attention
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("row-attention kernel unavailable, attention runs on torch's SDPA: %s", e)
        return None
