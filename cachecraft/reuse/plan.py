"""Plan data: how a request's prompt is laid out and, per chunk, what is reused and recomputed.

Pure data, torch-free. The planner (`planner.py`, one function per mode in `modes.py`) makes a
RecomputePlan; the runner splices and executes it without knowing which mode made it.

Prompt layout (absolute positions):

    0            prefix_len   chunk 1        chunk k       question_start        num_tokens
    |-- prefix --|-- C_1 --|-- ... --|-- C_k --|-- question + template tail --|

How a reused chunk's recomputed tokens are chosen (`ChunkPlan.select`):

    "planned"    `recompute` holds them already (paper scores, first-k, random, none).
    "probe"      `budget` of them, chosen after a probe pass by the attention the question rows
                 give each token (`RecomputePlan.probe`; `selectors.select_by_question` fills
                 `recompute` and the plan becomes "planned").
    "deviation"  the candidates in `recompute` (every token for CacheBlend) are computed up to
                 the check layer, where the `budget` tokens whose K/V deviate most keep going
                 (`RecomputePlan.deviation`; cachecraft weights the deviation by the question's
                 attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cachecraft.store.meta import VariantMeta

Select = Literal["planned", "probe", "deviation"]


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


def probe_rows(layout: PromptLayout, prefix_hit: bool, question_rows: int | None = None) -> int:
    """Rows a probe of `layout` runs: the question's last `question_rows` (None: all of it),
    and the prefix when it is not cached."""
    q = len(layout.question_ids)
    return (q if question_rows is None else min(question_rows, q)) + (
        0 if prefix_hit else layout.prefix_len
    )


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Per chunk: the variant reused (None = computed in full), what is recomputed and why.

    recompute: sorted offsets within the chunk (0..num_tokens-1) computed fresh; all of them
               when `variant` is None; filled later when `select` is "probe"; for
               "deviation" the candidates that run to the check layer.
    budget:    tokens this chunk recomputes (`len(recompute)` once planned; the check layer's
               keep count for "deviation").
    reason:    why this plan: "miss", "exact", "refresh" (stale variant recomputed in full),
               "cfo" (budget from CFO), "given" (a caller's budget), "mode" (the mode's own
               default), "none" (naive).
    is_exact:  after the prefill this chunk's K/V equal a full prefill's (a miss after exact
               chunks, or an exact variant in exactly its old context). A variant made from it
               is exact.
    error:     predicted error of reusing `variant` here (`variant_choice.predicted_error`).
    """

    slot: ChunkSlot
    variant: VariantMeta | None
    recompute: tuple[int, ...]
    budget: int
    reason: str
    is_exact: bool = False
    select: Select = "planned"
    cci: float | None = None
    beta: float | None = None
    gamma: float | None = None
    beta_adj: float | None = None
    cfo: float | None = None
    error: float | None = None

    @property
    def is_hit(self) -> bool:
        return self.variant is not None

    @property
    def num_recompute(self) -> int:
        """Tokens recomputed through the top layer (planned; the budget otherwise)."""
        return len(self.recompute) if self.select == "planned" else self.budget

    @property
    def num_rows(self) -> int:
        """Rows this chunk adds to the forward at layer 0."""
        if self.variant is None:
            return self.slot.num_tokens
        if self.select == "deviation":
            return len(self.recompute)
        return self.num_recompute

    def rows(self) -> tuple[int, ...]:
        """Absolute positions this chunk computes at layer 0 (needs a planned selection)."""
        if self.variant is None:
            return tuple(range(self.slot.start, self.slot.end))
        if self.select == "probe":
            raise ValueError("the chunk's tokens are chosen by the probe: resolve the plan first")
        return tuple(self.slot.start + t for t in self.recompute)


@dataclass(frozen=True, slots=True)
class EarlyExit:
    """After `layer`, reused chunks whose share of the question's attention to all chunks is
    below `threshold` stop being recomputed (cache-craft.md §4)."""

    layer: int
    threshold: float


@dataclass(frozen=True, slots=True)
class DeviationCheck:
    """CacheBlend's check: at `layer`, keep the candidates whose fresh K/V deviate most from the
    cached ones: per chunk its `budget`, or (`total` set) the top `total` across all chunks.

    weights: per chunk of the plan, one weight per offset in its `recompute` (None for chunks
    without a check); with weights the rank is weight x norm of the K/V deviation (cachecraft:
    the question's attention x how far the token's cached K/V are off)."""

    layer: int
    total: int | None = None
    weights: tuple[tuple[float, ...] | None, ...] | None = None
    sink: int = 0
    """The first `sink` tokens of each checked chunk are kept first, whatever their deviation."""


@dataclass(frozen=True, slots=True)
class ProbeCheck:
    """A probe pass of the question rows over the spliced (unfixed) cache, before the prefill.

    It measures, per reused chunk token, the attention the question rows give it (mean over
    heads and rows, over layers first_layer..last_layer); its K/V writes go to a scratch copy.
    `selectors.select_by_question` then spends `total` tokens (see there): "need" ranks
    tokens by the chunk's predicted error x the token's question attention (unfocused chunks
    get none), "global" by question attention alone (ProphetKV's one budget), "chunk" keeps
    each chunk's planned budget.
    blend: weight of the stored score s(t), added to the question attention (both scaled to
    [0, 1] per chunk), so a zero stored score never zeroes a token's rank.
    check: when > 0, the top ceil(check x total) tokens by that ranking become candidates that
    run to `check_layer`, where `total` of them keep going by question attention x K/V
    deviation (`check_score` "product") or by the deviation alone ("deviation").
    """

    total: int
    split: Literal["need", "global", "chunk"]
    first_layer: int
    last_layer: int
    focus_threshold: float = 0.0
    blend: float = 0.0
    check: float = 0.0
    check_layer: int = 1
    check_score: Literal["product", "deviation"] = "product"
    num_layers: int = 0
    """The model's layers (0: unknown, the probe is taken to run them all)."""
    sink: int = 0
    """The first `sink` tokens of each probed chunk rank above every other token."""
    sink_kept: bool = True
    """With a check: the lifted first tokens keep their lift in its rank, so they go on
    whatever their deviation (False: it ranks them by their own attention and deviation)."""
    check_power: float = 1.0
    """'product': the question attention enters the check's rank as attention ** this."""
    last_row: float = 0.0
    """The share of the measure from the question's last row (the rest: every row's mean)."""
    question_rows: int | None = None
    """The probe runs only the question's last `question_rows` rows (None: all of them),
    moved up to follow the context: a trimmed probe, fitted to probe_max_cost."""

    @property
    def layer_share(self) -> float:
        """Share of the model's layers the probe runs (layers 0..last_layer)."""
        run = self.last_layer + 1
        return min(run / self.num_layers, 1.0) if self.num_layers > 0 else 1.0


@dataclass(frozen=True, slots=True)
class RecomputePlan:
    """What the runner must do for one request.

    prefix_hit:    the system prefix's K/V come from the exact prefix cache (the planner was
                   told it holds them); otherwise its rows are computed.
    make_variants: chunks computed in full are offered to the store as variants, and a
                   computed prefix to the prefix cache (off for `full`, the reference).
    early_exit / deviation / probe: in-forward checks (None = off).
    measure_stats: the forward collects attention statistics for the new variants (off for
                   `prefix`, which reuses only exact variants and so never reads them: its
                   variants carry placeholder statistics and its prefill pays for none).
    """

    mode: str
    layout: PromptLayout
    chunks: tuple[ChunkPlan, ...]
    prefix_hit: bool
    make_variants: bool = True
    early_exit: EarlyExit | None = None
    deviation: DeviationCheck | None = None
    probe: ProbeCheck | None = None
    measure_stats: bool = True

    @property
    def is_resolved(self) -> bool:
        """Every chunk's rows are known (no probe pending)."""
        return all(c.select != "probe" for c in self.chunks)

    @property
    def num_rows(self) -> int:
        """Rows the prefill computes at layer 0 (question and uncached prefix included)."""
        prefix = 0 if self.prefix_hit else self.layout.prefix_len
        question = len(self.layout.question_ids)
        return prefix + question + sum(c.num_rows for c in self.chunks)

    @property
    def num_probe_rows(self) -> int:
        """Rows of the probe pass: the question (its last probe.question_rows when trimmed),
        and the prefix when it is not cached; 0 without a probe."""
        if self.probe is None:
            return 0
        return probe_rows(self.layout, self.prefix_hit, self.probe.question_rows)

    @property
    def probe_cost(self) -> float:
        """The probe's cost in full-depth rows: its rows x the share of layers it runs."""
        if self.probe is None:
            return 0.0
        return self.num_probe_rows * self.probe.layer_share

    def rows(self) -> tuple[int, ...]:
        """Absolute positions computed at layer 0, ascending (needs a resolved plan)."""
        layout = self.layout
        out: list[int] = [] if self.prefix_hit else list(range(layout.prefix_len))
        for c in self.chunks:
            out.extend(c.rows())
        out.extend(range(layout.question_start, layout.num_tokens))
        return tuple(out)
