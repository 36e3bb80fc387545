"""Log-probabilities in OpenAI's two response shapes: a chat choice's `logprobs.content` and a
completion choice's `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`.

Also vLLM's `prompt_logprobs`: per prompt token (the first one None) a map from token id to
{logprob, rank, decoded_token}, the prompt's token first, then the most likely ones.

Each entry is a token and its `TokenLogprobs` (engine/sampling.py; None for an echoed
prompt's first token, which nothing comes before: null in the response); a token's text is
what the tokenizer decodes it to alone (a piece of a multi-byte character shows as U+FFFD, as
vLLM shows it), its `bytes` that text's UTF-8.

JSON has no NaN or infinity: a log-probability of -inf (a token the sampling settings rule
out) is written as -9999.0, OpenAI's and vLLM's stand-in; NaN or +inf means the forward went
wrong, so the answer sampled from it is wrong too, and `NonFiniteOutput` fails the request
(OpenAI's schema makes `logprob` a number, never null, so a null would break typed clients).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from cachecraft.engine.sampling import TokenLogprobs

Entry = tuple[int, TokenLogprobs | None]

MIN_LOGPROB = -9999.0
"""OpenAI's and vLLM's JSON stand-in for a log-probability of -inf."""


class NonFiniteOutput(Exception):
    """The model's output held NaN or +inf: the request fails (HTTP 500, or an error event in
    a stream) rather than answer from it."""


def finite(logprob: float) -> float:
    """`logprob` as JSON can carry it: -inf as MIN_LOGPROB; NaN or +inf raise."""
    if math.isnan(logprob) or logprob == math.inf:
        raise NonFiniteOutput(
            f"the model produced a non-finite log-probability ({logprob}); the answer cannot "
            "be trusted and was not sent"
        )
    return max(logprob, MIN_LOGPROB)


def _text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _item(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = _text(tokenizer, token_id)
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, entries: list[Entry]) -> dict[str, Any]:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    content = []
    for token_id, lp in entries:
        assert lp is not None  # a chat has no echo
        item = _item(tokenizer, token_id, lp.logprob)
        item["top_logprobs"] = [_item(tokenizer, t, v) for t, v in lp.top]
        content.append(item)
    return {"content": content}


def completion_logprobs(tokenizer: Any, entries: list[Entry], offset: int) -> dict[str, Any]:
    """The legacy shape; `offset`: where the first entry's text begins in the answer."""
    tokens, offsets = [], []
    for token_id, _ in entries:
        offsets.append(offset)
        tokens.append(_text(tokenizer, token_id))
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else finite(lp.logprob) for _, lp in entries],
        "top_logprobs": [
            None if lp is None else {_text(tokenizer, t): finite(v) for t, v in lp.top}
            for _, lp in entries
        ],
        "text_offset": offsets,
    }


def _vllm_logprob(tokenizer: Any, logprob: float, rank: int, token_id: int) -> dict[str, Any]:
    return {"logprob": finite(logprob), "rank": rank, "decoded_token": _text(tokenizer, token_id)}


def vllm_prompt_logprobs(
    tokenizer: Any, token_ids: Sequence[int], entries: Sequence[TokenLogprobs], k: int
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the first of `token_ids`, then for each next token
    (entries[j] is token j + 1's) its own entry and the `k` most likely tokens' (ranks 1..k;
    token ids as JSON keys, strings)."""
    out: list[dict[str, Any] | None] = [None]
    for token_id, lp in zip(token_ids[1:], entries, strict=True):
        item = {str(token_id): _vllm_logprob(tokenizer, lp.logprob, lp.rank, token_id)}
        for rank, (t, v) in enumerate(lp.top[:k], start=1):
            item.setdefault(str(t), _vllm_logprob(tokenizer, v, rank, t))
        out.append(item)
    return out
