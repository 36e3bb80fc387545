"""Runner: turn a request into a plan, assemble its KV, run the partial prefill, make variants.

plan(request, strategy) -> RecomputePlan           (store metadata + prefix cache state)
splice(plan)         -> Spliced (KV spliced: prefix cache + moved chunk K/V; the probe's
                        SeqWork if the plan has one)
model.forward_step([spliced.probe.work, ...])    (the probes, the engine's all in one pass)
build(spliced, probe result) -> PrefillJob (the probe fixes the plan's rows; SeqWork)
model.forward_step([job.work, ...])              (one or many jobs batched by the engine)
finish(job, result)  -> PrefillOutcome (first-token logits, report)
commit(outcome)      -> new variants assembled and offered to the store, the prefix cached:
                        after the first token went out (off the time-to-first-token path)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from cachecraft.config import ReuseConfig
from cachecraft.engine.hooks import DeviationSelect, EarlyTermination
from cachecraft.engine.layer_loader import LayerLoader
from cachecraft.engine.prefix_cache import PrefixCache
from cachecraft.engine.probe import Probe, ScratchCaches, probe_work, runs_in_place
from cachecraft.engine.report import ChunkReport, RequestReport
from cachecraft.engine.retry import again_if_corrupt
from cachecraft.engine.selection import select_on_device
from cachecraft.engine.variants import make_variants
from cachecraft.errors import BadRequestError, NonFiniteError
from cachecraft.model.kv import KVCache
from cachecraft.model.loader import DTYPES, LoadedModel
from cachecraft.model.step import Hook, SeqResult, SeqWork
from cachecraft.request import RagRequest
from cachecraft.reuse.layout import PromptLayout, build_layout
from cachecraft.reuse.plan import ChunkPlan, RecomputePlan
from cachecraft.reuse.planner import as_miss, plan_request, without_prefix_hit
from cachecraft.reuse.stats import stats_layers
from cachecraft.reuse.strategy import ReuseStrategy
from cachecraft.reuse.token_cache import TokenCache
from cachecraft.store.base import ChunkStore
from cachecraft.store.codec import CorruptVariantError
from cachecraft.store.meta import VariantMeta
from cachecraft.store.variant import Variant

log = logging.getLogger(__name__)


def require_finite(logits: torch.Tensor) -> None:
    """Raise NonFiniteError unless every logit is finite (a NaN in K/V reaches them all)."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteError(
            "the model computed non-finite logits (NaN or infinity) for this request; "
            "nothing was cached from it"
        )


@dataclass(slots=True)
class Spliced:
    """A request between splicing and its prefill: its K/V in place; `probe` (the plan has
    one) still to run, its result to be given to `Runner.build`."""

    plan: RecomputePlan
    kv: KVCache
    loader: LayerLoader
    t_start: float
    probe: Probe | None = None


@dataclass(slots=True)
class PrefillJob:
    """One request between `start` and `finish`. rows: the positions computed, ascending."""

    plan: RecomputePlan
    kv: KVCache
    work: SeqWork
    rows: torch.Tensor
    t_start: float
    early_exit: EarlyTermination | None = None
    loader: LayerLoader | None = None
    stat_chunks: tuple[int, ...] = ()
    """Chunk indexes whose rows collect attention statistics (they become variants)."""
    probe_rows: int = 0
    """Rows the probe pass computed before the prefill (0: no probe ran)."""


@dataclass(slots=True)
class PrefillOutcome:
    """first_logits [vocab]; job and result stay until `Runner.variants` assembled the new
    variants from them (the job's KV must not be rewritten at prompt positions before)."""

    first_logits: torch.Tensor
    report: RequestReport
    hits: list[tuple[str, float]] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)
    rows_last_layer: torch.Tensor | None = None
    """Per computed row (PrefillJob.rows), the last layer it ran through."""
    job: PrefillJob | None = None
    result: SeqResult | None = None
    variants: list[Variant] = field(default_factory=list)
    is_assembled: bool = False


class Runner:
    """Executes plans for one model over one chunk store (and its own exact prefix cache)."""

    def __init__(
        self,
        loaded: LoadedModel,
        store: ChunkStore,
        reuse: ReuseConfig | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.loaded = loaded
        self.store = store
        self.reuse = reuse or ReuseConfig()
        self.prefix_cache = PrefixCache() if prefix_cache is None else prefix_cache
        self.storage_dtype = DTYPES[store.storage_dtype]
        self.stats_layers = stats_layers(self.reuse.stats_stride, loaded.arch.num_layers)
        self.scratches = ScratchCaches()
        """Probes' scratch caches, kept between requests (engine/probe.py)."""
        self.tokens = TokenCache()
        """Token ids of the chunks and system prompts laid out before (any thread)."""

    # ---- planning -------------------------------------------------------------------------
    def plan(
        self,
        request: RagRequest,
        strategy: ReuseStrategy,
        budgets: list[int | None] | None = None,
        lookup: bool = True,
        layout: PromptLayout | None = None,
        repeat: bool = False,
    ) -> RecomputePlan:
        """The request's plan; `lookup=False` ignores stored variants (every chunk computed in
        full and made a variant: `LLM.precompute`). `layout`: `self.layout(request)` computed
        earlier (tokenization done off the step thread). `repeat`: the engine saw this very
        prompt before (`ReuseConfig.refresh_repeats`)."""
        m = self.loaded
        layout = layout or self.layout(request)
        variants: dict[str, list[VariantMeta]] = {}
        if strategy.reads_store and lookup:
            variants = {c.key: self.store.variants(c.key) for c in layout.chunks}
        prefix_hit = self.prefix_cache.get(layout.prefix_key) is not None
        return plan_request(
            layout, variants, strategy, self.reuse, m.arch.num_layers, budgets, prefix_hit, repeat
        )

    def layout(self, request: RagRequest) -> PromptLayout:
        """Tokenize the request and check the context length (no model, no store: any thread)."""
        m = self.loaded
        outside = [t for t in request.prompt_ids if t >= m.arch.vocab_size]
        if outside:
            raise BadRequestError(
                f"prompt: token {outside[0]} is not in the vocabulary (ids 0-{m.arch.vocab_size - 1})"
            )
        return build_layout(
            request, m.tokenizer, m.fingerprint, m.arch.max_position_embeddings, self.tokens
        )

    # ---- KV assembly ----------------------------------------------------------------------
    def start(
        self,
        plan: RecomputePlan,
        extra_capacity: int = 0,
        t_start: float | None = None,
        *,
        precompute: bool = False,
        kv: KVCache | None = None,
    ) -> PrefillJob:
        """`splice`, the probe alone (if the plan has one), `build`."""
        spliced = self.splice(plan, extra_capacity, t_start, kv=kv)
        return self.build(spliced, self.run_probe(spliced), precompute)

    def run_probe(self, spliced: Spliced) -> SeqResult | None:
        """The spliced request's probe, alone (None: it has none). If it fails, the
        request's layer readers are closed."""
        if spliced.probe is None:
            return None
        try:
            return self.loaded.model.forward_step([spliced.probe.work])[0]
        except Exception:
            spliced.loader.close()
            raise

    def splice(
        self,
        plan: RecomputePlan,
        extra_capacity: int = 0,
        t_start: float | None = None,
        *,
        kv: KVCache | None = None,
    ) -> Spliced:
        """Splice the KV and make the plan's probe (if any). A variant that cannot be loaded
        becomes a miss; a prefix the cache dropped is computed. `kv`: the cache to fill (the
        engine's pool slot; emptied first); None: a new one."""
        t0 = time.perf_counter() if t_start is None else t_start
        m, layout = self.loaded, plan.layout
        capacity = layout.num_tokens + extra_capacity
        if kv is None:
            kv = KVCache(m.arch, capacity, m.model.dtype, m.model.device)
        else:
            kv.length = 0  # every prompt position is spliced or computed again below
            kv.ensure_capacity(capacity)
        if plan.prefix_hit:
            prefix = self.prefix_cache.get(layout.prefix_key)
            if prefix is None:
                plan = without_prefix_hit(plan)
            else:
                kv.write(0, *prefix)
        loader = LayerLoader(kv, self.loaded.model.rope)
        for i, cp in enumerate(plan.chunks):
            if not self._splice(loader, cp):
                plan = as_miss(plan, i)
        if plan.is_resolved:
            return Spliced(plan, kv, loader, t0)
        try:
            if runs_in_place(plan) and loader.reads_only_memory:
                # the probe's forward fills each layer of the reused chunks as it reaches it;
                # a chunk read from a file is read up front instead, where a corrupt one
                # still becomes a miss before any forward (`_splice`'s retry)
                probe = probe_work(m.model, kv, plan, self.scratches)
                probe.work.before_layer = loader.fill_layer
            else:  # every layer of the reused chunks up front (a scratch copy needs them too)
                loader.fill_all()
                probe = probe_work(m.model, kv, plan, self.scratches)
            return Spliced(plan, kv, loader, t0, probe)
        except Exception:
            loader.close()
            raise

    def build(
        self, spliced: Spliced, probe_result: SeqResult | None = None, precompute: bool = False
    ) -> PrefillJob:
        """The prefill of a spliced request: its probe's result (required when it has a
        probe) fixes the rows. Statistics are collected only for missed chunks the store
        would admit (`precompute`: for every chunk, whatever the store would say)."""
        plan, kv, loader = spliced.plan, spliced.kv, spliced.loader
        probe_rows = 0
        if spliced.probe is not None:
            if probe_result is None:
                raise ValueError("the request's probe has not run")
            probe_rows = plan.num_probe_rows
            assert probe_result.key_mass is not None
            plan = select_on_device(plan, spliced.probe.where, probe_result.key_mass)
            if spliced.probe.scratch is not None:  # it ran: its scratch is free again
                self.scratches.give(spliced.probe.scratch)
                spliced.probe.scratch = None
        rows = plan.rows()  # through numpy: torch.tensor reads a long tuple item by item
        token_ids = plan.layout.token_ids
        positions = torch.from_numpy(np.array(rows, dtype=np.int64))
        ids = torch.from_numpy(np.fromiter((token_ids[p] for p in rows), np.int64, len(rows)))
        work = SeqWork(kv, ids, positions)
        if loader.num_readers and not probe_rows:
            work.before_layer = loader.fill_layer
        job = PrefillJob(
            plan, kv, work, positions, spliced.t_start, loader=loader, probe_rows=probe_rows
        )
        self._add_stats(job, precompute)
        self._add_hooks(job)
        return job

    def _splice(self, loader: LayerLoader, cp: ChunkPlan) -> bool:
        """Queue the chunk's variant for layer-wise loading; False if it cannot be loaded."""
        if cp.variant is None:
            return True
        variant_id = cp.variant.variant_id
        reader = self.store.open_layers(variant_id)
        if reader is None:
            log.warning("variant %s vanished; computing chunk in full", variant_id)
            return False
        loader.add(reader, cp.slot.start, cp.slot.end)
        return True

    def _add_stats(self, job: PrefillJob, precompute: bool) -> None:
        """Attention statistics for chunks computed in full that will become variants (a plan
        that offers none, or that reuses only exact variants, never reads them)."""
        plan, layout = job.plan, job.plan.layout
        if not plan.make_variants or not plan.measure_stats:
            return
        picked = tuple(
            i
            for i, cp in enumerate(plan.chunks)
            if cp.variant is None and (precompute or self.store.would_admit(cp.slot.key))
        )
        job.stat_chunks = picked
        misses = [plan.chunks[i] for i in picked]
        if not misses:
            return
        bounds = [(0, layout.prefix_len)]
        bounds += [(cp.slot.start, cp.slot.end) for cp in plan.chunks]
        bounds.append((layout.question_start, layout.num_tokens))
        selected = torch.zeros_like(job.rows, dtype=torch.bool)
        for cp in misses:
            selected |= (job.rows >= cp.slot.start) & (job.rows < cp.slot.end)
        job.work.span_bounds = torch.tensor(bounds, dtype=torch.long)
        job.work.stats_rows = selected
        job.work.stats_layers = self.stats_layers

    def _add_hooks(self, job: PrefillJob) -> None:
        plan, layout = job.plan, job.plan.layout
        top = self.loaded.arch.num_layers - 1
        hooks: dict[int, Hook] = {}
        early = plan.early_exit
        if early is not None and early.layer < top:
            eligible = tuple(
                i for i, cp in enumerate(plan.chunks) if cp.variant is not None and cp.recompute
            )
            bounds = torch.tensor([(c.slot.start, c.slot.end) for c in plan.chunks] or [(0, 0)])
            if eligible:
                job.early_exit = EarlyTermination(
                    layout.question_start, bounds, eligible, early.threshold
                )
                hooks[early.layer] = job.early_exit
        if plan.deviation is not None:
            spans = tuple(
                (cp.slot.start, cp.slot.end, cp.budget)
                for cp in plan.chunks
                if cp.variant is not None and cp.select == "deviation"
            )
            if spans:
                weights = self._deviation_weights(plan)
                check = DeviationSelect(spans, plan.deviation.total, weights, plan.deviation.sink)
                check.prepare(job.rows, job.kv.k.device)  # every row reaches it: no early exit
                hooks[min(plan.deviation.layer, top)] = check
                job.work.hooks_need_old = True
        job.work.hooks = hooks

    @staticmethod
    def _deviation_weights(plan: RecomputePlan) -> torch.Tensor | None:
        """[num_tokens] the check's weight per absolute position (None: unweighted)."""
        check = plan.deviation
        if check is None or check.weights is None:
            return None
        out = torch.zeros(plan.layout.num_tokens, dtype=torch.float32)
        weighted = [(cp, w) for cp, w in zip(plan.chunks, check.weights, strict=True) if w]
        if weighted:
            at = np.concatenate(
                [np.array(cp.recompute, np.int64) + cp.slot.start for cp, _ in weighted]
            )
            values = np.concatenate([np.array(w, np.float32) for _, w in weighted])
            out[torch.from_numpy(at)] = torch.from_numpy(values)
        return out

    # ---- after the forward ----------------------------------------------------------------
    def finish(self, job: PrefillJob, result: SeqResult) -> PrefillOutcome:
        """The outcome of a prefill; raises NonFiniteError if its logits hold a NaN or an
        infinity (its K/V are then suspect: the request fails and nothing of it is stored)."""
        if job.loader is not None:
            job.loader.close()
        require_finite(result.logits[-1])
        plan, layout = job.plan, job.plan.layout
        top = self.loaded.arch.num_layers - 1
        last = result.rows_last_layer
        chunk_reports, hits, misses = [], [], []
        tokens_computed = int((job.rows < layout.prefix_len).sum())
        tokens_computed += len(layout.question_ids)
        for cp in plan.chunks:
            in_chunk = (job.rows >= cp.slot.start) & (job.rows < cp.slot.end)
            if cp.select == "deviation":  # CacheBlend: tokens kept past the check layer
                done = int((in_chunk & (last == top)).sum())
            else:
                done = int(in_chunk.sum())
            tokens_computed += done
            chunk_reports.append(self._chunk_report(cp, done, last[in_chunk]))
            if cp.variant is not None:
                hits.append((cp.variant.variant_id, done / max(1, cp.slot.num_tokens)))
            elif plan.make_variants:
                misses.append(cp.slot.key)
        total_layers = layout.num_tokens * (top + 1)
        report = RequestReport(
            mode=plan.mode,
            chunks=chunk_reports,
            prompt_tokens=layout.num_tokens,
            tokens_computed=tokens_computed,
            layer_fraction=float((last + 1).sum()) / total_layers if total_layers else 0.0,
            prefix_cached=layout.prefix_len if plan.prefix_hit else 0,
            probe_tokens=job.probe_rows,
            probe_cost=plan.probe_cost if job.probe_rows else 0.0,
        )
        return PrefillOutcome(result.logits[-1], report, hits, misses, last, job, result)

    def variants(self, outcome: PrefillOutcome) -> list[Variant]:
        """The new variants of `outcome` (assembled on the first call) and, once, the computed
        system prefix into the exact prefix cache. Call before its KV is rewritten at prompt
        positions (decoding writes only after the prompt)."""
        if outcome.is_assembled:
            return outcome.variants
        job, result = outcome.job, outcome.result
        outcome.is_assembled, outcome.job, outcome.result = True, None, None
        if job is None or result is None or not job.plan.make_variants:
            return outcome.variants
        plan, rope = job.plan, self.loaded.model.rope
        if not plan.measure_stats:
            misses = [i for i, cp in enumerate(plan.chunks) if cp.variant is None]
            outcome.variants = make_variants(
                plan, job.rows, job.kv, result, rope, self.storage_dtype, misses, measured=False
            )
        else:
            outcome.variants = make_variants(
                plan,
                job.rows,
                job.kv,
                result,
                rope,
                self.storage_dtype,
                job.stat_chunks,
                layers=self.stats_layers,
            )
        if not plan.prefix_hit:
            p = plan.layout.prefix_len
            k, v = job.kv.k[:, :, :p], job.kv.v[:, :, :p]
            if bool(torch.isfinite(k).all() and torch.isfinite(v).all()):
                self.prefix_cache.put(plan.layout.prefix_key, k.clone(), v.clone())
            else:  # every request of the namespace would reuse it
                log.warning("prefix %s holds non-finite K/V: not cached", plan.layout.prefix_key)
        return outcome.variants

    @staticmethod
    def _chunk_report(cp: ChunkPlan, done: int, last: torch.Tensor) -> ChunkReport:
        v = cp.variant
        return ChunkReport(
            key=cp.slot.key,
            label=cp.slot.label,
            is_hit=v is not None,
            variant_id=v.variant_id if v else None,
            s_old=list(v.s_old) if v else None,
            num_tokens=cp.slot.num_tokens,
            tokens_recomputed=done,
            last_layer=int(last.max()) if last.numel() else None,
            cci=cp.cci,
            beta=cp.beta,
            gamma=cp.gamma,
            beta_adj=cp.beta_adj,
            cfo=cp.cfo,
            reason=cp.reason,
            predicted_error=cp.error,
            is_exact=cp.is_exact,
        )

    def commit(self, outcome: PrefillOutcome, wait: bool = True) -> None:
        """Tell the store what was reused and missed, and offer the new variants (wait=False:
        their disk and Redis writes may finish on the store's writer thread)."""
        variants = self.variants(outcome)
        for variant_id, cfo in outcome.hits:
            self.store.record_hit(variant_id, cfo)
        for key in outcome.misses:
            self.store.record_miss(key)
        for variant in variants:
            offered = self.store.offer(variant, wait=wait)
            if not (offered.stored or offered.queued):
                log.debug("variant %s not stored: %s", offered.variant_id, offered.reason)

    def prefill(
        self,
        request: RagRequest,
        strategy: ReuseStrategy,
        budgets: list[int | None] | None = None,
        extra_capacity: int = 0,
    ) -> tuple[PrefillJob, PrefillOutcome]:
        """plan + start + forward + finish for one request (no commit). A chunk-cache found
        corrupt while its layers are read is dropped by the store; the request is then planned
        again (that chunk becomes a miss), never served from bad bytes."""
        t0 = time.perf_counter()

        def attempt(_: int) -> tuple[PrefillJob, PrefillOutcome]:
            job = self.start(self.plan(request, strategy, budgets), extra_capacity, t0)
            try:
                result = self.loaded.model.forward_step([job.work])[0]
            except CorruptVariantError:
                if job.loader is not None:
                    job.loader.close()
                raise
            return job, self.finish(job, result)

        return again_if_corrupt(attempt, "a request")
