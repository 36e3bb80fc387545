"""The question probe: how much attention the question rows give each token of the reused
chunks, measured over the spliced (not yet fixed) cache before the prefill runs.

The probe runs the question rows (and the system prefix when the prefix cache does not hold
it) through layers 0..probe.last_layer over the context the question can already see: the
prefix and the reused chunks. Chunks computed in this request hold no K/V yet, so they are
left out and the positions after them move up (keys re-rotated to their probe positions).
A trimmed probe (ProbeCheck.question_rows) runs only the question's last rows, moved up in
the same way to follow the context.

Where it runs: when no computed chunk lies before a reused one, every context key already
sits at its probe position in the request's own KVCache, and the probe's rows go to
positions the prefill computes at every layer anyway (the uncached prefix; everything after
the last reused chunk: computed chunks and the question). The probe then runs in that cache:
no copy, no re-rotation, and nothing the prefill reads before writing it changes. Otherwise it
runs over a scratch cache: keys before the first moved position are copied as they are, only
the moved ones are re-rotated, and only the probe's layers are filled. Scratch caches are
kept for reuse (`ScratchCaches`): a fresh one's pages are faulted in on its first write, which
costs far more than the copies themselves.

The probe is a SeqWork of its own (`probe_work`), so the engine runs the probes of every
request starting in a step through ONE forward (one pass over the weights for all of them);
its layers measure with a KeyMeter (explicit scores that give the output too), never SDPA
plus a second score matrix beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachecraft.model.kv import KVCache
from cachecraft.model.llama import LlamaModel
from cachecraft.model.step import KeyMeter, SeqResult, SeqWork
from cachecraft.reuse.plan import RecomputePlan

SCRATCH_ROUND = 256
"""Scratch caches are made with room for a multiple of this many positions, so that one
freed by a request fits the next requests of about its size."""

SCRATCH_KEEP_BYTES = 256 << 20
"""Scratch caches kept between requests, in all (SmolLM2-135M in float32: 45 KiB a position,
so four of 1,280 positions)."""


class ScratchCaches:
    """Scratch caches for probes that cannot run in place, handed out by `take` and kept once
    given back, the largest first, up to `max_bytes` in all (a probe that fails before giving
    its back only costs the next one a fresh allocation). Not thread-safe: the engine's step
    thread owns it."""

    def __init__(self, max_bytes: int = SCRATCH_KEEP_BYTES) -> None:
        self.max_bytes = max_bytes
        self._free: list[KVCache] = []

    def take(self, model: LlamaModel, positions: int, like: KVCache) -> KVCache:
        """An empty cache of at least `positions` positions with `like`'s layers, heads,
        dtype and device: the smallest kept one that fits, else a new one."""
        fits = [kv for kv in self._free if kv.k.shape[2] >= positions and _alike(kv, like)]
        if fits:
            kv = min(fits, key=lambda c: c.k.shape[2])
            self._free.remove(kv)
        else:
            kv = KVCache(model.arch, 0, like.k.dtype, like.k.device)
            capacity = -(-positions // SCRATCH_ROUND) * SCRATCH_ROUND
            shape = (like.k.shape[0], like.k.shape[1], capacity, like.k.shape[3])
            kv.k = torch.empty(shape, dtype=like.k.dtype, device=like.k.device)
            kv.v = torch.empty(shape, dtype=like.v.dtype, device=like.v.device)
        kv.length = 0
        return kv

    def give(self, kv: KVCache) -> None:
        """Keep `kv` for a later `take` (within `max_bytes`)."""
        kept, total = [], 0
        for c in sorted([*self._free, kv], key=lambda c: c.k.shape[2], reverse=True):
            size = c.k.nbytes + c.v.nbytes
            if total + size <= self.max_bytes:
                kept.append(c)
                total += size
        self._free = kept

    @property
    def num_kept(self) -> int:
        return len(self._free)


def _alike(a: KVCache, b: KVCache) -> bool:
    """Same layers, KV heads, head size, dtype and device."""
    same_shape = a.k.shape[:2] == b.k.shape[:2] and a.k.shape[3] == b.k.shape[3]
    return same_shape and a.k.dtype == b.k.dtype and a.k.device == b.k.device


@dataclass(slots=True)
class Probe:
    """A request's probe pass: `work` to run (alone or beside other probes), and per chunk of
    the plan its span in the probe's context (None: not reused, not measured). `scratch`:
    the scratch cache it runs over (None: in place), to give back once it ran."""

    work: SeqWork
    where: list[tuple[int, int] | None]
    scratch: KVCache | None = None

    def scores(self, result: SeqResult) -> list[list[float] | None]:
        """Per chunk, the question's attention on each of its tokens, from the work's result."""
        assert result.key_mass is not None
        mass = result.key_mass.tolist()
        return [None if w is None else mass[w[0] : w[1]] for w in self.where]


def probe_work(
    model: LlamaModel,
    kv: KVCache,
    plan: RecomputePlan,
    scratches: ScratchCaches | None = None,
) -> Probe:
    """The probe pass of `plan` over `kv`, which must hold every layer of the reused chunks
    (and of the prefix when `plan.prefix_hit`). Running it may write `kv` only at positions
    the prefill computes at every layer (see the module doc). A scratch cache, when one is
    needed, comes from `scratches` (None: a new one)."""
    probe = plan.probe
    if probe is None:
        raise ValueError("the plan has no probe")
    layout = plan.layout
    spans, where, m = _context(plan)
    question = layout.question_ids
    q = len(question) if probe.question_rows is None else min(probe.question_rows, len(question))
    in_place = spans[-1][1] == m  # no computed chunk before a reused one: nothing moves
    context = kv
    if not in_place:
        scratch = (scratches or ScratchCaches()).take(model, m + q, kv)
        context = _scratch(model, kv, spans, probe.last_layer, scratch)
    rows = list(range(m, m + q))
    ids = list(question[len(question) - q :])  # a trimmed probe: the question's last rows
    if not plan.prefix_hit:  # the prefix has no K/V yet: compute it in the probe as well
        rows = list(range(layout.prefix_len)) + rows
        ids = list(layout.prefix_ids) + ids
    n = len(rows)
    top = model.arch.num_layers - 1
    work = SeqWork(
        context,
        torch.tensor(ids, dtype=torch.long),
        torch.tensor(rows, dtype=torch.long),
        last_layer=None if probe.last_layer >= top else torch.full((n,), probe.last_layer),
        logits_for="none",
        meter=KeyMeter(m, probe.first_layer, probe.last_layer, probe.last_row),
    )
    return Probe(work, where, None if in_place else context)


def _context(
    plan: RecomputePlan,
) -> tuple[list[tuple[int, int]], list[tuple[int, int] | None], int]:
    """(real spans of the probe's context in order, per chunk its span in that context (None:
    not reused), the context's length)."""
    p = plan.layout.prefix_len
    spans = [(0, p)]
    where: list[tuple[int, int] | None] = []
    m = p
    for cp in plan.chunks:
        if cp.variant is None:
            where.append(None)
            continue
        where.append((m, m + cp.slot.num_tokens))
        spans.append((cp.slot.start, cp.slot.end))
        m += cp.slot.num_tokens
    return spans, where, m


def runs_in_place(plan: RecomputePlan) -> bool:
    """The plan's probe runs in the request's own cache (no computed chunk before a reused
    one): its context needs no copy, so the reused K/V may be filled layer by layer as the
    probe's forward reaches each layer."""
    spans, _, m = _context(plan)
    return spans[-1][1] == m


def probe_attention(
    model: LlamaModel, kv: KVCache, plan: RecomputePlan
) -> list[list[float] | None]:
    """Per chunk of `plan`, the question's attention on each of its tokens (mean over heads
    and the probe's layers; over the question rows, the last weighs `probe.last_row` and the
    mean of all the rest); None for chunks not reused. One probe alone (`probe_work` and its
    forward)."""
    probe = probe_work(model, kv, plan)
    return probe.scores(model.forward_step([probe.work])[0])


def _scratch(
    model: LlamaModel,
    kv: KVCache,
    spans: list[tuple[int, int]],
    last_layer: int,
    scratch: KVCache,
) -> KVCache:
    """`scratch` (room for the m positions of the spans and the probe's rows) with its first
    m positions holding the keys and values of `kv` at the `spans` (ascending (start, end) of
    real positions) one after the other, keys rotated to their new positions, at layers
    0..last_layer (the probe's rows stop there: nothing above is read, so it is left as it
    was)."""
    m, top = sum(e - s for s, e in spans), last_layer + 1
    at = 0
    for start, end in spans:
        keys = kv.k[:top, :, start:end]
        if at != start:  # moved up by a computed chunk before it: one rotation by the shift
            keys = model.rope.shift(keys, at - start)
        scratch.k[:top, :, at : at + end - start] = keys
        scratch.v[:top, :, at : at + end - start] = kv.v[:top, :, start:end]
        at += end - start
    scratch.length = m
    return scratch
