"""SamplingParams and next-token sampling: greedy, temperature, top-p, per-request seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachecraft.errors import BadRequestError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 means greedy; `seed` makes sampling reproducible per request."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    """Stop strings (a str or any sequence is accepted): the answer ends just before the
    first one to appear."""

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise BadRequestError("stop: give non-empty strings")
        object.__setattr__(self, "stop", stop)
        if self.max_tokens < 1:
            raise BadRequestError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise BadRequestError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise BadRequestError("top_p must be in (0, 1]")


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """logits [vocab] -> one token id."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = cum - sorted_p > params.top_p  # keep the smallest set reaching top_p
        sorted_p[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))
