"""Scheduler: FCFS continuous batching over SeqStates under a token budget. Torch-free.

Each step every running sequence decodes one token (1 each from the budget), then waiting
requests are admitted in arrival order while their prefill rows fit the rest of the budget and
fewer than `max_running` sequences run. With `split_prefills`, a request whose prefill may run
in pieces (`SeqState.can_split`) takes what is left of the budget and continues in the next
steps (prefills under way go first), so a long prompt never holds the others' decodes for its
whole prefill. A head-of-line request larger than the whole budget that cannot be split is
admitted alone in a step with no other prefill, so it never starves.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from cachecraft.engine.request import SeqState, Status


class QueueFull(Exception):
    """The waiting queue holds `max_queue` requests: try again later (HTTP 429)."""


class SchedulerOutput(NamedTuple):
    """prefill_rows[i]: the rows of prefill_ids[i] to compute this step (its next piece)."""

    prefill_ids: list[str]
    decode_ids: list[str]
    prefill_rows: list[int]

    @property
    def is_empty(self) -> bool:
        return not self.prefill_ids and not self.decode_ids


class Scheduler:
    def __init__(
        self,
        token_budget: int = 2048,
        max_running: int = 16,
        max_queue: int = 1024,
        split_prefills: bool = True,
    ):
        if max_running < 1 or max_queue < 1:
            raise ValueError("max_running and max_queue must be >= 1")
        if token_budget < max_running:
            raise ValueError(f"token_budget {token_budget} < max_running {max_running}")
        self.token_budget = token_budget
        self.max_running = max_running
        self.max_queue = max_queue
        self.split_prefills = split_prefills
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, state: SeqState) -> None:
        """Queue a request; raises QueueFull when `max_queue` requests already wait."""
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are waiting (max_queue)")
        state.status = Status.WAITING
        self.waiting.append(state)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work. Admitted requests move to `running` with status PREFILL; the
        caller advances `num_done_rows` after each piece and marks them DECODE once their whole
        prefill ran (`prefilled`)."""
        decode_ids = [s.request_id for s in self.running if s.status is Status.DECODE]
        left = self.token_budget - len(decode_ids)
        prefill_ids: list[str] = []
        prefill_rows: list[int] = []
        for s in self.running:  # prefills under way continue first
            if s.status is Status.PREFILL and left > 0:
                split = self.split_prefills and s.can_split
                rows = min(s.num_rows_left, left) if split else s.num_rows_left
                prefill_ids.append(s.request_id)
                prefill_rows.append(rows)
                left -= rows
        while self.waiting and len(self.running) < self.max_running:
            head = self.waiting[0]
            rows = head.num_rows_left
            if rows > left:
                oversize = rows > self.token_budget  # could never fit
                if self.split_prefills and head.can_split and left > 0:
                    rows = left
                elif not (oversize and not prefill_ids):
                    break
            self.waiting.popleft()
            head.status = Status.PREFILL
            self.running.append(head)
            prefill_ids.append(head.request_id)
            prefill_rows.append(rows)
            left -= rows
        return SchedulerOutput(prefill_ids, decode_ids, prefill_rows)

    def postpone(self, request_id: str) -> None:
        """Put a request admitted in this step's schedule, none of its prefill run, back at
        the head of the waiting queue (it starts in a later step)."""
        for i, s in enumerate(self.running):
            if s.request_id == request_id:
                if s.status is not Status.PREFILL or s.num_done_rows:
                    raise ValueError(f"request {request_id} has started its prefill")
                del self.running[i]
                s.status = Status.WAITING
                self.waiting.appendleft(s)
                return
        raise KeyError(request_id)

    def prefilled(self, request_id: str) -> None:
        """The request's prefill ran; from the next step on it decodes."""
        for s in self.running:
            if s.request_id == request_id:
                s.status = Status.DECODE
                return

    def finish(self, request_id: str, reason: str) -> SeqState | None:
        """Remove a running request that is done; returns its state (None if unknown)."""
        for i, s in enumerate(self.running):
            if s.request_id == request_id:
                del self.running[i]
                s.status, s.finish_reason = Status.FINISHED, reason
                return s
        return None

    def abort(self, request_id: str) -> SeqState | None:
        """Remove a waiting or running request; returns its state (None if unknown)."""
        for queue in (self.waiting, self.running):
            for s in queue:
                if s.request_id == request_id:
                    queue.remove(s)
                    s.status, s.finish_reason = Status.ABORTED, "abort"
                    return s
        return None

    def check_integrity(self) -> None:
        ids = [s.request_id for s in [*self.waiting, *self.running]]
        assert len(ids) == len(set(ids)), "a request is queued twice"
        assert len(self.running) <= self.max_running, "more running than max_running"
        assert all(s.status is Status.WAITING for s in self.waiting)
        assert all(s.status in (Status.PREFILL, Status.DECODE) for s in self.running)
