"""The synthetic workload: chunks of real Wikipedia text drawn with Zipf popularity.

The Zipf exponent is calibrated so that the top 5% of chunks appear in ~60% of requests (the
paper's production skew); chunks recur in new orders and new company. Each question asks which
article a quoted sentence of one chunk comes from; the gold answer is that article's title.
With `permute`, the same sets of k chunks recur instead, each time in a new order (where the
order of a chunk's context, and so the order penalty, matters).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from cachecraft.errors import BadRequestError
from cachecraft.request import Chunk, RagRequest
from cachecraft_bench.item import WorkloadItem, estimate_tokens, sentences, words_for_tokens
from cachecraft_bench.sources import wiki_articles

logger = logging.getLogger(__name__)

QUESTION = 'Which article is this sentence from: "{sentence}"? Answer with the article title.'
_CALIBRATION_REQUESTS = 1000


@dataclass(frozen=True, slots=True)
class SyntheticChunk:
    id: str
    text: str
    segments: tuple[tuple[str, str], ...]
    """(article title, article text included in the chunk), in order."""


def parse_chunk_tokens(text: str) -> tuple[int, int]:
    """ "MIN,MAX" (a --chunk-tokens flag) -> (MIN, MAX); a clear error otherwise."""
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise BadRequestError(f"--chunk-tokens wants MIN,MAX, got {text!r}") from None
    if not 16 <= low <= high:
        raise BadRequestError(f"--chunk-tokens must satisfy 16 <= MIN <= MAX, got {text!r}")
    return low, high


def build_chunks(
    num_chunks: int, chunk_tokens: tuple[int, int], rng: np.random.Generator
) -> list[SyntheticChunk]:
    """`num_chunks` chunks of "title\\ntext" article segments (articles in a seeded order), each
    of a length drawn uniformly in `chunk_tokens`; the last article is cut to fit."""
    lo, hi = chunk_tokens
    if not 16 <= lo <= hi:
        raise BadRequestError(f"chunk_tokens must satisfy 16 <= low <= high, got {chunk_tokens}")
    articles = wiki_articles()
    order = rng.permutation(len(articles)).tolist()
    chunks: list[SyntheticChunk] = []
    pos = 0
    while len(chunks) < num_chunks:
        target = int(rng.integers(lo, hi + 1))
        segments: list[tuple[str, str]] = []
        size = 0
        while size < target:
            if pos >= len(order):
                raise BadRequestError(
                    f"the wiki paragraphs make only {len(chunks)} chunks of {lo}-{hi} tokens, "
                    f"asked for {num_chunks}"
                )
            art = articles[order[pos]]
            pos += 1
            # words left within `hi` once the title line is added (estimates are additive enough)
            room = words_for_tokens(hi - size) - len(art.title.split())
            if room < 8:
                break
            words = art.extract.split()[:room]
            segments.append((art.title, " ".join(words)))
            size = estimate_tokens("\n\n".join(f"{t}\n{x}" for t, x in segments))
        text = "\n\n".join(f"{t}\n{x}" for t, x in segments)
        chunks.append(SyntheticChunk(f"syn{len(chunks)}", text, tuple(segments)))
    return chunks


def _topk_with_gumbel(log_w: np.ndarray, gumbel: np.ndarray, k: int) -> np.ndarray:
    """k distinct indices per row, sampled without replacement with probabilities ~ w."""
    return np.argpartition(-(log_w[None, :] + gumbel), k - 1, axis=1)[:, :k]


def _hot_share(exponent: float, n: int, k: int, n_hot: int, gumbel: np.ndarray) -> float:
    log_w = -exponent * np.log(np.arange(1, n + 1))
    picked = _topk_with_gumbel(log_w, gumbel, k)
    return float(np.mean((picked < n_hot).any(axis=1)))


def calibrate_zipf(
    num_chunks: int, k: int, top_fraction: float = 0.05, target_share: float = 0.6, seed: int = 0
) -> float:
    """Zipf exponent s (weights 1/rank^s) for which a request of k distinct chunks holds one of
    the top `top_fraction` ranks with probability `target_share` (bisection, common noise)."""
    n_hot = max(1, round(top_fraction * num_chunks))
    gumbel = np.random.default_rng(seed).gumbel(size=(_CALIBRATION_REQUESTS, num_chunks))
    lo, hi = 0.0, 4.0
    if _hot_share(lo, num_chunks, k, n_hot, gumbel) >= target_share:
        logger.info("uniform popularity already gives the target share; using s = 0")
        return 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if _hot_share(mid, num_chunks, k, n_hot, gumbel) < target_share:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _question(chunk: SyntheticChunk, rng: np.random.Generator) -> tuple[str, str]:
    """A quoted sentence of one article of the chunk (not its first when it has more, as the
    first usually names the title) and that article's title."""
    title, text = chunk.segments[int(rng.integers(len(chunk.segments)))]
    candidates = [s for s in sentences(text) if len(s.split()) >= 4] or [text]
    sentence = candidates[1] if len(candidates) > 1 else candidates[0]
    sentence = " ".join(sentence.split()[:40]).rstrip(".")
    return QUESTION.format(sentence=sentence), title


def synthetic(
    num_requests: int,
    num_chunks: int | None = None,
    k: int = 5,
    chunk_tokens: tuple[int, int] = (128, 512),
    seed: int = 0,
    top_fraction: float = 0.05,
    target_share: float = 0.6,
    rate_per_s: float | None = None,
    permute: bool = False,
) -> list[WorkloadItem]:
    """`num_requests` requests of k distinct chunks from a pool of `num_chunks` (default: enough
    for ~5 uses per chunk), popularity Zipf-calibrated to the paper's skew, in shuffled order.
    `rate_per_s` adds Poisson arrival times. `permute`: see `permuted_sets`."""
    if num_chunks is None:
        num_chunks = max(4 * k, math.ceil(num_requests * k / 5))
    if num_requests < 0 or k < 1 or num_chunks < k:
        raise BadRequestError(f"synthetic needs num_chunks >= k >= 1, got {num_chunks}, {k}")
    rng = np.random.default_rng(seed)
    if permute:
        return permuted_sets(num_requests, k, chunk_tokens, seed, rng)
    chunks = build_chunks(num_chunks, chunk_tokens, rng)
    exponent = calibrate_zipf(num_chunks, k, top_fraction, target_share, seed)
    logger.info("synthetic: %d chunks, Zipf exponent %.3f", num_chunks, exponent)
    # popularity rank r belongs to chunk rank_to_chunk[r], so hot chunks are spread over the pool
    rank_to_chunk = rng.permutation(num_chunks)
    log_w = -exponent * np.log(np.arange(1, num_chunks + 1))
    # sampled in row blocks so the noise matrix stays small for large pools
    picked = np.concatenate(
        [
            _topk_with_gumbel(log_w, rng.gumbel(size=(min(256, num_requests - a), num_chunks)), k)
            for a in range(0, num_requests, 256)
        ]
        or [np.zeros((0, k), dtype=np.int64)]
    )
    arrivals = None
    if rate_per_s is not None:
        arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, size=num_requests))
    items = []
    for i, ranks in enumerate(picked):
        members = [chunks[rank_to_chunk[r]] for r in rng.permutation(ranks)]
        arrival = None if arrivals is None else float(arrivals[i] - arrivals[0])
        items.append(_item(f"synthetic-{seed}-{i}", members, rng, arrival))
    return items


def _item(
    item_id: str, members: list[SyntheticChunk], rng: np.random.Generator, arrival: float | None
) -> WorkloadItem:
    question, title = _question(members[int(rng.integers(len(members)))], rng)
    return WorkloadItem(
        id=item_id,
        request=RagRequest(question, [Chunk(c.text, c.id) for c in members]),
        answers=(title,),
        arrival_s=arrival,
    )


def permuted_sets(
    num_requests: int,
    k: int,
    chunk_tokens: tuple[int, int],
    seed: int,
    rng: np.random.Generator,
    uses_per_set: int = 4,
) -> list[WorkloadItem]:
    """ceil(num_requests / uses_per_set) disjoint sets of k chunks; requests visit the sets in
    rounds (each round in a new random order of sets), every visit with the set's chunks in a
    new random order and a question about one of them."""
    if uses_per_set < 1:
        raise BadRequestError("uses_per_set must be >= 1")
    num_sets = max(1, math.ceil(num_requests / uses_per_set))
    chunks = build_chunks(num_sets * k, chunk_tokens, rng)
    sets = [chunks[j * k : (j + 1) * k] for j in range(num_sets)]
    order: list[int] = []
    while len(order) < num_requests:
        order.extend(rng.permutation(num_sets).tolist())
    items = []
    for i, j in enumerate(order[:num_requests]):
        members = [sets[j][t] for t in rng.permutation(k)]
        items.append(_item(f"permute-{seed}-{i}", members, rng, None))
    return items
