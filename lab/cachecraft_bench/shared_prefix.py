"""The shared-prefix workload: vLLM's prefix-caching benchmark shape over real text.

Each request is one long user message: one of a few shared beginnings (Wikipedia passages run
together into one paragraph, ~1,500 tokens) followed by a FanOutQA question of its own. There
are no documents and nothing for the server to cut into paragraphs, so only a prefix cache can
reuse the beginning (vLLM's, or ours: the question's leading blocks, `reuse/layout.py`).
"""

from __future__ import annotations

import numpy as np

from cachecraft.errors import BadRequestError
from cachecraft.request import RagRequest
from cachecraft_bench.item import WorkloadItem, estimate_tokens
from cachecraft_bench.sources import fanout_questions
from cachecraft_bench.wiki_qa import wiki_passages


def shared_prefix(
    num_requests: int, seed: int = 0, num_prefixes: int = 4, prefix_tokens: int = 1500
) -> list[WorkloadItem]:
    """`num_requests` requests, each a uniformly drawn beginning of about `prefix_tokens`
    tokens (whole passages, one paragraph) and a question drawn from FanOutQA's."""
    if num_requests < 0 or num_prefixes < 1 or prefix_tokens < 1:
        raise BadRequestError("shared-prefix needs requests >= 0, prefixes >= 1, tokens >= 1")
    rng = np.random.default_rng(seed)
    passages = wiki_passages()
    order = rng.permutation(len(passages)).tolist()
    prefixes = []
    for _ in range(num_prefixes):
        texts: list[str] = []
        size = 0
        while size < prefix_tokens:
            texts.append(" ".join(passages[order.pop()].text.split()))
            size += estimate_tokens(texts[-1])
        prefixes.append(" ".join(texts))
    questions = fanout_questions()
    items = []
    for n in range(num_requests):
        p = int(rng.integers(num_prefixes))
        q = questions[int(rng.integers(len(questions)))]
        text = f"{prefixes[p]} Answer from the text above: {q.question}"
        items.append(WorkloadItem(f"p{p}/{n}", RagRequest(text), q.answers or None))
    return items
