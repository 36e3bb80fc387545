"""LLM: the offline API. `LLM(model).generate(requests, sampling, mode=...)`, `.answer` (one
request with a benchmark's measurements), `.precompute` and `.warm`; and `split_settings`, the
one place that says which settings object a named setting belongs to.

The server's engine plus a step loop (`engine.offline`): requests given together are batched
as the server batches them, through the same planner, runner, scheduler and decode loop.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from cachecraft.config import ReuseConfig, field_names
from cachecraft.engine.engine import Engine, EngineConfig, RequestOptions
from cachecraft.engine.offline import Submission, run_requests
from cachecraft.engine.precompute import prefill_in_full
from cachecraft.engine.report import RequestReport
from cachecraft.engine.runner import Runner
from cachecraft.engine.sampling import SamplingParams, TokenLogprobs
from cachecraft.env import tune_allocator
from cachecraft.errors import BadRequestError
from cachecraft.model.loader import LoadedModel, load_model
from cachecraft.request import Chunk, RagRequest
from cachecraft.reuse.plan import RecomputePlan
from cachecraft.reuse.strategies import DEFAULT_STRATEGY, STRATEGIES
from cachecraft.reuse.strategy import ReuseStrategy, StrategyRegistry
from cachecraft.store.base import ChunkStore
from cachecraft.store.config import StoreConfig
from cachecraft.store.memory import MemoryStore
from cachecraft.store.store import make_store

DEFAULT_STORE_BYTES = 2 << 30


@dataclass(slots=True)
class RequestOutput:
    """text and token_ids of the answer; report of what was reused.

    first_token_logits [vocab] is kept when asked (`keep_logits`); teacher_forced_logits
    [m, vocab]: row j is the distribution for forced token j given the prompt and tokens < j;
    logprobs: one `TokenLogprobs` per token id when the sampling asked for them;
    prompt_logprobs: one per prompt token (None for the first) when the sampling asked for
    them (`SamplingParams.prompt_logprobs`; the request then runs in `full` mode).
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    report: RequestReport
    first_token_logits: torch.Tensor | None = None
    teacher_forced_logits: torch.Tensor | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(slots=True)
class Answer:
    """One request answered by `LLM.answer`, with what a benchmark measures.

    token_ids: generated ids (a final EOS/stop id included); text without it.
    plan: the plan as executed. first_logits [vocab]: the prompt's next-token logits.
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


def split_settings(
    fields: Mapping[str, object], strategy: ReuseStrategy | StrategyRegistry | None = None
) -> tuple[dict[str, object], dict[str, object], dict[str, object]]:
    """The one settings registry: `fields` split into (ReuseConfig fields, the parameters of
    `strategy` (or of any strategy of a registry), StoreConfig fields). A name none of them
    knows is a BadRequestError naming the known ones."""
    reuse_names = field_names(ReuseConfig)
    own = strategy.param_names() if strategy is not None else frozenset()
    store_names = field_names(StoreConfig)
    unknown = sorted(set(fields) - reuse_names - own - store_names)
    if unknown:
        known = sorted(reuse_names | own)
        raise BadRequestError(f"unknown option(s) {unknown}; known: {known}")
    reuse = {k: v for k, v in fields.items() if k in reuse_names}
    params = {k: v for k, v in fields.items() if k in own and k not in reuse_names}
    store = {k: v for k, v in fields.items() if k in store_names and k not in reuse_names | own}
    return reuse, params, store


def reuse_config(**fields: object) -> ReuseConfig:
    """ReuseConfig from keyword fields (a config file's "reuse" section, flags), with a clear
    error for an unknown one and for a store setting given here (it belongs to StoreConfig)."""
    return configure(fields, None)[0]


def configure(
    fields: Mapping[str, object], registry: StrategyRegistry | None = STRATEGIES
) -> tuple[ReuseConfig, StrategyRegistry | None]:
    """(ReuseConfig, `registry` with its strategies' parameters changed) from `fields`; an
    unknown name, a store setting or a bad value is a BadRequestError."""
    reuse, params, store = split_settings(fields, registry)
    if store:
        name = sorted(store)[0]
        raise BadRequestError(
            f"{', '.join(sorted(store))}: a store setting, not a reuse one; give it to the "
            f"store, e.g. LLM(store=StoreConfig({name}=...)) or `cachecraft serve "
            f"--{name.replace('_', '-')}`"
        )
    try:
        config = ReuseConfig(**reuse)  # type: ignore[arg-type]
        if registry is not None and params:
            registry = registry.with_params(**params)
    except ValueError as e:
        raise BadRequestError(f"bad reuse setting: {e}") from None
    return config, registry


class LLM:
    """A model plus a chunk store. `model`: a path or name for `load_model`, or a model loaded
    already (several LLMs may share its weights; dtype and device are then the model's).
    `store`: a ChunkStore, a StoreConfig to build one from (its `device` is where the memory
    tier lives, the CPU unless set, whatever `device` says), or None for an in-memory LRU
    store (`MemoryStore`, 2 GiB, host memory). `config` (a ReuseConfig) or `**reuse` (its
    fields and the parameters of the registered strategies, each given to the strategies that
    take it: `LLM(model, probe_max_cost=None)`), not both.
    `engine`: the EngineConfig of its step loop (None: the defaults).

    Thread-safe: calls from several threads run one after another; to batch requests, give
    them together in one `generate` call. Creating one tunes glibc's allocator for the whole
    process (`cachecraft.env.tune_allocator`)."""

    def __init__(
        self,
        model: str | LoadedModel | None = None,
        *,
        dtype: str | None = None,
        device: str = "cpu",
        store: ChunkStore | StoreConfig | None = None,
        config: ReuseConfig | None = None,
        engine: EngineConfig | None = None,
        **reuse: object,
    ) -> None:
        if config is not None and reuse:
            raise BadRequestError(
                f"reuse settings given twice: config=ReuseConfig(...) and {sorted(reuse)}"
            )
        configured, strategies = configure(reuse)
        self.config = config if config is not None else configured
        self.strategies = strategies or STRATEGIES
        """The strategies `generate` and `answer` resolve a name in."""
        tune_allocator()  # process-wide: large activations from the heap (cachecraft/env.py)
        if isinstance(model, LoadedModel):
            self.loaded = model
        else:
            self.loaded = load_model(model, dtype, device)
        if store is None:  # not `or`: an empty store is falsy (it has __len__)
            store = MemoryStore(DEFAULT_STORE_BYTES)
        elif isinstance(store, StoreConfig):
            store = make_store(store)
        self.runner = Runner(self.loaded, store, self.config)
        self.engine = Engine(self.runner, engine or EngineConfig(), caller_driven=True)
        self._lock = threading.RLock()
        """One step loop at a time: calls from several threads run one after another (two
        loops stepping one engine mixed their requests' tokens up)."""

    @property
    def store(self) -> ChunkStore:
        return self.runner.store

    def generate(
        self,
        requests: RagRequest | list[RagRequest],
        sampling: SamplingParams | None = None,
        mode: str | ReuseStrategy = DEFAULT_STRATEGY,
        *,
        budgets: list[list[int | None] | None] | None = None,
        teacher_force: list[list[int] | None] | None = None,
        keep_logits: bool = False,
    ) -> list[RequestOutput]:
        """Answer the requests together, as the server would (a request sees the variants of
        those whose prefill finished before its own started). budgets[i] / teacher_force[i]
        go with requests[i]; outputs come back in request order. `mode`: a registered
        strategy's name, or a strategy object (e.g. one with other parameters)."""
        strategy = self.strategies.resolve(mode)
        if not isinstance(requests, RagRequest | list | tuple):
            raise BadRequestError(
                f"expected a RagRequest or a list of them, got {type(requests).__name__}"
            )
        items = [requests] if isinstance(requests, RagRequest) else list(requests)
        for r in items:
            if not isinstance(r, RagRequest):
                raise BadRequestError(f"expected RagRequest, got {type(r).__name__}")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise BadRequestError(
                f"sampling must be a SamplingParams, got {type(sampling).__name__}"
            )
        sampling = sampling or SamplingParams()
        subs = []
        for i, request in enumerate(items):
            forced = teacher_force[i] if teacher_force else None
            options = RequestOptions(tuple(forced or ())) if forced or keep_logits else None
            subs.append(
                Submission(request, sampling, strategy, budgets[i] if budgets else None, options)
            )
        with self._lock:
            completions = run_requests(self.engine, subs)
        outs = []
        for done in completions:
            assert done.report is not None
            extras = done.extras
            outs.append(
                RequestOutput(
                    text=done.text,
                    token_ids=done.token_ids,
                    finish_reason=done.finish_reason,
                    report=done.report,
                    first_token_logits=extras.first_logits if extras and keep_logits else None,
                    teacher_forced_logits=extras.forced_logits if extras else None,
                    logprobs=done.logprobs,
                    prompt_logprobs=done.prompt_logprobs,
                )
            )
        return outs

    def answer(
        self,
        request: RagRequest,
        sampling: SamplingParams | None = None,
        mode: str | ReuseStrategy = DEFAULT_STRATEGY,
        *,
        budgets: list[int | None] | None = None,
        forced: list[int] | None = None,
        force_answer: bool = False,
        commit: bool = True,
    ) -> Answer:
        """Answer one request in `mode` with the benchmark's measurements: teacher-force
        `forced` (if any) after the prompt, decode per `sampling`, then (if `commit`) offer new
        variants to the store; `force_answer`: teacher-force the generated answer itself
        afterwards (the reference other modes are compared with). Same engine and step loop as
        `generate`; report.ttft_ms covers planning, KV assembly, the prefill and sampling the
        first token."""
        options = RequestOptions(tuple(forced or ()), force_answer, commit)
        strategy = self.strategies.resolve(mode)
        sub = Submission(request, sampling or SamplingParams(), strategy, budgets, options)
        with self._lock:
            done = run_requests(self.engine, [sub])[0]
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

    def precompute(
        self,
        chunks: list[Chunk | str],
        context: list[Chunk | str] | None = None,
        namespace: str = "default",
        system: str | None = None,
    ) -> list[str]:
        """Compute each chunk in full after `context` (S_old) and store it; returns the
        variant ids of `chunks` (those the store admitted)."""
        ids = []
        before = list(context or [])
        for chunk in chunks:
            request = RagRequest(".", [*before, chunk], system=system, namespace=namespace)
            ids += self._compute_in_full(request, only_last=True)
        return ids

    def warm(self, request: RagRequest) -> list[str]:
        """Compute every chunk of `request` in full in its own context (one prefill, no answer)
        and offer each as a variant; returns the variant ids the store admitted."""
        return self._compute_in_full(request, only_last=False)

    def _compute_in_full(self, request: RagRequest, only_last: bool) -> list[str]:
        with self._lock:
            outcome = prefill_in_full(self.runner, request)
            self.runner.commit(outcome)
        made = outcome.variants[-1:] if only_last else outcome.variants
        return [
            v.variant_id
            for v in made
            if any(s.variant_id == v.variant_id for s in self.store.variants(v.chunk_key))
        ]
