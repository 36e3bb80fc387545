"""SamplingParams and next-token sampling: penalties, greedy, temperature, top-k/p, min-p,
per-request seed, and the log-probabilities a request may ask for (`token_logprobs`).

Parameters are checked when they are made (BadRequestError names the field), and `sample`
never fails on the logits it is given: non-finite or degenerate probabilities fall back to
the greedy choice over the finite logits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
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
MAX_REPETITION_PENALTY = 10.0


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
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token the answer already holds."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted once per time the answer already holds the token."""
    repetition_penalty: float = 1.0
    """vLLM's: the logits of tokens in the prompt or the answer are divided by it (multiplied
    when negative); 1 is off."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI's: (token id, bias in [-100, 100]) added to those tokens' logits."""
    min_tokens: int = 0
    """vLLM's: no stop token (EOS, `stop_token_ids`) is sampled before this many tokens."""
    prompt_logprobs: int | None = None
    """vLLM's: None: none; k >= 0: each prompt token's log-probability given the tokens before
    it and the k most likely tokens there (`prompt_token_logprobs`). Every prompt row is then
    computed: the request runs in `full` mode whatever mode it was given."""

    @property
    def penalized(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
        )

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v) or not -2 <= v <= 2:
                raise BadRequestError(f"{name} must be in [-2, 2]")
        r = self.repetition_penalty
        if not math.isfinite(r) or not 0 < r <= MAX_REPETITION_PENALTY:
            raise BadRequestError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}]")
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise BadRequestError("min_tokens must be an integer >= 0")
        ids = self.stop_token_ids
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise BadRequestError("stop_token_ids: give token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        bias = tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items())
        if any(t < 0 or not -100 <= b <= 100 for t, b in bias):
            raise BadRequestError("logit_bias: give token ids >= 0 and biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (
                isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS
            ):
                raise BadRequestError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}]")


class TokenLogprobs(NamedTuple):
    """A sampled token's log-probability, its rank in the vocabulary (1: the most likely;
    ties share the better rank) and the `k` most likely tokens' (ids, most likely first),
    under the model's own distribution (before penalties, temperature, top-k/p and min-p, as
    vLLM reports them)."""

    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int = 1


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """logits [vocab] -> the log-softmax at `token` and its top `k` (non-finite logits give
    -inf / nan log-probabilities, never an error)."""
    return prompt_token_logprobs(logits[None], torch.tensor([token]), k)[0]


def prompt_token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> list[TokenLogprobs]:
    """logits [m, vocab] (row j: the distribution after the prompt's first j + 1 tokens, say)
    and tokens [m] (the token that came next in each row) -> one `TokenLogprobs` per row, as
    `token_logprobs` gives for one."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.long()[:, None])
    ranks = (1 + (logp > chosen).sum(dim=-1)).tolist()
    values = chosen[:, 0].tolist()
    if not k:
        return [TokenLogprobs(v, (), r) for v, r in zip(values, ranks, strict=True)]
    top = torch.topk(logp, k, dim=-1)
    tops = zip(top.indices.tolist(), top.values.tolist(), strict=True)
    return [
        TokenLogprobs(v, tuple(zip(i, t, strict=True)), r)
        for v, r, (i, t) in zip(values, ranks, tops, strict=True)
    ]


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


def penalize(
    logits: torch.Tensor,
    params: SamplingParams,
    output_ids: list[int],
    prompt_ids: Sequence[int],
    stops: Collection[int] = (),
) -> torch.Tensor:
    """logits [vocab] (float32) with the request's penalties applied, as vLLM applies them:
    repetition over the prompt's and the answer's tokens, presence and frequency over the
    answer's, then the logit bias (ids past the vocabulary are ignored), and `stops` (the
    request's stop token ids) ruled out while the answer is shorter than `min_tokens`. A new
    tensor; `logits` itself is left as it was."""
    vocab = logits.shape[-1]
    out = logits.clone()
    if params.repetition_penalty != 1:
        seen = torch.zeros(vocab, dtype=torch.bool)
        ids = torch.tensor([*prompt_ids, *output_ids], dtype=torch.long)
        seen[ids[(ids >= 0) & (ids < vocab)]] = True
        r = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(output_ids, dtype=torch.long)
        counts = torch.bincount(ids[(ids >= 0) & (ids < vocab)], minlength=vocab).float()
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    for token, bias in params.logit_bias:
        if token < vocab:
            out[token] += bias
    if len(output_ids) < params.min_tokens:
        banned = [t for t in stops if 0 <= t < vocab]
        out[banned] = float("-inf")
    return out


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    gen: torch.Generator | None,
    output_ids: list[int] | None = None,
    prompt_ids: Sequence[int] = (),
    stops: Collection[int] = (),
) -> int:
    """logits [vocab] -> one token id, after the penalties (`penalize`) when the params set
    any. Never raises on inf/nan: greedy (nan ranked last)."""
    logits = logits.float()
    if params.penalized:
        logits = penalize(logits, params, output_ids or [], prompt_ids, stops)
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
