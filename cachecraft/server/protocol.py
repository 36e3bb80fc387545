"""Request and response bodies of the OpenAI-compatible API (pydantic) plus our extensions.

Unknown fields are accepted and ignored (extra="allow"; their text must still be valid Unicode),
except the OpenAI fields this server cannot honour (`unsupported_fields`: tools,
response_format, store, metadata, reasoning_effort, web_search_options, vLLM's guided
decoding, ...), which are refused by name as vLLM does, and input it cannot read (non-text
content parts),
refused with what to send instead. `model` may be left out (the served model), as in vLLM.
Every string must be encodable UTF-8 (no lone surrogates such as "\\ud800"). Extensions:
`documents`, `cache_namespace`, `cachecraft_mode`, `ignore_eos`, and vLLM's `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `stop_token_ids`, `prompt_logprobs`,
`include_stop_str_in_output`, `cache_salt`, `skip_special_tokens` and
`stream_options.continuous_usage_stats`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic import StrictStr as _StrictStr

from cachecraft.engine.sampling import MAX_LOGPROBS  # alternatives per token, everywhere


def check_utf8(text: str) -> str:
    """Refuse strings that cannot be encoded as UTF-8 (lone surrogates from JSON escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"not valid Unicode text: lone surrogate {text[e.start]!r} at index {e.start}"
        ) from None
    return text


StrictStr = Annotated[_StrictStr, AfterValidator(check_utf8)]
"""A JSON string that is valid Unicode (what the tokenizer and every response can carry)."""


def _bad_text(value: Any, path: str) -> str | None:
    """Where in an ignored extra value a string is not valid Unicode (None: nowhere)."""
    if isinstance(value, str):
        try:
            check_utf8(value)
        except ValueError as e:
            return f"{path}: {e}"
    elif isinstance(value, dict):
        for k, v in value.items():
            found = _bad_text(k, path) or _bad_text(v, f"{path}.{k}")
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _bad_text(v, f"{path}.{i}")
            if found:
                return found
    return None


class _Lenient(BaseModel):
    """Fields it does not declare are accepted and ignored, but their text must be valid
    Unicode as everywhere else (a lone surrogate is refused, named by its path)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _extras_are_text(self) -> Any:
        for name, value in (self.model_extra or {}).items():
            found = _bad_text(name, name) or _bad_text(value, name)
            if found:
                raise ValueError(found)
        return self


MAX_ID_CHARS = 256


class Document(BaseModel):
    """One retrieved passage: `{"text": ..., "id": ...}`, vLLM's `{"title": ..., "text": ...}`
    (the title becomes the passage's first line) or a bare string (its text)."""

    model_config = ConfigDict(extra="forbid")
    id: StrictStr | None = Field(default=None, max_length=MAX_ID_CHARS)
    title: StrictStr | None = Field(default=None, max_length=MAX_ID_CHARS)
    text: StrictStr = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _bare_string(cls, v: Any) -> Any:
        return {"text": v} if isinstance(v, str) else v

    @field_validator("text")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("a document holds only whitespace; leave it out")
        return v

    @property
    def passage(self) -> str:
        """What the model reads: the title (if any) on the first line, then the text."""
        return self.text if not self.title else f"{self.title}\n{self.text}"

    @property
    def label(self) -> str | None:
        """Its name in a request's reuse report: the id, else the title."""
        return self.id if self.id is not None else self.title


class TextPart(_Lenient):
    type: Literal["text"]
    text: StrictStr


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = Field(default=None, max_length=MAX_ID_CHARS)
    """OpenAI's participant name: accepted, not read (the template has no place for it)."""

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        """Name a part this server cannot read (an image, audio, a file) instead of reporting
        that it failed every branch of the union."""
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(
                        f"part {i} has type {kind!r}: this server reads text parts only"
                    )
        return v

    def text(self) -> str:
        """The content; text parts are paragraphs, a blank line between them (a client that
        sends each passage as a part of its own gets each as a chunk-cache: server/split.py)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n\n".join(p.text for p in self.content)


class StreamOptions(_Lenient):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    """vLLM's: with `include_usage`, every chunk also carries its choice's usage so far."""


StopStr = Annotated[StrictStr, Field(min_length=1, max_length=256)]
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
MAX_CHOICES = 8  # `n`: each choice is one engine request (its own prefill)
MIN_TEMPERATURE = 1e-3  # below it softmax(logits / t) overflows to inf / nan


class _Generation(_Lenient):
    model: StrictStr | None = Field(default=None, max_length=MAX_ID_CHARS)  # None: served
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=2**31)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=2**31)
    temperature: StrictFloat | None = Field(default=None, ge=0, le=2)
    top_p: StrictFloat | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=2**31)  # vLLM's; 0 or -1: off
    min_p: StrictFloat | None = Field(default=None, ge=0, le=1)  # vLLM's
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0, le=10)  # vLLM's
    logit_bias: dict[StrictStr, StrictFloat] | None = Field(default=None, max_length=300)
    min_tokens: StrictInt | None = Field(default=None, ge=0, le=2**31)  # vLLM's
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = Field(
        default=None, max_length=64
    )  # vLLM's
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """vLLM's: each prompt token's log-probability and the k most likely tokens' there (the
    request runs as a full prefill: every prompt row's logits are read)."""
    user: StrictStr | None = Field(default=None, max_length=MAX_ID_CHARS)
    safety_identifier: StrictStr | None = Field(default=None, max_length=MAX_ID_CHARS)
    prompt_cache_key: StrictStr | None = Field(default=None, max_length=MAX_ID_CHARS)
    """OpenAI's end-user ids and cache routing hint: accepted, with nothing to do here (no
    abuse monitoring; chunk-caches are found by content, whatever the key)."""
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=1024)
    """vLLM's: requests share cached K/V only with requests of the same salt (here: a cache
    namespace of the salt's hash, inside `cache_namespace` when both are given)."""

    @field_validator("prompt_logprobs", mode="before")
    @classmethod
    def _bool_is_one(cls, v: Any) -> Any:
        """vLLM reads `true` as 1 (its field is a lax int); `false` asks for none."""
        if isinstance(v, bool):
            return 1 if v else None
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        """OpenAI's: token ids (as strings) to a bias in [-100, 100]."""
        for key, bias in (v or {}).items():
            # isdigit alone passes "²" and other digits int() cannot read
            if not (key.isascii() and key.isdigit()) or int(key) >= 2**31:
                raise ValueError(
                    f"key {key!r} must be a token id (a non-negative integer as a string, "
                    'e.g. "42")'
                )
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {key} must be in [-100, 100]")
        return v

    seed: StrictInt | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    n: StrictInt | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    documents: list[Document] = Field(default_factory=list)
    cache_namespace: StrictStr | None = Field(default=None, min_length=1, max_length=128)
    cachecraft_mode: StrictStr | None = Field(default=None, max_length=64)
    ignore_eos: StrictBool = False
    stop: StopStr | list[StopStr] | None = Field(default=None, max_length=4)
    include_stop_str_in_output: StrictBool = False  # vLLM's: the answer ends after its stop
    skip_special_tokens: StrictBool = True  # vLLM's: False keeps special tokens in the text

    @field_validator(
        "stream",
        "ignore_eos",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "documents",
        mode="before",
    )
    @classmethod
    def _null_is_default(cls, v: Any, info: Any) -> Any:
        """OpenAI's schema makes `stream` nullable (null: false); our extensions do the same."""
        if v is None:
            return cls.model_fields[info.field_name].get_default(call_default_factory=True)
        return v

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, v: float | None) -> float | None:
        if v is not None and 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"give 0 (greedy) or a temperature of at least {MIN_TEMPERATURE}")
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else v or []
        if len(items) > 4 or any(not s or len(s) > 256 for s in items):
            raise ValueError("give at most 4 non-empty stop strings of at most 256 characters")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("set logprobs to true to ask for top_logprobs")
        return v

    def logprobs_k(self) -> int | None:
        """Alternatives per token to report (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None


TokenIds = list[Annotated[StrictInt, Field(ge=0)]]
MAX_PROMPT_IDS = 1 << 20


class CompletionRequest(_Generation):
    """`prompt`: text, token ids, or a list of either (batched prompts). Token ids, and any
    prompt with `echo`, are read as given (raw: no chat template); `echo` puts the prompt
    before the answer (with `logprobs`, each prompt token's entry first, the first one null),
    and then `max_tokens` may be 0 (the prompt alone, as a scoring client asks)."""

    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    max_tokens: StrictInt | None = Field(default=None, ge=0, le=2**31)

    def logprobs_k(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind(cls, v: Any) -> Any:
        """A list is all strings, all token ids or all lists of ids (named when mixed), and
        holds at most MAX_PROMPT_IDS ids in all, none negative; every prompt holds something."""
        if not isinstance(v, list):
            return v
        if not v:
            raise ValueError("give at least one prompt (a string or token ids)")
        kinds = {type(x) for x in v}
        if len(kinds) > 1:
            raise ValueError("give a list of strings, of token ids or of token-id lists, not a mix")
        if list in kinds and any(not x for x in v):
            raise ValueError("a token-id prompt is empty")
        ids = [] if str in kinds else [i for x in v for i in (x if isinstance(x, list) else [x])]
        negative = next((i for i in ids if type(i) is int and i < 0), None)
        if negative is not None:
            raise ValueError(f"token ids are never negative; got {negative}")
        if len(ids) > MAX_PROMPT_IDS:
            raise ValueError(f"at most {MAX_PROMPT_IDS} token ids in all")
        return v

    @field_validator("echo", mode="before")
    @classmethod
    def _null_is_false(cls, v: Any) -> Any:
        return False if v is None else v  # nullable in OpenAI's schema

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 asks for no answer; only with echo (the prompt alone)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TokenizeRequest(_Lenient):
    """vLLM's POST /tokenize: the token ids this server would prefill for a chat's `messages`
    or a completion's `prompt` (with the documents), chat template and chunks included."""

    model: StrictStr | None = Field(default=None, max_length=MAX_ID_CHARS)
    prompt: StrictStr | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    documents: list[Document] = Field(default_factory=list)
    return_token_strs: StrictBool = False
    add_special_tokens: StrictBool = True
    """vLLM's, for a raw `prompt` (`--raw-completions`): the tokenizer's own special tokens."""

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Lenient):
    """vLLM's POST /detokenize: token ids back to text."""

    model: StrictStr | None = Field(default=None, max_length=MAX_ID_CHARS)
    tokens: list[Annotated[StrictInt, Field(ge=0)]] = Field(max_length=1 << 20)


class ChunksRequest(BaseModel):
    """POST /v1/chunks: compute each document's chunk-cache now (optionally pinned)."""

    model_config = ConfigDict(extra="forbid")
    documents: list[Document] = Field(min_length=1)
    cache_namespace: StrictStr | None = Field(default=None, min_length=1, max_length=128)
    system: StrictStr | None = None
    pin: StrictBool = False


# OpenAI fields this server cannot honour, with the values that mean "not asked for".
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),  # chat only: a completion's `echo` is a field of its own
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),  # only means something with `tools`
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    # vLLM's, for what this server does not do: structured output, beam search, prompt
    # truncation, other templates or continuing the assistant's message, other token output
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "logits_processors": (None, []),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "truncate_prompt_tokens": (None,),
    "use_beam_search": (None, False),
    "chat_template": (None,),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "prompt_embeds": (None,),
    "return_tokens_as_token_ids": (None, False),
    # OpenAI's, for what this server does not do: no stored completions, no web search, no
    # reasoning or verbosity setting, one service tier
    "store": (None, False),
    "metadata": (None, {}),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "service_tier": (None, "auto", "default"),
}


_TOOL_FIELDS = frozenset({"tools", "functions", "parallel_tool_calls"})
"""Harmless beside `tool_choice: "none"`: the client offers tools and asks for no call, which
is every answer this server gives (an agent's last turn, after its tool results)."""


def unsupported_fields(
    body: BaseModel, table: dict[str, tuple[Any, ...]] | None = None
) -> list[str]:
    """Names of fields in the request that ask for something this server does not do: those
    of `table` (default: OpenAI's and vLLM's, `_UNSUPPORTED`) present with a value other than
    their "not asked" ones; with the default table, tools offered with `tool_choice: "none"`
    (`_TOOL_FIELDS`) are not."""
    extra = body.model_extra or {}
    if table is None and extra.get("tool_choice") == "none":
        extra = {k: v for k, v in extra.items() if k not in _TOOL_FIELDS}
    bad = []
    for name, harmless in (_UNSUPPORTED if table is None else table).items():
        if name in extra and not any(
            type(extra[name]) is type(h) and extra[name] == h or extra[name] is h for h in harmless
        ):
            bad.append(name)
    return bad


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
