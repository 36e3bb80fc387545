"""The question probe: how much attention the question rows give each token of the reused
chunks, measured over the spliced (not yet fixed) cache before the prefill runs.

The probe runs the question rows (and the system prefix when the prefix cache does not hold
it) through layers 0..probe.last_layer over a scratch copy of the context the question can
already see: the prefix and the reused chunks. Chunks computed in this request hold no K/V
yet, so they are left out and the positions after them move up (keys re-rotated to their
probe positions). The request's own KVCache is only read, never written.
"""

from __future__ import annotations

import torch

from cachecraft.engine.hooks import QuestionAttention
from cachecraft.model.kv import KVCache
from cachecraft.model.llama import LlamaModel
from cachecraft.model.step import SeqWork
from cachecraft.reuse.plan import RecomputePlan


def probe_attention(
    model: LlamaModel, kv: KVCache, plan: RecomputePlan
) -> list[list[float] | None]:
    """Per chunk of `plan`, the question's attention on each of its tokens (mean over heads,
    question rows and the probe's layers); None for chunks not reused. `kv` must hold every
    layer of the reused chunks (and of the prefix when `plan.prefix_hit`)."""
    probe = plan.probe
    if probe is None:
        raise ValueError("the plan has no probe")
    layout = plan.layout
    p = layout.prefix_len
    src: list[int] = list(range(p))
    where: list[tuple[int, int] | None] = []  # per chunk: its span in the probe's context
    for cp in plan.chunks:
        if cp.variant is None:
            where.append(None)
            continue
        where.append((len(src), len(src) + cp.slot.num_tokens))
        src.extend(range(cp.slot.start, cp.slot.end))
    m, q = len(src), len(layout.question_ids)
    scratch = KVCache(model.arch, m + q, kv.k.dtype, kv.k.device)
    index = torch.tensor(src, dtype=torch.long, device=kv.k.device)
    dst = torch.arange(m, device=kv.k.device)
    keys = kv.k[:, :, index]  # [L, Hkv, m, D], rotated at their real positions
    if m and not torch.equal(index, dst):
        keys = model.rope.rotate(model.rope.unrotate(keys, index), dst)
    scratch.write(0, keys, kv.v[:, :, index])
    rows = list(range(m, m + q))
    ids = list(layout.question_ids)
    if not plan.prefix_hit:  # the prefix has no K/V yet: compute it in the probe as well
        rows = list(range(p)) + rows
        ids = list(layout.prefix_ids) + ids
    hook = QuestionAttention(question_start=m, context=m)
    n = len(rows)
    work = SeqWork(
        scratch,
        torch.tensor(ids, dtype=torch.long),
        torch.tensor(rows, dtype=torch.long),
        last_layer=torch.full((n,), probe.last_layer, dtype=torch.long),
        hooks=dict.fromkeys(range(probe.first_layer, probe.last_layer + 1), hook),
        logits_for="none",
    )
    model.forward_step([work])
    scores = hook.mean().tolist()
    return [None if w is None else scores[w[0] : w[1]] for w in where]
