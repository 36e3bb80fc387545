"""Log-probabilities in OpenAI's two response shapes: a chat choice's `logprobs.content` and a
completion choice's `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`.

Each entry is a token and its `TokenLogprobs` (engine/sampling.py; None for an echoed
prompt's first token, which nothing comes before: null in the response); a token's text is
what the tokenizer decodes it to alone (a piece of a multi-byte character shows as U+FFFD, as
vLLM shows it), its `bytes` that text's UTF-8.
"""

from __future__ import annotations

from typing import Any

from cachecraft.engine.sampling import TokenLogprobs

Entry = tuple[int, TokenLogprobs | None]


def _text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _item(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = _text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


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
        "token_logprobs": [None if lp is None else lp.logprob for _, lp in entries],
        "top_logprobs": [
            None if lp is None else {_text(tokenizer, t): v for t, v in lp.top} for _, lp in entries
        ],
        "text_offset": offsets,
    }
