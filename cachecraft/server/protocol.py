"""Request and response bodies of the OpenAI-compatible API (pydantic) plus our extensions.

Unknown OpenAI fields are accepted and ignored (extra="allow"); the fields we use are typed and
validated. Extensions: `documents`, `cache_namespace`, `cachecraft_mode`, `ignore_eos`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: StrictStr | None = None
    text: StrictStr


class TextPart(_Lenient):
    type: Literal["text"]
    text: StrictStr


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Lenient):
    include_usage: StrictBool = False


class _Generation(_Lenient):
    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0, le=2)
    top_p: StrictFloat | None = Field(default=None, gt=0, le=1)
    seed: StrictInt | None = None
    n: StrictInt | None = Field(default=None, ge=1, le=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    documents: list[Document] = Field(default_factory=list)
    cache_namespace: StrictStr | None = Field(default=None, min_length=1, max_length=128)
    cachecraft_mode: StrictStr | None = None
    ignore_eos: StrictBool = False
    stop: StrictStr | list[StrictStr] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else v or []
        if len(items) > 4 or any(not s for s in items):
            raise ValueError("give at most 4 non-empty stop strings")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(_Generation):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Generation):
    prompt: StrictStr | list[StrictStr]


class ChunksRequest(BaseModel):
    """POST /v1/chunks: compute each document's chunk-cache now (optionally pinned)."""

    model_config = ConfigDict(extra="forbid")
    documents: list[Document] = Field(min_length=1)
    cache_namespace: StrictStr | None = Field(default=None, min_length=1, max_length=128)
    system: StrictStr | None = None
    pin: StrictBool = False


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None):
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(
    prompt_tokens: int, completion_tokens: int, report: dict[str, Any] | None
) -> dict[str, Any]:
    """OpenAI usage plus `prompt_tokens_details.cached_tokens` (reused) and our report."""
    cached = int(report["tokens_reused"]) if report else 0
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if report is not None:
        out["cachecraft"] = report
    return out
