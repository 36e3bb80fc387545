"""Engine: continuous batching of many requests over one Runner, driven by one step loop.

Per step: plan newly submitted requests (and prefetch their variants), let the Scheduler pick
prefills and decodes, run ONE forward `step` over all of them (the decodes as one DecodeBatch
over the engine's KVPool: one attention call per layer for all of them), sample, push events
to each request's handle, commit new variants after the first tokens went out, free finished
requests (and their pool slots).
The loop is the engine's own thread (`start`: the server) or the caller (`caller_driven`: the
offline `LLM`, calling `step()`); either way every tensor lives on that one thread and other
threads only enqueue (submit, abort, call).

A request's own state and transitions are `live.Live`; what a step runs is built and run by
`batch.BatchBuilder`; this class owns the loop, admission and the end of each request.
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
from typing import Any

import torch

from cachecraft.engine.batch import BatchBuilder
from cachecraft.engine.config import EngineConfig, EngineStopped, Liveness
from cachecraft.engine.handle import Failed, Finished, RequestHandle
from cachecraft.engine.live import MAX_PROMPTS_SEEN, Live, PromptMemory
from cachecraft.engine.options import RequestExtras, RequestOptions, StepStat
from cachecraft.engine.runner import PrefillOutcome, Runner, require_finite
from cachecraft.engine.sampling import SamplingParams, sample, token_logprobs
from cachecraft.engine.scheduler import QueueFull, Scheduler
from cachecraft.model.kv import KVCache
from cachecraft.model.kv_pool import KVPool
from cachecraft.model.step import SeqResult
from cachecraft.request import RagRequest
from cachecraft.reuse.layout import PromptLayout
from cachecraft.reuse.strategies import STRATEGIES
from cachecraft.reuse.strategy import ReuseStrategy, StrategyRegistry

log = logging.getLogger(__name__)

Call = tuple[Callable[[], Any], Future]


class Engine:
    """Owns the runner and the step thread. `start()` before `submit`, `stop()` at the end."""

    def __init__(
        self,
        runner: Runner,
        config: EngineConfig | None = None,
        *,
        caller_driven: bool = False,
        strategy: ReuseStrategy | None = None,
        strategies: StrategyRegistry | None = None,
    ) -> None:
        self.runner = runner
        self.caller_driven = caller_driven
        self.config = config or EngineConfig()
        c = self.config
        self.scheduler = Scheduler(c.token_budget, c.max_running, c.max_queue, c.chunked_prefill)
        self._wake = threading.Condition()
        self._inbox: deque[Live] = deque()
        self._aborts: dict[str, str] = {}  # request id -> finish reason ("abort" or "stop")
        self._calls: deque[Call] = deque()
        self._live: dict[str, Live] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._busy_since: float | None = None
        self.clock: Callable[[], float] = time.monotonic
        """The watchdog's clock: how long the step thread has been busy (tests move it)."""
        self.num_steps = 0
        self.num_aborted = 0
        self.num_failed = 0
        self.recent_steps: deque[StepStat] = deque(maxlen=4096)
        self.num_threads = torch.get_num_threads()
        """torch threads of the step thread: the creating thread's count (cachecraft/env.py)."""
        model = runner.loaded.model
        self.admit_in_step = (
            model.device.type != "cpu" if c.admit_in_step is None else c.admit_in_step
        )
        """EngineConfig.admit_in_step, resolved for the model's device."""
        self.pool: KVPool | None = None
        if c.kv_pool_mib:
            self.pool = KVPool(
                runner.loaded.arch,
                c.max_running,
                model.dtype,
                model.device,
                c.kv_pool_mib << 20,
                warm_positions=c.kv_warm_positions,
            )
        self._released: list[KVCache] = []  # caches of requests that ended this step
        self._warm = False  # `_warm_kernels` ran
        self._prompts = PromptMemory()
        self.batches = BatchBuilder(runner, self.pool, self._live, self._fail)
        self.strategies = strategies or STRATEGIES
        """The strategies a request's mode names (a server's, with its parameters)."""
        self.default_strategy = strategy or self.strategies.get(c.mode)
        """Requests submitted without a strategy use this one (`strategy`, else the one
        registered as EngineConfig.mode)."""

    # ---- other threads ----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def is_alive(self) -> bool:
        if self.caller_driven:
            return not self._stopping
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def liveness(self) -> Liveness:
        busy = self._busy_since
        return Liveness(
            self.is_alive,
            None if busy is None else self.clock() - busy,
            self.num_steps,
            self.num_failed,
        )

    def submit(
        self,
        request: RagRequest,
        sampling: SamplingParams | None = None,
        strategy: ReuseStrategy | None = None,
        budgets: list[int | None] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        layout: PromptLayout | None = None,
        options: RequestOptions | None = None,
    ) -> RequestHandle:
        """Queue a request. Raises QueueFull (backpressure) or EngineStopped; planning errors
        (context length, ...) arrive as a Failed event. `strategy`: resolved by the caller
        (None: `default_strategy`). `layout`: the request already tokenized
        (`runner.layout(request)`, on any thread)."""
        strategy = strategy or self.default_strategy
        with self._wake:
            if not self.is_alive:
                raise EngineStopped("the engine is not running")
            if self.num_waiting >= self.config.max_queue:
                raise QueueFull(f"{self.num_waiting} requests are waiting (max_queue)")
            handle = RequestHandle(f"req-{next(self._ids)}", self.abort, loop)
            sampling = sampling or SamplingParams()
            live = Live(handle, request, sampling, strategy, budgets, time.perf_counter())
            live.layout = layout
            live.options = options
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

    def has_work(self) -> bool:
        """Anything submitted, queued or running that a step would advance."""
        with self._wake:
            return bool(self._inbox or self._aborts or self._calls or self.scheduler.has_work())

    def step(self) -> None:
        """Caller-driven engines: take what was submitted since the last call and run one step
        (the thread of a started engine does the same in its loop)."""
        if not self.caller_driven:
            raise RuntimeError("step() drives a caller_driven engine; this one has a thread")
        self._warm_kernels()
        self._advance(*self._take())

    def start(self) -> Engine:
        if self.caller_driven:
            raise RuntimeError("a caller_driven engine is stepped by its caller, not started")
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
        torch.set_num_threads(self.num_threads)  # its own: another thread may have changed it
        try:
            self._warm_kernels()
            self._loop()
        except BaseException:
            log.critical("the engine step thread died", exc_info=True)
            self._stopping = True
            raise
        finally:
            self._busy_since = None
            self._shutdown()

    def _warm_kernels(self) -> None:
        """bf16: have oneDNN build its kernels for every aligned step size before the first
        request needs them (model/llama.py). Once, on the thread that steps: oneDNN keys its
        kernels by thread count, and a parallel operation on another thread (the one that made
        the engine) would start a second OpenMP team there (cachecraft/env.py)."""
        if not self._warm:
            self._warm = True
            c = self.config
            self.runner.loaded.model.warm_kernels(c.token_budget + c.max_running)

    def _loop(self) -> None:
        warming = self.pool is not None
        while True:
            with self._wake:  # a Condition's lock is reentrant: has_work takes it again
                while not (busy := self._stopping or self.has_work()) and not warming:
                    self._wake.wait()
                if self._stopping:
                    break
            if busy:
                self._advance(*self._take())
                warming = self.pool is not None  # slots given back may want mapping
            else:  # idle: map a little of the pool, outside the lock, then look again
                assert self.pool is not None
                warming = self.pool.warm_step()

    def _take(self) -> tuple[list[Live], dict[str, str], list[Call]]:
        """What other threads queued since the last step (under the lock)."""
        with self._wake:
            inbox, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = self._aborts, {}
            calls, self._calls = list(self._calls), deque()
        return inbox, aborts, calls

    def _advance(self, inbox: list[Live], aborts: dict[str, str], calls: list[Call]) -> None:
        """Run the queued calls, apply aborts, admit new requests, then one step; then give
        the pool slots of requests that ended back (after the step's commits read their K/V)."""
        self._busy_since = self.clock()
        for fn, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # the caller gets it; the loop goes on
                    future.set_exception(e)
        for request_id, reason in aborts.items():
            self._drop(request_id, reason)
        for live in inbox:
            reason = aborts.get(live.request_id)
            if reason is not None:
                self.num_aborted += reason == "abort"
                live.handle.push(Finished(reason, [], None))
            else:
                self._admit(live)
        try:
            self._step()
        except Exception:  # never let one bad step end the loop
            log.exception("engine step failed")
            self._fail_stuck()
        released, self._released = self._released, []
        for kv in released:
            if self.pool is not None and kv.pool is self.pool:
                self.pool.release(kv)
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

    # ---- one request's way through ------------------------------------------------------------
    def _admit_arrivals(self) -> None:
        """Admit the requests queued since this step began (EngineConfig.admit_in_step). Their
        plans are made before this step's variants are stored, which costs nothing: a prefill
        plans again when it starts. Aborts and calls wait for the next step; an abort of a
        request admitted here finds it queued."""
        with self._wake:
            inbox, self._inbox = list(self._inbox), deque()
        for live in inbox:
            self._admit(live)

    def _admit(self, live: Live) -> None:
        """Plan (store metadata only), prefetch the chosen variants, queue for the scheduler.
        An error fails this request alone: a planning one (context length, ...) as a Failed
        event, any other counted as a failure."""
        rid = live.request_id
        try:
            try:
                live.tokenize(self.runner, self._prompts)
                plan = self.batches.plan(live)
            except Exception as e:
                live.handle.push(Failed(e))
                return
            planned = live.admitted(plan, self.runner)
            variant_ids = [cp.variant.variant_id for cp in plan.chunks if cp.variant is not None]
            if variant_ids:
                self.runner.store.prefetch(variant_ids)
            assert live.state is not None
            try:
                self.scheduler.add(live.state)
            except QueueFull as e:
                live.handle.push(Failed(e))
                return
            self._live[rid] = live
            live.handle.push(planned)
        except Exception as e:
            log.warning("request %s failed on admission: %r", rid, e)
            self.scheduler.abort(rid)
            self._live.pop(rid, None)
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

    def _step(self) -> None:
        out = self.scheduler.schedule()
        if out.is_empty:
            return
        starting = [rid for rid in out.prefill_ids if self._live[rid].is_starting()]
        later = self.batches.start_all([self._live[rid] for rid in starting])
        for rid in reversed(later):  # back at the head of the queue, in their order
            self.scheduler.postpone(rid)
        batch = self.batches.build(out, starting)
        if batch.is_empty:
            return
        self.num_steps += 1
        t_step = time.perf_counter()
        results, decode_logits = self.batches.forward(batch)
        if self.admit_in_step:  # before anything below waits for the forward's kernels
            self._admit_arrivals()
        outcomes: list[PrefillOutcome] = []
        for (rid, is_prefill), result in zip(batch.order, results, strict=True):
            live = self._live.get(rid)
            if live is None or result is None:
                continue
            if is_prefill:
                outcome = self._prefill_done(live, result, batch.spans[rid])
                if outcome is None:
                    continue  # more pieces to come, or it failed
                if live.options is None or live.options.commit:
                    outcomes.append(outcome)
                logits = outcome.first_logits
            else:
                logits = result.logits[0]
            self._sample_emit(rid, logits)
            if is_prefill and live.options is not None and rid in self._live:
                live.fill_extras(self.runner)  # after the first token: off the TTFT path
        for rid, row in zip(batch.decode_ids, decode_logits, strict=True):
            if row is not None:
                self._sample_emit(rid, row)
        num_prefills = sum(is_prefill for _, is_prefill in batch.order)
        ms = 1000 * (time.perf_counter() - t_step)
        stat = StepStat(num_prefills, batch.num_prefill_rows, len(out.decode_ids), ms)
        self.recent_steps.append(stat)
        for outcome in outcomes:  # off the time-to-first-token path
            try:  # the next step need not wait for file writes: the store's writer ends them
                self.runner.commit(outcome, wait=False)
            except Exception:  # the answer went out; only the cache entry is lost
                log.exception("committing variants failed")

    def _prefill_done(
        self, live: Live, result: SeqResult, span: tuple[int, int]
    ) -> PrefillOutcome | None:
        """Rows `span` of its prefill ran: its outcome once the whole prefill is in (None: more
        pieces to come, or finishing it failed the request)."""
        try:  # a non-finite row never becomes a prompt log-probability
            whole = live.prefill_result(result, span)
        except Exception as e:
            self._fail(live.request_id, e)
            return None
        if whole is None:
            return None
        assert live.job is not None
        try:
            outcome = self.runner.finish(live.job, whole)
        except Exception as e:
            self._fail(live.request_id, e)
            return None
        live.outcome = outcome
        if live.prompt_hash is not None:
            self._prompts.remember(live.prompt_hash)
        self.scheduler.prefilled(live.request_id)
        live.prefilled(outcome)
        return outcome

    def _sample_emit(self, rid: str, logits: torch.Tensor) -> None:
        live = self._live.get(rid)
        if live is None:
            return
        k = live.sampling.logprobs
        try:
            assert live.state is not None
            out, prompt = live.state.output_ids, live.prompt_ids
            require_finite(logits)  # never a token (or a log-probability) from a NaN
            token = sample(logits, live.sampling, live.generator, out, prompt, live.stops)
            logprobs = None if k is None else token_logprobs(logits, token, k)
        except Exception as e:
            log.warning("request %s failed while sampling: %r", rid, e)
            self._fail(rid, e)
            return
        reason = live.emitted(token, logprobs)
        if reason is not None:
            self.scheduler.finish(rid, reason)
            self._live.pop(rid, None)
            if live.kv is not None:
                self._released.append(live.kv)
            live.finished(reason, live.fill_extras(self.runner, at_end=True))

    def _fail(self, request_id: str, error: BaseException) -> None:
        live = self._drop(request_id, None)
        if live is not None:
            self.num_failed += 1
            live.handle.push(Failed(error))

    def _drop(self, request_id: str, reason: str | None) -> Live | None:
        """Free a request; with a reason, tell its handle it finished that way."""
        self.scheduler.abort(request_id)
        live = self._live.pop(request_id, None)
        if live is None:  # still in this step's inbox, or already finished
            return None
        if live.kv is not None:
            self._released.append(live.kv)
        if live.outcome is None:  # ended before its prefill finished: its readers stay open
            live.close_loader()
        if reason is not None:
            self.num_aborted += reason == "abort"
            live.finished(reason, live.fill_extras(self.runner, at_end=True))
        return live


__all__ = [
    "MAX_PROMPTS_SEEN",
    "Liveness",
    "Engine",
    "EngineConfig",
    "EngineStopped",
    "RequestExtras",
    "RequestOptions",
    "StepStat",
]
