"""answer(): one request through the engine's step loop, with a benchmark's options.

Kept as a function for the quality benchmark: it runs the same engine, scheduler and decode
loop as `LLM.generate` and the server (a caller-driven Engine over the given Runner), asking
for teacher forcing and logits through `RequestOptions`. Returns the computed rows and their
last layers for FLOPs accounting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachecraft.engine.engine import Engine, EngineConfig, RequestOptions
from cachecraft.engine.offline import Submission, run_requests
from cachecraft.engine.report import RequestReport
from cachecraft.engine.runner import Runner
from cachecraft.engine.sampling import SamplingParams
from cachecraft.request import RagRequest
from cachecraft.reuse.plan import RecomputePlan


@dataclass(slots=True)
class Answer:
    """One answered request.

    token_ids: generated ids (a final EOS/stop id included); text without it.
    first_logits [vocab]: the prompt's next-token logits.
    forced_logits [m, vocab]: row j is the distribution for forced token j given the prompt
    and forced tokens < j (None unless `forced` or `force_answer` was given).
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
    engine = Engine(runner, EngineConfig(mode=mode), caller_driven=True)
    options = RequestOptions(tuple(forced or ()), force_answer, commit)
    done = run_requests(engine, [Submission(request, sampling, mode, budgets, options)])[0]
    extras = done.extras
    assert done.report is not None and extras is not None and extras.plan is not None
    assert extras.first_logits is not None and extras.rows is not None
    assert extras.rows_last_layer is not None
    return Answer(
        text=done.text,
        token_ids=done.token_ids,
        finish_reason=done.finish_reason,
        report=done.report,
        plan=extras.plan,
        first_logits=extras.first_logits,
        forced_logits=extras.forced_logits,
        rows=extras.rows,
        rows_last_layer=extras.rows_last_layer,
    )
