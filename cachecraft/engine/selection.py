"""Resolve a plan's probe with tensor operations on the model's device.

The same choices as `reuse/selectors.select_by_question` (its docstring is the specification;
tests/test_selection.py holds the two equal), made without a Python loop over tokens: the
question's attention stays where the probe measured it, tokens are ranked by one stable sort
(ties to the lower chunk, then the lower offset, as the reference's sort keys order them), and
per-chunk counts are bincounts. The plan is pure data, so its picks come back to the host once,
in one transfer, after the ranking; scores are float64 as the reference's Python floats are.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from cachecraft.reuse.plan import DeviationCheck, RecomputePlan


def select_on_device(
    plan: RecomputePlan, where: list[tuple[int, int] | None], key_mass: torch.Tensor
) -> RecomputePlan:
    """`plan` with its probe resolved from key_mass [context] (the probe's KeyMeter measure, on
    any device) and per chunk its span in it (`Probe.where`)."""
    probe = plan.probe
    if probe is None:
        return plan
    if len(where) != len(plan.chunks):
        raise ValueError(f"where has {len(where)} entries for {len(plan.chunks)} chunks")
    idx = [i for i, c in enumerate(plan.chunks) if c.select == "probe"]
    sizes = []
    for i in idx:
        span = where[i]
        if span is None or span[1] - span[0] != plan.chunks[i].slot.num_tokens:
            raise ValueError(f"chunk {i} needs one attention value per token")
        sizes.append(span[1] - span[0])
    device = key_mass.device
    num = len(idx)
    if num == 0 or sum(sizes) == 0:
        return _resolved(plan, idx, [[] for _ in idx], [0] * num, None)
    f64 = torch.float64
    att = torch.cat([key_mass[where[i][0] : where[i][1]] for i in idx]).to(f64)  # type: ignore[index]
    sizes_t = torch.tensor(sizes, device=device)
    chunk_of = torch.repeat_interleave(torch.arange(num, device=device), sizes_t)  # [T]
    starts = torch.cumsum(sizes_t, 0) - sizes_t
    offset = torch.arange(att.shape[0], device=device) - starts[chunk_of]
    scores = att
    if probe.blend > 0:
        stored = torch.cat(
            [torch.tensor(plan.chunks[i].variant.token_scores, dtype=f64) for i in idx]  # type: ignore[union-attr]
        ).to(device)
        scores = _scaled(att, chunk_of, num) + probe.blend * _scaled(stored, chunk_of, num)
    judged = scores  # what the check weighs a candidate by
    if probe.sink > 0:
        lift = 1.0 + scores.max().clamp(min=0.0)
        scores = torch.where(offset < probe.sink, scores + lift, scores)
        judged = scores if probe.sink_kept else judged
    weight = _weights(plan, idx, att, chunk_of, num)  # per probed chunk, host floats
    eligible = sum(s for s, w in zip(sizes, weight, strict=True) if w > 0)
    order = _global_order(scores, chunk_of, weight, device)
    if probe.split == "chunk":
        counts = [plan.chunks[i].budget for i in idx]
    else:
        counts = _counts(order, chunk_of, num, min(max(probe.total, 0), eligible))
    checked = probe.check > 0 and sum(counts) > 0
    if checked:
        if probe.split == "chunk":
            wide = [math.ceil(probe.check * c - 1e-9) for c in counts]
        else:
            top = math.ceil(probe.check * probe.total - 1e-9)
            wide = _counts(order, chunk_of, num, min(max(top, 0), eligible))
    take = wide if checked else counts
    if probe.split == "chunk":
        picked = _top_per_chunk(scores, chunk_of, starts, take, device)  # bool [T]
    else:  # take counts the first sum(take) of `order`, which ranks a chunk's tokens as
        # _top_per_chunk does (by score, ties to the lower offset): those are the picks
        picked = torch.zeros(att.shape[0], dtype=torch.bool, device=device)
        picked[order[: sum(take)]] = True
    power = probe.check_power if probe.check_score == "product" else 0.0
    flat = torch.nonzero(picked).flatten()  # ascending: chunk by chunk, offsets in order
    values = None
    if checked:
        w = torch.tensor(weight, dtype=f64, device=device)[chunk_of[flat]]
        values = ((w * judged[flat]) ** power).tolist()
    # the one transfer of the picks to the host, then cut per chunk (no loop over tokens)
    per_chunk = torch.bincount(chunk_of[flat], minlength=num).tolist()
    offsets_host = (flat - starts[chunk_of[flat]]).tolist()
    offsets: list[list[int]] = []
    per_weights: list[list[float]] = []
    at = 0
    for count in per_chunk:
        offsets.append(offsets_host[at : at + count])
        per_weights.append([] if values is None else values[at : at + count])
        at += count
    return _resolved(plan, idx, offsets, counts, per_weights if checked else None)


def _scaled(values: torch.Tensor, chunk_of: torch.Tensor, num: int) -> torch.Tensor:
    """values / their chunk's max (0 where that max is not positive)."""
    top = torch.full((num,), -math.inf, dtype=values.dtype, device=values.device)
    top = top.scatter_reduce(0, chunk_of, values, "amax")
    per = top[chunk_of]
    return torch.where(per > 0, values / per.clamp(min=1e-300), torch.zeros_like(values))


def _weights(
    plan: RecomputePlan, idx: list[int], att: torch.Tensor, chunk_of: torch.Tensor, num: int
) -> list[float]:
    """Per probed chunk, the multiplier of its tokens' scores (reference: `_weights`)."""
    probe = plan.probe
    assert probe is not None
    if probe.split != "need":
        return [1.0] * num
    mass = torch.zeros(num, dtype=att.dtype, device=att.device).index_add_(0, chunk_of, att)
    masses = mass.tolist()
    total = sum(masses)
    out = []
    for i, m in zip(idx, masses, strict=True):
        focus = m / total if total > 0 else 1.0 / num
        stale = plan.chunks[i].error
        stale = plan.chunks[i].cfo if stale is None else stale
        out.append((stale or 0.0) if focus >= probe.focus_threshold else 0.0)
    return out


def _global_order(
    scores: torch.Tensor, chunk_of: torch.Tensor, weight: list[float], device: torch.device
) -> torch.Tensor:
    """Token indexes by (-weight x score, chunk, offset), tokens of weight-0 chunks last."""
    w = torch.tensor(weight, dtype=scores.dtype, device=device)[chunk_of]
    key = torch.where(w > 0, -w * scores, torch.full_like(scores, math.inf))
    return torch.sort(key, stable=True).indices


def _counts(order: torch.Tensor, chunk_of: torch.Tensor, num: int, n: int) -> list[int]:
    """Per chunk, how many of the first `n` tokens of `order` it holds."""
    if n <= 0:
        return [0] * num
    return torch.bincount(chunk_of[order[:n]], minlength=num).tolist()


def _top_per_chunk(
    scores: torch.Tensor,
    chunk_of: torch.Tensor,
    starts: torch.Tensor,
    take: list[int],
    device: torch.device,
) -> torch.Tensor:
    """bool [T]: per chunk its `take` highest scores (ties: lower offset first)."""
    by_score = torch.sort(-scores, stable=True).indices
    grouped = by_score[torch.sort(chunk_of[by_score], stable=True).indices]
    rank = torch.empty_like(grouped)
    rank[grouped] = torch.arange(grouped.shape[0], device=device) - starts[chunk_of[grouped]]
    limit = torch.tensor(take, device=device).clamp(min=0)[chunk_of]
    return rank < limit


def _resolved(
    plan: RecomputePlan,
    idx: list[int],
    offsets: list[list[int]],
    counts: list[int],
    weights: list[list[float]] | None,
) -> RecomputePlan:
    """The plan with the probed chunks' picks (reference: the end of select_by_question)."""
    probe = plan.probe
    assert probe is not None
    chunks = list(plan.chunks)
    for j, i in enumerate(idx):
        reason = f"{chunks[i].reason}+{probe.split}"
        picked = tuple(offsets[j])
        if weights is None:
            chunks[i] = replace(
                chunks[i], recompute=picked, budget=len(picked), select="planned", reason=reason
            )
        else:
            chunks[i] = replace(
                chunks[i],
                recompute=picked,
                budget=min(counts[j], len(picked)),
                select="deviation",
                reason=reason + "+check",
            )
    if weights is None:
        return replace(plan, chunks=tuple(chunks))
    all_weights: list[tuple[float, ...] | None] = [None] * len(chunks)
    for j, i in enumerate(idx):
        all_weights[i] = tuple(weights[j])
    total = None if probe.split == "chunk" else probe.total
    check = DeviationCheck(probe.check_layer, total, tuple(all_weights))
    return replace(plan, chunks=tuple(chunks), deviation=check)
