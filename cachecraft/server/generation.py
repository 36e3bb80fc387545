"""Chat and text completions: body -> RagRequest, submit to the engine, stream or collect.

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
from fastapi.responses import JSONResponse, StreamingResponse

from cachecraft.engine.handle import Failed, Finished, Planned, RequestHandle, Token
from cachecraft.engine.report import RequestReport
from cachecraft.engine.sampling import SamplingParams
from cachecraft.engine.text import TextStream
from cachecraft.errors import BadRequestError, CachecraftError
from cachecraft.request import Chunk, RagRequest
from cachecraft.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Document,
    error_body,
    usage,
)


def to_rag(body: ChatCompletionRequest | CompletionRequest, namespace: str) -> RagRequest:
    """system messages -> system; last user message -> question (earlier turns go in front of
    it as a transcript); documents -> chunks. A completion's prompt is the question."""
    chunks = _chunks(body.documents)
    if isinstance(body, CompletionRequest):
        prompt = body.prompt if isinstance(body.prompt, str) else None
        if prompt is None:
            if len(body.prompt) != 1:
                raise BadRequestError("prompt: give one string (batched prompts are not supported)")
            prompt = body.prompt[0]
        return RagRequest(prompt, chunks, namespace=namespace)
    system = "\n".join(m.text() for m in body.messages if m.role in ("system", "developer"))
    turns = [m for m in body.messages if m.role in ("user", "assistant")]
    if not turns or turns[-1].role != "user":
        raise BadRequestError("messages: the last user/assistant message must be from the user")
    history = "".join(f"{m.role}: {m.text()}\n" for m in turns[:-1])
    question = turns[-1].text()
    if history and question.strip():
        question = f"Conversation so far:\n{history}\n{question}"
    return RagRequest(question, chunks, system=system or None, namespace=namespace)


def _chunks(documents: list[Document]) -> list[Chunk]:
    return [Chunk(d.text, d.id) for d in documents]


def sampling_of(body: ChatCompletionRequest | CompletionRequest, defaults: Any) -> SamplingParams:
    max_tokens = body.max_completion_tokens or body.max_tokens or defaults.default_max_tokens
    temperature = defaults.default_temperature if body.temperature is None else body.temperature
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        stop=body.stop_strings(),
    )


class Generation:
    """One request in flight: its handle and what it produced so far."""

    def __init__(
        self,
        app_state: Any,
        handle: RequestHandle,
        chat: bool,
        model: str,
        namespace: str,
        stops: tuple[str, ...] = (),
    ) -> None:
        self.state = app_state
        self.namespace = namespace
        self.handle = handle
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.t0 = time.perf_counter()
        self.text = TextStream(app_state.engine.runner.loaded.tokenizer, stops)
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

    async def deltas(self) -> AsyncIterator[str]:
        """Text deltas until the request finishes; sets finish_reason and report."""
        while True:
            event = await self.handle.next_event()
            if isinstance(event, Token):
                if self.text.stopped:
                    continue  # sampled before the engine heard of the stop string
                self.num_output += 1
                if not event.is_stop:
                    delta = self.text.add(event.token_id)
                    if self.text.stopped:
                        self.handle.stop()
                    if delta:
                        yield delta
            elif isinstance(event, Finished):
                self.finish_reason = "stop" if self.text.stopped else event.finish_reason
                self.report = event.report
                self._done()
                rest = self.text.flush()
                if rest:
                    yield rest
                return
            elif isinstance(event, Failed):
                raise event.error

    def _done(self) -> None:
        m = self.state.metrics
        m.observe(self.report, self.num_output, time.perf_counter() - self.t0)
        if self.report is not None:
            for c in self.report.chunks:
                self.state.registry.add(self.namespace, c.key, c.label, c.num_tokens)

    def usage(self) -> dict[str, Any]:
        report = self.report.to_dict() if self.report is not None else None
        return usage(self.num_prompt_tokens, self.num_output, report)

    def choice(self, text: str | None, finish: str | None, delta: bool) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if delta:
            content = {} if text is None else {"content": text}
            return {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish}
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}

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


async def respond(request: Request, gen: Generation, stream: bool, include_usage: bool):
    if stream:
        return StreamingResponse(_sse(gen, include_usage), media_type="text/event-stream")
    task = asyncio.ensure_future(_collect(gen))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                gen.handle.abort()
                gen.state.metrics.aborted.inc()
                return JSONResponse({}, status_code=499)
        text = task.result()
    finally:
        if not task.done():
            task.cancel()
    body = gen.envelope([gen.choice(text, gen.finish_reason, delta=False)], stream=False)
    body["usage"] = gen.usage()
    return JSONResponse(body)


async def _collect(gen: Generation) -> str:
    async for _ in gen.deltas():
        pass
    return gen.text.final_text()


async def _sse(gen: Generation, include_usage: bool) -> AsyncIterator[str]:
    def event(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    try:
        if gen.chat:
            first = gen.choice(None, None, delta=True)
            first["delta"] = {"role": "assistant", "content": ""}
            yield event(gen.envelope([first], stream=True))
        async for delta in gen.deltas():
            yield event(gen.envelope([gen.choice(delta, None, delta=True)], stream=True))
        last = gen.envelope(
            [gen.choice("" if not gen.chat else None, gen.finish_reason, True)], True
        )
        if include_usage:
            yield event(last)
            last = gen.envelope([], stream=True)
            last["usage"] = gen.usage()
        yield event(last)
        yield "data: [DONE]\n\n"
    except Exception as e:  # headers are gone: report in-band, as OpenAI does
        type_ = "invalid_request_error" if isinstance(e, CachecraftError) else "server_error"
        yield event(error_body(f"{type(e).__name__}: {e}", type_))
    finally:
        if not gen.handle.is_done:  # client went away mid-stream
            gen.handle.abort()
            gen.state.metrics.aborted.inc()
