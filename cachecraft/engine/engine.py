"""Engine: continuous batching of many requests over one Runner, driven by one step loop.

Per step: plan newly submitted requests (and prefetch their variants), let the Scheduler pick
prefills and decodes, run ONE forward `step` over all of them (the decodes as one DecodeBatch
over the engine's KVPool: one attention call per layer for all of them), sample, push events
to each request's handle, commit new variants after the first tokens went out, free finished
requests (and their pool slots).
The loop is the engine's own thread (`start`: the server) or the caller (`caller_driven`: the
offline `LLM`, calling `step()`); either way every tensor lives on that one thread and other
threads only enqueue (submit, abort, call).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from cachecraft.engine.handle import (
    Failed,
    Finished,
    Planned,
    PromptLogprobs,
    RequestHandle,
    Token,
)
from cachecraft.engine.options import RequestExtras, RequestOptions, StepStat, force_tokens
from cachecraft.engine.request import SeqState
from cachecraft.engine.runner import PrefillJob, PrefillOutcome, Runner, Spliced
from cachecraft.engine.sampling import (
    SamplingParams,
    TokenLogprobs,
    make_generator,
    prompt_token_logprobs,
    sample,
    token_logprobs,
)
from cachecraft.engine.scheduler import QueueFull, Scheduler
from cachecraft.model.kv import KVCache
from cachecraft.model.kv_pool import KVPool
from cachecraft.model.step import DecodeBatch, SeqResult, SeqWork, merge_results, piece
from cachecraft.request import RagRequest
from cachecraft.reuse.layout import PromptLayout
from cachecraft.reuse.plan import RecomputePlan
from cachecraft.reuse.strategies import FULL, STRATEGIES
from cachecraft.reuse.strategy import ReuseStrategy
from cachecraft.store.codec import CorruptVariantError

log = logging.getLogger(__name__)


MAX_PROMPTS_SEEN = 1 << 16
"""Prompts the engine remembers to recognise a repeat (one int each)."""


class EngineStopped(RuntimeError):
    """The engine shut down before the request finished."""


class Liveness(NamedTuple):
    """What /health reads: is the step thread alive, and how long has its current unit of
    work (admits, calls, one step) been running (None: idle)."""

    is_alive: bool
    busy_s: float | None
    num_steps: int
    num_failed_requests: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """token_budget: rows per step (prefill rows computed + 1 per decode); max_running: cap on
    sequences holding a KV cache; max_queue: waiting requests before QueueFull (HTTP 429; a
    load generator sending hundreds at once, as vLLM's benchmark does, expects them queued);
    kv_pool_mib: most memory of the KV pool (max_running slots) that batches decode attention;
    a request that does not fit gets a cache of its own and decodes alone (0: no pool);
    chunked_prefill: a prefill larger than what is left of a step's budget runs in pieces over
    several steps, the others' decodes going on between them (plans whose in-forward checks
    need all rows at once always run whole); kv_warm_positions: positions of every free pool
    slot whose pages the step thread maps while it has nothing else to do (`KVPool.warm_step`;
    ~70 MB a slot for SmolLM2 at 1,024; 0: none). Caller-driven engines (`LLM`) never idle."""

    token_budget: int = 2048
    max_running: int = 16
    max_queue: int = 1024
    mode: str = "cachecraft"
    kv_pool_mib: int = 4096
    chunked_prefill: bool = True
    kv_warm_positions: int = 1024

    def __post_init__(self) -> None:
        if self.mode not in STRATEGIES:
            names = ", ".join(STRATEGIES.names())
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {names}")
        for name in ("kv_pool_mib", "kv_warm_positions"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("token_budget", "max_running", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Offer(NamedTuple):
    """A chunk computed in full by a prefill under way, whose variant the store will take:
    its key, the keys in front of it (the prefix's, then the chunks') and whether its K/V will
    be exact."""

    key: str
    context: tuple[str, ...]
    is_exact: bool


@dataclass(slots=True)
class _Live:
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


class Engine:
    """Owns the runner and the step thread. `start()` before `submit`, `stop()` at the end."""

    def __init__(
        self,
        runner: Runner,
        config: EngineConfig | None = None,
        *,
        caller_driven: bool = False,
        strategy: ReuseStrategy | None = None,
    ) -> None:
        self.runner = runner
        self.caller_driven = caller_driven
        self.config = config or EngineConfig()
        c = self.config
        self.scheduler = Scheduler(c.token_budget, c.max_running, c.max_queue, c.chunked_prefill)
        self._wake = threading.Condition()
        self._inbox: deque[_Live] = deque()
        self._aborts: dict[str, str] = {}  # request id -> finish reason ("abort" or "stop")
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._live: dict[str, _Live] = {}
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
        self._prompts: OrderedDict[int, None] = OrderedDict()
        """Hashes of the last MAX_PROMPTS_SEEN prompts prefilled by a strategy that remembers
        prompts (one sent again is a repeat, and refreshed)."""
        self.default_strategy = strategy or STRATEGIES.get(c.mode)
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
            live = _Live(handle, request, sampling, strategy, budgets, time.perf_counter())
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
            with self._wake:
                while not (busy := self._has_work()) and not warming:
                    self._wake.wait()
                if self._stopping:
                    break
            if busy:
                self._advance(*self._take())
                warming = self.pool is not None  # slots given back may want mapping
            else:  # idle: map a little of the pool, outside the lock, then look again
                assert self.pool is not None
                warming = self.pool.warm_step()

    def _has_work(self) -> bool:
        """Something for the step thread to do (under the lock)."""
        return bool(
            self._stopping
            or self._inbox
            or self._aborts
            or self._calls
            or self.scheduler.has_work()
        )

    def _take(self) -> tuple[list[_Live], dict[str, str], list[tuple[Callable[[], Any], Future]]]:
        """What other threads queued since the last step (under the lock)."""
        with self._wake:
            inbox, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = self._aborts, {}
            calls, self._calls = list(self._calls), deque()
        return inbox, aborts, calls

    def _advance(
        self,
        inbox: list[_Live],
        aborts: dict[str, str],
        calls: list[tuple[Callable[[], Any], Future]],
    ) -> None:
        """Run the queued calls, apply aborts, admit new requests, then one step."""
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
        self._free_caches()
        self._busy_since = None

    def _free_caches(self) -> None:
        """Give the pool slots of requests that ended back, after the step's commits read
        their K/V (a slot is reused by the next request admitted)."""
        released, self._released = self._released, []
        for kv in released:
            if self.pool is not None and kv.pool is self.pool:
                self.pool.release(kv)

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
        """`_splice`, its probe alone (if any) and the job."""
        spliced = self._splice(live)
        live.job = self.runner.build(spliced, self.runner.run_probe(spliced))
        self._ask_logits(live)

    @staticmethod
    def _is_starting(live: _Live) -> bool:
        """Its prefill has no job yet, or none of its rows ran: (re)start it this step."""
        assert live.state is not None
        return live.job is None or live.state.num_done_rows == 0

    def _start_all(self, lives: list[_Live]) -> None:
        """Start the prefills of this step: plan and splice each, run all their probes through
        ONE forward (one pass over the weights for all; if it fails, each alone so that only
        failing ones fail), build the jobs. A request that fails here fails alone. One that
        would compute a chunk another prefill under way is computing into a variant it could
        reuse goes back to the head of the queue instead (`_waits_for`): it starts once that
        variant is stored, rather than computing the chunk a second time beside it."""
        spliced: list[tuple[_Live, Spliced]] = []
        later: list[str] = []  # wait for a chunk another prefill computes (`_waits_for`)
        in_flight = {
            o for live in self._live.values() if self._is_prefilling(live) for o in live.offers
        }
        for live in lives:
            try:
                plan = self._plan(live)
                if live.job is None and _waits_for(plan, live.strategy, in_flight):
                    later.append(live.handle.request_id)
                    continue
                live.offers = self._offers(plan)
                in_flight |= live.offers
                spliced.append((live, self._splice(live, plan)))
            except Exception as e:
                self._fail(live.handle.request_id, e)
        for rid in reversed(later):  # back at the head of the queue, in their order
            self.scheduler.postpone(rid)
        probes = [(live, s) for live, s in spliced if s.probe is not None]
        results: dict[str, SeqResult | None] = {}
        if probes:
            try:
                works = [s.probe.work for _, s in probes if s.probe is not None]
                outs = self.runner.loaded.model.forward_step(works)
                for (live, _), result in zip(probes, outs, strict=True):
                    results[live.handle.request_id] = result
            except Exception:
                log.exception("the probe pass over %d requests failed; isolating", len(probes))
                for live, s in probes:
                    try:
                        results[live.handle.request_id] = self.runner.run_probe(s)
                    except Exception as e:
                        self._fail(live.handle.request_id, e)
        for live, s in spliced:
            rid = live.handle.request_id
            if s.probe is not None and rid not in results:
                continue  # failed above
            try:
                live.job = self.runner.build(s, results.get(rid))
                self._ask_logits(live)
            except Exception as e:
                s.loader.close()
                self._fail(rid, e)

    @staticmethod
    def _ask_logits(live: _Live) -> None:
        """Prompt log-probabilities need every prompt row's logits (`_keep_prompt_logprobs`)."""
        if live.sampling.prompt_logprobs is not None and live.job is not None:
            live.job.work.logits_for = "all"

    @staticmethod
    def _keep_prompt_logprobs(live: _Live, result: SeqResult, start: int) -> SeqResult:
        """A prefill result (the whole prompt, or one piece) with every row's logits: the rows
        become prompt log-probabilities (row at position p: the prompt's token p + 1), and only
        the last row's logits stay (the next token's, once the last piece is in). `start`: the
        piece's first row (a prefill run again whole after a failed step starts at 0)."""
        assert live.job is not None and live.plan is not None
        ids = live.prompt_ids
        m = result.logits.shape[0]
        start = 0 if m == len(live.job.rows) else start
        if start == 0:
            live.prompt_entries = []
        positions = live.job.rows[start : start + m]
        keep = positions < len(ids) - 1
        nxt = torch.tensor(ids, dtype=torch.long)[positions[keep] + 1]
        k = live.sampling.prompt_logprobs or 0
        live.prompt_entries += prompt_token_logprobs(result.logits[keep], nxt, k)
        return dataclasses.replace(result, logits=result.logits[-1:])

    def _splice(self, live: _Live, plan: RecomputePlan | None = None) -> Spliced:
        """Plan again (variants stored while this request waited, by requests admitted before
        it, become hits; metadata only, so cheap; `plan`: made just now) and splice its KV. A
        chunk-cache found corrupt while splicing (a probe reads every layer up front) was
        dropped by the store, so planning once more makes it a miss."""
        assert live.state is not None
        for attempt in range(2):
            live.plan = plan if plan is not None and attempt == 0 else self._plan(live)
            try:
                extra = live.state.max_tokens + len(live.options.forced if live.options else ())
                if live.kv is None:
                    live.kv = self._new_cache(live.plan.layout.num_tokens + extra)
                return self.runner.splice(live.plan, extra, live.t_submit, kv=live.kv)
            except CorruptVariantError:
                if attempt:
                    raise
                log.warning(
                    "request %s: a chunk-cache was corrupt; planning it again",
                    live.handle.request_id,
                )
        raise AssertionError("unreachable")

    def _new_cache(self, capacity: int) -> KVCache:
        """A pool slot (decodes batched with the others) or, when none fits, a cache of its own."""
        kv = self.pool.acquire(capacity) if self.pool is not None else None
        if kv is None:
            m = self.runner.loaded
            kv = KVCache(m.arch, capacity, m.model.dtype, m.model.device)
        return kv

    def _plan(self, live: _Live) -> RecomputePlan:
        return self.runner.plan(
            live.request, live.strategy, live.budgets, layout=live.layout, repeat=live.repeat
        )

    def _remember(self, prompt_hash: int) -> None:
        """A prefill of this prompt by a strategy that remembers prompts is done: the next one
        is a repeat. Only prefills count, so the `n` choices of one request, submitted
        together, are not repeats of each other (nor is a reference run of another strategy a
        sighting)."""
        self._prompts[prompt_hash] = None
        self._prompts.move_to_end(prompt_hash)
        if len(self._prompts) > MAX_PROMPTS_SEEN:
            self._prompts.popitem(last=False)

    @staticmethod
    def _is_prefilling(live: _Live) -> bool:
        """Its prefill started and has not finished (its new variants are not stored yet)."""
        return live.job is not None and live.state is not None and live.outcome is None

    def _offers(self, plan: RecomputePlan) -> frozenset[Offer]:
        """The chunk-caches `plan`'s prefill will offer the store that it would admit."""
        if not plan.make_variants:
            return frozenset()
        store = self.runner.store
        return frozenset(
            Offer(c.slot.key, front, c.is_exact)
            for c, front in zip(plan.chunks, _in_front(plan), strict=True)
            if c.variant is None and store.would_admit(c.slot.key)
        )

    def _forward_isolated(
        self,
        works: list[SeqWork],
        order: list[tuple[str, bool]],
        decode: DecodeBatch | None = None,
        decode_ids: list[str] | None = None,
    ) -> tuple[list[SeqResult | None], list[torch.Tensor | None]]:
        """One forward step over all works and the decode batch: (a result per work, logits
        [vocab] per batch row). If it raises, each sequence runs again alone so that only the
        failing ones fail (None). K/V writes go to explicit positions, so a decode run twice
        writes the same K/V; a prefill is started afresh (its layer readers may be spent),
        and one whose chunk-cache was corrupt is planned again (the store dropped it, so it
        becomes a miss), as `Runner.prefill` does."""
        model = self.runner.loaded.model
        try:
            results, logits = model.step(works, decode)
            return list(results), [] if logits is None else list(logits)
        except Exception:
            num = len(works) + (len(decode.caches) if decode is not None else 0)
            log.exception("forward step over %d sequences failed; isolating", num)
        alone = len(works) + (len(decode.caches) if decode is not None else 0) == 1
        out: list[SeqResult | None] = []
        for work, (rid, is_prefill) in zip(works, order, strict=True):
            out.append(self._forward_alone(work, rid, is_prefill, alone))
        rows: list[torch.Tensor | None] = []
        if decode is not None and decode_ids is not None:
            for i, (kv, rid) in enumerate(zip(decode.caches, decode_ids, strict=True)):
                work = SeqWork(kv, decode.token_ids[i : i + 1], decode.positions[i : i + 1])
                result = self._forward_alone(work, rid, False, alone)
                rows.append(None if result is None else result.logits[0])
        return out, rows

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
        k = live.sampling.logprobs
        try:
            assert live.state is not None
            out, prompt = live.state.output_ids, live.prompt_ids
            token = sample(logits, live.sampling, live.generator, out, prompt, live.stops)
            logprobs = None if k is None else token_logprobs(logits, token, k)
        except Exception as e:
            log.warning("request %s failed while sampling: %r", rid, e)
            self._fail(rid, e)
            return
        self._emit(live, token, logprobs)

    def _commit_guarded(self, outcome: PrefillOutcome) -> None:
        try:  # the next step need not wait for file writes: they finish on the store's writer
            self.runner.commit(outcome, wait=False)
        except Exception:  # the answer went out; only the cache entry is lost
            log.exception("committing variants failed")

    def _admit(self, live: _Live) -> None:
        """Plan (store metadata only), prefetch the chosen variants, queue for the scheduler."""
        rid = live.handle.request_id
        if live.sampling.prompt_logprobs is not None:
            live.strategy = FULL  # every prompt row's logits: nothing is reused
        try:
            live.layout = live.layout or self.runner.layout(live.request)
            ids = live.layout.token_ids  # built once (a property that joins the slots)
            if live.sampling.repetition_penalty != 1 or live.sampling.prompt_logprobs is not None:
                live.prompt_ids = ids
            if live.strategy.remembers_prompts:
                live.prompt_hash = hash(ids)
                live.repeat = live.prompt_hash in self._prompts
            plan = self._plan(live)
        except Exception as e:
            live.handle.push(Failed(e))
            return
        layout = live.layout  # tokenized once: `_splice` plans again with it
        max_ctx = self.runner.loaded.arch.max_position_embeddings
        # n output tokens need n - 1 fed back in: positions up to num_tokens + n - 2 < max_ctx.
        max_tokens = min(live.sampling.max_tokens, max_ctx - layout.num_tokens + 1)
        live.plan = plan
        live.state = SeqState(rid, layout.num_tokens, plan.num_rows, max_tokens)
        live.state.can_split = plan.early_exit is None and plan.deviation is None
        live.generator = make_generator(live.sampling)
        eos = () if live.sampling.ignore_eos else self.runner.loaded.eos_token_ids
        live.stops = frozenset((*eos, *live.sampling.stop_token_ids))
        variant_ids = [cp.variant.variant_id for cp in plan.chunks if cp.variant is not None]
        if variant_ids:
            self.runner.store.prefetch(variant_ids)
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
        spans: dict[str, tuple[int, int]] = {}  # prefill rows a..b-1 of its job this step
        starting = [rid for rid in out.prefill_ids if self._is_starting(self._live[rid])]
        self._start_all([self._live[rid] for rid in starting])
        for rid, count in zip(out.prefill_ids, out.prefill_rows, strict=True):
            live = self._live.get(rid)
            if live is None or live.job is None:
                continue  # failed to start, or waits for a chunk another request computes
            state = live.state
            assert live.plan is not None and state is not None and live.job is not None
            if rid in starting:
                work = live.job.work
                live.pieces, state.num_done_rows = [], 0
                state.num_prefill_rows = len(live.job.rows)  # a re-plan may have changed it
                state.can_split = not work.hooks and work.last_layer is None
            total, a = state.num_prefill_rows, state.num_done_rows
            b = min(total, a + count) if state.can_split else total
            works.append(live.job.work if (a, b) == (0, total) else piece(live.job.work, a, b))
            order.append((rid, True))
            spans[rid] = (a, b)
        # Decodes in a pool slot go in one DecodeBatch: ids and positions in one tensor.
        batch_ids: list[str] = []
        caches: list[KVCache] = []
        rows: list[tuple[int, int]] = []
        for rid in out.decode_ids:
            live = self._live[rid]
            try:
                assert live.job is not None and live.state is not None
                kv, token = live.job.kv, live.state.output_ids[-1]
            except Exception as e:  # a request in a state it cannot decode from
                self._fail(rid, e)
                continue
            if self.pool is not None and kv.pool is self.pool:
                batch_ids.append(rid)
                caches.append(kv)
                rows.append((token, kv.length))
            else:
                pos = torch.tensor([kv.length], device=kv.k.device)
                works.append(SeqWork(kv, torch.tensor([token]), pos))
                order.append((rid, False))
        decode = None
        if rows:
            ids_pos = torch.tensor(rows)
            decode = DecodeBatch(caches, ids_pos[:, 0], ids_pos[:, 1])
        if not works and decode is None:
            return
        self.num_steps += 1
        t_step = time.perf_counter()
        results, decode_logits = self._forward_isolated(works, order, decode, batch_ids)
        outcomes: list[PrefillOutcome] = []
        for (rid, is_prefill), result in zip(order, results, strict=True):
            live = self._live.get(rid)
            if live is None or result is None:
                continue
            if is_prefill:
                assert live.job is not None and live.state is not None
                if live.sampling.prompt_logprobs is not None:
                    result = self._keep_prompt_logprobs(live, result, spans[rid][0])
                if result.rows_last_layer.shape[0] < len(live.job.rows):  # a piece
                    live.pieces.append(result)
                    live.state.num_done_rows = spans[rid][1]
                    if live.state.num_done_rows < len(live.job.rows):
                        continue  # more pieces in the next steps
                    result = merge_results(live.pieces)
                live.pieces = []
                live.state.num_done_rows = len(live.job.rows)
                try:
                    outcome = self.runner.finish(live.job, result)
                except Exception as e:
                    self._fail(rid, e)
                    continue
                live.outcome = outcome
                if live.prompt_hash is not None:
                    self._remember(live.prompt_hash)
                if live.options is None or live.options.commit:
                    outcomes.append(outcome)
                self.scheduler.prefilled(rid)
                if live.sampling.prompt_logprobs is not None:
                    live.handle.push(PromptLogprobs(live.prompt_ids, live.prompt_entries))
                logits = outcome.first_logits
            else:
                logits = result.logits[0]
            self._sample_emit(rid, logits)
            if is_prefill and live.options is not None and rid in self._live:
                self._extras(live)  # after the first token: off the TTFT path
        for rid, row in zip(batch_ids, decode_logits, strict=True):
            if row is not None:
                self._sample_emit(rid, row)
        num_prefills = sum(is_prefill for _, is_prefill in order)
        prefill_rows = sum(int(w.positions.shape[0]) for w in works[:num_prefills])
        ms = 1000 * (time.perf_counter() - t_step)
        self.recent_steps.append(StepStat(num_prefills, prefill_rows, len(out.decode_ids), ms))
        for outcome in outcomes:  # off the time-to-first-token path
            self._commit_guarded(outcome)

    def _emit(self, live: _Live, token: int, logprobs: TokenLogprobs | None = None) -> None:
        state = live.state
        assert state is not None
        if not state.output_ids and live.outcome is not None:
            live.outcome.report.ttft_ms = 1000 * (time.perf_counter() - live.t_submit)
        state.output_ids.append(token)
        is_stop = token in live.stops
        live.handle.push(Token(token, is_stop, logprobs))
        reason = "stop" if is_stop else None
        if reason is None and state.num_output_tokens >= state.max_tokens:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(state.request_id, reason)
            self._live.pop(state.request_id, None)
            if live.kv is not None:
                self._released.append(live.kv)
            report = live.outcome.report if live.outcome is not None else None
            extras = self._extras(live, at_end=True)
            live.handle.push(Finished(reason, list(state.output_ids), report, extras))

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
        if live.kv is not None:
            self._released.append(live.kv)
        if live.outcome is None:  # ended before its prefill finished: its readers stay open
            self._close_loader(live)
        if reason is not None:
            self.num_aborted += reason == "abort"
            out = list(live.state.output_ids) if live.state else []
            report = live.outcome.report if live.outcome is not None else None
            extras = self._extras(live, at_end=True)
            live.handle.push(Finished(reason, out, report, extras))
        return live

    def _extras(self, live: _Live, at_end: bool = False) -> RequestExtras | None:
        """Fill what `live.options` asked for: teacher forcing of `forced` once the prompt is
        in (before any decode step writes after it), of the output itself at the end."""
        opts, job, outcome = live.options, live.job, live.outcome
        if opts is None or job is None or outcome is None or live.state is None:
            return None
        model = self.runner.loaded.model
        if live.extras is None:
            live.extras = RequestExtras(
                job.plan, job.rows, outcome.rows_last_layer, outcome.first_logits
            )
            if opts.forced:
                live.extras.forced_logits = force_tokens(model, job.kv, outcome, list(opts.forced))
        if at_end and opts.force_answer and live.state.output_ids:
            output = list(live.state.output_ids)
            live.extras.forced_logits = force_tokens(model, job.kv, outcome, output)
        return live.extras


def _waits_for(plan: RecomputePlan, strategy: ReuseStrategy, in_flight: set[Offer]) -> bool:
    """Whether a chunk `plan` computes in full is being computed, by a prefill under way, into
    a variant this request could reuse: starting a step later (after that prefill stores it)
    then spares computing it twice. Any variant of the chunk serves a strategy that reuses
    approximately; one with `exact_only` only an exact one made in exactly this place; one
    that does not read the store none."""
    if not strategy.reads_store or not in_flight:
        return False
    exact_only = strategy.exact_only
    return any(
        o.key == c.slot.key and (not exact_only or (o.is_exact and o.context == front))
        for c, front in zip(plan.chunks, _in_front(plan), strict=True)
        if c.variant is None
        for o in in_flight
    )


def _in_front(plan: RecomputePlan) -> list[tuple[str, ...]]:
    """Per chunk of `plan`, the keys in front of it: the prefix's, then the chunks' before it."""
    keys = (plan.layout.prefix_key, *(c.slot.key for c in plan.chunks))
    return [keys[: i + 1] for i in range(len(plan.chunks))]


__all__ = ["Engine", "EngineConfig", "EngineStopped", "RequestExtras", "RequestOptions", "StepStat"]
