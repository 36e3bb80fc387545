"""The sharegpt workload: real conversation lengths from the ShareGPT logs as RAG requests.

Each human turn is a question; the earlier turns of its conversation, each cut into chunks of
~`chunk_tokens`, are the context (so a conversation's later requests reuse its earlier chunks, in
a shifted window). Arrivals are a seeded Poisson process (the logs carry no timestamps).
"""

from __future__ import annotations

import logging

import numpy as np

from cachecraft.errors import BadRequestError
from cachecraft.request import Chunk, RagRequest
from cachecraft_bench.item import WorkloadItem, estimate_tokens, split_words, words_for_tokens
from cachecraft_bench.sources import iter_sharegpt

logger = logging.getLogger(__name__)

_ROLES = {"human": "User", "gpt": "Assistant"}


def conversation_turns(record: dict) -> list[tuple[str, str]]:
    """(role, text) of a record's human/gpt turns, empty turns dropped."""
    out = []
    for turn in record.get("conversations") or []:
        role = _ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        text = turn.get("value") if role else None
        if isinstance(text, str) and text.strip():
            out.append((role, text))
    return out


def conversation_items(
    record: dict, chunk_tokens: int, max_chunks: int, max_question_tokens: int
) -> list[WorkloadItem]:
    """One request per human turn of `record`: the turn is the question (a long turn keeps its
    tail as the question and its head becomes extra chunks); earlier turns are the chunks,
    newest `max_chunks` kept; the gpt reply that followed is the reference answer."""
    turns = conversation_turns(record)
    pieces = [
        [
            Chunk(p, f"{record.get('id', '?')}/t{t}/{j}")
            for j, p in enumerate(split_words(f"{role}: {text}", chunk_tokens))
        ]
        for t, (role, text) in enumerate(turns)
    ]
    items = []
    for t, (role, text) in enumerate(turns):
        if role != "User":
            continue
        chunks = [c for turn_chunks in pieces[:t] for c in turn_chunks]
        words = text.split()
        keep = words_for_tokens(max_question_tokens)
        if len(words) > keep:
            head = " ".join(words[:-keep])
            chunks += [
                Chunk(p, f"{record.get('id', '?')}/t{t}/q{j}")
                for j, p in enumerate(split_words(head, chunk_tokens))
            ]
            words = words[-keep:]
        chunks = chunks[-max_chunks:] if max_chunks > 0 else []
        reply = turns[t + 1][1] if t + 1 < len(turns) and turns[t + 1][0] == "Assistant" else None
        items.append(
            WorkloadItem(
                id=f"{record.get('id', '?')}/t{t}",
                request=RagRequest(" ".join(words), chunks),
                answers=(reply,) if reply else None,
            )
        )
    return items


def sharegpt(
    num_requests: int,
    seed: int = 0,
    chunk_tokens: int = 256,
    max_chunks: int = 8,
    max_question_tokens: int = 256,
    rate_per_s: float = 1.0,
) -> list[WorkloadItem]:
    """`num_requests` requests from ShareGPT conversations taken in a seeded order (all turns of
    one conversation, in turn order, before the next), with Poisson arrivals at `rate_per_s`."""
    if num_requests < 0 or chunk_tokens < 1 or rate_per_s <= 0:
        raise BadRequestError("sharegpt needs num_requests >= 0, chunk_tokens >= 1, rate_per_s > 0")
    rng = np.random.default_rng(seed)
    limit = max(64, 2 * num_requests)
    while True:
        records = list(iter_sharegpt(limit))
        items = []
        for r in rng.permutation(len(records)).tolist():
            items += conversation_items(records[r], chunk_tokens, max_chunks, max_question_tokens)
            if len(items) >= num_requests:
                break
        if len(items) >= num_requests or len(records) < limit:
            break
        limit *= 2
    if len(items) < num_requests:
        raise BadRequestError(f"ShareGPT holds only {len(items)} requests, asked {num_requests}")
    items = items[:num_requests]
    gaps = rng.exponential(1.0 / rate_per_s, size=num_requests)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])]) if num_requests else gaps
    lengths = [sum(estimate_tokens(c.text) for c in it.request.chunks) for it in items]
    logger.info(
        "sharegpt: %d requests, median context ~%d tokens",
        len(items),
        int(np.median(lengths or [0])),
    )
    return [
        WorkloadItem(it.id, it.request, it.answers, float(a))
        for it, a in zip(items, arrivals, strict=True)
    ]
