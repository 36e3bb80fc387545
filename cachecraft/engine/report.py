"""Per-request reuse report: what each chunk reused and recomputed, and the totals."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class ChunkReport:
    key: str
    label: str | None
    is_hit: bool
    variant_id: str | None
    s_old: list[str] | None
    num_tokens: int
    tokens_recomputed: int
    last_layer: int | None
    """Layer through which this chunk's recomputed tokens ran (None: nothing recomputed)."""
    cci: float | None = None
    beta: float | None = None
    gamma: float | None = None
    beta_adj: float | None = None
    cfo: float | None = None
    reason: str | None = None
    """Why the plan did what it did for this chunk (reuse/plan.py ChunkPlan.reason)."""
    predicted_error: float | None = None
    is_exact: bool = False
    """Its K/V after the prefill equal a full prefill's."""


@dataclass(slots=True)
class RequestReport:
    mode: str
    chunks: list[ChunkReport]
    prompt_tokens: int
    tokens_computed: int
    """Prompt positions computed fresh at layer 0 (question and uncached prefix included)."""
    layer_fraction: float
    """Share of (position, layer) pairs computed: early termination lowers it."""
    ttft_ms: float = 0.0
    prefix_cached: int = 0
    probe_tokens: int = 0
    """Rows the question probe computed before the prefill (not in tokens_computed)."""
    probe_cost: float = 0.0
    """The probe's cost in full-depth rows: probe_tokens x the share of layers it ran."""

    @property
    def tokens_reused(self) -> int:
        return self.prompt_tokens - self.tokens_computed

    @property
    def probe_fraction(self) -> float:
        """The probe's cost in full-depth rows per prompt token."""
        return self.probe_cost / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def computed_fraction(self) -> float:
        """Rows computed, the probe's included (by the layers it ran), per prompt token."""
        done = self.tokens_computed + self.probe_cost
        return done / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["tokens_reused"] = self.tokens_reused
        out["computed_fraction"] = self.computed_fraction
        return out
