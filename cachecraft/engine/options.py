"""What one request may ask of the engine beyond sampling (teacher forcing, logits), what it
gets back, and the per-step record the engine keeps (StepStat). The server asks for none of it;
the benchmarks and `answer` do, through the same engine and step loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from cachecraft.engine.runner import PrefillOutcome
from cachecraft.model.kv import KVCache
from cachecraft.model.llama import LlamaModel
from cachecraft.model.step import SeqWork
from cachecraft.reuse.plan import RecomputePlan


class StepStat(NamedTuple):
    """One engine step: its prefills (and their computed rows), decodes, and wall time from
    the start of the forward to the last token pushed (sampling included)."""

    num_prefills: int
    num_prefill_rows: int
    num_decodes: int
    ms: float


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What a benchmark may ask of one request beyond sampling (the server asks none).

    forced: token ids teacher-forced right after the prompt; forced_logits row j is then the
    distribution for forced[j] given the prompt and forced[:j]. Decoding goes on from the
    prompt as if they had never been there. force_answer: once the request ends, teacher-force
    its own output the same way (the reference other modes are compared with). commit: False
    leaves the store as it was (no hits, misses or variants recorded).
    """

    forced: tuple[int, ...] = ()
    force_answer: bool = False
    commit: bool = True


@dataclass(slots=True)
class RequestExtras:
    """Sent with Finished to a request submitted with options: its plan (as executed), the
    prompt positions computed (rows [n]) and the last layer of each, the prompt's next-token
    logits [vocab] and the teacher-forced logits [m, vocab] (None unless asked)."""

    plan: RecomputePlan | None = None
    rows: torch.Tensor | None = None
    rows_last_layer: torch.Tensor | None = None
    first_logits: torch.Tensor | None = None
    forced_logits: torch.Tensor | None = None


def force_tokens(
    model: LlamaModel, kv: KVCache, outcome: PrefillOutcome, forced: list[int]
) -> torch.Tensor:
    """Logits [m, vocab] for each of `forced` given the n-token prompt in `kv` and the
    forced tokens before it; leaves kv.length at n (decoding rewrites those positions)."""
    n = outcome.report.prompt_tokens
    kv.length = n
    pos = torch.arange(n, n + len(forced), device=kv.k.device)
    work = SeqWork(kv, torch.tensor(forced, device=kv.k.device), pos, logits_for="all")
    logits = model.forward_step([work])[0].logits
    kv.length = n
    return torch.cat([outcome.first_logits[None], logits[:-1]])
