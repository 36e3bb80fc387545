"""BatchBuilder: what one engine step runs. It starts the step's prefills (plan again, splice,
all their probes through one forward, build the jobs), gathers the prefill rows and the decodes
into one StepBatch (decodes in a pool slot as one DecodeBatch), and runs it through the model,
isolating a failure to the requests it belongs to.

It reads and changes the engine's live requests but never finishes one: a request that fails
here is handed to `fail` (the engine's), which frees it and tells its handle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from cachecraft.engine.live import Live, Offer
from cachecraft.engine.retry import again_if_corrupt
from cachecraft.engine.runner import Runner, Spliced
from cachecraft.engine.scheduler import SchedulerOutput
from cachecraft.model.kv import KVCache
from cachecraft.model.kv_pool import KVPool
from cachecraft.model.step import DecodeBatch, SeqResult, SeqWork, piece
from cachecraft.reuse.plan import RecomputePlan
from cachecraft.reuse.strategy import ReuseStrategy

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepBatch:
    """One step's forward: `works` (the prefills first, then decodes that have a cache of their
    own), `order` (request id, is_prefill) per work, `spans` (the prefill rows a..b-1 of a
    job this step), the pooled decodes as one DecodeBatch and their request ids."""

    works: list[SeqWork] = field(default_factory=list)
    order: list[tuple[str, bool]] = field(default_factory=list)
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    decode: DecodeBatch | None = None
    decode_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.works and self.decode is None

    @property
    def num_prefill_rows(self) -> int:
        num = sum(is_prefill for _, is_prefill in self.order)
        return sum(int(w.positions.shape[0]) for w in self.works[:num])


class BatchBuilder:
    """Builds and runs the engine's steps over `live` (request id -> Live)."""

    def __init__(
        self,
        runner: Runner,
        pool: KVPool | None,
        live: Mapping[str, Live],
        fail: Callable[[str, BaseException], None],
    ) -> None:
        self.runner = runner
        self.pool = pool
        self.live = live
        self.fail = fail

    # ---- starting prefills --------------------------------------------------------------------
    def plan(self, live: Live) -> RecomputePlan:
        return self.runner.plan(
            live.request, live.strategy, live.budgets, layout=live.layout, repeat=live.repeat
        )

    def start(self, live: Live) -> None:
        """`splice`, its probe alone (if any) and the job."""
        spliced = self.splice(live)
        live.job = self.runner.build(spliced, self.runner.run_probe(spliced))
        live.ask_logits()

    def start_all(self, lives: list[Live]) -> list[str]:
        """Start the prefills of this step: plan and splice each, run all their probes through
        ONE forward (one pass over the weights for all; if it fails, each alone so that only
        failing ones fail), build the jobs. A request that fails here fails alone. One that
        would compute a chunk another prefill under way is computing into a variant it could
        reuse waits instead (`waits_for`): returned, in order, to go back to the head of the
        queue, so it starts once that variant is stored rather than compute it beside it."""
        spliced: list[tuple[Live, Spliced]] = []
        later: list[str] = []
        in_flight = {o for live in self.live.values() if live.is_prefilling() for o in live.offers}
        for live in lives:
            try:
                plan = self.plan(live)
                if live.job is None and waits_for(plan, live.strategy, in_flight):
                    later.append(live.request_id)
                    continue
                live.offers = self.offers(plan)
                in_flight |= live.offers
                spliced.append((live, self.splice(live, plan)))
            except Exception as e:
                self.fail(live.request_id, e)
        results = self._run_probes([(live, s) for live, s in spliced if s.probe is not None])
        for live, s in spliced:
            rid = live.request_id
            if s.probe is not None and rid not in results:
                continue  # failed in the probe pass
            try:
                live.job = self.runner.build(s, results.get(rid))
                live.ask_logits()
            except Exception as e:
                s.loader.close()
                self.fail(rid, e)
        return later

    def _run_probes(self, probes: list[tuple[Live, Spliced]]) -> dict[str, SeqResult | None]:
        """Request id -> its probe's result: all in one forward, each alone if that fails."""
        results: dict[str, SeqResult | None] = {}
        if not probes:
            return results
        try:
            works = [s.probe.work for _, s in probes if s.probe is not None]
            outs = self.runner.loaded.model.forward_step(works)
            for (live, _), result in zip(probes, outs, strict=True):
                results[live.request_id] = result
        except Exception:
            log.exception("the probe pass over %d requests failed; isolating", len(probes))
            for live, s in probes:
                try:
                    results[live.request_id] = self.runner.run_probe(s)
                except Exception as e:
                    self.fail(live.request_id, e)
        return results

    def splice(self, live: Live, plan: RecomputePlan | None = None) -> Spliced:
        """Plan again (variants stored while this request waited, by requests admitted before
        it, become hits; metadata only, so cheap; `plan`: made just now) and splice its KV. A
        chunk-cache found corrupt while splicing (a probe reads every layer up front) was
        dropped by the store, so planning once more makes it a miss."""
        assert live.state is not None
        state = live.state

        def attempt(i: int) -> Spliced:
            live.plan = plan if plan is not None and i == 0 else self.plan(live)
            extra = state.max_tokens + len(live.options.forced if live.options else ())
            if live.kv is None:
                live.kv = self._new_cache(live.plan.layout.num_tokens + extra)
            return self.runner.splice(live.plan, extra, live.t_submit, kv=live.kv)

        return again_if_corrupt(attempt, f"request {live.request_id}")

    def _new_cache(self, capacity: int) -> KVCache:
        """A pool slot (decodes batched with the others) or, when none fits, a cache of its own."""
        kv = self.pool.acquire(capacity) if self.pool is not None else None
        if kv is None:
            m = self.runner.loaded
            kv = KVCache(m.arch, capacity, m.model.dtype, m.model.device)
        return kv

    def offers(self, plan: RecomputePlan) -> frozenset[Offer]:
        """The chunk-caches `plan`'s prefill will offer the store that it would admit."""
        if not plan.make_variants:
            return frozenset()
        store = self.runner.store
        return frozenset(
            Offer(c.slot.key, front, c.is_exact)
            for c, front in zip(plan.chunks, in_front(plan), strict=True)
            if c.variant is None and store.would_admit(c.slot.key)
        )

    # ---- the step -------------------------------------------------------------------------------
    def build(self, out: SchedulerOutput, starting: list[str]) -> StepBatch:
        """The step's batch for the scheduler's `out`; `starting`: the prefills started (or
        started again) this step."""
        batch = StepBatch()
        for rid, count in zip(out.prefill_ids, out.prefill_rows, strict=True):
            live = self.live.get(rid)
            if live is None or live.job is None:
                continue  # failed to start, or waits for a chunk another request computes
            state = live.state
            assert live.plan is not None and state is not None
            if rid in starting:
                live.started()
            total, a = state.num_prefill_rows, state.num_done_rows
            b = min(total, a + count) if state.can_split else total
            work = live.job.work
            batch.works.append(work if (a, b) == (0, total) else piece(work, a, b))
            batch.order.append((rid, True))
            batch.spans[rid] = (a, b)
        # Decodes in a pool slot go in one DecodeBatch: ids and positions in one tensor.
        caches: list[KVCache] = []
        rows: list[tuple[int, int]] = []
        for rid in out.decode_ids:
            live = self.live[rid]
            try:
                assert live.job is not None and live.state is not None
                kv, token = live.job.kv, live.state.output_ids[-1]
            except Exception as e:  # a request in a state it cannot decode from
                self.fail(rid, e)
                continue
            if self.pool is not None and kv.pool is self.pool:
                batch.decode_ids.append(rid)
                caches.append(kv)
                rows.append((token, kv.length))
            else:
                pos = torch.tensor([kv.length], device=kv.k.device)
                batch.works.append(SeqWork(kv, torch.tensor([token]), pos))
                batch.order.append((rid, False))
        if rows:
            ids_pos = torch.tensor(rows)
            batch.decode = DecodeBatch(caches, ids_pos[:, 0], ids_pos[:, 1])
        return batch

    def forward(self, batch: StepBatch) -> tuple[list[SeqResult | None], list[torch.Tensor | None]]:
        """One forward step over all works and the decode batch: (a result per work, logits
        [vocab] per batch row). If it raises, each sequence runs again alone so that only the
        failing ones fail (None). K/V writes go to explicit positions, so a decode run twice
        writes the same K/V; a prefill is started afresh (its layer readers may be spent),
        and one whose chunk-cache was corrupt is planned again (the store dropped it, so it
        becomes a miss), as `Runner.prefill` does."""
        works, decode = batch.works, batch.decode
        try:
            results, logits = self.runner.loaded.model.step(works, decode)
            return list(results), [] if logits is None else list(logits)
        except Exception:
            num = len(works) + (len(decode.caches) if decode is not None else 0)
            log.exception("forward step over %d sequences failed; isolating", num)
        alone = len(works) + (len(decode.caches) if decode is not None else 0) == 1
        out: list[SeqResult | None] = []
        for work, (rid, is_prefill) in zip(works, batch.order, strict=True):
            out.append(self._forward_alone(work, rid, is_prefill, alone))
        rows: list[torch.Tensor | None] = []
        if decode is not None:
            for i, (kv, rid) in enumerate(zip(decode.caches, batch.decode_ids, strict=True)):
                work = SeqWork(kv, decode.token_ids[i : i + 1], decode.positions[i : i + 1])
                result = self._forward_alone(work, rid, False, alone)
                rows.append(None if result is None else result.logits[0])
        return out, rows

    def _forward_alone(
        self, work: SeqWork, rid: str, is_prefill: bool, failed_alone: bool
    ) -> SeqResult | None:
        live = self.live.get(rid)
        if live is None:
            return None

        def attempt(i: int) -> SeqResult:
            if not is_prefill:
                return self.runner.loaded.model.forward_step([work])[0]
            live.close_loader()  # start afresh: a re-plan, so a chunk found corrupt is a miss
            self.start(live)
            assert live.job is not None
            return self.runner.loaded.model.forward_step([live.job.work])[0]

        try:  # a prefill that already failed alone once starts afresh right away, once
            if is_prefill and not failed_alone:
                return again_if_corrupt(attempt, f"request {rid}")
            return attempt(1)
        except Exception as e:
            log.warning("request %s failed in the forward step: %r", rid, e)
            self.fail(rid, e)
            return None


def waits_for(plan: RecomputePlan, strategy: ReuseStrategy, in_flight: set[Offer]) -> bool:
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
        for c, front in zip(plan.chunks, in_front(plan), strict=True)
        if c.variant is None
        for o in in_flight
    )


def in_front(plan: RecomputePlan) -> list[tuple[str, ...]]:
    """Per chunk of `plan`, the keys in front of it: the prefix's, then the chunks' before it."""
    keys = (plan.layout.prefix_key, *(c.slot.key for c in plan.chunks))
    return [keys[: i + 1] for i in range(len(plan.chunks))]
