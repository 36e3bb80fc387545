"""The strategy names the lab runs, in the order its reports list them (light: no torch, so the
command line can offer them without loading the model stack)."""

from __future__ import annotations

LAB_MODES: tuple[str, ...] = (
    "full", "prefix", "naive", "cacheblend", "epic", "random", "prophet", "cachecraft-paper",
    "cachecraft",
)  # fmt: skip
"""The product's three and the baselines `cachecraft_bench.strategies.register` adds."""
