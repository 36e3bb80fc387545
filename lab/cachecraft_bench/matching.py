"""How a baseline arm gets cachecraft's budget on one request, on equal tokens or equal FLOPs.

Equal tokens counts token-layers: every row computed through all layers is one token, and a row
that stopped early (cachecraft's probe rows, the check's candidates it stopped, CacheBlend's
tokens that ran only to its check layer) counts the share of layers it ran. Neither side gets
its partial rows free.

Equal FLOPs counts by position (`flops.py`): a late token attends over more keys and costs more
than an early one, so the same token-layers at other positions are other FLOPs. A baseline's
tokens are chosen while it runs (CacheBlend's by deviation, prophet's by the probe), so its
FLOPs are known only afterwards: `answer_at_flops` tries the arm at a few budgets (nothing
committed to its store) until its FLOPs fraction comes within `MATCH_TOLERANCE` of
cachecraft's, then answers once more at the closest budget and commits.

EPIC keeps its own shape throughout: one k for every reused chunk (its first k tokens, LegoLink),
the k whose cost comes closest, not cachecraft's per-chunk split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cachecraft.api import (
    Answer,
    RecomputePlan,
    ReuseStrategy,
    matched_budgets,
    probe_cost,
    rows_that_fit,
)
from cachecraft_bench.flops import ModelShape, flops_fraction, full_prefill_flops, token_flops

MATCH_TOLERANCE = 0.002
"""Per request, an arm's FLOPs fraction counts as matched within this of cachecraft's (a fifth
of a point; the report's compute-equal label allows half a point on the mean)."""
MAX_TRIALS = 6
"""Budgets tried per arm and request before the closest one is taken."""

Budgets = list[int | None]
Attempt = Callable[[Budgets, bool], Answer]
"""Answer the request with these per-chunk budgets; the bool: commit to the arm's store."""


@dataclass(frozen=True, slots=True)
class Source:
    """What a cachecraft arm's answer leaves for the arms matched to it."""

    answer: Answer
    extra: float
    """Its cost beyond its full-depth rows, in full-depth rows (`cost_beyond_rows`)."""
    flops: float
    """Its FLOPs fraction of the prompt's full prefill (`answer_flops`)."""


def answer_flops(got: Answer, shape: ModelShape) -> float:
    """`got`'s FLOPs as a fraction of its prompt's full prefill: its computed rows, each through
    the layers it ran, and its probe's rows, counted at the prompt's last positions (an upper
    bound on their attention cost)."""
    rows = got.rows.cpu().numpy()
    layers = (got.rows_last_layer + 1).cpu().numpy()
    probe = got.plan.probe
    n = got.report.prompt_tokens
    if probe is not None and got.report.probe_tokens:
        probe_rows = np.arange(n - got.report.probe_tokens, n)
        rows = np.concatenate([rows, probe_rows])
        layers = np.concatenate([layers, np.full(probe_rows.shape, probe.last_layer + 1)])
    return flops_fraction(shape, rows, n, layers)


def cost_beyond_rows(got: Answer, num_layers: int) -> float:
    """cachecraft's cost beyond its full-depth rows, in full-depth rows: the probe's rows x the
    share of layers they ran, plus the rows that stopped early (the check's candidates) x
    theirs."""
    layers = float((got.rows_last_layer + 1).sum()) / num_layers
    full_depth = float((got.rows_last_layer + 1 == num_layers).sum())
    return got.report.probe_cost + layers - full_depth


def token_budgets(mode: str, strategy: ReuseStrategy, source: Source, num_layers: int) -> Budgets:
    """Per chunk, the budget that gives an arm of `mode` the token-layers `source` spent.

    prophet pays its own (trimmed) probe out of the total; CacheBlend, whose every reused token
    runs to its check layer, keeps per chunk the b with b + (n - b) x s = the chunk's matched
    tokens (s: the share of layers up to its check); EPIC gets one k for every chunk."""
    got = source.answer
    extra = source.extra
    if mode == "prophet":
        spend = sum(b for b in matched_budgets(got.plan, extra=round(extra)) if b is not None)
        extra -= _prophet_probe_cost(got, strategy, num_layers, spend)
    budgets = matched_budgets(got.plan, extra=round(extra))
    sizes = [c.slot.num_tokens for c in got.plan.chunks]
    if mode == "cacheblend":
        s = min(strategy.params.cacheblend_check_layer + 1, num_layers) / num_layers
        budgets = [
            None if b is None else max(math.floor((b - n * s) / (1 - s) + 1e-9), 0)
            for b, n in zip(budgets, sizes, strict=True)
        ]
    if mode == "epic":
        target = sum(b for b in budgets if b is not None)
        return uniform(budgets, sizes, uniform_k(budgets, sizes, target))
    return budgets


def _prophet_probe_cost(got: Answer, strategy: ReuseStrategy, num_layers: int, spend: int) -> float:
    """What prophet's probe costs when `spend` tokens pay for it and for its recompute: its
    whole cost, or, when that is over probe_max_cost x what is left, the rows that fit."""
    p = strategy.params.probe
    layout, prefix_hit = got.plan.layout, got.plan.prefix_hit
    whole = probe_cost(layout, prefix_hit, p, num_layers)
    cap = p.probe_max_cost
    if not p.probe_trim or cap is None or whole <= cap * (spend - whole):
        return whole
    rows = max(rows_that_fit(layout, prefix_hit, p, num_layers, cap * spend / (1 + cap)), 1)
    return probe_cost(layout, prefix_hit, p, num_layers, rows)


def uniform_k(budgets: Budgets, sizes: Sequence[int], target: int) -> int:
    """EPIC's k: the one whose sum over reused chunks of min(k, size) is closest to `target`
    tokens (ties: the smaller k)."""
    reused = [n for b, n in zip(budgets, sizes, strict=True) if b is not None]
    totals = [sum(min(k, n) for n in reused) for k in range(max(reused, default=0) + 1)]
    return int(np.argmin([abs(t - target) for t in totals]))


def uniform(budgets: Budgets, sizes: Sequence[int], k: int) -> Budgets:
    """Each reused chunk's first k tokens (all of a shorter chunk); misses stay None."""
    return [None if b is None else min(k, n) for b, n in zip(budgets, sizes, strict=True)]


def scaled(budgets: Budgets, sizes: Sequence[int], total: int) -> Budgets:
    """`budgets` scaled to add up to `total` (in proportion to them, or to the chunks' sizes
    when they are all 0), none past its chunk's size."""
    reused = {i: n for i, (b, n) in enumerate(zip(budgets, sizes, strict=True)) if b is not None}
    room = sum(reused.values())
    total = min(max(total, 0), room)
    weights = {i: budgets[i] or 0 for i in reused}
    if not sum(weights.values()):
        weights = dict(reused)
    out: Budgets = [None] * len(budgets)
    left, weight = total, sum(weights.values())
    for i in sorted(reused, key=lambda j: weights[j] / reused[j]):  # the fullest last
        share = min(round(left * weights[i] / weight) if weight else 0, reused[i])
        out[i] = share
        left -= share
        weight -= weights[i]
    for i in sorted(reused, key=lambda j: -weights[j]):  # rounding left over
        add = min(left, reused[i] - (out[i] or 0))
        out[i] = (out[i] or 0) + add
        left -= add
    return out


def answer_at_flops(
    attempt: Attempt,
    mode: str,
    budgets: Budgets,
    source: Source,
    shape: ModelShape,
) -> tuple[Answer, int]:
    """The arm's answer at the budget whose FLOPs fraction comes closest to `source`'s, and the
    answers it took (the last one, committed, included). `budgets`: the token-matched start.
    The search runs on one number, the total budget (EPIC: its k), by secant steps kept inside
    the bracket found so far; more budget never costs fewer FLOPs."""
    plan = source.answer.plan
    sizes = [c.slot.num_tokens for c in plan.chunks]
    epic = mode == "epic"
    if epic:
        x = next((b for b in budgets if b is not None), 0) or 0
        top = max((n for b, n in zip(budgets, sizes, strict=True) if b is not None), default=0)
    else:
        x = sum(b for b in budgets if b is not None)
        top = sum(n for b, n in zip(budgets, sizes, strict=True) if b is not None)

    def spread(v: int) -> Budgets:
        return uniform(budgets, sizes, v) if epic else scaled(budgets, sizes, v)

    gaps: dict[int, float] = {}
    lo, hi = -1, top + 1  # budgets known to cost too little / too much
    slope = _slope(plan, shape, epic)
    while len(gaps) < MAX_TRIALS and x not in gaps:
        gaps[x] = answer_flops(attempt(spread(x), False), shape) - source.flops
        if abs(gaps[x]) <= MATCH_TOLERANCE:
            break
        if gaps[x] < 0:
            lo = max(lo, x)
        else:
            hi = min(hi, x)
        if lo in gaps and hi in gaps and gaps[hi] > gaps[lo]:  # secant inside the bracket
            step = lo + (hi - lo) * (-gaps[lo]) / (gaps[hi] - gaps[lo])
        else:
            step = x - gaps[x] / slope
        x = min(max(round(step), lo + 1), hi - 1)
        if not lo < x < hi:
            break
    best = min(gaps, key=lambda v: (abs(gaps[v]), v))
    return attempt(spread(best), True), len(gaps) + 1


def _slope(plan: RecomputePlan, shape: ModelShape, epic: bool) -> float:
    """A first guess at the FLOPs fraction one more unit of budget buys: a full-depth token at
    the reused chunks' mean position (EPIC: one per reused chunk)."""
    chunks = [c for c in plan.chunks if c.is_hit]
    n = plan.layout.num_tokens
    full = full_prefill_flops(**shape.as_kwargs(), seq_len=n)
    if not chunks or not full:
        return 1.0
    positions = [c.slot.start + c.slot.num_tokens // 2 for c in chunks]
    per_token = float(token_flops(shape, positions).mean()) / full
    return max(per_token * (len(chunks) if epic else 1), 1e-9)
