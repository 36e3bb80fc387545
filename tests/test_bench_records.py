"""Slim per-request records: a real `bench quality` run on the tiny model, slimmed and expanded
back, gives the paired comparisons the full records give, runs pool without clashing, and
`bench records` keeps and pools them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachecraft.cli import main
from cachecraft.model.loader import LoadedModel
from cachecraft_bench.paired import kl_removed, paired_difference
from cachecraft_bench.quality import run_quality
from cachecraft_bench.records import SLIM_KEYS, expand, slim
from cachecraft_bench.workloads import build_workload


@pytest.fixture(scope="module")
def results(tiny: LoadedModel) -> dict:
    items = build_workload("two-hop", 5, seed=3)
    arms = ["full", "naive", "cachecraft", "epic"]
    return run_quality(tiny, items, arms, warmup=1, max_tokens=3, progress=False, workload="wl")


def test_slim_records_give_the_same_comparisons(results: dict) -> None:
    small = json.loads(json.dumps(slim(results)))  # what a file gives back
    records = results["workloads"]["wl"]["requests"]
    assert small["wl"]["ids"] == [r["id"] for r in records["full"]]
    assert set(small["wl"]["arms"]["epic"]) == set(SLIM_KEYS)
    pooled = expand({"a": small["wl"]})
    assert [r["id"] for r in pooled["naive"]] == [f"a:{r['id']}" for r in records["naive"]]
    for arm in ("naive", "epic"):
        want = paired_difference(records[arm], records["cachecraft"], "tf_kl")
        got = paired_difference(pooled[arm], pooled["cachecraft"], "tf_kl")
        assert got["n"] == want["n"] == 4
        assert got["mean"] == pytest.approx(want["mean"], rel=1e-4, abs=1e-9)
    want = kl_removed(records["epic"], records["naive"])
    got = kl_removed(pooled["epic"], pooled["naive"])
    assert got["worse"] == want["worse"]
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-3, abs=1e-6)


def test_runs_pool_and_arms_must_hold_the_same_requests(results: dict) -> None:
    small = slim(results)["wl"]
    pooled = expand({"a": small, "b": small})
    assert len(pooled["epic"]) == 8 and len({r["id"] for r in pooled["epic"]}) == 8
    d = paired_difference(pooled["epic"], pooled["cachecraft"], "tf_kl")
    assert d["n"] == 8
    broken = json.loads(json.dumps(results))
    broken["workloads"]["wl"]["requests"]["epic"].reverse()
    with pytest.raises(ValueError, match="other requests"):
        slim(broken)


@pytest.fixture
def run(results: dict, tmp_path: Path) -> Path:
    """`results` written as a run's results.json."""
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    return path


def test_the_records_command_adds_pools_and_refuses_bad_input(
    results: dict, run: Path, tmp_path: Path, capsys
) -> None:
    file = tmp_path / "records.json"
    assert main(["bench", "records", str(file), "--add", f"a={run}", "--add", f"b={run}"]) == 0
    assert set(json.loads(file.read_text())) == {"a", "b"}
    capsys.readouterr()
    assert main(["bench", "records", str(file), "--pool", "a,b", "--against", "epic"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("8 requests from a, b")
    row = next(line for line in out.splitlines() if line.startswith("cachecraft "))
    assert "worse" in row and "epic minus it" in row
    for argv, message in (
        (["--pool", "a,c"], "no entries ['c']"),
        (["--pool", "a", "--against", "nope"], "--against 'nope'"),
        (["--add", "a"], "NAME=RESULTS.json"),
        (["--add", f"c={tmp_path / 'none.json'}"], "does not exist"),
        ([], "--add NAME=RESULTS.json or --pool"),
    ):
        assert main(["bench", "records", str(file), *argv]) == 2
        assert message in capsys.readouterr().err


def test_add_joins_the_arms_of_a_later_run_of_the_same_requests(
    results: dict, run: Path, tmp_path: Path, capsys
) -> None:
    file = tmp_path / "records.json"
    assert main(["bench", "records", str(file), "--add", f"a={run}"]) == 0
    other = json.loads(json.dumps(results))  # the same requests again, with another arm
    requests = other["workloads"]["wl"]["requests"]
    requests["epic-late"] = requests.pop("epic")
    del requests["cachecraft"]
    run2 = tmp_path / "later.json"
    run2.write_text(json.dumps(other))
    assert main(["bench", "records", str(file), "--add", f"a={run2}"]) == 0
    arms = json.loads(file.read_text())["a"]["arms"]
    assert set(arms) == {"full", "naive", "cachecraft", "epic", "epic-late"}
    assert arms["epic-late"] == arms["epic"]
    fewer = json.loads(json.dumps(results))  # other requests: the entry is replaced
    for records in fewer["workloads"]["wl"]["requests"].values():
        records.pop()
    run3 = tmp_path / "fewer.json"
    run3.write_text(json.dumps(fewer))
    assert main(["bench", "records", str(file), "--add", f"d={run3}", "--add", f"d={run2}"]) == 0
    assert set(json.loads(file.read_text())["d"]["arms"]) == {"full", "naive", "epic-late"}
    changed = json.loads(json.dumps(other))  # the same requests, a naive arm that differs
    changed["workloads"]["wl"]["requests"]["naive"][0]["tf_kl"] += 1.0
    run4 = tmp_path / "changed.json"
    run4.write_text(json.dumps(changed))
    before = file.read_text()
    assert main(["bench", "records", str(file), "--add", f"a={run4}"]) == 2
    assert "other records for ['naive']" in capsys.readouterr().err
    assert file.read_text() == before
