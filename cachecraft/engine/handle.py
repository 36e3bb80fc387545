"""RequestHandle: one submitted request's event stream, fed by the engine thread.

Events: Planned (the prompt was laid out and queued), PromptLogprobs (when asked, right before
the first Token), Token (one sampled id), Finished (last), Failed (the request could not run;
the error names why). Consumers read them with `await
next_event()` (asyncio; events arrive through `loop.call_soon_threadsafe`) or `get()` (threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import Callable
from typing import Any, NamedTuple

from cachecraft.engine.report import RequestReport
from cachecraft.engine.sampling import TokenLogprobs


class Planned(NamedTuple):
    num_prompt_tokens: int
    max_tokens: int


class PromptLogprobs(NamedTuple):
    """The prompt's n token ids and, for i = 1..n-1, token i's log-probability given tokens
    0..i-1 and its top alternatives (`SamplingParams.prompt_logprobs`; the first has none)."""

    token_ids: tuple[int, ...]
    entries: list[TokenLogprobs]


class Token(NamedTuple):
    token_id: int
    is_stop: bool
    """An EOS / stop token: counted as output, never shown as text."""
    logprobs: TokenLogprobs | None = None
    """When the request's sampling asked for them (`SamplingParams.logprobs`)."""


class Finished(NamedTuple):
    finish_reason: str
    """stop, length or abort."""
    output_ids: list[int]
    report: RequestReport | None
    extras: Any = None
    """`engine.RequestExtras` when the request asked for logits or teacher forcing."""


class Failed(NamedTuple):
    error: BaseException


Event = Planned | PromptLogprobs | Token | Finished | Failed


class RequestHandle:
    """Created by `Engine.submit`; `abort()` frees the request (client gone)."""

    def __init__(
        self,
        request_id: str,
        abort: Callable[[str, str], None],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.request_id = request_id
        self._abort = abort
        self._loop = loop
        self._async_q: asyncio.Queue[Event] | None = asyncio.Queue() if loop else None
        self._sync_q: queue.Queue[Event] = queue.Queue()
        self.is_done = False

    def push(self, event: Event) -> None:
        """Engine thread: deliver one event."""
        if self._loop is not None and self._async_q is not None:
            # A closed loop means nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._async_q.put_nowait, event)
        else:
            self._sync_q.put(event)

    async def next_event(self) -> Event:
        assert self._async_q is not None, "submit with a loop to read events asynchronously"
        event = await self._async_q.get()
        self.is_done = self.is_done or isinstance(event, Finished | Failed)
        return event

    def poll(self) -> Event | None:
        """The next event if one is waiting, else None (never blocks; threads only)."""
        try:
            event = self._sync_q.get_nowait()
        except queue.Empty:
            return None
        self.is_done = self.is_done or isinstance(event, Finished | Failed)
        return event

    def get(self, timeout: float | None = None) -> Event:
        event = self._sync_q.get(timeout=timeout)
        self.is_done = self.is_done or isinstance(event, Finished | Failed)
        return event

    def abort(self) -> None:
        """The client went away: free the request; a Finished("abort") event follows."""
        if not self.is_done:
            self._abort(self.request_id, "abort")
            self.is_done = True

    def stop(self) -> None:
        """The caller has all it wants (a stop string): free the request; a Finished event
        with reason "stop" and the request's report follows."""
        if not self.is_done:
            self._abort(self.request_id, "stop")
