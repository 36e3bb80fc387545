"""The wiki-qa workload: FanOutQA questions over BM25-retrieved Wikipedia lead passages.

FanOutQA's own evidence is fetched live (fails offline), so each question is answered from the
top-k passages of the offline Wikipedia paragraphs instead; passages of the question's evidence
titles are boosted. The BM25 index is built once per process (in memory only).
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import bm25s
import numpy as np
from nltk.stem.porter import PorterStemmer

from cachecraft.errors import BadRequestError
from cachecraft.request import Chunk, RagRequest
from cachecraft_bench.item import WorkloadItem, estimate_tokens, split_sentences
from cachecraft_bench.sources import FanoutQuestion, fanout_questions, wiki_articles

logger = logging.getLogger(__name__)


def question_set(question_id: str) -> Literal["tuning", "report"]:
    """The evaluation set (docs/evaluation.md) a question belongs to: a stable hash of its id,
    about half each."""
    return "report" if hashlib.blake2b(question_id.encode()).digest()[0] & 1 else "tuning"


@lru_cache(maxsize=1 << 16)
def _stem(word: str) -> str:
    return _porter().stem(word)


@lru_cache(maxsize=1)
def _porter() -> PorterStemmer:
    return PorterStemmer()


def _stem_words(words: list[str]) -> list[str]:
    return [_stem(w) for w in words]


def _tokenize(texts: list[str], return_ids: bool) -> object:
    return bm25s.tokenize(
        texts, stopwords="en", stemmer=_stem_words, return_ids=return_ids, show_progress=False
    )


@dataclass(frozen=True, slots=True)
class Passage:
    id: str
    title: str
    text: str


@dataclass(frozen=True, slots=True)
class WikiIndex:
    """Passages of ~[min_tokens, max_tokens] and a BM25 index over them (title included)."""

    passages: tuple[Passage, ...]
    by_title: dict[str, tuple[int, ...]]
    retriever: bm25s.BM25

    def scores(self, query: str) -> np.ndarray:
        tokens = _tokenize([query], return_ids=False)[0]
        return np.asarray(self.retriever.get_scores(tokens), dtype=np.float64)


def wiki_passages(min_tokens: int = 100, max_tokens: int = 300) -> tuple[Passage, ...]:
    """Every lead paragraph as "title\\ntext" passages: long ones split by sentences into pieces
    of at most `max_tokens`; passages under `min_tokens` (estimated) are left out."""
    out = []
    for art in wiki_articles():
        budget = max_tokens - estimate_tokens(art.title) - 1
        pieces = split_sentences(art.extract, max(budget, 16))
        for i, piece in enumerate(pieces):
            text = f"{art.title}\n{piece}"
            if estimate_tokens(text) < min_tokens:
                continue
            pid = art.title if len(pieces) == 1 else f"{art.title}#{i + 1}"
            out.append(Passage(pid, art.title, text))
    return tuple(out)


@lru_cache(maxsize=4)
def wiki_index(min_tokens: int = 100, max_tokens: int = 300) -> WikiIndex:
    passages = wiki_passages(min_tokens, max_tokens)
    if not passages:
        raise BadRequestError(f"no wiki passage has between {min_tokens} and {max_tokens} tokens")
    by_title: dict[str, list[int]] = {}
    for i, p in enumerate(passages):
        by_title.setdefault(p.title, []).append(i)
    corpus = _tokenize([p.text for p in passages], return_ids=True)
    retriever = bm25s.BM25()
    retriever.index(corpus, show_progress=False)
    logger.info("indexed %d wiki passages (%d-%d tokens)", len(passages), min_tokens, max_tokens)
    return WikiIndex(passages, {t: tuple(ix) for t, ix in by_title.items()}, retriever)


def _title_matches(index: WikiIndex, q: FanoutQuestion, max_words: int = 8) -> list[int]:
    """Passages of the question's evidence titles and of multi-word titles named verbatim in the
    question (runs of 2..`max_words` words, trailing punctuation and possessive 's stripped);
    one-word titles are left to BM25, as "School" or "Building" would match generic words."""
    hits = [i for t in q.evidence_titles for i in index.by_title.get(t, ())]
    words = [re.sub(r"('s)?[?,.;:!]*$", "", w) for w in q.question.split()]
    for a in range(len(words)):
        for b in range(a + 2, min(a + max_words, len(words)) + 1):
            hits.extend(index.by_title.get(" ".join(words[a:b]), ()))
    return list(dict.fromkeys(hits))


def retrieve(
    index: WikiIndex, q: FanoutQuestion, depth: int, title_boost: float = 1.0
) -> list[int]:
    """The top `depth` passage indices for `q`: BM25 score, plus `title_boost` times the best
    score for passages whose title the question names (so with 1.0 those rank first)."""
    scores = index.scores(q.question)
    matched = _title_matches(index, q)
    if matched and title_boost:
        scores[matched] += title_boost * max(float(scores.max()), 1.0)
    # a stable sort: ties keep passage order, so retrieval is deterministic
    return np.argsort(-scores, kind="stable")[:depth].tolist()


def wiki_qa(
    num_requests: int,
    k: int = 5,
    seed: int = 0,
    min_tokens: int = 100,
    max_tokens: int = 300,
    title_boost: float = 1.0,
    questions: Literal["all", "tuning", "report"] = "all",
    num_questions: int | None = None,
) -> list[WorkloadItem]:
    """`num_requests` FanOutQA dev questions (gold answers flattened to strings), each with its
    top-k retrieved passages as chunks, in a seeded question order. Passages are lead
    paragraphs (title line included) cut to <= `max_tokens`; those under `min_tokens` are not
    indexed (about half the paragraphs at the defaults: 5,047 passages remain).

    There are 310 questions: beyond that they are reused, round after round, each round in a
    new order; a reused question gets k passages sampled from its top 2k, in a shuffled order.
    `questions`: all, or only those of the tuning or the report set (`question_set`);
    `num_questions`: only that many of them (seeded), so that questions recur sooner.
    """
    if num_requests < 0 or k < 1:
        raise BadRequestError("wiki-qa needs num_requests >= 0 and k >= 1")
    if questions not in ("all", "tuning", "report"):
        raise BadRequestError(f"wiki-qa questions must be all, tuning or report, not {questions!r}")
    asked = fanout_questions()
    if questions != "all":
        asked = tuple(q for q in asked if question_set(q.id) == questions)
    index = wiki_index(min_tokens, max_tokens)
    rng = np.random.default_rng(seed)
    if num_questions is not None:
        if num_questions < 1:
            raise BadRequestError("wiki-qa needs num_questions >= 1")
        asked = tuple(asked[i] for i in sorted(rng.permutation(len(asked))[:num_questions]))
    items: list[WorkloadItem] = []
    order: list[int] = []
    for n in range(num_requests):
        rnd, slot = divmod(n, len(asked))
        if slot == 0:
            order = rng.permutation(len(asked)).tolist()
        q = asked[order[slot]]
        if rnd == 0:
            picked = retrieve(index, q, k, title_boost)
        else:
            pool = retrieve(index, q, 2 * k, title_boost)
            picked = rng.choice(pool, size=min(k, len(pool)), replace=False).tolist()
        chunks = [Chunk(index.passages[i].text, index.passages[i].id) for i in picked]
        items.append(
            WorkloadItem(
                id=q.id if rnd == 0 else f"{q.id}-r{rnd}",
                request=RagRequest(q.question, chunks),
                answers=q.answers or None,
            )
        )
    return items


def wiki_qa_zipf(
    num_requests: int,
    k: int = 5,
    seed: int = 0,
    zipf_s: float = 1.0,
    num_questions: int | None = None,
    min_tokens: int = 100,
    max_tokens: int = 300,
    exact_repeats: bool = False,
) -> list[WorkloadItem]:
    """A serving trace over wiki-qa: questions drawn with Zipf(`zipf_s`) popularity (a seeded
    rank order over `num_questions` FanOutQA questions, all 310 by default). A question's first
    draw gets its BM25 top-k passages in rank order; a repeat gets k of its top 2k in a shuffled
    order (asked again, retrieved a little differently), so repeats reuse chunks at new
    positions rather than whole prompts. With `exact_repeats` retrieval is deterministic: a
    repeat is the same prompt again, the case where a prefix cache is all it takes."""
    if num_requests < 0 or k < 1 or zipf_s < 0:
        raise BadRequestError("wiki-qa-zipf needs num_requests >= 0, k >= 1 and zipf_s >= 0")
    questions = fanout_questions()
    pool = len(questions) if num_questions is None else min(num_questions, len(questions))
    if pool < 1:
        raise BadRequestError("wiki-qa-zipf needs at least one question")
    index = wiki_index(min_tokens, max_tokens)
    rng = np.random.default_rng(seed)
    by_rank = rng.permutation(len(questions))[:pool]
    weights = 1.0 / np.arange(1, pool + 1) ** zipf_s
    drawn = rng.choice(pool, size=num_requests, p=weights / weights.sum())
    seen: dict[int, int] = {}
    items: list[WorkloadItem] = []
    for n, rank in enumerate(drawn.tolist()):
        q = questions[int(by_rank[rank])]
        times = seen.get(rank, 0)
        seen[rank] = times + 1
        if times == 0 or exact_repeats:
            picked = retrieve(index, q, k)
        else:
            top = retrieve(index, q, 2 * k)
            picked = rng.choice(top, size=min(k, len(top)), replace=False).tolist()
        chunks = [Chunk(index.passages[i].text, index.passages[i].id) for i in picked]
        items.append(
            WorkloadItem(
                id=f"{q.id}-z{n}",
                request=RagRequest(q.question, chunks),
                answers=q.answers or None,
            )
        )
    return items
