"""Reuse arithmetic of cache-craft.md §2-§3: CCI, prefix overlap (beta), order penalty (gamma),
Cache Fix Overhead (CFO). Token selection lives in `selectors.py`.

Pure math on floats, ids and VariantMeta; no torch, no store access, no state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from cachecraft.config import check_fields, ranged
from cachecraft.store.meta import VariantMeta

EmptyRule = Literal["paper", "safe"]


@dataclass(frozen=True, slots=True)
class ScoringRules:
    """How a strategy scores a stored variant (cache-craft.md §3); the parameters of every
    strategy that scores variants start with these."""

    empty_s_old: EmptyRule = "safe"
    """S_old empty: 'paper' sets beta = 1 (free reuse); 'safe' sets beta = 0 when the new
    prefix holds any chunk, so the fix is alpha x CCI."""
    novel_prefix_min_fix: float = ranged(0.0, 0.0, 1.0)
    """Smallest CFO of a chunk whose new prefix holds chunks absent from its S_old."""
    beta_rule: Literal["honest", "paper"] = "honest"
    """'honest': beta also counts the attention the chunk would put on chunks now in front of
    it that were not in S_old, and the variant with the lowest predicted error wins; 'paper':
    only S_old's mass, the lowest CFO wins."""
    prefix_mismatch_penalty: float = ranged(0.5, 0.0, 1.0)
    """beta' is scaled by (1 - this) when a variant was made under another system prefix."""
    use_order_penalty: bool = True
    """beta' = beta x (1 - gamma), gamma the share of S_old's chunk pairs now in another order."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True)
class Scoring(ScoringRules):
    """ScoringRules with the user's CFO bounds (ReuseConfig's alpha, min_fix, max_fix)."""

    alpha: float = ranged(0.5, 0.0)
    min_fix: float = ranged(0.0, 0.0, 1.0)
    max_fix: float = ranged(1.0, 0.0, 1.0)

    @classmethod
    def of(cls, alpha: float, min_fix: float, max_fix: float, rules: ScoringRules) -> Scoring:
        fields = {f: getattr(rules, f) for f in ScoringRules.__dataclass_fields__}
        return cls(alpha=alpha, min_fix=min_fix, max_fix=max_fix, **fields)


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def cci(
    inter: Sequence[Sequence[float]],
    intra: Sequence[float],
    s_old_sizes: Sequence[int],
    num_tokens: int,
) -> float:
    """Cache Context Impact of a chunk of `num_tokens` tokens, in [0.5, 1].

    inter[j][l]: mass layer l put on old chunk j (of s_old_sizes[j] tokens); intra[l]: own mass.
    abar = mean_l sum_j inter[j][l] / (n |C_j|), bbar = mean_l intra[l] / n^2,
    CCI = sigmoid(abar / bbar). No old chunks -> 0.5; bbar == 0 -> 1.0 if abar > 0 else 0.5.
    """
    if len(inter) != len(s_old_sizes):
        raise ValueError("inter and s_old_sizes need one entry per old chunk")
    num_layers = len(intra)
    if not inter or num_layers == 0 or num_tokens <= 0:
        return 0.5
    n = float(num_tokens)
    abar = 0.0
    for per_layer, size in zip(inter, s_old_sizes, strict=True):
        if size > 0:
            abar += sum(per_layer) / (n * size)
    abar /= num_layers
    bbar = sum(intra) / (n * n * num_layers)
    if bbar <= 0.0:
        return 1.0 if abar > 0.0 else 0.5
    return _sigmoid(abar / bbar)


def stats_layers(stride: int, num_layers: int) -> tuple[int, ...]:
    """The layers a variant's statistics are measured at: the middle layer of every run of
    `stride` (stride // 2, stride // 2 + stride, ...; the middle one when stride spans them
    all); stride 1: every layer."""
    if stride < 1 or num_layers < 1:
        raise ValueError(f"need stride >= 1 and num_layers >= 1, got {stride}, {num_layers}")
    return tuple(range(min(stride // 2, (num_layers - 1) // 2), num_layers, stride))


def prefix_overlap(meta: VariantMeta, s_new: Sequence[str], empty_rule: EmptyRule) -> float:
    """beta: share of the variant's layer-summed inter mass whose source chunk is still in s_new.

    S_old empty: 'paper' -> 1.0; 'safe' -> 0.0 if s_new is non-empty, else 1.0.
    S_old non-empty with zero total mass: the plain fraction of S_old entries found in s_new.
    """
    if empty_rule not in ("paper", "safe"):
        raise ValueError(f"empty_rule must be 'paper' or 'safe', got {empty_rule!r}")
    if not meta.s_old:
        if empty_rule == "paper":
            return 1.0
        return 0.0 if s_new else 1.0
    present = set(s_new)
    totals = meta.inter_total()
    total = sum(totals)
    if total <= 0.0:
        kept = sum(1 for key in meta.s_old if key in present)
        return kept / len(meta.s_old)
    kept_mass = sum(mass for key, mass in zip(meta.s_old, totals, strict=True) if key in present)
    return kept_mass / total


def _first_ranks(keys: Sequence[str]) -> dict[str, int]:
    ranks: dict[str, int] = {}
    for rank, key in enumerate(keys):
        ranks.setdefault(key, rank)
    return ranks


def order_penalty(s_old: Sequence[str], s_new: Sequence[str]) -> float:
    """gamma: normalised Kendall-tau distance D / (m(m-1)/2) between the orders of the m chunks
    common to s_old and s_new (a repeated key counts at its first occurrence); 0 if m < 2."""
    old_rank = _first_ranks(s_old)
    new_rank = _first_ranks(s_new)
    common = [key for key in old_rank if key in new_rank]  # in s_old order
    m = len(common)
    if m < 2:
        return 0.0
    new_order = [new_rank[key] for key in common]
    discordant = sum(1 for a in range(m) for b in range(a + 1, m) if new_order[a] > new_order[b])
    return discordant / (m * (m - 1) / 2)


def _clamp(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def cache_fix_overhead(
    cci: float,
    beta: float,
    gamma: float,
    config: Scoring,
    has_novel_prefix: bool,
) -> tuple[float, float]:
    """Return (beta', CFO).

    beta' = beta * (1 - gamma) (just beta with config.use_order_penalty off);
    CFO = clamp(alpha * CCI * (1 - beta'), min_fix, max_fix), raised to novel_prefix_min_fix when
    the new prefix holds a chunk absent from S_old, then kept within [0, max_fix] and [0, 1].
    """
    beta_adj = beta * (1.0 - gamma) if config.use_order_penalty else beta
    cfo = _clamp(config.alpha * cci * (1.0 - beta_adj), config.min_fix, config.max_fix)
    if has_novel_prefix:
        cfo = min(max(cfo, config.novel_prefix_min_fix), config.max_fix)
    return beta_adj, _clamp(cfo, 0.0, 1.0)
