"""ReuseConfig (the planner's knobs) and the modes. The other settings live with their owner:
StoreConfig (store/config.py), EngineConfig (engine/engine.py), ServerConfig (server/config.py);
the model is chosen by path (`load_model`). Environment variables: env.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["full", "prefix", "naive", "cacheblend", "epic", "random", "cachecraft"]
MODES: tuple[str, ...] = ("full", "prefix", "naive", "cacheblend", "epic", "random", "cachecraft")


@dataclass(frozen=True, slots=True)
class ReuseConfig:
    """Cache-Craft planning knobs (cache-craft.md §3-§4) and the baselines' budgets (§6)."""

    alpha: float = 0.5
    """CFO = clamp(alpha * CCI * (1 - beta'), min_fix, max_fix)."""
    min_fix: float = 0.0
    max_fix: float = 1.0
    empty_s_old: Literal["paper", "safe"] = "safe"
    """S_old empty: 'paper' sets beta = 1 (free reuse); 'safe' sets beta = 0 when the new prefix
    holds any chunk, so the fix is alpha * CCI."""
    novel_prefix_min_fix: float = 0.0
    """Minimum fix fraction for a chunk whose new prefix holds chunks absent from its S_old."""
    use_order_penalty: bool = True
    early_termination: bool = True
    et_layer: int | None = None
    """Layer after which unfocused chunks stop being recomputed; None = num_layers // 3."""
    focus_threshold: float = 0.05
    """A chunk is unfocused when its share of the question's attention to chunks is below this."""
    cacheblend_ratio: float = 0.15
    cacheblend_check_layer: int = 1
    epic_k: int = 32
    seed: int = 0
