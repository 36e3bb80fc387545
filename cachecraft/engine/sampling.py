"""SamplingParams and next-token sampling: greedy, temperature, top-p, per-request seed, and
the log-probabilities a request may ask for (`token_logprobs`).

Parameters are checked when they are made (BadRequestError names the field), and `sample`
never fails on the logits it is given: non-finite or degenerate probabilities fall back to
the greedy choice over the finite logits.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from cachecraft.errors import BadRequestError

log = logging.getLogger(__name__)

MIN_TEMPERATURE = 1e-3
"""Below this a softmax over fp32 logits is greedy anyway, and logits / temperature overflows
(1e-38 and below give inf); such requests are refused, not silently changed."""
MAX_TEMPERATURE = 100.0
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""torch.Generator.manual_seed accepts exactly this range."""
MAX_LOGPROBS = 20
"""Most alternatives per token (OpenAI's `top_logprobs` bound)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 means greedy; `seed` makes sampling reproducible per request."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    """Sample among the k most likely tokens only (0 or -1: all of them, as in vLLM)."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p x the most likely one's probability (0: none)."""
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    """Stop strings (a str or any sequence is accepted): the answer ends just before the
    first one to appear."""
    logprobs: int | None = None
    """None: none; k >= 0: each sampled token's log-probability and the k most likely tokens'
    (`token_logprobs`), at most MAX_LOGPROBS."""

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise BadRequestError("stop: give non-empty strings")
        object.__setattr__(self, "stop", stop)
        if self.max_tokens < 1:
            raise BadRequestError("max_tokens must be at least 1")
        t = self.temperature
        if not math.isfinite(t) or t < 0:
            raise BadRequestError("temperature must be a finite number >= 0")
        if 0 < t < MIN_TEMPERATURE or t > MAX_TEMPERATURE:
            raise BadRequestError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]"
            )
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise BadRequestError("top_p must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise BadRequestError("top_k must be an integer >= -1 (0 or -1: no limit)")
        if not math.isfinite(self.min_p) or not 0 <= self.min_p <= 1:
            raise BadRequestError("min_p must be in [0, 1]")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise BadRequestError(f"seed must be in [{SEED_MIN}, {SEED_MAX}]")
        k = self.logprobs
        if k is not None and (
            isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS
        ):
            raise BadRequestError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}]")


class TokenLogprobs(NamedTuple):
    """A sampled token's log-probability and the `k` most likely tokens' (ids, most likely
    first), under the model's own distribution (before temperature, top-k/p and min-p, as
    vLLM reports them)."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """logits [vocab] -> the log-softmax at `token` and its top `k` (non-finite logits give
    -inf / nan log-probabilities, never an error)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, k) if k else None
    pairs = (
        () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    )
    return TokenLogprobs(float(logp[token]), pairs)


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


def _greedy(logits: torch.Tensor) -> int:
    """argmax with nan ranked last and +inf first."""
    info = torch.finfo(torch.float32)
    return int(torch.argmax(torch.nan_to_num(logits, nan=info.min, posinf=info.max)))


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """logits [vocab] -> one token id. Never raises on inf/nan: greedy (nan ranked last)."""
    logits = logits.float()
    if params.temperature == 0:
        return _greedy(logits)
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = cum - sorted_p > params.top_p  # keep the smallest set reaching top_p
        sorted_p[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        log.warning("non-finite sampling probabilities; taking the greedy token")
        return _greedy(logits)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))
