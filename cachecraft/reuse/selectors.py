"""Token selectors: which offsets of a reused chunk are recomputed, and how a request's budget
is split across its reused chunks. One function per selector; pure Python, no torch.

* `top_scored`: the paper's selector, top-N by the stored score s(t).
* `first_n`: EPIC, the chunk's first N tokens.
* `random_n`: N distinct offsets from a seeded generator.
* `select_by_question`: resolve a plan's probe: spend its budget on the tokens the question
  rows attend to most (globally, per chunk, or by need), optionally blended with s(t) or
  with each chunk's first tokens ranked first, and optionally through a check layer that
  weighs question attention by K/V deviation.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import replace

from cachecraft.reuse.plan import ChunkPlan, DeviationCheck, RecomputePlan


def top_scored(scores: Sequence[float], n: int) -> tuple[int, ...]:
    """Offsets of the n highest scores (ties: lower offset first), sorted ascending."""
    n = min(max(n, 0), len(scores))
    ranked = sorted(range(len(scores)), key=lambda t: (-scores[t], t))
    return tuple(sorted(ranked[:n]))


def spread_by_size(
    extra: int, sizes: Mapping[int, int], start: Mapping[int, int] | None = None
) -> dict[int, int]:
    """Add `extra` tokens to `start` (default all 0), one at a time to the chunk furthest below
    its share by size (`sizes`: chunk -> tokens), never past a chunk's size."""
    base = {i: (start or {}).get(i, 0) for i in sizes}
    out = dict(base)
    total = sum(sizes.values())
    for k in range(max(extra, 0)):
        open_ = [i for i in sizes if out[i] < sizes[i]]
        if not open_:
            break
        i = max(open_, key=lambda j: (sizes[j] * (k + 1) / total - (out[j] - base[j]), -j))
        out[i] += 1
    return out


def first_n(num_tokens: int, n: int) -> tuple[int, ...]:
    return tuple(range(min(max(n, 0), num_tokens)))


def random_n(num_tokens: int, n: int, seed: str) -> tuple[int, ...]:
    """n distinct offsets of 0..num_tokens-1, sorted; the same for the same seed string."""
    rng = random.Random(seed)
    return tuple(sorted(rng.sample(range(num_tokens), min(max(n, 0), num_tokens))))


def _scaled(values: Sequence[float]) -> list[float]:
    top = max(values, default=0.0)
    return [v / top for v in values] if top > 0 else [0.0 for _ in values]


def _ranking_scores(cp: ChunkPlan, attention: Sequence[float], blend: float) -> list[float]:
    if blend <= 0 or cp.variant is None:
        return list(attention)
    att, stored = _scaled(attention), _scaled(cp.variant.token_scores)
    return [a + blend * s for a, s in zip(att, stored, strict=True)]


def _lift_sinks(scores: dict[int, list[float]], sink: int) -> dict[int, list[float]]:
    """Scores with each chunk's first `sink` offsets lifted above every score of every chunk
    (ranked first within and across chunks; still in their own order)."""
    if sink <= 0:
        return scores
    lift = 1.0 + max((max(s, default=0.0) for s in scores.values()), default=0.0)
    return {i: [v + lift if t < sink else v for t, v in enumerate(s)] for i, s in scores.items()}


def _global_counts(
    idx: Sequence[int],
    scores: dict[int, list[float]],
    weight: dict[int, float],
    total: int,
) -> dict[int, int]:
    """Per chunk, how many of the top `total` tokens of all chunks by weight x score it holds."""
    ranked = sorted(
        ((i, t) for i in idx if weight[i] > 0 for t in range(len(scores[i]))),
        key=lambda it: (-weight[it[0]] * scores[it[0]][it[1]], it[0], it[1]),
    )
    counts = dict.fromkeys(idx, 0)
    for i, _ in ranked[: max(total, 0)]:
        counts[i] += 1
    return counts


def _weights(
    plan: RecomputePlan, idx: Sequence[int], att: dict[int, Sequence[float]]
) -> dict[int, float]:
    """Per probed chunk, the multiplier of its tokens' scores under the plan's split."""
    probe = plan.probe
    assert probe is not None
    weight = dict.fromkeys(idx, 1.0)
    if probe.split == "need":
        mass = {i: sum(att[i]) for i in idx}
        total_mass = sum(mass.values())
        for i in idx:
            focus = mass[i] / total_mass if total_mass > 0 else 1.0 / len(idx)
            stale = plan.chunks[i].error
            stale = plan.chunks[i].cfo if stale is None else stale
            weight[i] = (stale or 0.0) if focus >= probe.focus_threshold else 0.0
    return weight


def select_by_question(
    plan: RecomputePlan, attention: Sequence[Sequence[float] | None]
) -> RecomputePlan:
    """Resolve `plan`'s probe. attention[i]: per token of chunk i, the attention the question
    rows gave it in the probe (None for chunks not probed).

    split "need":   the top `probe.total` tokens of all probed chunks by (chunk's predicted
                    error) x (token's question attention): a token is worth recomputing when
                    the question reads it and its chunk's K/V are stale. Chunks whose share
                    of the question's attention is below `probe.focus_threshold` get none
                    (early termination, decided before the forward instead of inside it).
    split "global": the top `probe.total` tokens by question attention alone (ProphetKV).
    split "chunk":  each chunk its own planned budget, top tokens by question attention.

    Without a check (`probe.check` 0) those tokens are the plan's (select "planned"). With it,
    the top ceil(check x budget) by the same ranking become candidates (select "deviation"):
    they run to `probe.check_layer`, where the plan's DeviationCheck keeps the budget (per
    chunk for "chunk", `probe.total` over all chunks otherwise) by question attention x K/V
    deviation. Returns the plan with no chunk left on "probe" (reason gains "+global" etc.).
    """
    probe = plan.probe
    if probe is None:
        return plan
    if len(attention) != len(plan.chunks):
        raise ValueError(f"attention has {len(attention)} entries for {len(plan.chunks)} chunks")
    idx = [i for i, c in enumerate(plan.chunks) if c.select == "probe"]
    att: dict[int, Sequence[float]] = {}
    for i in idx:
        a = attention[i]
        if a is None or len(a) != plan.chunks[i].slot.num_tokens:
            raise ValueError(f"chunk {i} needs one attention value per token")
        att[i] = a
    base = {i: _ranking_scores(plan.chunks[i], att[i], probe.blend) for i in idx}
    scores = _lift_sinks(base, probe.sink)
    judged = scores if probe.sink_kept else base  # what the check weighs a candidate by
    weight = _weights(plan, idx, att)
    if probe.split == "chunk":
        counts = {i: plan.chunks[i].budget for i in idx}
    else:
        counts = _global_counts(idx, scores, weight, probe.total)
    checked = probe.check > 0 and sum(counts.values()) > 0
    if checked:
        if probe.split == "chunk":
            wide = {i: math.ceil(probe.check * counts[i] - 1e-9) for i in idx}
        else:
            wide = _global_counts(idx, scores, weight, math.ceil(probe.check * probe.total - 1e-9))
    chunks = list(plan.chunks)
    weights: list[tuple[float, ...] | None] = [None] * len(chunks)
    power = probe.check_power if probe.check_score == "product" else 0.0  # 0: deviation alone
    for i in idx:
        reason = f"{chunks[i].reason}+{probe.split}"
        if not checked:
            picked = top_scored(scores[i], counts[i])
            chunks[i] = replace(
                chunks[i], recompute=picked, budget=len(picked), select="planned", reason=reason
            )
            continue
        picked = top_scored(scores[i], wide[i])
        weights[i] = tuple((weight[i] * judged[i][t]) ** power for t in picked)
        chunks[i] = replace(
            chunks[i],
            recompute=picked,
            budget=min(counts[i], len(picked)),
            select="deviation",
            reason=reason + "+check",
        )
    if not checked:
        return replace(plan, chunks=tuple(chunks))
    total = None if probe.split == "chunk" else probe.total
    check = DeviationCheck(probe.check_layer, total, tuple(weights))
    return replace(plan, chunks=tuple(chunks), deviation=check)
