"""The invented-fact workloads (exact gold, deterministic, chunks that recur) and the tuning /
report sets (disjoint seeds and wiki-qa questions; `bench quality --set` picks them)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from cachecraft.cli import main as cli_main
from cachecraft_bench.eval_sets import SHAPES, question_set, seed_set, set_shapes, set_workloads
from cachecraft_bench.facts import long_doc, many_short, two_hop
from cachecraft_bench.item import WorkloadItem
from cachecraft_bench.metrics import contains_answer
from cachecraft_bench.sources import fanout_questions
from cachecraft_bench.wiki_qa import wiki_qa


def _holding(item: WorkloadItem) -> list[int]:
    """Positions of the chunks that hold the gold answer."""
    gold = item.answers[0]
    return [i for i, c in enumerate(item.request.chunks) if contains_answer(c.text, [gold])]


@pytest.mark.parametrize("make", [two_hop, many_short, long_doc])
def test_fact_workloads_are_deterministic_and_chunks_recur(make) -> None:
    items = make(24, seed=1000)
    assert items == make(24, seed=1000)
    assert items != make(24, seed=1001)
    uses = Counter(c.id for it in items for c in it.request.chunks)
    assert max(uses.values()) >= 3  # a chunk cache has something to serve
    for it in items:
        assert len(it.answers) == 1 and _holding(it)  # the gold answer is in the passages
        texts = [c.text for c in it.request.chunks]
        assert len(set(texts)) == len(texts)


def test_two_hop_answer_needs_both_chunks() -> None:
    for it in two_hop(16, seed=3):
        name = it.request.question.split("designer of the ")[1].split(" born?")[0]
        place = [c.text for c in it.request.chunks if c.text.startswith(f"The {name} ")]
        assert len(place) == 1 and not contains_answer(place[0], it.answers)  # hop one
        designer = place[0].split("designed by ")[1].split(" and opened")[0]
        person = [c.text for c in it.request.chunks if c.text.startswith(designer)]
        assert len(person) == 1 and contains_answer(person[0], it.answers)  # hop two


def test_long_doc_windows_are_consecutive_sections_in_order() -> None:
    for it in long_doc(16, k=4, sections=8, seed=5):
        doc, first = it.request.chunks[0].id.rsplit("-s", 1)
        ids = [c.id for c in it.request.chunks]
        assert ids == [f"{doc}-s{int(first) + j}" for j in range(4)]


def test_many_short_chunks_are_short() -> None:
    items = many_short(10, k=12, seed=7)
    assert {len(it.request.chunks) for it in items} == {12}
    assert max(len(c.text.split()) for it in items for c in it.request.chunks) < 45


def test_sets_split_seeds_and_questions() -> None:
    assert seed_set(0) == "tuning" and seed_set(999) == "tuning" and seed_set(1000) == "report"
    sets = Counter(question_set(q.id) for q in fanout_questions())
    assert sets["tuning"] + sets["report"] == 310 and min(sets.values()) > 120
    report = wiki_qa(12, seed=1000, questions="report", num_questions=4)
    assert {question_set(it.id.split("-r")[0]) for it in report} == {"report"}
    assert len({it.request.question for it in report}) == 4  # asked three times each
    assert set_shapes("report")[0] == 1000 and set_shapes("tuning")[0] == 0
    assert {s.name for s in SHAPES["report"]} > {s.name for s in SHAPES["tuning"]}


def test_set_workloads_are_the_shapes_at_the_set_seed() -> None:
    runs = set_workloads("report", requests=6, warmup=2)
    assert [name for name, _, _ in runs] == [s.name for s in SHAPES["report"]]
    assert all(len(items) == 6 and warmup == 2 for _, items, warmup in runs)
    two = dict((name, items) for name, items, _ in runs)["two-hop"]
    assert two == two_hop(6, seed=1000)


def test_bench_quality_set_runs_every_shape(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from cachecraft_bench import eval_sets

    small = (eval_sets.Shape("two-hop", "two-hop"), eval_sets.Shape("long-doc", "long-doc"))
    monkeypatch.setitem(eval_sets.SHAPES, "tuning", small)
    args = ["bench", "quality", "--set", "tuning", "--model", str(tiny_dir), "--requests", "3"]
    args += ["--warmup", "1", "--max-tokens", "2", "--modes", "full,naive", "--no-progress"]
    assert cli_main([*args, "--json", "--store-mib", "64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["workload"] for s in out] == ["two-hop", "long-doc"]
    assert all(s["requests"] == 3 and s["modes"]["full"]["n"] == 2 for s in out)
    assert all(s["modes"]["full"]["contains_vs_gold"] is not None for s in out)
