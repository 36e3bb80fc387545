"""vLLM at its best in `bench serve`: its plausible configurations tried on the same short
test, the best kept. Owns the search; `serve_bench` supplies the trial (start vLLM in a
configuration, warm it up as every system is warmed, then one burst of the same requests:
its throughput is the configuration's capacity).

The search is coordinate-wise from the configuration first used here (eager, our 2,048-token
step budget, no core reserved): each setting flipped alone (compiled graphs; vLLM's default
batched-token limit; one core kept for its front end), then every flip that beat the start
together, when two or more did. Four to five start-ups, not the eight of every combination:
the default `bench serve` stays within its time.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from cachecraft.errors import CachecraftError
from cachecraft_bench.peer_vllm import PeerConfig

logger = logging.getLogger(__name__)

Trial = Callable[[PeerConfig], dict[str, Any]]
"""`trial(config)` -> {"capacity_rps": float, ...} for vLLM in `config`; raising a
CachecraftError (it did not start) marks the configuration failed."""

START = PeerConfig()


def flips(start: PeerConfig = START) -> list[PeerConfig]:
    """`start`, then `start` with each setting changed alone."""
    return [
        start,
        dataclasses.replace(start, enforce_eager=not start.enforce_eager),
        dataclasses.replace(
            start, max_num_batched_tokens=None if start.max_num_batched_tokens else 2048
        ),
        dataclasses.replace(start, reserved_cpus=0 if start.reserved_cpus else 1),
    ]


def _combined(start: PeerConfig, winners: Sequence[PeerConfig]) -> PeerConfig:
    changes: dict[str, Any] = {}
    for config in winners:
        for field in dataclasses.fields(PeerConfig):
            value = getattr(config, field.name)
            if value != getattr(start, field.name):
                changes[field.name] = value
    return dataclasses.replace(start, **changes)


def search(
    trial: Trial,
    configs: Sequence[PeerConfig] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[PeerConfig, list[dict[str, Any]]]:
    """The best configuration by capacity, and every trial as {"config", "label",
    "capacity_rps", ...} or {"config", "label", "error"}. `configs` replaces the
    coordinate-wise search with a fixed list (one config: no trial at all)."""
    if configs is not None and len(configs) == 1:
        return configs[0], []
    tried: list[dict[str, Any]] = []
    scores: dict[PeerConfig, float] = {}

    def run(config: PeerConfig) -> None:
        if config in scores or any(t["config"] == config.as_dict() for t in tried):
            return
        record: dict[str, Any] = {"config": config.as_dict(), "label": config.label()}
        try:
            record.update(trial(config))
            scores[config] = float(record.get("capacity_rps") or 0.0)
        except CachecraftError as e:  # did not start, or answered nothing: not a candidate
            record["error"] = str(e).splitlines()[0][:300]
            logger.warning("vLLM in %s failed: %s", config.label(), record["error"])
        tried.append(record)
        if progress is not None:
            got = record.get("capacity_rps", record.get("error"))
            progress(f"tried {config.label()}: {got}")

    candidates = list(configs) if configs is not None else flips()
    for config in candidates:
        run(config)
    if configs is None and START in scores:
        winners = [c for c in candidates[1:] if scores.get(c, 0.0) > scores[START]]
        if len(winners) >= 2:
            run(_combined(START, winners))
    if not scores:
        raise CachecraftError("vLLM started in none of the configurations tried: " + str(tried))
    best = max(scores, key=lambda c: scores[c])
    return best, tried
