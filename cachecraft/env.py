"""Every environment variable cachecraft reads or sets, in one place. Nothing else in the
library touches `os.environ` (the vLLM peer benchmark passes the environment on to its child).

* `XDG_CACHE_HOME` (read): where converted models are cached, `$XDG_CACHE_HOME/cachecraft`
  (default `~/.cache/cachecraft`).
* `OMP_WAIT_POLICY` (set by the `cachecraft` command to `PASSIVE` unless already set, before
  torch loads OpenMP): OpenMP's active waiting starves our own threads (README, "Threads").
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """`$XDG_CACHE_HOME/cachecraft`, else `~/.cache/cachecraft`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cachecraft"


def set_passive_openmp() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the user chose otherwise; call before importing torch."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
