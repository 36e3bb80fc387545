"""Batched attention of plain decode rows over a KVPool: one attention per layer per group.

Once per step the rows are sorted by slot and split into groups of neighbouring slots; a
group reads k[layer, first:end, :, :length] as one view (no copy), padded to its longest
context, with a key mask built once per step and shared by every layer (none when every slot
of the group decodes at the same length). The attention is two batched matmuls and a softmax
(one query row per head: cheaper per decode step than SDPA's flash kernel, with the same
values to ~1e-7); the scores read the pool's transposed keys (k_t) as a plain
GEMM operand. A pool of untransposed keys (bfloat16's, model/kv_pool.py) is read by SDPA
instead, with each KV head's query heads as its query rows: its batched matmuls would copy the
strided slices first, which makes them slower than SDPA there. A group grows while the
padding it reads stays small, so mixed context lengths split into a few calls instead of one
that reads mostly padding. Slots inside a group's range that do not decode get a zero query on key 0 only;
their output is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from cachecraft.errors import ContextLengthError
from cachecraft.model.kv_pool import KVPool
from cachecraft.model.step import DecodeBatch

PAD_SLACK = 0.25
"""A group may read this fraction more keys than its rows need (padding) ..."""
PAD_KEYS = 256
"""... plus this many: one SDPA call costs about what reading ~200 extra key positions of
SmolLM2's K/V costs on this CPU, so a few padded keys are cheaper than one more call."""


class DecodeGroup(NamedTuple):
    """Sorted decode rows `rows` (a slice) in slots first..end-1; keys 0..length-1 read.
    at [m]: slot - first per row (None: the rows are exactly slots first..end-1 in order);
    hidden [end - first, 1, 1, length] bool, True where a slot must not see a key (None:
    every slot sees every key)."""

    rows: slice
    first: int
    end: int
    length: int
    at: torch.Tensor | None
    hidden: torch.Tensor | None


@dataclass(slots=True)
class DecodePlan:
    """One step's decode rows, sorted by slot: order[i] is the DecodeBatch row at sorted
    row i (None: already sorted); slots, positions [B] sorted."""

    pool: KVPool
    order: torch.Tensor | None
    slots: torch.Tensor
    positions: torch.Tensor
    groups: list[DecodeGroup]


def plan_decode(batch: DecodeBatch, window: int | None, max_positions: int) -> DecodePlan:
    """Sort and group the rows, make room in the pool and set each cache's length."""
    caches = batch.caches
    pool = caches[0].pool
    if not isinstance(pool, KVPool) or any(kv.pool is not pool for kv in caches):
        raise ValueError("every cache of a DecodeBatch must be a live slot of one KVPool")
    slots = [kv.slot for kv in caches]
    positions = batch.positions.tolist()
    if len(set(slots)) != len(slots):
        raise ValueError("a DecodeBatch has two rows in one slot")
    top = max(positions) + 1
    if top > max_positions:
        raise ContextLengthError(top, max_positions)
    pool.grow(top)
    for kv, p in zip(caches, positions, strict=True):
        kv.length = max(kv.length, p + 1)
    order = sorted(range(len(slots)), key=slots.__getitem__)
    s = [slots[i] for i in order]
    p = [positions[i] for i in order]
    is_sorted = order == list(range(len(order)))
    device = pool.v.device
    return DecodePlan(
        pool,
        None if is_sorted else torch.tensor(order, device=device),
        torch.tensor(s, device=device),
        torch.tensor(p, device=device),
        _groups(s, p, window, device),
    )


def _groups(
    slots: list[int], positions: list[int], window: int | None, device: torch.device
) -> list[DecodeGroup]:
    groups = []
    i = 0
    while i < len(slots):
        first, length = slots[i], positions[i] + 1
        useful, j = length, i + 1
        while j < len(slots):
            grown, more = max(length, positions[j] + 1), useful + positions[j] + 1
            if (slots[j] + 1 - first) * grown - more > PAD_SLACK * more + PAD_KEYS:
                break
            length, useful, j = grown, more, j + 1
        groups.append(_group(slots[i:j], positions[i:j], i, first, length, window, device))
        i = j
    return groups


def _group(
    slots: list[int],
    positions: list[int],
    row0: int,
    first: int,
    length: int,
    w: int | None,
    device: torch.device,
) -> DecodeGroup:
    """One group; its index and mask tensors built on the host, kept on `device`."""
    end = slots[-1] + 1
    rows = slice(row0, row0 + len(slots))
    is_dense = end - first == len(slots)
    at = None if is_dense else (torch.tensor(slots) - first).to(device)
    needs_window = w is not None and length > w
    if is_dense and not needs_window and all(p + 1 == length for p in positions):
        return DecodeGroup(rows, first, end, length, at, None)
    # slots of the range that do not decode see key 0 only (no empty softmax row)
    limit = torch.zeros(end - first, dtype=torch.long)
    limit[torch.tensor(slots) - first] = torch.tensor(positions)
    keys = torch.arange(length)
    mask = keys[None, :] <= limit[:, None]
    if needs_window:
        assert w is not None
        low = torch.full((end - first,), -1, dtype=torch.long)
        low[torch.tensor(slots) - first] = torch.tensor(positions) - w
        mask &= keys[None, :] > low[:, None]
    return DecodeGroup(rows, first, end, length, at, (~mask[:, None, None, :]).to(device))


def attend_decode(
    plan: DecodePlan, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Write the rows' fresh (rotated) K/V into their slots, attend: q [B, H, D], k, v
    [B, Hkv, D] in sorted row order -> [B, H * D]."""
    pool = plan.pool
    kl, vl = pool.k_t[layer], pool.v[layer]  # [slots, Hkv, D, capacity], [slots, Hkv, capacity, D]
    kl[plan.slots, :, :, plan.positions] = k.to(kl.dtype)
    vl[plan.slots, :, plan.positions] = v.to(vl.dtype)
    sdpa = not pool.transposed_keys
    num_rows, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    out = torch.empty((num_rows, num_heads * head_dim), dtype=q.dtype, device=q.device)
    scale = head_dim**-0.5
    for g in plan.groups:
        n = g.end - g.first
        # GQA fold: the query heads of each KV head are its "query rows": [n, Hkv, group, D]
        qg = q[g.rows].view(-1, num_kv, group, head_dim)
        if g.at is not None:
            full = qg.new_zeros((n, num_kv, group, head_dim))
            full[g.at] = qg
            qg = full
        values = vl[g.first : g.end, :, : g.length].to(q.dtype)
        if sdpa:
            keys = pool.k[layer, g.first : g.end, :, : g.length].to(q.dtype)  # [n, Hkv, length, D]
            mask = None if g.hidden is None else ~g.hidden
            o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        else:
            keys_t = kl[g.first : g.end, ..., : g.length].to(q.dtype)  # [n, Hkv, D, length]
            scores = torch.matmul(qg * scale, keys_t)  # [n, Hkv, group, length]
            if g.hidden is not None:
                scores.masked_fill_(g.hidden, float("-inf"))
            o = torch.matmul(torch.softmax(scores, -1), values)
        if g.at is not None:
            o = o[g.at]
        out[g.rows] = o.reshape(-1, num_heads * head_dim)
    return out
