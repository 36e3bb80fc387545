"""Live: the engine-thread state of one request and its transitions (admitted, prefill started,
piece done, prefilled, token emitted, finished, dropped), and PromptMemory, the prompts the
engine prefilled with a strategy that remembers them (`ReuseStrategy.remembers_prompts`).

Only the step thread touches a Live; the scheduler sees its SeqState, never its tensors.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from cachecraft.engine.handle import Finished, Planned, PromptLogprobs, RequestHandle, Token
from cachecraft.engine.options import RequestExtras, RequestOptions, force_tokens
from cachecraft.engine.request import SeqState
from cachecraft.engine.runner import PrefillJob, PrefillOutcome, Runner, require_finite
from cachecraft.engine.sampling import (
    SamplingParams,
    TokenLogprobs,
    make_generator,
    prompt_token_logprobs,
)
from cachecraft.model.kv import KVCache
from cachecraft.model.step import SeqResult, merge_results
from cachecraft.request import RagRequest
from cachecraft.reuse.layout import PromptLayout
from cachecraft.reuse.plan import RecomputePlan
from cachecraft.reuse.strategies import FULL
from cachecraft.reuse.strategy import ReuseStrategy

log = logging.getLogger(__name__)

MAX_PROMPTS_SEEN = 1 << 16
"""Prompts the engine remembers to recognise a repeat (one int each)."""


class Offer(NamedTuple):
    """A chunk computed in full by a prefill under way, whose variant the store will take:
    its key, the keys in front of it (the prefix's, then the chunks') and whether its K/V will
    be exact."""

    key: str
    context: tuple[str, ...]
    is_exact: bool


class PromptMemory:
    """Hashes of the last MAX_PROMPTS_SEEN prompts prefilled by a strategy that remembers
    prompts: one sent again is a repeat (and refreshed)."""

    def __init__(self, capacity: int = MAX_PROMPTS_SEEN) -> None:
        self._seen: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity

    def __contains__(self, prompt_hash: object) -> bool:
        return prompt_hash in self._seen

    def remember(self, prompt_hash: int) -> None:
        """A prefill of this prompt is done: the next one is a repeat. Only prefills count, so
        the `n` choices of one request, submitted together, are not repeats of each other (nor
        is a reference run of another strategy a sighting)."""
        self._seen[prompt_hash] = None
        self._seen.move_to_end(prompt_hash)
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)


@dataclass(slots=True)
class Live:
    """Engine-thread state of one request (the tensors the scheduler never sees)."""

    handle: RequestHandle
    request: RagRequest
    sampling: SamplingParams
    strategy: ReuseStrategy
    budgets: list[int | None] | None
    t_submit: float
    state: SeqState | None = None
    plan: RecomputePlan | None = None
    job: PrefillJob | None = None
    generator: torch.Generator | None = None
    stops: frozenset[int] = field(default_factory=frozenset)
    outcome: PrefillOutcome | None = None
    layout: PromptLayout | None = None
    """Tokenized before submit (off the step thread), else by the first plan; every later
    plan reuses it."""
    options: RequestOptions | None = None
    extras: RequestExtras | None = None
    kv: KVCache | None = None
    """Its KV cache (a pool slot when one was free), kept across re-plans; freed after the
    step it finished in."""
    pieces: list[SeqResult] = field(default_factory=list)
    """Results of the pieces of a chunked prefill computed so far."""
    offers: frozenset[Offer] = frozenset()
    """The chunk-caches its prefill will offer the store (set when it starts)."""
    repeat: bool = False
    """Its strategy remembers prompts and an earlier request prefilled this very one with it
    (`ReuseConfig.refresh_repeats`)."""
    prompt_hash: int | None = None
    """Its prompt's hash, remembered once its prefill is done (`remembers_prompts` only)."""
    prompt_ids: tuple[int, ...] = ()
    """Its prompt's token ids, kept only for a repetition penalty (read at every token) or
    prompt log-probabilities."""
    prompt_entries: list[TokenLogprobs] = field(default_factory=list)
    """Prompt log-probabilities of the rows computed so far (`SamplingParams.prompt_logprobs`)."""

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    # ---- admitted -----------------------------------------------------------------------------
    def tokenize(self, runner: Runner, prompts: PromptMemory) -> None:
        """Its layout (unless given), the prompt ids it must keep and whether it is a repeat.
        Prompt log-probabilities need every prompt row's logits: nothing is reused then."""
        if self.sampling.prompt_logprobs is not None:
            self.strategy = FULL
        self.layout = self.layout or runner.layout(self.request)
        ids = self.layout.token_ids  # built once (a property that joins the slots)
        if self.sampling.repetition_penalty != 1 or self.sampling.prompt_logprobs is not None:
            self.prompt_ids = ids
        if self.strategy.remembers_prompts:
            self.prompt_hash = hash(ids)
            self.repeat = self.prompt_hash in prompts

    def admitted(self, plan: RecomputePlan, runner: Runner) -> Planned:
        """Its first plan made: its sequence state, sampler and stop ids set."""
        assert self.layout is not None
        max_ctx = runner.loaded.arch.max_position_embeddings
        # n output tokens need n - 1 fed back in: positions up to num_tokens + n - 2 < max_ctx.
        max_tokens = min(self.sampling.max_tokens, max_ctx - self.layout.num_tokens + 1)
        self.plan = plan
        self.state = SeqState(self.request_id, self.layout.num_tokens, plan.num_rows, max_tokens)
        self.state.can_split = plan.early_exit is None and plan.deviation is None
        self.generator = make_generator(self.sampling)
        eos = () if self.sampling.ignore_eos else runner.loaded.eos_token_ids
        self.stops = frozenset((*eos, *self.sampling.stop_token_ids))
        return Planned(self.layout.num_tokens, max_tokens)

    # ---- the prefill --------------------------------------------------------------------------
    def is_starting(self) -> bool:
        """Its prefill has no job yet, or none of its rows ran: (re)start it this step."""
        assert self.state is not None
        return self.job is None or self.state.num_done_rows == 0

    def is_prefilling(self) -> bool:
        """Its prefill started and has not finished (its new variants are not stored yet)."""
        return self.job is not None and self.state is not None and self.outcome is None

    def started(self) -> None:
        """Its job was (re)built this step: no rows done, every row of the job to compute."""
        assert self.job is not None and self.state is not None
        work = self.job.work
        self.pieces, self.state.num_done_rows = [], 0
        self.state.num_prefill_rows = len(self.job.rows)  # a re-plan may have changed it
        self.state.can_split = not work.hooks and work.last_layer is None

    def ask_logits(self) -> None:
        """Prompt log-probabilities need every prompt row's logits (`keep_prompt_logprobs`)."""
        if self.sampling.prompt_logprobs is not None and self.job is not None:
            self.job.work.logits_for = "all"

    def prefill_result(self, result: SeqResult, span: tuple[int, int]) -> SeqResult | None:
        """Rows span[0]..span[1]-1 of its prefill ran: the whole prefill's result once the last
        piece is in (None: more pieces to come)."""
        assert self.job is not None and self.state is not None
        if self.sampling.prompt_logprobs is not None:
            result = self.keep_prompt_logprobs(result, span[0])
        if result.rows_last_layer.shape[0] < len(self.job.rows):  # a piece
            self.pieces.append(result)
            self.state.num_done_rows = span[1]
            if self.state.num_done_rows < len(self.job.rows):
                return None
            result = merge_results(self.pieces)
        self.pieces = []
        self.state.num_done_rows = len(self.job.rows)
        return result

    def keep_prompt_logprobs(self, result: SeqResult, start: int) -> SeqResult:
        """A prefill result (the whole prompt, or one piece) with every row's logits: the rows
        become prompt log-probabilities (row at position p: the prompt's token p + 1), and only
        the last row's logits stay (the next token's, once the last piece is in). `start`: the
        piece's first row (a prefill run again whole after a failed step starts at 0)."""
        assert self.job is not None and self.plan is not None
        require_finite(result.logits)  # every row becomes a log-probability
        ids = self.prompt_ids
        m = result.logits.shape[0]
        start = 0 if m == len(self.job.rows) else start
        if start == 0:
            self.prompt_entries = []
        positions = self.job.rows[start : start + m]
        keep = positions < len(ids) - 1
        nxt = torch.tensor(ids, dtype=torch.long)[positions[keep] + 1]
        k = self.sampling.prompt_logprobs or 0
        self.prompt_entries += prompt_token_logprobs(result.logits[keep], nxt, k)
        return dataclasses.replace(result, logits=result.logits[-1:])

    def prefilled(self, outcome: PrefillOutcome) -> None:
        """Its prefill finished: the outcome kept (its report, the variants to commit), the
        prompt log-probabilities (if asked) sent."""
        self.outcome = outcome
        if self.sampling.prompt_logprobs is not None:
            self.handle.push(PromptLogprobs(self.prompt_ids, self.prompt_entries))

    def close_loader(self) -> None:
        """Close its layer readers (a prefill ended early, or starts afresh)."""
        loader = self.job.loader if self.job is not None else None
        if loader is not None:
            try:
                loader.close()
            except Exception:  # noqa: BLE001 - closing a spent reader must not fail the retry
                log.debug("closing a layer loader failed", exc_info=True)

    # ---- decoding and the end -------------------------------------------------------------------
    def emitted(self, token: int, logprobs: TokenLogprobs | None) -> str | None:
        """Push one sampled token; the finish reason when it ended the request."""
        state = self.state
        assert state is not None
        if not state.output_ids and self.outcome is not None:
            self.outcome.report.ttft_ms = 1000 * (time.perf_counter() - self.t_submit)
        state.output_ids.append(token)
        is_stop = token in self.stops
        self.handle.push(Token(token, is_stop, logprobs))
        if is_stop:
            return "stop"
        return "length" if state.num_output_tokens >= state.max_tokens else None

    def finished(self, reason: str, extras: RequestExtras | None) -> None:
        """Tell its handle it finished (`reason`), with what it produced."""
        out = list(self.state.output_ids) if self.state else []
        report = self.outcome.report if self.outcome is not None else None
        self.handle.push(Finished(reason, out, report, extras))

    def fill_extras(self, runner: Runner, at_end: bool = False) -> RequestExtras | None:
        """What `options` asked for (benchmarks only): teacher forcing of `forced` once the
        prompt is in (before any decode step writes after it), of the output itself at the end."""
        opts, job, outcome = self.options, self.job, self.outcome
        if opts is None or job is None or outcome is None or self.state is None:
            return None
        model = runner.loaded.model
        if self.extras is None:
            self.extras = RequestExtras(
                job.plan, job.rows, outcome.rows_last_layer, outcome.first_logits
            )
            if opts.forced:
                self.extras.forced_logits = force_tokens(model, job.kv, outcome, list(opts.forced))
        if at_end and opts.force_answer and self.state.output_ids:
            output = list(self.state.output_ids)
            self.extras.forced_logits = force_tokens(model, job.kv, outcome, output)
        return self.extras


__all__ = ["MAX_PROMPTS_SEEN", "Live", "Offer", "PromptMemory"]
