"""Which stored variant of a chunk to reuse at a place in a new prompt, and what it will cost.

Scores each variant (beta, gamma, beta', CFO: cache-craft.md §3) and its predicted error,
`CCI x (1 - beta')`: how much of the attention the chunk's K/V were made with is missing now.
Two rules for beta:

* "paper": the share of S_old's mass whose chunks are still in front. Blind to chunks now in
  front that were never in S_old, so the stalest variant can look perfect.
* "honest": those new chunks count too: the chunk is expected to put on them as much attention
  per token as it put on its old context, so beta = kept / (old mass + estimated new mass).
  A variant made under another system prefix has beta' scaled by (1 - prefix_mismatch_penalty).

Pure Python: no torch, no store access.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from cachecraft.reuse.stats import Scoring, cache_fix_overhead, order_penalty, prefix_overlap
from cachecraft.store.meta import VariantMeta


class VariantScore(NamedTuple):
    """One variant scored for one place in a new prompt."""

    variant: VariantMeta
    beta: float
    gamma: float
    beta_adj: float
    cfo: float
    error: float
    """Predicted error of reusing it here: CCI x (1 - beta'), in [0, 1]."""
    is_exact_here: bool
    """Its K/V are exactly what a full prefill computes here (exact, same prefix and S_old)."""


def _kept_shares(
    variant: VariantMeta, s_new: Sequence[str], s_new_sizes: Sequence[int]
) -> dict[str, float] | None:
    """Per chunk of S_old still in s_new, its share of the honest denominator: its mass over
    (S_old mass + (S_old mass per S_old token) x tokens of the s_new chunks absent from S_old);
    without recorded mass the same ratio over token counts. They add up to the honest beta.
    None when the denominator is 0 (nothing recorded and no tokens on either side)."""
    if len(s_new) != len(s_new_sizes):
        raise ValueError("s_new_sizes needs one size per chunk of s_new")
    old = set(variant.s_old)
    present = set(s_new)
    novel_tokens = sum(n for key, n in zip(s_new, s_new_sizes, strict=True) if key not in old)
    old_tokens = sum(variant.s_old_sizes)
    totals = variant.inter_total()
    total = sum(totals)
    if total <= 0.0:  # no mass recorded: weigh by tokens instead
        weights, denom = variant.s_old_sizes, float(old_tokens + novel_tokens)
    else:
        weights, denom = totals, total + total / max(old_tokens, 1) * novel_tokens
    if denom <= 0.0:
        return None
    return {k: w / denom for k, w in zip(variant.s_old, weights, strict=True) if k in present}


def honest_overlap(
    variant: VariantMeta,
    s_new: Sequence[str],
    s_new_sizes: Sequence[int],
    empty_rule: str,
    inherited: Mapping[str, float] | None = None,
) -> float:
    """beta counting the chunks in front now that were not in S_old.

    kept = S_old mass whose chunks are in s_new; new = (S_old mass per S_old token) x tokens of
    the s_new chunks absent from S_old. beta = kept / (S_old mass + new). Without recorded mass
    the same ratio is taken over token counts. S_old empty: as `prefix_overlap`'s rule.
    inherited: chunk key -> predicted error of that chunk in front as reused here; a kept
    chunk then counts by its share x (1 - its error).
    """
    if len(s_new) != len(s_new_sizes):
        raise ValueError("s_new_sizes needs one size per chunk of s_new")
    if not variant.s_old:
        return prefix_overlap(variant, s_new, empty_rule)  # type: ignore[arg-type]
    shares = _kept_shares(variant, s_new, s_new_sizes)
    if shares is None:
        return 1.0
    stale = inherited or {}
    return min(max(sum(w * (1.0 - stale.get(k, 0.0)) for k, w in shares.items()), 0.0), 1.0)


def score_variant(
    variant: VariantMeta,
    s_new: Sequence[str],
    config: Scoring,
    *,
    s_new_sizes: Sequence[int] | None = None,
    prefix_key: str | None = None,
    rule: str | None = None,
    inherited: Mapping[str, float] | None = None,
) -> VariantScore:
    """Score `variant` reused after the chunks `s_new` (sizes needed by the honest rule) under
    the system prefix `prefix_key` (None: assume it matches). rule: config.beta_rule if None.
    inherited (honest rule): chunk key -> predicted error of that chunk in front as reused
    here; a kept chunk counts in beta only by its share x (1 - its error), because K/V that
    were stale themselves are not the context this variant was computed over."""
    rule = rule or config.beta_rule
    if rule not in ("honest", "paper"):
        raise ValueError(f"beta rule must be 'honest' or 'paper', got {rule!r}")
    if rule == "honest":
        sizes = s_new_sizes if s_new_sizes is not None else [0] * len(s_new)
        beta = honest_overlap(variant, s_new, sizes, config.empty_s_old, inherited)
    else:
        beta = prefix_overlap(variant, s_new, config.empty_s_old)
    gamma = order_penalty(variant.s_old, s_new)
    same_prefix = prefix_key is None or variant.prefix_key == prefix_key
    old = set(variant.s_old)
    has_novel_prefix = any(key not in old for key in s_new)
    beta_adj, cfo = cache_fix_overhead(variant.cci, beta, gamma, config, has_novel_prefix)
    if rule == "honest" and not same_prefix:
        beta_adj *= 1.0 - config.prefix_mismatch_penalty
        _, cfo = cache_fix_overhead(variant.cci, beta_adj, 0.0, config, has_novel_prefix)
    error = min(max(variant.cci * (1.0 - beta_adj), 0.0), 1.0)
    exact_here = variant.is_exact and same_prefix and variant.s_old == tuple(s_new)
    return VariantScore(variant, beta, gamma, beta_adj, cfo, error, exact_here)


def choose_variant(
    variants: Sequence[VariantMeta],
    s_new: Sequence[str],
    config: Scoring,
    *,
    s_new_sizes: Sequence[int] | None = None,
    prefix_key: str | None = None,
    rule: str | None = None,
    inherited: Mapping[str, float] | None = None,
) -> VariantScore | None:
    """The variant to reuse, None if there is none.

    honest: lowest predicted error, then exact here, then larger beta', then the first.
    paper:  lowest CFO, then larger beta', then the first (the paper's rule).
    """
    rule = rule or config.beta_rule
    scores = [
        score_variant(
            v,
            s_new,
            config,
            s_new_sizes=s_new_sizes,
            prefix_key=prefix_key,
            rule=rule,
            inherited=inherited,
        )
        for v in variants
    ]
    if not scores:
        return None
    if rule == "paper":
        return min(scores, key=lambda s: (s.cfo, -s.beta_adj))  # min keeps the first of equals
    return min(scores, key=lambda s: (s.error, not s.is_exact_here, -s.beta_adj))
