"""ReuseConfig (the planner's knobs, checked when made) and the modes. The other settings live
with their owner: StoreConfig (store/config.py), EngineConfig (engine/engine.py), ServerConfig
(server/config.py); the model is chosen by path (`load_model`). Environment variables: env.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

Mode = Literal[
    "full", "prefix", "naive", "cacheblend", "epic", "random", "prophet", "cachecraft-paper",
    "cachecraft",
]  # fmt: skip
MODES: tuple[str, ...] = (
    "full", "prefix", "naive", "cacheblend", "epic", "random", "prophet", "cachecraft-paper",
    "cachecraft",
)  # fmt: skip
"""`cachecraft` (default): CFO budgets spent by need on the tokens the question reads (a probe
pass); `cachecraft-paper`: the paper's rules (lowest CFO, stored-score tokens, early exit);
`prophet`: question attention alone, one global budget (ProphetKV-style baseline)."""


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
    beta_rule: Literal["honest", "paper"] = "honest"
    """'honest': beta also counts the attention the chunk would put on chunks now in front of
    it that were not in S_old (estimated from its attention per old-context token), and the
    variant with the lowest predicted error is used; 'paper': only S_old's mass (cachecraft-paper
    always uses it)."""
    prefix_mismatch_penalty: float = 0.5
    """beta' is scaled by (1 - this) when a variant was made under another system prefix."""
    refresh_error: float | None = None
    """Predicted error above which a reused chunk is computed in full instead and offered as a
    new variant (None: never)."""
    inherit_error: bool = True
    """cachecraft: a chunk in front that is itself reused counts in beta only by (1 - its
    predicted error): staleness passes down the prompt (ablation `cachecraft-no-inherit`)."""
    refresh_repeats: bool = True
    """cachecraft: a prompt this engine prefilled before (token for token) computes in full
    every chunk with no exact variant in its place and offers them, so from its next repeat
    on it is reused exactly, as a prefix cache serves a repeated prompt."""
    use_order_penalty: bool = True
    early_termination: bool = True
    et_layer: int | None = None
    """cachecraft-paper: layer after which unfocused chunks stop being recomputed; None =
    num_layers // 3. (cachecraft's `need` split folds it into the probe's budget split.)"""
    focus_threshold: float = 0.05
    """A chunk is unfocused when its share of the question's attention to chunks is below this."""
    probe_split: Literal["need", "global", "chunk"] = "global"
    """cachecraft: how the probe spends the request's CFO budget: 'global' (top tokens of all
    reused chunks by question attention), 'need' (by predicted error x question attention;
    chunks below focus_threshold get none) or 'chunk' (each chunk its own CFO budget)."""
    probe_first_layer: int = 0
    probe_last_layer: int | None = None
    """Layers whose question attention the probe averages (None: set by probe_depth). The
    probe runs up to probe_last_layer only."""
    probe_depth: float = 1.0
    """When probe_last_layer is None: the share of the model's layers the probe runs, from
    layer 0 (last layer ceil(probe_depth x L) - 1; 1.0: every layer). Its cost is counted
    as rows x layers run / L."""
    probe_blend: float = 0.0
    """Weight of the stored score added to the question attention (both scaled per chunk)."""
    probe_check: float = 3.0
    """cachecraft: after the probe, the top probe_check x budget tokens by its ranking run to
    probe_check_layer, where the budget tokens whose K/V deviate most, weighted by question
    attention (probe_check_score), keep going; 0: the probe's ranking alone decides."""
    probe_check_layer: int = 3
    """The layer whose fresh-minus-cached K/V the check measures (the candidates run through
    layers 0..probe_check_layer). 3, not CacheBlend's 1: on four workloads (wiki-qa, synthetic,
    permuted chunks, chat history as chunks) the deviation measured two layers deeper picked
    better tokens at the same computed tokens (paired TF-KL CIs excluding 0 on all four), for
    0.7-3.4% more of the prompt's FLOPs (ablation `cachecraft-check-layer1`)."""
    probe_sink: int = 4
    """cachecraft: the first probe_sink tokens of every probed chunk rank above all others in
    the probe's ranking (a chunk's first tokens stood at its start when it was cached: its own
    attention sink); the check layer still weighs them by their K/V deviation. 0: question
    attention alone ranks them (ablation `cachecraft-no-sink`)."""
    probe_last_row: float = 0.5
    """cachecraft and prophet: the share of the probe's measure taken from the question's last
    row (the one the first answer token comes from); the rest is the mean over every question
    row. Same cost: every row runs. 0.5 beat 0.0 (every row alike, ablation
    `cachecraft-every-row`) on both KLs on wiki-qa, chat history, short and permuted chunks;
    1.0 (the last row alone, `cachecraft-last-row`) lost TF-KL on short chunks."""
    probe_max_cost: float | None = 0.5
    """cachecraft: the probe costs (rows x layers run / L) at most this many times the
    recompute budget it steers. Above that (a long question over few reused tokens) it is
    trimmed to the question's last rows that fit (probe_trim), the rows left out going to
    the budget; without probe_trim (or when not one row fits) it is skipped and its rows go
    to the budget instead: CFO budget + probe cost tokens (at most every reused token): each
    reused chunk's first probe_sink tokens, then the ones CacheBlend's K/V deviation check
    at probe_check_layer ranks highest across the chunks. Same computed tokens either way.
    1.0 until the twenty-ninth session (ablation `cachecraft-probe-at-budget`); None: always
    the whole probe (ablation `cachecraft-always-probe`)."""
    probe_skip_share: float = 1.0
    """cachecraft: the share of the probe's cost that probe_max_cost cut (the rows a trimmed
    probe leaves out, or a skipped probe's whole cost) added to the budget: 1.0, as many
    computed tokens as with the whole probe; 0.0, the CFO budget alone (the rows saved;
    ablations `cachecraft-trim-save`, `cachecraft-skip-at-budget`)."""
    probe_trim: bool = True
    """cachecraft: a probe over its probe_max_cost is trimmed instead of skipped: only the
    question's last rows that fit the cost run (the last one weighs probe_last_row), and the
    tokens are still chosen by question attention; skipped only when not one row fits.
    False (ablation `cachecraft-no-trim`): skipped, as until the thirty-third session."""
    probe_check_score: Literal["product", "deviation"] = "product"
    """At the check: 'product' ranks by question attention (to probe_check_power) x K/V
    deviation (the first-order change a token's stale K/V make to the question's attention
    output); 'deviation' by the deviation alone among the candidates (as power 0)."""
    probe_check_power: float = 0.75
    """At the check ('product'): the question attention enters the rank as attention ** this
    (1: the product; 0: the deviation alone among the candidates). The question's attention
    only estimates what the answer will read; 0.75 hedged it on chat history (seeds 22 / 23:
    0.74 -> 0.77 / 0.77 -> 0.81 of naive's TF-KL removed) and on wiki-qa at the same tokens,
    and tied on synthetic, permuted and short chunks, where 0.5 lost first-token KL
    (ablations `cachecraft-check-product` = 1, `cachecraft-check-sqrt` = 0.5)."""
    prophet_ratio: float = 0.2
    """prophet: share of the reused chunks' tokens recomputed (when no budget is given)."""
    cacheblend_ratio: float = 0.15
    cacheblend_global: bool = False
    """cacheblend: pick the top deviating tokens across all reused chunks, not per chunk."""
    cacheblend_check_layer: int = 1
    epic_k: int = 32
    seed: int = 0
    stats_stride: int = 3
    """A chunk computed in full to become a variant has its attention statistics (inter,
    intra, token scores) measured at every stats_stride-th layer, the middle one of each run
    (layers s // 2, s // 2 + s, ...); 1: every layer (ablation `cachecraft-stats-all`). They
    cost a miss's prefill ~4-5% at every layer and ~1-2% at a third of them; a third moved CCI
    by 0.01-0.02 and budgets by <0.5% of a chunk's tokens (docs/algorithm.md §2)."""

    def __post_init__(self) -> None:
        """Types, ranges and the Literal fields' choices, so a bad config file or keyword is one
        clear ValueError at start-up (and every ReuseConfig a planner sees is a valid one)."""
        for f in fields(self):
            value, kind = getattr(self, f.name), str(f.type)
            if value is None and "None" in kind:
                continue
            if kind.startswith("float") and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise ValueError(f"{f.name} must be a finite number, got {value!r}")
            if kind.startswith("int") and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{f.name} must be an integer, got {value!r}")
            if kind == "bool" and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be true or false, got {value!r}")
            if kind.startswith("Literal") and not isinstance(value, str):
                raise ValueError(f"{f.name} must be a string, got {value!r}")
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")
        if not 0.0 <= self.min_fix <= self.max_fix <= 1.0:
            raise ValueError(
                f"min_fix and max_fix must satisfy 0 <= min_fix <= max_fix <= 1, got "
                f"{self.min_fix} and {self.max_fix}"
            )
        if self.stats_stride < 1:
            raise ValueError(f"stats_stride must be >= 1, got {self.stats_stride}")
        if self.focus_threshold < 0:  # above 1: every chunk is unfocused (tests use it)
            raise ValueError(f"focus_threshold must be >= 0, got {self.focus_threshold}")
        for name in (
            "novel_prefix_min_fix", "cacheblend_ratio", "probe_last_row", "prefix_mismatch_penalty",
            "prophet_ratio", "probe_skip_share",
        ):  # fmt: skip
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in (
            "et_layer", "probe_first_layer", "probe_last_layer", "probe_check_layer", "probe_sink",
            "cacheblend_check_layer", "epic_k",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.beta_rule not in ("honest", "paper"):
            raise ValueError(f"beta_rule must be 'honest' or 'paper', got {self.beta_rule!r}")
        if self.probe_split not in ("need", "global", "chunk"):
            raise ValueError(f"probe_split must be need, global or chunk, got {self.probe_split!r}")
        if self.refresh_error is not None and self.refresh_error < 0.0:
            raise ValueError("refresh_error must be >= 0 (or None: never refresh)")
        if self.probe_blend < 0.0:
            raise ValueError("probe_blend must be >= 0")
        if self.probe_max_cost is not None and self.probe_max_cost < 0.0:
            raise ValueError("probe_max_cost must be >= 0 (or None: always probe)")
        if self.probe_check < 0.0:
            raise ValueError("probe_check must be >= 0 (0: no check layer)")
        if self.probe_check_power < 0.0:
            raise ValueError("probe_check_power must be >= 0")
        if self.probe_check_score not in ("product", "deviation"):
            raise ValueError(
                f"probe_check_score must be product or deviation, got {self.probe_check_score!r}"
            )
