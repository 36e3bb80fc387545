"""OpenAI's Responses API (`POST /v1/responses`) served over the chat path.

A Responses request becomes a chat completion request: `instructions` the system message,
`input` (a string, or messages whose `input_text` parts are read like a chat's text parts:
each part a chunk; a `function_call` item the assistant's tool call, a `function_call_output`
item the tool's result) the turns, `max_output_tokens` its `max_tokens`; every other field passes
on (sampling, `documents`, `cache_namespace`, `cachecraft_mode`, ...). The chat answer becomes
a Response object, its stream the Responses stream events (`response.created`, ...,
`response.output_text.delta`, ..., `response.completed`). Nothing is stored, as in vLLM by
default: `store` is ignored and `previous_response_id` refused. Errors name the Responses
fields (`input.1.content`, `max_output_tokens`), not the chat request's.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, StrictInt, Tag, field_validator

from cachecraft.server.protocol import MAX_ID_CHARS, StrictStr, _Lenient, unsupported_fields

# Responses fields this server cannot honour, with the values that mean "not asked for".
_REFUSED: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (None,),  # nothing is stored
    "conversation": (None,),
    "prompt": (None,),  # a stored prompt template
    "background": (None, False),
    "include": (None, []),
    "reasoning": (None, {}, {"effort": None}),
    "text": (None, {}, {"format": {"type": "text"}}),
    "truncation": (None, "disabled"),
    "n": (None, 1),  # one output per response
}
# Responses fields with no effect here, dropped before the chat request.
_DROPPED = (
    "store",
    "metadata",
    "user",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "stream_options",
    "top_logprobs",  # only read with `include`
    "max_tool_calls",
    "parallel_tool_calls",
)


class InputPart(_Lenient):
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr


class InputMessage(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[InputPart]


class FunctionCall(_Lenient):
    """A tool call the model made (the client ran it): the chat's assistant turn with it."""

    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr = ""


class FunctionCallOutput(_Lenient):
    """The client's result of a tool call: the chat's `tool` message (read as context)."""

    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr


_ITEM_TYPES = ("message", "function_call", "function_call_output")


def _item_type(item: Any) -> str:
    """An input item's `type` (a message may leave it out)."""
    if isinstance(item, dict):
        return str(item.get("type", "message"))
    return str(getattr(item, "type", "message"))


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCall, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")],
    Discriminator(_item_type),
]
"""One `input` item, validated as the kind its `type` names (so a bad item's error names its
own missing or wrong field, not every kind it failed to be)."""


def _readable(items: list[Any]) -> None:
    """Name the first input item or content part this server cannot read (reasoning, an
    image, a file) instead of reporting that it failed every branch of a union."""
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind not in _ITEM_TYPES:
            raise ValueError(
                f"item {i} has type {kind!r}: this server reads messages, function calls and "
                f"their outputs only"
            )
        for j, part in enumerate(
            item.get("content") if isinstance(item.get("content"), list) else ()
        ):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("input_text", "output_text", "text"):
                raise ValueError(
                    f"item {i}, part {j} has type {kind!r}: this server reads text parts only"
                )


class ResponsesRequest(_Lenient):
    model: StrictStr | None = Field(default=None, max_length=MAX_ID_CHARS)
    input: StrictStr | list[InputItem]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1, le=2**31)
    stream: StrictBool = False

    @field_validator("input", mode="before")
    @classmethod
    def _messages(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("give at least one message")
            _readable(v)
        return v

    @field_validator("stream", mode="before")
    @classmethod
    def _null_is_false(cls, v: Any) -> Any:
        return False if v is None else v

    def refused(self) -> list[str]:
        """Responses fields that ask for what this server does not do."""
        return unsupported_fields(self, _REFUSED)

    def num_leading(self) -> int:
        """Chat messages before the first `input` one (the instructions')."""
        return 0 if self.instructions is None else 1

    def to_chat(self) -> dict[str, Any]:
        """The chat completion request (a dict to validate) that answers this one."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        for m in self.input if isinstance(self.input, list) else ():
            if isinstance(m, FunctionCall):
                call = {"name": m.name, "arguments": m.arguments}
                tool_calls = [{"id": m.call_id, "type": "function", "function": call}]
                messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
            elif isinstance(m, FunctionCallOutput):
                messages.append({"role": "tool", "tool_call_id": m.call_id, "content": m.output})
            else:
                content = (
                    m.content
                    if isinstance(m.content, str)
                    else [{"type": "text", "text": p.text} for p in m.content]
                )
                messages.append({"role": m.role, "content": content})
        extra = dict(self.model_extra or {})
        for name in (*_DROPPED, *_REFUSED):
            extra.pop(name, None)
        if not extra.get("tools"):  # Responses' default `tool_choice` is "auto"
            extra.pop("tools", None)
            extra.pop("tool_choice", None)
        body = {**extra, "model": self.model, "messages": messages, "stream": self.stream}
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.stream:
            body["stream_options"] = {"include_usage": True}  # the last event's usage
        return body


_CHAT_FIELD = re.compile(r"\bmessages(?:\.(\d+))?\b|\bmax_tokens\b|\bmax_completion_tokens\b")


def responses_field(text: str, request: ResponsesRequest) -> str:
    """A chat request's field names in `text` as the Responses request's (`responses_loc`):
    `messages.2` is `input.1` after the instructions, `messages` is `input`, `max_tokens` is
    `max_output_tokens`."""

    def name(m: re.Match[str]) -> str:
        loc = ("messages", int(m.group(1))) if m.group(1) else (m.group(0),)
        return ".".join(str(part) for part in responses_loc(loc, request))

    renamed = _CHAT_FIELD.sub(name, text)
    return renamed.replace("input.content", "input").replace("instructions.content", "instructions")


def responses_loc(loc: Sequence[Any], request: ResponsesRequest) -> tuple[Any, ...]:
    """A chat validation error's location as the Responses request's: message i is input item
    i - (leading instruction messages), or `instructions` itself, or `input` for a string
    input; `messages` alone is `input`; the answer-length fields are `max_output_tokens`."""
    if loc and loc[0] in ("max_tokens", "max_completion_tokens"):
        return ("max_output_tokens", *loc[1:])
    if tuple(loc) == ("messages",):
        return ("input",)
    if len(loc) < 2 or loc[0] != "messages" or not isinstance(loc[1], int):
        return tuple(loc)
    i = loc[1] - request.num_leading()
    if i < 0:
        return ("instructions",)
    if isinstance(request.input, str):
        return ("input",)
    return ("input", i, *loc[2:])


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    out = {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }
    if "cachecraft" in chat_usage:
        out["cachecraft"] = chat_usage["cachecraft"]
    return out


class ResponseBuilder:
    """One response's objects: the Response itself and, when streamed, its events."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.request = request
        self.model = model
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.item_id = "msg_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.sequence = 0

    def message(self, text: str | None, done: bool) -> dict[str, Any]:
        content = [] if text is None else [self.part(text)]
        status = "completed" if done else "in_progress"
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def response(
        self, text: str | None, finish: str | None, usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The Response object: in progress while `finish` is None."""
        r = self.request
        incomplete = finish == "length"
        status = "in_progress" if finish is None else "incomplete" if incomplete else "completed"
        extra = r.model_extra or {}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": [] if finish is None else [self.message(text, done=True)],
            "parallel_tool_calls": False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": extra.get("temperature"),
            "text": {"format": {"type": "text"}},
            "tool_choice": "none",
            "tools": [],
            "top_p": extra.get("top_p"),
            "truncation": "disabled",
            "usage": None if usage is None else _usage(usage),
            "metadata": extra.get("metadata") or {},
        }

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The Response of a (non-streamed) chat completion."""
        choice = chat["choices"][0]
        return self.response(choice["message"]["content"], choice["finish_reason"], chat["usage"])

    def event(self, type_: str, **fields: Any) -> str:
        body = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {type_}\ndata: {json.dumps(body)}\n\n"

    async def events(self, chat_sse: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        """The Responses stream of a chat completion stream (which asked for usage). An
        in-band error is passed on as it came (a client raises on it) and ends the stream.
        However it ends (a client gone too), the chat stream is closed: its requests freed."""
        try:
            async for event in self._events(chat_sse):
                yield event
        finally:
            close = getattr(chat_sse, "aclose", None)
            if close is not None:
                await close()

    async def _events(self, chat_sse: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.response(None, None, None))
        yield self.event("response.in_progress", response=self.response(None, None, None))
        yield self.event(
            "response.output_item.added", output_index=0, item=self.message(None, False)
        )
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield self.event("response.content_part.added", **where, part=self.part(""))
        text, finish, usage = "", None, None
        async for raw in chat_sse:
            for line in (raw.decode() if isinstance(raw, bytes) else raw).splitlines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    yield f"event: error\ndata: {json.dumps(chunk)}\n\n"
                    return
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", ()):
                    delta = choice["delta"].get("content")
                    if delta:
                        text += delta
                        yield self.event(
                            "response.output_text.delta", **where, delta=delta, logprobs=[]
                        )
                    finish = choice.get("finish_reason") or finish
        yield self.event("response.output_text.done", **where, text=text, logprobs=[])
        yield self.event("response.content_part.done", **where, part=self.part(text))
        yield self.event("response.output_item.done", output_index=0, item=self.message(text, True))
        final = self.response(text, finish or "stop", usage)
        done = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield self.event(done, response=final)
