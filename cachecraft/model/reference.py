"""Plain, unbatched forward passes over a fresh KV: the reference our engine's answers and HF
transformers' forward are checked against, and what `bench model` times as "our prefill".

No store, no plan, no scheduler: one `forward_step` per call. Never used to serve requests.
"""

from __future__ import annotations

import torch

from cachecraft.model.kv import KVCache
from cachecraft.model.loader import LoadedModel
from cachecraft.model.step import SeqWork


def prefill(
    m: LoadedModel, ids: torch.Tensor, *, extra_capacity: int = 0, all_logits: bool = False
) -> tuple[torch.Tensor, KVCache]:
    """Prefill the n token ids [n] at positions 0..n-1 in a fresh KV (room for
    `extra_capacity` more); returns the logits ([n, vocab] if `all_logits`, else those of the
    last row) and the KV, ready for `greedy_tokens`."""
    kv = KVCache(m.arch, len(ids) + extra_capacity, m.model.dtype, m.model.device)
    work = SeqWork(kv, ids, torch.arange(len(ids)), logits_for="all" if all_logits else "last")
    return m.model.forward_step([work])[0].logits, kv


def greedy_tokens(m: LoadedModel, kv: KVCache, first_logits: torch.Tensor, n: int) -> list[int]:
    """n greedy tokens (EOS ignored) continuing the prompt in `kv`, one plain forward step
    each: the naive reference our forward's tokens are checked with against HF."""
    tokens = [int(first_logits.argmax())]
    while len(tokens) < n:
        pos = torch.tensor([kv.length])
        step = m.model.forward_step([SeqWork(kv, torch.tensor(tokens[-1:]), pos)])[0]
        tokens.append(int(step.logits[0].argmax()))
    return tokens
