"""Built-in workloads at tiny sizes (counts, chunk sizes, determinism, skew) and the JSONL format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachecraft.errors import BadRequestError
from cachecraft.request import Chunk, RagRequest
from cachecraft_bench.item import estimate_tokens, split_sentences
from cachecraft_bench.sources import fanout_questions, flatten_answer, iter_sharegpt
from cachecraft_bench.workloads import (
    WorkloadItem,
    build_workload,
    chunk_popularity,
    load_workload_file,
    sharegpt,
    synthetic,
    wiki_qa,
    write_workload_file,
)

SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "wiki_qa_sample.jsonl"


def _signature(items: list[WorkloadItem]) -> list:
    return [(it.id, [c.text for c in it.request.chunks], it.request.question) for it in items]


def test_wiki_qa_shape_lengths_answers():
    items = wiki_qa(12, k=5, seed=0)
    assert len(items) == 12 and len({it.id for it in items}) == 12
    for it in items:
        assert len(it.request.chunks) == 5
        assert it.answers and all(isinstance(a, str) and a for a in it.answers)
        for c in it.request.chunks:
            assert 100 <= estimate_tokens(c.text) <= 300 + 5  # +title line rounding
            assert c.id and c.text.startswith(c.id.split("#")[0] + "\n")
    assert _signature(wiki_qa(12, seed=0)) == _signature(items)
    assert _signature(wiki_qa(12, seed=1)) != _signature(items)


def test_wiki_qa_reuses_questions_beyond_310():
    n = len(fanout_questions())
    assert n == 310
    items = wiki_qa(n + 3, k=3, seed=0)
    assert len(items) == n + 3
    assert items[n].id.endswith("-r1") and all(len(it.request.chunks) == 3 for it in items[n:])


def test_wiki_qa_boosts_evidence_titles():
    # the question names "Taj Mahal" and "Empire State Building", both wiki titles
    q = next(q for q in fanout_questions() if "Empire State Building" in q.question)
    item = next(it for it in wiki_qa(310, k=5) if it.request.question == q.question)
    ids = [c.id for c in item.request.chunks]
    assert "Empire State Building" in ids and "Taj Mahal" in ids


def test_flatten_answer():
    assert flatten_answer({"a": "x", "b": ["y", 3], "c": True}) == ["x", "y", "3", "True"]
    assert flatten_answer("  ") == [] and flatten_answer(None) == []


def test_synthetic_shape_lengths_determinism():
    items = synthetic(30, num_chunks=40, k=4, chunk_tokens=(128, 512), seed=0)
    assert len(items) == 30
    for it in items:
        texts = [c.text for c in it.request.chunks]
        assert len(texts) == 4 and len(set(texts)) == 4
        assert all(120 <= estimate_tokens(t) <= 512 for t in texts)
        # the gold title is an article of one of the chunks
        assert any(t.startswith(it.answers[0] + "\n") or f"\n{it.answers[0]}\n" in t for t in texts)
    assert _signature(synthetic(30, num_chunks=40, k=4, seed=0)) == _signature(items)
    assert _signature(synthetic(30, num_chunks=40, k=4, seed=1)) != _signature(items)


def test_synthetic_permute_repeats_chunk_sets_in_new_orders():
    items = synthetic(20, k=4, chunk_tokens=(64, 128), seed=0, permute=True)
    assert len(items) == 20
    sets: dict[frozenset[str], list[tuple[str, ...]]] = {}
    for it in items:
        ids = tuple(c.id for c in it.request.chunks)
        assert len(set(ids)) == 4
        sets.setdefault(frozenset(ids), []).append(ids)
    assert len(sets) == 5  # ceil(20 / 4) disjoint sets, each used 4 times
    assert all(len(uses) == 4 for uses in sets.values())
    assert len(set().union(*sets)) == 20  # disjoint
    assert all(len(set(uses)) > 1 for uses in sets.values())  # orders change
    again = synthetic(20, k=4, chunk_tokens=(64, 128), seed=0, permute=True)
    assert _signature(again) == _signature(items)


def test_synthetic_skew_top5_percent_in_60_percent_of_requests():
    items = synthetic(2000, num_chunks=300, k=5, chunk_tokens=(128, 256), seed=0)
    share = chunk_popularity(items, top_fraction=0.05)
    assert 0.5 <= share <= 0.7
    # chunks recur in new orders: some pair of requests share a chunk at different slots
    slots: dict[str, set[int]] = {}
    for it in items[:200]:
        for j, c in enumerate(it.request.chunks):
            slots.setdefault(c.text, set()).add(j)
    assert max(len(s) for s in slots.values()) >= 3


def test_sharegpt_shape_arrivals_determinism():
    items = sharegpt(25, seed=0, chunk_tokens=128, max_chunks=6, rate_per_s=2.0)
    assert len(items) == 25
    arrivals = [it.arrival_s for it in items]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    for it in items:
        assert len(it.request.chunks) <= 6
        assert all(estimate_tokens(c.text) <= 128 + 2 for c in it.request.chunks)
        assert estimate_tokens(it.request.question) <= 256 + 2
    assert any(it.request.chunks for it in items)
    assert _signature(sharegpt(25, seed=0, chunk_tokens=128, max_chunks=6)) == _signature(items)


def test_sharegpt_parser_stops_at_truncation():
    records = list(iter_sharegpt(limit=5))
    assert len(records) == 5 and all("conversations" in r for r in records)


def test_split_sentences_balanced():
    text = " ".join(f"Sentence {i} has exactly six words." for i in range(50))
    pieces = split_sentences(text, 300)
    assert len(pieces) == 2 and abs(len(pieces[0].split()) - len(pieces[1].split())) <= 6
    assert " ".join(pieces) == text


def test_workload_file_round_trip(tmp_path):
    items = [
        WorkloadItem("a", RagRequest("Q1?", [Chunk("one", "c1"), Chunk("two")]), ("x", "y"), 0.5),
        WorkloadItem("b", RagRequest("Q2?", [], system="Be brief.", namespace="t1")),
    ]
    path = write_workload_file(items, tmp_path / "sub" / "w.jsonl")
    assert load_workload_file(path) == items
    assert build_workload(str(path), 1) == items[:1]


def test_sample_file_is_wiki_qa_output():
    items = load_workload_file(SAMPLE)
    assert len(items) == 10 and SAMPLE.stat().st_size < 100_000
    assert _signature(items) == _signature(wiki_qa(10, seed=0))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: bad JSON"),
        ('{"chunks": []}', "line 2: missing field 'question'"),
        ('{"question": "q"}', "line 2: missing field 'chunks'"),
        ('{"question": "q", "chunks": [{"id": "x"}]}', "chunk 0 is missing field 'text'"),
        ('{"question": " ", "chunks": []}', "line 2: the question is empty"),
        ('{"question": "q", "chunks": [], "answers": [1]}', "'answers' must be a list of strings"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_workload_file_errors(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "ok?", "chunks": ["c"]}) + "\n" + line + "\n")
    with pytest.raises(BadRequestError, match=message):
        load_workload_file(path)


def test_build_workload_dispatch_and_errors(tmp_path):
    assert len(build_workload("synthetic", 3, seed=0, num_chunks=10, k=2)) == 3
    with pytest.raises(BadRequestError, match="unknown workload 'nope'"):
        build_workload("nope", 3)
    with pytest.raises(BadRequestError, match="does not exist"):
        build_workload(str(tmp_path / "missing.jsonl"), 3)
    with pytest.raises(BadRequestError, match="unexpected keyword"):
        build_workload("synthetic", 3, colour="red")


def test_wiki_qa_zipf_repeats_popular_questions_with_reordered_passages():
    from collections import Counter

    from cachecraft_bench.wiki_qa import wiki_qa_zipf

    items = wiki_qa_zipf(30, seed=0, zipf_s=1.2, num_questions=10)
    counts = Counter(it.request.question for it in items)
    assert len(counts) <= 10 and counts.most_common(1)[0][1] >= 5  # Zipf: a hot question
    hot = counts.most_common(1)[0][0]
    runs = [[c.id for c in it.request.chunks] for it in items if it.request.question == hot]
    assert all(len(r) == 5 and len(set(r)) == 5 for r in runs)
    assert len({tuple(r) for r in runs}) > 1  # repeats come back in new orders / company
    assert _signature(wiki_qa_zipf(30, seed=0, zipf_s=1.2, num_questions=10)) == _signature(items)
    with pytest.raises(BadRequestError):
        wiki_qa_zipf(3, zipf_s=-1.0)


def test_exact_repeats_come_back_as_the_same_prompt():
    """`bench serve --workload repeats`: the same draws of questions, but a repeat retrieves
    the same passages in the same order, so a prefix cache serves it whole."""
    from cachecraft_bench.wiki_qa import wiki_qa_zipf

    items = wiki_qa_zipf(30, seed=0, zipf_s=1.2, num_questions=10, exact_repeats=True)
    shuffled = wiki_qa_zipf(30, seed=0, zipf_s=1.2, num_questions=10)
    assert [it.request.question for it in items] == [it.request.question for it in shuffled]
    by_question: dict[str, set] = {}
    for it in items:
        by_question.setdefault(it.request.question, set()).add(it.request)
    assert all(len(requests) == 1 for requests in by_question.values())
    assert len(by_question) < len(items)  # there are repeats


def test_shared_prefix_requests_share_long_beginnings_and_nothing_else():
    from cachecraft_bench.shared_prefix import shared_prefix

    items = shared_prefix(12, seed=3, num_prefixes=2, prefix_tokens=300)
    assert items == shared_prefix(12, seed=3, num_prefixes=2, prefix_tokens=300)
    beginnings = {it.request.question.split(" Answer from the text above: ")[0] for it in items}
    assert len(beginnings) == 2 and all(estimate_tokens(b) >= 300 for b in beginnings)
    for it in items:  # one paragraph, no documents: only a prefix cache can reuse it
        assert it.request.chunks == () and "\n" not in it.request.question
    with pytest.raises(BadRequestError):
        shared_prefix(1, num_prefixes=0)
