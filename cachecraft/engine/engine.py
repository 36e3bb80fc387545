"""Engine: continuous batching of many requests over one Runner, on one step thread.

Per step: plan newly submitted requests (and prefetch their variants), let the Scheduler pick
prefills and decodes, run ONE `forward_step` over all of them, sample, push events to each
request's handle, commit new variants after the first tokens went out, free finished requests.
Every tensor lives on the step thread; other threads only enqueue (submit, abort, call).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from cachecraft.config import MODES
from cachecraft.engine.handle import Failed, Finished, Planned, RequestHandle, Token
from cachecraft.engine.request import SeqState
from cachecraft.engine.runner import PrefillJob, PrefillOutcome, Runner
from cachecraft.engine.sampling import SamplingParams, make_generator, sample
from cachecraft.engine.scheduler import QueueFull, Scheduler
from cachecraft.errors import BadRequestError
from cachecraft.model.step import SeqResult, SeqWork
from cachecraft.request import RagRequest
from cachecraft.reuse.layout import PromptLayout
from cachecraft.reuse.plan import RecomputePlan
from cachecraft.store.codec import CorruptVariantError

log = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine shut down before the request finished."""


class Liveness(NamedTuple):
    """What /health reads: is the step thread alive, and how long has its current unit of
    work (admits, calls, one step) been running (None: idle)."""

    is_alive: bool
    busy_s: float | None
    num_steps: int
    num_failed_requests: int


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """token_budget: rows per step (prefill rows computed + 1 per decode); max_running: cap on
    sequences holding a KV cache; max_queue: waiting requests before QueueFull (HTTP 429)."""

    token_budget: int = 2048
    max_running: int = 16
    max_queue: int = 64
    mode: str = "cachecraft"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")


@dataclass(slots=True)
class _Live:
    """Engine-thread state of one request (the tensors the scheduler never sees)."""

    handle: RequestHandle
    request: RagRequest
    sampling: SamplingParams
    mode: str
    budgets: list[int | None] | None
    t_submit: float
    state: SeqState | None = None
    plan: RecomputePlan | None = None
    job: PrefillJob | None = None
    generator: torch.Generator | None = None
    stops: frozenset[int] = field(default_factory=frozenset)
    outcome: PrefillOutcome | None = None
    layout: PromptLayout | None = None
    """Tokenized before submit (off the step thread); None: tokenized when planned."""


class Engine:
    """Owns the runner and the step thread. `start()` before `submit`, `stop()` at the end."""

    def __init__(self, runner: Runner, config: EngineConfig | None = None) -> None:
        self.runner = runner
        self.config = config or EngineConfig()
        c = self.config
        self.scheduler = Scheduler(c.token_budget, c.max_running, c.max_queue)
        self._wake = threading.Condition()
        self._inbox: deque[_Live] = deque()
        self._aborts: dict[str, str] = {}  # request id -> finish reason ("abort" or "stop")
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._busy_since: float | None = None
        self.num_steps = 0
        self.num_aborted = 0
        self.num_failed = 0

    # ---- other threads ----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def liveness(self) -> Liveness:
        busy = self._busy_since
        return Liveness(
            self.is_alive,
            None if busy is None else time.monotonic() - busy,
            self.num_steps,
            self.num_failed,
        )

    def submit(
        self,
        request: RagRequest,
        sampling: SamplingParams | None = None,
        mode: str | None = None,
        budgets: list[int | None] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        layout: PromptLayout | None = None,
    ) -> RequestHandle:
        """Queue a request. Raises QueueFull (backpressure), BadRequestError (unknown mode) or
        EngineStopped; planning errors (context length, ...) arrive as a Failed event.
        `layout`: the request already tokenized (`runner.layout(request)`, on any thread)."""
        mode = mode or self.config.mode
        if mode not in MODES:
            raise BadRequestError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        with self._wake:
            if not self.is_alive:
                raise EngineStopped("the engine is not running")
            if self.num_waiting >= self.config.max_queue:
                raise QueueFull(f"{self.num_waiting} requests are waiting (max_queue)")
            handle = RequestHandle(f"req-{next(self._ids)}", self.abort, loop)
            sampling = sampling or SamplingParams()
            live = _Live(handle, request, sampling, mode, budgets, time.perf_counter())
            live.layout = layout
            self._inbox.append(live)
            self._wake.notify()
        return handle

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request now. reason "abort": the client left (counted in num_aborted); "stop":
        the caller saw a stop string, so it finishes normally with its report."""
        with self._wake:
            self._aborts.setdefault(request_id, reason)
            self._wake.notify()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` on the step thread between steps (it may use the model and the store)."""
        future: Future = Future()
        with self._wake:
            if not self.is_alive:
                raise EngineStopped("the engine is not running")
            self._calls.append((fn, future))
            self._wake.notify()
        return future

    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cachecraft-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the step thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            log.critical("the engine step thread died", exc_info=True)
            self._stopping = True
            raise
        finally:
            self._busy_since = None
            self._shutdown()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (
                    self._stopping
                    or self._inbox
                    or self._aborts
                    or self._calls
                    or self.scheduler.has_work()
                ):
                    self._wake.wait()
                if self._stopping:
                    break
                inbox, self._inbox = list(self._inbox), deque()
                aborts, self._aborts = self._aborts, {}
                calls, self._calls = list(self._calls), deque()
            self._busy_since = time.monotonic()
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as e:  # the caller gets it; the loop goes on
                        future.set_exception(e)
            for request_id, reason in aborts.items():
                self._drop(request_id, reason)
            for live in inbox:
                reason = aborts.get(live.handle.request_id)
                if reason is not None:
                    self.num_aborted += reason == "abort"
                    live.handle.push(Finished(reason, [], None))
                else:
                    self._admit_guarded(live)
            try:
                self._step()
            except Exception:  # never let one bad step end the loop
                log.exception("engine step failed")
                self._fail_stuck()
            self._busy_since = None

    def _shutdown(self) -> None:
        with self._wake:
            pending = [*self._inbox, *self._live.values()]
            self._inbox.clear()
            calls = list(self._calls)
        for live in pending:
            live.handle.push(Failed(EngineStopped("the server is shutting down")))
        for _, future in calls:
            future.cancel()
        self._live.clear()

    # ---- fault isolation: one request's error fails that request, never the loop ------------
    def _admit_guarded(self, live: _Live) -> None:
        try:
            self._admit(live)
        except Exception as e:
            log.warning("request %s failed on admission: %r", live.handle.request_id, e)
            self.scheduler.abort(live.handle.request_id)
            self._live.pop(live.handle.request_id, None)
            self.num_failed += 1
            live.handle.push(Failed(e))

    def _fail_stuck(self) -> None:
        """After a step failed outside every per-request guard: fail the requests that would
        fail the same way on every later step (prefilled, so scheduled to decode, but without a
        token to feed back); the others are simply scheduled again."""
        for rid, live in list(self._live.items()):
            state = live.state
            if state is not None and live.outcome is not None and not state.output_ids:
                self._fail(rid, RuntimeError("the engine step failed for this request"))

    def _start(self, live: _Live) -> None:
        """Plan again (variants stored while this request waited, by requests admitted before
        it, become hits; metadata only, so cheap) and splice its KV. A chunk-cache found corrupt
        while splicing (a probe reads every layer up front) was dropped by the store, so
        planning once more makes it a miss."""
        assert live.state is not None
        for attempt in range(2):
            live.plan = self._plan(live)
            try:
                live.job = self.runner.start(live.plan, live.state.max_tokens, live.t_submit)
                return
            except CorruptVariantError:
                if attempt:
                    raise
                log.warning(
                    "request %s: a chunk-cache was corrupt; planning it again",
                    live.handle.request_id,
                )

    def _plan(self, live: _Live) -> RecomputePlan:
        return self.runner.plan(live.request, live.mode, live.budgets, layout=live.layout)

    def _forward_isolated(
        self, works: list[SeqWork], order: list[tuple[str, bool]]
    ) -> list[SeqResult | None]:
        """One forward step over all works; if it raises, each sequence runs again alone so
        that only the failing ones fail (None). K/V writes go to explicit positions, so a decode
        run twice writes the same K/V; a prefill is started afresh (its layer readers may be
        spent), and one whose chunk-cache was corrupt is planned again (the store dropped it,
        so it becomes a miss), as `Runner.prefill` does."""
        try:
            return list(self.runner.loaded.model.forward_step(works))
        except Exception:
            log.exception("forward step over %d sequences failed; isolating", len(works))
        results: list[SeqResult | None] = []
        for work, (rid, is_prefill) in zip(works, order, strict=True):
            results.append(self._forward_alone(work, rid, is_prefill, len(works) == 1))
        return results

    def _forward_alone(
        self, work: SeqWork, rid: str, is_prefill: bool, failed_alone: bool
    ) -> SeqResult | None:
        live = self._live.get(rid)
        if live is None:
            return None
        for attempt in range(2):
            try:
                if is_prefill:
                    if failed_alone and attempt == 0:
                        continue  # it already failed alone once; start afresh right away
                    self._close_loader(live)
                    self._start(live)
                    assert live.job is not None
                    work = live.job.work
                return self.runner.loaded.model.forward_step([work])[0]
            except CorruptVariantError as e:
                if not is_prefill or attempt:
                    self._fail(rid, e)
                    return None
                log.warning("request %s: a chunk-cache was corrupt; planning it again", rid)
            except Exception as e:
                log.warning("request %s failed in the forward step: %r", rid, e)
                self._fail(rid, e)
                return None
        return None

    @staticmethod
    def _close_loader(live: _Live) -> None:
        loader = live.job.loader if live.job is not None else None
        if loader is not None:
            try:
                loader.close()
            except Exception:  # noqa: BLE001 - closing a spent reader must not fail the retry
                log.debug("closing a layer loader failed", exc_info=True)

    def _sample_emit(self, rid: str, logits: torch.Tensor) -> None:
        live = self._live.get(rid)
        if live is None:
            return
        try:
            token = sample(logits, live.sampling, live.generator)
        except Exception as e:
            log.warning("request %s failed while sampling: %r", rid, e)
            self._fail(rid, e)
            return
        self._emit(live, token)

    def _commit_guarded(self, outcome: PrefillOutcome) -> None:
        try:
            self.runner.commit(outcome)
        except Exception:  # the answer went out; only the cache entry is lost
            log.exception("committing variants failed")

    def _admit(self, live: _Live) -> None:
        """Plan (store metadata only), prefetch the chosen variants, queue for the scheduler."""
        rid = live.handle.request_id
        try:
            plan = self._plan(live)
        except Exception as e:
            live.handle.push(Failed(e))
            return
        layout = plan.layout
        max_ctx = self.runner.loaded.arch.max_position_embeddings
        # n output tokens need n - 1 fed back in: positions up to num_tokens + n - 2 < max_ctx.
        max_tokens = min(live.sampling.max_tokens, max_ctx - layout.num_tokens + 1)
        live.plan = plan
        live.state = SeqState(rid, layout.num_tokens, plan.num_rows, max_tokens)
        live.generator = make_generator(live.sampling)
        eos = () if live.sampling.ignore_eos else self.runner.loaded.eos_token_ids
        live.stops = frozenset((*eos, *live.sampling.stop_token_ids))
        variant_ids = [cp.variant.variant_id for cp in plan.chunks if cp.variant is not None]
        prefetch = getattr(self.runner.store, "prefetch", None)
        if variant_ids and prefetch is not None:
            prefetch(variant_ids)
        try:
            self.scheduler.add(live.state)
        except QueueFull as e:
            live.handle.push(Failed(e))
            return
        self._live[rid] = live
        live.handle.push(Planned(layout.num_tokens, max_tokens))

    def _step(self) -> None:
        out = self.scheduler.schedule()
        if out.is_empty:
            return
        works: list[SeqWork] = []
        order: list[tuple[str, bool]] = []  # (request id, is_prefill) per work
        for rid in out.prefill_ids:
            live = self._live[rid]
            assert live.plan is not None and live.state is not None
            try:
                self._start(live)
            except Exception as e:
                self._fail(rid, e)
                continue
            works.append(live.job.work)
            order.append((rid, True))
        for rid in out.decode_ids:
            live = self._live[rid]
            try:
                assert live.job is not None and live.state is not None
                kv = live.job.kv
                pos = torch.tensor([kv.length], device=kv.k.device)
                works.append(SeqWork(kv, torch.tensor([live.state.output_ids[-1]]), pos))
            except Exception as e:  # a request in a state it cannot decode from
                self._fail(rid, e)
                continue
            order.append((rid, False))
        if not works:
            return
        self.num_steps += 1
        results = self._forward_isolated(works, order)
        outcomes: list[PrefillOutcome] = []
        for (rid, is_prefill), result in zip(order, results, strict=True):
            live = self._live.get(rid)
            if live is None or result is None:
                continue
            if is_prefill:
                assert live.job is not None
                try:
                    outcome = self.runner.finish(live.job, result)
                except Exception as e:
                    self._fail(rid, e)
                    continue
                live.outcome = outcome
                outcomes.append(outcome)
                self.scheduler.prefilled(rid)
                logits = outcome.first_logits
            else:
                logits = result.logits[0]
            self._sample_emit(rid, logits)
        for outcome in outcomes:  # off the time-to-first-token path
            self._commit_guarded(outcome)

    def _emit(self, live: _Live, token: int) -> None:
        state = live.state
        assert state is not None
        if not state.output_ids and live.outcome is not None:
            live.outcome.report.ttft_ms = 1000 * (time.perf_counter() - live.t_submit)
        state.output_ids.append(token)
        is_stop = token in live.stops
        live.handle.push(Token(token, is_stop))
        reason = "stop" if is_stop else None
        if reason is None and state.num_output_tokens >= state.max_tokens:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(state.request_id, reason)
            self._live.pop(state.request_id, None)
            report = live.outcome.report if live.outcome is not None else None
            live.handle.push(Finished(reason, list(state.output_ids), report))

    def _fail(self, request_id: str, error: BaseException) -> None:
        live = self._drop(request_id, None)
        if live is not None:
            self.num_failed += 1
            live.handle.push(Failed(error))

    def _drop(self, request_id: str, reason: str | None) -> _Live | None:
        """Free a request; with a reason, tell its handle it finished that way."""
        self.scheduler.abort(request_id)
        live = self._live.pop(request_id, None)
        if live is None:  # still in this step's inbox, or already finished
            return None
        if reason is not None:
            self.num_aborted += reason == "abort"
            out = list(live.state.output_ids) if live.state else []
            report = live.outcome.report if live.outcome is not None else None
            live.handle.push(Finished(reason, out, report))
        return live
