"""ServerConfig: the HTTP layer's knobs (one field per `cachecraft serve` flag it owns)."""

from __future__ import annotations

from dataclasses import dataclass

from cachecraft.server.split import PASTED_CHUNK_CHARS


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """api_keys: empty = no auth. Each key gets its own cache namespace unless
    `share_namespace`. model_aliases: extra names accepted in the `model` field.

    Limits (413 above them): max_request_bytes of body; max_prompt_chars of message / prompt /
    system text per request; max_document_chars per document. watchdog_s: /health says 503
    when one unit of engine work (a step, an admission round, a chunk precompute) runs longer.
    metrics_public: /metrics and /health's store-wide figures for everyone (default: only with
    an admin key when keys are set). public_docs: /docs, /redoc and /openapi.json served while
    keys are set (without keys they always are).
    shutdown_timeout_s: how long a stopping server waits for open requests."""

    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()
    share_namespace: bool = False
    max_documents: int = 16
    max_document_chars: int = 8000
    """~2,000 tokens. A document is prefilled in one engine turn and the cost grows faster
    than its length (bundled model, one thread: 573 tokens 2.0 s, 2,427 tokens 21.9 s), so
    this bounds how long one document can hold every other request."""
    max_prompt_chars: int = 32000
    max_prompts: int = 128
    """Prompts in one completion's `prompt` list (a 400 above it, before any is tokenized):
    each is an engine request, so a long list only waits for the queue to refuse it."""
    pasted_chunk_chars: int = PASTED_CHUNK_CHARS
    """Context pasted into the last message (or a completion's prompt) is cut into paragraphs
    (blank lines, and lines this long) and so into chunk-caches, a paragraph this long closing
    a chunk (`server/split.py`); 0: never, the whole message is the question."""
    max_request_bytes: int = 4 * 1024 * 1024
    watchdog_s: float = 120.0
    metrics_public: bool = False
    public_docs: bool = False
    shutdown_timeout_s: float = 10.0
    default_max_tokens: int = 256
    default_temperature: float = 0.0
    """Greedy unless a request asks for sampling (OpenAI's default would be 1.0)."""
    model_aliases: tuple[str, ...] = ("cachecraft",)
    retry_after_s: int = 1
    raw_completions: bool = False
    """Every completion prompt is read as given, as vLLM reads it (a plain language model
    continues the text; no chat template, no chunks), and `/tokenize` of a prompt and
    `/tokenizer_info` follow. Off: a text prompt is a chat turn (its pasted context
    chunk-caches); token-id prompts and `echo` are raw either way."""

    @property
    def is_secured(self) -> bool:
        """Keys are set: callers are told apart (tenants, the operator, anonymous)."""
        return bool(self.api_keys or self.admin_keys)

    def __post_init__(self) -> None:
        if set(self.api_keys) & set(self.admin_keys):
            raise ValueError("an admin key must not also be an API key")
        if self.max_prompts < 1:
            raise ValueError("max_prompts must be >= 1")
        if self.max_documents < 0 or self.max_document_chars < 1:
            raise ValueError("max_documents must be >= 0 and max_document_chars >= 1")
        if min(self.max_prompt_chars, self.max_request_bytes) < 1:
            raise ValueError("max_prompt_chars and max_request_bytes must be >= 1")
        if self.pasted_chunk_chars < 0:
            raise ValueError("pasted_chunk_chars must be >= 0 (0: do not cut pasted context)")
        if self.watchdog_s <= 0 or self.shutdown_timeout_s < 0:
            raise ValueError("watchdog_s must be > 0 and shutdown_timeout_s >= 0")
