"""answer(): one request through a Runner — prefill, optional teacher forcing, decode, commit.

The single-request path shared by `LLM` and the quality benchmark. Owns no store or model
state; the Runner does. Returns the computed rows and their last layers for FLOPs accounting.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from cachecraft.engine.generate import decode
from cachecraft.engine.report import RequestReport
from cachecraft.engine.runner import Runner
from cachecraft.engine.sampling import SamplingParams
from cachecraft.engine.text import TextStream
from cachecraft.model.kv import KVCache
from cachecraft.model.llama import LlamaModel
from cachecraft.model.step import SeqWork
from cachecraft.request import RagRequest
from cachecraft.reuse.plan import RecomputePlan


@dataclass(slots=True)
class Answer:
    """One answered request.

    token_ids: generated ids (a final EOS/stop id included); text without it.
    first_logits [vocab]: the prompt's next-token logits.
    forced_logits [m, vocab]: row j is the distribution for forced token j given the prompt
    and forced tokens < j (None unless `forced` was given).
    rows [n]: prompt positions computed; rows_last_layer [n]: the last layer each ran through.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    report: RequestReport
    plan: RecomputePlan
    first_logits: torch.Tensor
    forced_logits: torch.Tensor | None
    rows: torch.Tensor
    rows_last_layer: torch.Tensor


def _force(
    model: LlamaModel, kv: KVCache, n: int, forced: list[int], first_logits: torch.Tensor
) -> torch.Tensor:
    """Logits [m, vocab] for each of `forced` given the n-token prompt in `kv` and the forced
    tokens before it; leaves kv.length at n."""
    kv.length = n
    pos = torch.arange(n, n + len(forced))
    work = SeqWork(kv, torch.tensor(forced), pos, logits_for="all")
    step = model.forward_step([work])[0].logits  # [m, vocab]
    kv.length = n
    return torch.cat([first_logits[None], step[:-1]])


def _until_stop(
    tokenizer: Any, first: int, rest: Iterator[int], stops: tuple[str, ...]
) -> tuple[list[int], str | None]:
    """Drain the generated tokens; with stop strings, end at the token that completes the
    first one. Returns (ids, the text before the stop string or None when none appeared)."""
    if not stops:
        return [first, *rest], None
    stream = TextStream(tokenizer, stops)
    ids: list[int] = []
    for token in itertools.chain([first], rest):
        ids.append(token)
        stream.add(token)
        if stream.stopped:
            return ids, stream.final_text()
    return ids, None


def answer(
    runner: Runner,
    request: RagRequest,
    sampling: SamplingParams,
    mode: str = "cachecraft",
    *,
    budgets: list[int | None] | None = None,
    forced: list[int] | None = None,
    force_answer: bool = False,
    commit: bool = True,
) -> Answer:
    """Prefill `request` in `mode`, teacher-force `forced` (if any) after the prompt, decode
    greedily/sampled per `sampling`, then (if `commit`) offer new variants to the store.

    force_answer: teacher-force the generated answer itself afterwards (forced_logits along
    token_ids, computed like those of `forced`: the reference for comparing other modes).
    report.ttft_ms covers planning, KV assembly, the prefill and sampling the first token.
    """
    loaded = runner.loaded
    model = loaded.model
    extra = sampling.max_tokens + (len(forced) if forced else 0)
    t0 = time.perf_counter()
    job, outcome = runner.prefill(request, mode, budgets, extra_capacity=extra)
    tokens = decode(model, job.kv, outcome.first_logits, sampling, loaded.eos_token_ids)
    first = next(tokens)
    outcome.report.ttft_ms = 1000 * (time.perf_counter() - t0)
    n = outcome.report.prompt_tokens
    forced_logits = None
    if forced:
        # Forced tokens go after the prompt; decoding then rewrites those positions.
        forced_logits = _force(model, job.kv, n, forced, outcome.first_logits)
    ids_out, text = _until_stop(loaded.tokenizer, first, tokens, sampling.stop)
    if force_answer:
        forced_logits = _force(model, job.kv, n, ids_out, outcome.first_logits)
    if commit:
        runner.commit(outcome)
    eos = set(loaded.eos_token_ids) | set(sampling.stop_token_ids)
    stopped = text is not None or (ids_out[-1] in eos and not sampling.ignore_eos)
    if text is None:
        text_ids = ids_out[:-1] if stopped else ids_out
        text = loaded.tokenizer.decode(text_ids, skip_special_tokens=True).strip()
    return Answer(
        text=text,
        token_ids=ids_out,
        finish_reason="stop" if stopped else "length",
        report=outcome.report,
        plan=job.plan,
        first_logits=outcome.first_logits,
        forced_logits=forced_logits,
        rows=job.rows,
        rows_last_layer=outcome.rows_last_layer,
    )
