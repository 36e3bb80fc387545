"""Chat and text completions in flight: each choice's engine events to OpenAI's choices, the
answer collected or streamed (server-sent events), usage and log-probabilities included.

Every request frees its engine slot when its client goes away (stream closed, or a
non-streaming client disconnected while waiting).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cachecraft.engine.handle import (
    Failed,
    Finished,
    Planned,
    PromptLogprobs,
    RequestHandle,
    Token,
)
from cachecraft.engine.report import RequestReport
from cachecraft.engine.text import TextStream
from cachecraft.errors import CachecraftError
from cachecraft.server.logprobs import (
    Entry,
    NonFiniteOutput,
    chat_logprobs,
    completion_logprobs,
    vllm_prompt_logprobs,
)
from cachecraft.server.protocol import (
    error_body,
    usage,
)
from cachecraft.server.state import ServerState


class Generation:
    """One request in flight: its handle and what it produced so far."""

    def __init__(
        self,
        app_state: ServerState,
        handle: RequestHandle,
        chat: bool,
        model: str,
        namespace: str,
        stops: tuple[str, ...] = (),
        index: int = 0,
        logprobs: int | None = None,
        echo: str | None = None,
        hide_output: bool = False,
        prompt_logprobs: int | None = None,
        include_stop: bool = False,
        skip_special: bool = True,
    ) -> None:
        self.state = app_state
        self.index = index
        self.logprobs: list[Entry] | None = [] if logprobs is not None else None
        """(token, TokenLogprobs) of each shown token, when the request asked for them (with
        `echo`, the prompt's tokens first, the first one's None)."""
        self._k = logprobs or 0
        self.prompt_logprobs_k = prompt_logprobs
        self.prompt_logprobs: list[dict[str, Any] | None] | None = None
        """vLLM's `prompt_logprobs` (asked for with `prompt_logprobs_k`), once the engine sent
        them: None for the first token, then {token id: {logprob, rank, decoded_token}}."""
        self.echo = echo
        """A completion's `echo`: this text (the prompt) goes before the answer."""
        self.hide_output = hide_output
        """`max_tokens: 0` with echo: the one token the engine makes is not shown or counted."""
        self._echoed = ""
        self._sent_logprobs = 0  # entries already in a streamed chunk
        self._sent_chars = 0  # text already in one (a completion's `text_offset`)
        self.namespace = namespace
        self.handle = handle
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.t0 = time.perf_counter()
        self.text = TextStream(
            app_state.engine.runner.loaded.tokenizer, stops, include_stop, skip_special
        )
        self.num_prompt_tokens = 0
        self.num_output = 0
        self.finish_reason: str | None = None
        self.report: RequestReport | None = None

    async def planned(self) -> None:
        """Wait until the engine planned the request; raise its error if it could not."""
        event = await self.handle.next_event()
        if isinstance(event, Failed):
            raise event.error
        assert isinstance(event, Planned)
        self.num_prompt_tokens = event.num_prompt_tokens

    async def deltas(self) -> AsyncIterator[tuple[str, int]]:
        """(text delta, log-probability entries so far) until the request finishes; sets
        finish_reason and report. An entry goes with the first delta after its token (text
        is held back inside a multi-byte character or a possible stop string)."""
        while True:
            event = await self.handle.next_event()
            if isinstance(event, PromptLogprobs):
                if self.prompt_logprobs_k is not None:
                    self.prompt_logprobs = vllm_prompt_logprobs(
                        self.text.tokenizer, event.token_ids, event.entries, self.prompt_logprobs_k
                    )
                if self.logprobs is not None and self.echo is not None:
                    entries = [lp._replace(top=lp.top[: self._k]) for lp in event.entries]
                    self.logprobs += zip(event.token_ids, [None, *entries], strict=True)
                continue
            if self.echo is not None and isinstance(event, Token | Finished):
                self._echoed, self.echo = self.echo, None
                yield self._echoed, self._num_logprobs()
            if isinstance(event, Token):
                if self.hide_output:
                    continue
                if self.text.stopped:
                    continue  # sampled before the engine heard of the stop string
                self.num_output += 1
                if not event.is_stop:
                    if self.logprobs is not None and event.logprobs is not None:
                        self.logprobs.append((event.token_id, event.logprobs))
                    delta = self.text.add(event.token_id)
                    if self.text.stopped:
                        self.handle.stop()
                    if delta:
                        yield delta, self._num_logprobs()
            elif isinstance(event, Finished):
                self.finish_reason = "stop" if self.text.stopped else event.finish_reason
                self.report = event.report
                self._done()
                rest = self.text.flush()
                if rest:
                    yield rest, self._num_logprobs()
                return
            elif isinstance(event, Failed):
                raise event.error

    def final_text(self) -> str:
        """The choice's whole text: the echoed prompt, if any, then the answer."""
        return self._echoed + self.text.final_text()

    def _done(self) -> None:
        m = self.state.metrics
        m.observe(self.report, self.num_output, time.perf_counter() - self.t0)
        if self.report is not None:
            for c in self.report.chunks:
                self.state.registry.add(self.namespace, c.key, c.label, c.num_tokens)

    def usage(self) -> dict[str, Any]:
        report = self.report.to_dict() if self.report is not None else None
        return usage(self.num_prompt_tokens, self.num_output, report)

    def _num_logprobs(self) -> int:
        return 0 if self.logprobs is None else len(self.logprobs)

    def _logprobs_upto(self, upto: int | None) -> dict[str, Any] | None:
        """The entries not sent yet, up to `upto` (None: all), in the choice's shape."""
        if self.logprobs is None:
            return None
        end = len(self.logprobs) if upto is None else upto
        entries = self.logprobs[self._sent_logprobs : end]
        self._sent_logprobs = end
        tokenizer = self.text.tokenizer
        if self.chat:
            return chat_logprobs(tokenizer, entries)
        out = completion_logprobs(tokenizer, entries, self._sent_chars)
        self._sent_chars += sum(len(t) for t in out["tokens"])
        return out

    def choice(
        self, text: str | None, finish: str | None, delta: bool, upto: int | None = None
    ) -> dict[str, Any]:
        """The choice object; its log-probabilities are the entries not yet sent, up to
        `upto` (None: all of them)."""
        i, lp = self.index, self._logprobs_upto(upto)
        if not self.chat:
            out = {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}
            if self.prompt_logprobs_k is not None and not delta:
                out["prompt_logprobs"] = self.prompt_logprobs
            return out
        if delta:
            content = {} if text is None else {"content": text}
            return {"index": i, "delta": content, "logprobs": lp, "finish_reason": finish}
        message = {"role": "assistant", "content": text}
        return {"index": i, "message": message, "logprobs": lp, "finish_reason": finish}

    def envelope(self, choices: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        if stream and self.chat:
            obj += ".chunk"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def total_usage(gens: list[Generation], n: int = 1) -> dict[str, Any]:
    """`len(gens) / n` prompts with `n` completions each (choice p * n + i is prompt p's i-th):
    OpenAI counts each prompt once and every choice's tokens; the reuse report is the first
    choice's, `cached_tokens` every prompt's."""
    out = gens[0].usage()
    firsts = gens[::n]
    num_prompt = sum(g.num_prompt_tokens for g in firsts)
    num_output = sum(g.num_output for g in gens)
    out["prompt_tokens"] = num_prompt
    out["completion_tokens"] = num_output
    out["total_tokens"] = num_prompt + num_output
    cached = [g.usage()["prompt_tokens_details"]["cached_tokens"] for g in firsts]
    out["prompt_tokens_details"]["cached_tokens"] = sum(cached)
    return out


def abort_all(gens: list[Generation]) -> None:
    """Free the engine slots of the choices still running (client gone, or a sibling failed)."""
    for g in gens:
        if not g.handle.is_done:
            g.handle.abort()
            g.state.metrics.aborted.inc()


async def respond(
    request: Request,
    gens: list[Generation],
    stream: bool,
    include_usage: bool,
    n: int = 1,
    continuous_usage: bool = False,
):
    """The answer of one request with `len(gens)` choices (`n` per prompt). A stream ends with
    the usage when `include_usage`; with `continuous_usage` too, every chunk carries its
    choice's usage so far (vLLM's `continuous_usage_stats`)."""
    if stream:
        events = _sse(gens, include_usage, n, include_usage and continuous_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    tasks = [asyncio.ensure_future(_collect(g)) for g in gens]
    try:
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION)
            if any(t.done() and t.exception() is not None for t in tasks):
                break
            if not all(t.done() for t in tasks) and await request.is_disconnected():
                abort_all(gens)
                return JSONResponse({}, status_code=499)
        texts = [t.result() for t in tasks]  # the first failure, if any, is the answer
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        abort_all(gens)
    choices = [
        g.choice(text, g.finish_reason, delta=False) for g, text in zip(gens, texts, strict=True)
    ]
    body = gens[0].envelope(choices, stream=False)
    if gens[0].chat and gens[0].prompt_logprobs_k is not None:
        body["prompt_logprobs"] = gens[0].prompt_logprobs  # vLLM's: the request's, not a choice's
    body["usage"] = total_usage(gens, n)
    return Response(_dumps(body), media_type="application/json")


def _dumps(obj: dict[str, Any]) -> str:
    """Strict JSON (no NaN or infinity anywhere: a client's parser would refuse the answer)."""
    try:
        return json.dumps(obj, allow_nan=False)
    except ValueError:
        raise NonFiniteOutput("the answer holds a non-finite number; it was not sent") from None


async def _collect(gen: Generation) -> str:
    async for _ in gen.deltas():
        pass
    return gen.final_text()


async def _pump(gen: Generation, out: asyncio.Queue[tuple[Generation, Any]]) -> None:
    """Feed one choice's deltas into the shared queue, then None (its end) or its error."""
    try:
        async for text, upto in gen.deltas():  # (text, log-probability entries so far)
            await out.put((gen, (text, upto, gen.num_output)))  # tokens made by then
        await out.put((gen, None))
    except Exception as e:  # noqa: BLE001 - handed to the stream, which reports it in-band
        await out.put((gen, e))


async def _sse(
    gens: list[Generation], include_usage: bool, n: int, continuous_usage: bool
) -> AsyncIterator[str]:
    def event(obj: dict[str, Any]) -> str:
        return f"data: {_dumps(obj)}\n\n"

    def chunk_event(g: Generation, choice: dict[str, Any], made: int) -> str:
        obj = head.envelope([choice], stream=True)
        if continuous_usage:  # vLLM's: the choice's usage when this chunk was made
            prompt = g.num_prompt_tokens
            obj["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": made,
                "total_tokens": prompt + made,
            }
        return event(obj)

    head = gens[0]
    queue: asyncio.Queue[tuple[Generation, Any]] = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(g, queue)) for g in gens]
    try:
        if head.chat:
            for g in gens:
                first = g.choice(None, None, delta=True, upto=0)
                first["delta"] = {"role": "assistant", "content": ""}
                yield chunk_event(g, first, 0)
        running = len(gens)
        while running:
            g, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is not None:
                text, upto, made = item
                yield chunk_event(g, g.choice(text, None, delta=True, upto=upto), made)
                continue
            running -= 1
            done = g.choice("" if not g.chat else None, g.finish_reason, delta=True)
            yield chunk_event(g, done, g.num_output)
        if include_usage:
            last = head.envelope([], stream=True)
            last["usage"] = total_usage(gens, n)
            yield event(last)
        yield "data: [DONE]\n\n"
    except Exception as e:  # headers are gone: report in-band, as OpenAI does
        type_ = "invalid_request_error" if isinstance(e, CachecraftError) else "server_error"
        yield event(error_body(f"{type(e).__name__}: {e}", type_))
        yield "data: [DONE]\n\n"  # the stream still ends as every OpenAI stream does
    finally:
        for p in pumps:
            p.cancel()
        abort_all(gens)  # client went away mid-stream, or a choice failed
