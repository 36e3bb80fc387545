"""ServerConfig: the HTTP layer's knobs (one field per `cachecraft serve` flag it owns)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """api_keys: empty = no auth. Each key gets its own cache namespace unless
    `share_namespace`. model_aliases: extra names accepted in the `model` field."""

    api_keys: tuple[str, ...] = ()
    share_namespace: bool = False
    max_documents: int = 16
    max_document_chars: int = 20000
    default_max_tokens: int = 256
    default_temperature: float = 0.0
    """Greedy unless a request asks for sampling (OpenAI's default would be 1.0)."""
    model_aliases: tuple[str, ...] = ("cachecraft",)
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_documents < 0 or self.max_document_chars < 1:
            raise ValueError("max_documents must be >= 0 and max_document_chars >= 1")
