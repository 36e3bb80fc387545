"""The second stage of a plan (plan.SecondStage; ProphetKV's two stages): after the prefill
fixed the first stage's tokens, the question rows run again over that cache and measure the
attention they give each reused token; the most read of those the first stage did not
recompute are recomputed together with the question rows, whose last row then gives the
prompt's next-token logits.

The prefill measures that attention itself when it can (`question_meter`: its question rows
already run over the cache it fixes); one that collects span statistics for new variants
cannot carry a meter too, and the question rows then run once more to measure it, rewriting
their K/V with the values the prefill gave them. The recompute writes the picked tokens and
the question rows at every layer. Neither touches a computed chunk, so the
variants made from the prefill's rows and statistics stay what they were.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cachecraft.engine.hooks import DeviationSelect
from cachecraft.model.kv import KVCache
from cachecraft.model.llama import LlamaModel
from cachecraft.model.step import KeyMeter, SeqWork
from cachecraft.reuse.plan import RecomputePlan


@dataclass(slots=True)
class StageTwo:
    """What the second stage did: the prompt's next-token `logits` [vocab]; every prompt
    position computed (`rows` [n], ascending) and the last layer each ran through (`last`
    [n]), the prefill's and the second stage's merged; the rows it ran beyond the recomputed
    tokens (`extra_rows`: the probe's and the question's again) and their cost in full-depth
    rows (`extra_cost`)."""

    logits: torch.Tensor
    rows: torch.Tensor
    last: torch.Tensor
    extra_rows: int
    extra_cost: float


def question_meter(plan: RecomputePlan) -> KeyMeter | None:
    """The meter that makes the prefill itself the second stage's probe: its question rows
    measure the attention they give every earlier position (None: no second stage)."""
    stage = plan.second
    if stage is None:
        return None
    start = plan.layout.question_start
    return KeyMeter(start, stage.first_layer, stage.last_layer, stage.last_row)


def run_second_stage(
    model: LlamaModel,
    kv: KVCache,
    plan: RecomputePlan,
    rows: torch.Tensor,
    last: torch.Tensor,
    mass: torch.Tensor | None = None,
) -> StageTwo:
    """The second stage of `plan` over `kv`, which holds the prefill's result: `rows` [n] it
    computed (ascending) and the last layer of each (`last` [n]); `mass`: what the prefill's
    `question_meter` measured (None: the question rows run once more to measure it)."""
    stage = plan.second
    if stage is None:
        raise ValueError("the plan has no second stage")
    layout = plan.layout
    top = model.arch.num_layers - 1
    q_start, n = layout.question_start, layout.num_tokens
    q = n - q_start
    question = torch.arange(q_start, n, dtype=torch.long)
    question_ids = torch.tensor(layout.question_ids, dtype=torch.long)
    probe_rows, probe_cost = 0, 0.0
    if mass is None:  # the prefill could not measure it (it collected span statistics)
        depth = None if stage.last_layer >= top else torch.full((q,), stage.last_layer)
        probe = SeqWork(
            kv,
            question_ids,
            question,
            last_layer=depth,
            logits_for="none",
            meter=question_meter(plan),
        )
        mass = model.forward_step([probe])[0].key_mass
        assert mass is not None
        probe_rows, probe_cost = q, q * (stage.last_layer + 1) / (top + 1)
    wide = stage.tokens if stage.check <= 0 else math.ceil(stage.check * stage.tokens - 1e-9)
    att = mass.float().cpu()
    picked = _picked(plan, rows, last, att, top, wide)
    positions = torch.cat([picked, question])
    ids = torch.tensor([layout.token_ids[p] for p in picked.tolist()], dtype=torch.long)
    fix = SeqWork(kv, torch.cat([ids, question_ids]), positions)
    if picked.numel() > stage.tokens:  # candidates: the check keeps `tokens` of them
        weights = torch.zeros(n, dtype=torch.float32)
        weights[picked] = att[picked].double().pow(stage.check_power).float()
        spans = tuple((c.slot.start, c.slot.end, 0) for c in plan.chunks if c.variant is not None)
        check = DeviationSelect(spans, stage.tokens, weights)
        check.prepare(positions, kv.k.device)
        fix.hooks = {min(stage.check_layer, top): check}
        fix.hooks_need_old = True
    result = model.forward_step([fix])[0]
    logits = result.logits[-1]
    last_at = torch.full((n,), -1, dtype=torch.long)  # per prompt position (-1: not run)
    last_at[rows.cpu()] = last.cpu().long()
    ran = result.rows_last_layer.cpu().long()[: picked.numel()]
    last_at[picked] = torch.maximum(last_at[picked], ran)
    merged = torch.nonzero(last_at >= 0).flatten()
    return StageTwo(logits, merged, last_at[merged], probe_rows + q, probe_cost + q)


def _picked(
    plan: RecomputePlan,
    rows: torch.Tensor,
    last: torch.Tensor,
    mass: torch.Tensor,
    top: int,
    tokens: int,
) -> torch.Tensor:
    """Ascending positions of the `tokens` reused tokens the question attends to most (`mass`
    [question_start]), among those the prefill did not run through every layer (ties: the
    lower position)."""
    reused = torch.zeros(mass.shape[0], dtype=torch.bool)
    for cp in plan.chunks:
        if cp.variant is not None:
            reused[cp.slot.start : cp.slot.end] = True
    done = rows[last.cpu() >= top]
    reused[done[done < mass.shape[0]]] = False
    candidates = torch.nonzero(reused).flatten()
    if candidates.numel() == 0:
        return candidates
    order = torch.sort(-mass[candidates].double(), stable=True).indices[:tokens]
    return torch.sort(candidates[order]).values
