"""Plan data: how a request's prompt is laid out and, per chunk, what is reused and recomputed.

Pure data, torch-free. The planner (`planner.py`) makes a RecomputePlan; the runner executes it.

Prompt layout (absolute positions):

    0            prefix_len   chunk 1        chunk k       question_start        num_tokens
    |-- prefix --|-- C_1 --|-- ... --|-- C_k --|-- question + template tail --|
"""

from __future__ import annotations

from dataclasses import dataclass

from cachecraft.store.meta import VariantMeta


@dataclass(frozen=True, slots=True)
class ChunkSlot:
    """One chunk as placed in a new prompt: its key, the caller's label and where it starts."""

    key: str
    label: str | None
    token_ids: tuple[int, ...]
    start: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class PromptLayout:
    """[prefix][chunk 1]...[chunk k][question]; each chunk tokenized on its own."""

    prefix_key: str
    prefix_ids: tuple[int, ...]
    chunks: tuple[ChunkSlot, ...]
    question_ids: tuple[int, ...]

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_ids)

    @property
    def question_start(self) -> int:
        return self.chunks[-1].end if self.chunks else self.prefix_len

    @property
    def num_tokens(self) -> int:
        return self.question_start + len(self.question_ids)

    @property
    def token_ids(self) -> tuple[int, ...]:
        ids = list(self.prefix_ids)
        for chunk in self.chunks:
            ids.extend(chunk.token_ids)
        ids.extend(self.question_ids)
        return tuple(ids)


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Per chunk: the variant reused (None = computed in full), the offsets recomputed.

    recompute:   sorted offsets within the chunk (0..num_tokens-1) computed fresh. All of them
                 when `variant` is None.
    deviation_budget: for `cacheblend`, the runner picks this many tokens itself at the check
                 layer (by K/V deviation); `recompute` is then empty.
    last_layer:  None = recompute through every layer; otherwise stop after this layer.
    """

    slot: ChunkSlot
    variant: VariantMeta | None
    recompute: tuple[int, ...]
    deviation_budget: int | None = None
    last_layer: int | None = None
    cci: float | None = None
    beta: float | None = None
    gamma: float | None = None
    beta_adj: float | None = None
    cfo: float | None = None

    @property
    def is_hit(self) -> bool:
        return self.variant is not None

    @property
    def num_recompute(self) -> int:
        if self.deviation_budget is not None:
            return self.deviation_budget
        return len(self.recompute)


@dataclass(frozen=True, slots=True)
class RecomputePlan:
    """What the runner must do for one request.

    prefix_cached: leading positions whose K/V come exactly from the prefix cache (the system
                   prefix; in `prefix` mode also the leading chunks whose variant was computed
                   after exactly the same prefix and chunks). Chunk plans for those chunks have
                   the variant set and `recompute == ()`.
    et_layer / focus_threshold: adaptive early termination (None = off).
    """

    mode: str
    layout: PromptLayout
    chunks: tuple[ChunkPlan, ...]
    prefix_cached: int
    et_layer: int | None = None
    focus_threshold: float | None = None
    cacheblend_check_layer: int | None = None

    @property
    def num_planned_compute(self) -> int:
        """Positions computed (question included), before early termination."""
        question = len(self.layout.question_ids)
        uncached_prefix = max(0, self.layout.prefix_len - self.prefix_cached)
        return uncached_prefix + question + sum(c.num_recompute for c in self.chunks)
