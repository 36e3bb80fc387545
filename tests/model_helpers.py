"""A model's greedy answer to a prompt, for tests that compare two forms of one model."""

from __future__ import annotations

import torch

from cachecraft.model.kv import KVCache
from cachecraft.model.llama import LlamaModel
from cachecraft.model.step import SeqWork


def greedy_run(model: LlamaModel, ids: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill `ids` (logits of every row), then `steps` greedy decode steps: the tokens and
    every logit row [len(ids) + steps, vocab]."""
    n = ids.shape[0]
    kv = KVCache(model.arch, n + steps + 1, torch.float32, "cpu")
    res = model.forward_step([SeqWork(kv, ids, torch.arange(n), logits_for="all")])[0]
    tokens, logits = [int(res.logits[-1].argmax())], [res.logits]
    for _ in range(steps):
        pos = torch.tensor([kv.length])
        step = model.forward_step([SeqWork(kv, torch.tensor(tokens[-1:]), pos)])[0]
        tokens.append(int(step.logits[0].argmax()))
        logits.append(step.logits)
    return tokens, torch.cat(logits)
