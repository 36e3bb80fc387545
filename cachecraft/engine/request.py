"""Engine-side request state: ids, counts and status only (no torch, no asyncio).

The scheduler reads and moves these; the engine keeps the tensors (KV, generator) apart.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    """Admitted: its prefill rows (or the next piece of them) are in the step being built."""
    DECODE = "decode"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True)
class SeqState:
    """One request as the scheduler sees it.

    num_prefill_rows: prompt positions the prefill computes (reused positions excluded).
    num_prompt_tokens: the whole prompt; max_tokens: the output cap (already clamped to the
    model's context by the engine).
    can_split: its prefill may run in pieces over several steps (no in-forward check needs
    all its rows at once); num_done_rows: prefill rows computed in earlier steps.
    """

    request_id: str
    num_prompt_tokens: int
    num_prefill_rows: int
    max_tokens: int
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    can_split: bool = False
    num_done_rows: int = 0

    @property
    def num_rows_left(self) -> int:
        return max(self.num_prefill_rows - self.num_done_rows, 0)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)
