"""The offline step loop: drive a caller-driven Engine until every request finished.

`LLM.generate` and `answer` run here, so offline answers, benchmarks and the server share one
scheduler, one batched forward and one decode loop (as nano-vllm's `LLM` is its engine plus a
step loop). Stop strings end a request the way the server ends one: the text stream sees the
stop, the handle stops the request, the next step frees it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachecraft.engine.engine import Engine, RequestExtras, RequestOptions
from cachecraft.engine.handle import Failed, Finished, PromptLogprobs, RequestHandle, Token
from cachecraft.engine.report import RequestReport
from cachecraft.engine.sampling import SamplingParams, TokenLogprobs
from cachecraft.engine.scheduler import QueueFull
from cachecraft.engine.text import TextStream
from cachecraft.request import RagRequest
from cachecraft.reuse.strategy import ReuseStrategy


@dataclass(frozen=True, slots=True)
class Submission:
    """One request for `run_requests`; strategy None means the engine's default."""

    request: RagRequest
    sampling: SamplingParams
    strategy: ReuseStrategy | None = None
    budgets: list[int | None] | None = None
    options: RequestOptions | None = None


@dataclass(slots=True)
class Completion:
    """token_ids: generated ids (a final EOS/stop id included); text without it, cut before
    the first stop string. extras: see RequestExtras (None unless the submission had options).
    logprobs: one per generated id when the sampling asked for them (`SamplingParams.logprobs`);
    prompt_logprobs: one per prompt token, None for the first (`SamplingParams.prompt_logprobs`)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    report: RequestReport | None
    extras: RequestExtras | None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class _Tracked:
    def __init__(self, handle: RequestHandle, sub: Submission, tokenizer: Any) -> None:
        self.handle = handle
        self.sub = sub
        self.stream = TextStream(tokenizer, sub.sampling.stop) if sub.sampling.stop else None
        self.done: Completion | None = None
        self.error: BaseException | None = None
        self.logprobs: list[TokenLogprobs] | None = None if sub.sampling.logprobs is None else []
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None


def run_requests(engine: Engine, submissions: Sequence[Submission]) -> list[Completion]:
    """Submit all (stepping while the queue is full), step until all finished; completions in
    submission order. The first request that failed raises its error once all are done."""
    if not engine.caller_driven:
        raise ValueError("run_requests drives a caller_driven Engine")
    tokenizer = engine.runner.loaded.tokenizer
    tracked: list[_Tracked] = []
    try:
        _loop(engine, list(submissions), tracked, tokenizer)
    except BaseException:
        # a bad submission (or an interrupt): leave the engine empty for the next call
        for t in tracked:
            t.handle.abort()
        while engine.has_work():
            engine.step()
        raise
    for t in tracked:
        if t.error is not None:
            raise t.error
    return [t.done for t in tracked if t.done is not None]


def _loop(
    engine: Engine, pending: list[Submission], tracked: list[_Tracked], tokenizer: Any
) -> None:
    while pending or any(t.done is None and t.error is None for t in tracked):
        while pending:
            sub = pending[0]
            try:
                handle = engine.submit(
                    sub.request, sub.sampling, sub.strategy, sub.budgets, options=sub.options
                )
            except QueueFull:
                if not engine.has_work():
                    raise
                break
            tracked.append(_Tracked(handle, pending.pop(0), tokenizer))
        engine.step()
        for t in tracked:
            _drain(t, tokenizer)


def _drain(t: _Tracked, tokenizer: Any) -> None:
    while (event := t.handle.poll()) is not None:
        if isinstance(event, PromptLogprobs):
            t.prompt_logprobs = [None, *event.entries]
        elif isinstance(event, Token):
            if t.logprobs is not None and event.logprobs is not None:
                t.logprobs.append(event.logprobs)
            if t.stream is not None:
                t.stream.add(event.token_id)
                if t.stream.stopped:
                    t.handle.stop()  # the next step frees it with reason "stop"
        elif isinstance(event, Finished):
            t.done = _completion(t, event, tokenizer)
        elif isinstance(event, Failed):
            t.error = event.error


def _completion(t: _Tracked, event: Finished, tokenizer: Any) -> Completion:
    ids = list(event.output_ids)
    if t.stream is not None and t.stream.stopped:
        text = t.stream.final_text()
    else:
        shown = ids[:-1] if event.finish_reason == "stop" and ids else ids
        text = tokenizer.decode(shown, skip_special_tokens=True).strip()
    return Completion(
        text, ids, event.finish_reason, event.report, event.extras, t.logprobs, t.prompt_logprobs
    )
