"""LLM: the offline API. `LLM(model).generate(requests, sampling, mode=...)` and `.precompute`.

The server's engine plus a step loop (`engine.offline`): requests given together are batched
as the server batches them, through the same planner, runner, scheduler and decode loop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from cachecraft.config import ReuseConfig
from cachecraft.engine.engine import Engine, EngineConfig, RequestOptions
from cachecraft.engine.offline import Submission, run_requests
from cachecraft.engine.report import RequestReport
from cachecraft.engine.runner import Runner
from cachecraft.engine.sampling import SamplingParams
from cachecraft.errors import BadRequestError
from cachecraft.model.loader import load_model
from cachecraft.request import Chunk, RagRequest
from cachecraft.store.base import ChunkStore
from cachecraft.store.config import StoreConfig
from cachecraft.store.memory import MemoryStore
from cachecraft.store.store import make_store

DEFAULT_STORE_BYTES = 2 << 30


@dataclass(slots=True)
class RequestOutput:
    """text and token_ids of the answer; report of what was reused.

    first_token_logits [vocab] is kept when asked (`keep_logits`); teacher_forced_logits
    [m, vocab]: row j is the distribution for forced token j given the prompt and tokens < j.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    report: RequestReport
    first_token_logits: torch.Tensor | None = None
    teacher_forced_logits: torch.Tensor | None = None


def reuse_config(**fields: object) -> ReuseConfig:
    """ReuseConfig from keyword fields, with a clear error for an unknown one and for a store
    setting given here (it belongs to StoreConfig)."""
    known = {f.name for f in dataclasses.fields(ReuseConfig)}
    store_fields = {f.name for f in dataclasses.fields(StoreConfig)}
    misplaced = sorted((set(fields) - known) & store_fields)
    if misplaced:
        raise BadRequestError(
            f"{', '.join(misplaced)}: a store setting, not a reuse one; give it to the store, "
            f"e.g. LLM(store=StoreConfig({misplaced[0]}=...)) or `cachecraft serve "
            f"--{misplaced[0].replace('_', '-')}`"
        )
    unknown = sorted(set(fields) - known)
    if unknown:
        raise BadRequestError(f"unknown option(s) {unknown}; known: {sorted(known)}")
    return ReuseConfig(**fields)  # type: ignore[arg-type]


class LLM:
    """A model plus a chunk store. `store`: a ChunkStore, a StoreConfig to build one from, or
    None for an in-memory LRU store (`MemoryStore`, 2 GiB). `**reuse`: ReuseConfig fields."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        store: ChunkStore | StoreConfig | None = None,
        **reuse: object,
    ) -> None:
        self.config = reuse_config(**reuse)
        self.loaded = load_model(model, dtype, device)
        if store is None:  # not `or`: an empty store is falsy (it has __len__)
            store = MemoryStore(DEFAULT_STORE_BYTES)
        elif isinstance(store, StoreConfig):
            store = make_store(store)
        self.runner = Runner(self.loaded, store, self.config)
        self.engine = Engine(self.runner, EngineConfig(), caller_driven=True)

    @property
    def store(self) -> ChunkStore:
        return self.runner.store

    def generate(
        self,
        requests: RagRequest | list[RagRequest],
        sampling: SamplingParams | None = None,
        mode: str = "cachecraft",
        *,
        budgets: list[list[int | None] | None] | None = None,
        teacher_force: list[list[int] | None] | None = None,
        keep_logits: bool = False,
    ) -> list[RequestOutput]:
        """Answer the requests together, as the server would (a request sees the variants of
        those whose prefill finished before its own started). budgets[i] / teacher_force[i]
        go with requests[i]; outputs come back in request order."""
        items = [requests] if isinstance(requests, RagRequest) else list(requests)
        for r in items:
            if not isinstance(r, RagRequest):
                raise BadRequestError(f"expected RagRequest, got {type(r).__name__}")
        sampling = sampling or SamplingParams()
        subs = []
        for i, request in enumerate(items):
            forced = teacher_force[i] if teacher_force else None
            options = RequestOptions(tuple(forced or ())) if forced or keep_logits else None
            subs.append(
                Submission(request, sampling, mode, budgets[i] if budgets else None, options)
            )
        outs = []
        for done in run_requests(self.engine, subs):
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
                )
            )
        return outs

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
            plan = self.runner.plan(request, "cachecraft", lookup=False)
            job = self.runner.start(plan, precompute=True)
            result = self.loaded.model.forward_step([job.work])[0]
            outcome = self.runner.finish(job, result)
            self.runner.commit(outcome)
            target = outcome.variants[-1]
            if any(
                v.variant_id == target.variant_id for v in self.store.variants(target.chunk_key)
            ):
                ids.append(target.variant_id)
        return ids
