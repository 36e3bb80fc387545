"""EngineConfig (the step loop's settings, checked when made), Liveness (what /health reads)
and EngineStopped; the Engine itself is in engine.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from cachecraft.reuse.strategies import STRATEGIES


class EngineStopped(RuntimeError):
    """The engine shut down before the request finished."""


class Liveness(NamedTuple):
    """What /health reads: is the step thread alive, and how long has its current unit of
    work (admits, calls, one step) been running (None: idle)."""

    is_alive: bool
    busy_s: float | None
    num_steps: int
    num_failed_requests: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """token_budget: rows per step (prefill rows computed + 1 per decode); max_running: cap on
    sequences holding a KV cache; max_queue: waiting requests before QueueFull (HTTP 429; a
    load generator sending hundreds at once, as vLLM's benchmark does, expects them queued);
    kv_pool_mib: most memory of the KV pool (max_running slots) that batches decode attention;
    a request that does not fit gets a cache of its own and decodes alone (0: no pool);
    chunked_prefill: a prefill larger than what is left of a step's budget runs in pieces over
    several steps, the others' decodes going on between them (plans whose in-forward checks
    need all rows at once always run whole); kv_warm_positions: positions of every free pool
    slot whose pages the step thread maps while it has nothing else to do (`KVPool.warm_step`;
    ~70 MB a slot for SmolLM2 at 1,024; 0: none). Caller-driven engines (`LLM`) never idle.
    admit_in_step: requests that arrived while a step ran are admitted (planned, prefetched,
    queued) right after its forward is launched and before its results are read, so that on an
    accelerator their planning runs while its kernels do (None: on an accelerator only; on a
    CPU the forward is over when it returns, so nothing would overlap)."""

    token_budget: int = 2048
    max_running: int = 16
    max_queue: int = 1024
    mode: str = "cachecraft"
    kv_pool_mib: int = 4096
    chunked_prefill: bool = True
    kv_warm_positions: int = 1024
    admit_in_step: bool | None = None

    def __post_init__(self) -> None:
        if self.mode not in STRATEGIES:
            names = ", ".join(STRATEGIES.names())
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {names}")
        for name in ("kv_pool_mib", "kv_warm_positions"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("token_budget", "max_running", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
