"""Exceptions cachecraft raises for bad input: each carries a message a user can act on.

The CLI and the server turn these into one-line errors / HTTP 4xx, never stack traces
(`NonFiniteError` alone is the server's fault: 500).
"""

from __future__ import annotations


class CachecraftError(Exception):
    """Base class of every error cachecraft reports to its user."""


class ModelLoadError(CachecraftError):
    """The model could not be found or is not a supported architecture."""


class ContextLengthError(CachecraftError):
    """A sequence is longer than the model's context window."""

    def __init__(self, num_tokens: int, max_tokens: int) -> None:
        super().__init__(
            f"prompt needs {num_tokens} tokens but the model's context is {max_tokens} tokens"
        )
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens


class BadRequestError(CachecraftError):
    """A request is malformed (empty question, a chunk that is not text, ...)."""


class PinLimitError(CachecraftError):
    """Pinning a variant would take a namespace past `StoreConfig.max_pinned_bytes_per_namespace`."""


class StoreUnavailableError(CachecraftError):
    """A store location (cache directory, Redis) cannot be used; the message says which."""


class NonFiniteError(RuntimeError):
    """The model computed a NaN or an infinity for a request (its logits or log-probabilities).
    Not the user's fault (the server answers 500, or an error event in a stream): the request
    fails and nothing computed for it is cached."""
