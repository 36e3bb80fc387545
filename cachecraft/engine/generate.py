"""Single-sequence decoding over a KVCache whose prompt is already prefilled."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from cachecraft.engine.sampling import SamplingParams, make_generator, sample
from cachecraft.model.kv import KVCache
from cachecraft.model.llama import LlamaModel
from cachecraft.model.step import SeqWork


def decode(
    model: LlamaModel,
    kv: KVCache,
    first_logits: torch.Tensor,
    params: SamplingParams,
    eos_token_ids: tuple[int, ...] = (),
) -> Iterator[int]:
    """Yield generated tokens: the first from `first_logits` [vocab], then one step each."""
    gen = make_generator(params)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    logits = first_logits
    for i in range(params.max_tokens):
        token = sample(logits, params, gen)
        yield token
        if token in stops or i + 1 == params.max_tokens:
            return
        pos = torch.tensor([kv.length], device=kv.k.device)
        work = SeqWork(kv, torch.tensor([token]), pos)
        logits = model.forward_step([work])[0].logits[0]
