"""Paired comparisons (bench/paired.py) and `bench report` on hand-made per-request records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachecraft.errors import BadRequestError
from cachecraft_bench.merge import merge_results
from cachecraft_bench.paired import kl_removed, paired_difference, paired_summary
from cachecraft_bench.report import write_report
from cachecraft_bench.report_cli import load_results, refresh


def _records(tf_kl: list[float], rouge: float = 1.0) -> list[dict]:
    return [{"id": f"r{i}", "tf_kl": v, "rouge_l": rouge} for i, v in enumerate(tf_kl)]


def test_paired_difference_matches_by_id_and_counts_wins() -> None:
    ref = _records([0.1, 0.2, 0.3, 0.4])
    arm = list(reversed(_records([0.2, 0.2, 0.5, 0.3])))  # order must not matter
    d = paired_difference(arm, ref, "tf_kl")
    assert d["n"] == 4
    assert d["mean"] == pytest.approx((0.1 + 0.0 + 0.2 - 0.1) / 4)
    assert d["ci95"][0] <= d["mean"] <= d["ci95"][1]
    assert d["ref_lower"] == 0.5  # r0 and r2; r1 is a tie, r3 the arm wins
    missing = paired_difference(arm[:2], ref, "tf_kl")  # only r3, r2 shared
    assert missing["n"] == 2


def test_kl_removed_is_one_minus_ratio_of_means() -> None:
    naive = _records([0.4, 0.2, 0.6])
    arm = _records([0.1, 0.1, 0.1])
    r = kl_removed(arm, naive)
    assert r["mean"] == pytest.approx(1 - 0.3 / 1.2)
    assert 0 <= r["ci95"][0] <= r["mean"] <= r["ci95"][1] <= 1
    assert kl_removed(arm, _records([0.0, 0.0, 0.0]))["mean"] is None
    assert r["worse"] == 0
    # one request left further off than naive's: counted, whatever the ratio of means says
    tail = kl_removed(_records([0.1, 0.1, 0.7]), naive)
    assert tail["worse"] == 1 and tail["mean"] == pytest.approx(1 - 0.9 / 1.2)


def test_paired_summary_and_report_refresh(tmp_path: Path) -> None:
    requests = {
        "full": _records([0, 0, 0]),
        "cachecraft": _records([0.1, 0.1, 0.2], rouge=0.9),
        "naive": _records([0.4, 0.3, 0.5], rouge=0.5),
        "epic": _records([0.1, 0.2, 0.6], rouge=0.8),
    }
    s = paired_summary(requests)
    assert set(s["arms"]) == {"naive", "epic"}
    assert s["arms"]["naive"]["rouge_l"]["mean"] == pytest.approx(-0.4)
    assert s["kl_removed"]["cachecraft"]["mean"] == pytest.approx(1 - 0.4 / 1.2)
    assert paired_summary({"full": requests["full"]}) == {}

    results = {"config": {}, "workloads": {"w": {"modes": dict.fromkeys(requests, {}),
                                                  "requests": requests}}}  # fmt: skip
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    write_report(refresh(load_results(str(path))), tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "### Paired with `cachecraft`" in report
    assert "| epic | +0.1667" in report and "0.67 [" in report
    rows = {line.split(" | ")[0]: line for line in report.splitlines() if line.startswith("| ")}
    assert "| 1/3 |" in rows["| epic"] and "| 0/3 |" in rows["| cachecraft"]  # worse than naive
    path.write_text("{}")
    with pytest.raises(BadRequestError, match="no 'workloads'"):
        load_results(str(path))
    with pytest.raises(BadRequestError, match="does not exist"):
        load_results(str(tmp_path / "nope.json"))


def _shard(ids: range, seed: int) -> dict:
    def recs(scale: float) -> list[dict]:
        return [
            {"id": f"s{seed}-{i}", "tf_kl": scale * i, "rouge_l": 1 - scale, "ttft_ms": 10.0 * i}
            for i in ids
        ]

    requests = {"full": recs(0.0), "cachecraft": recs(0.01), "naive": recs(0.03)}
    modes = {arm: {"storage_bytes": 100 * (seed + 1)} for arm in requests}
    return {"config": {"requests": len(ids), "reuse": {"seed": seed}},
            "workloads": {"w": {"modes": modes, "requests": requests}}}  # fmt: skip


def test_merge_pools_the_records_of_shards() -> None:
    merged = merge_results([_shard(range(0, 4), 0), _shard(range(4, 10), 1)], ["a", "b"])
    assert merged["config"]["requests"] == 10 and merged["config"]["seeds"] == [0, 1]
    w = merged["workloads"]["w"]
    cc = w["modes"]["cachecraft"]
    assert cc["n"] == 10 and cc["tf_kl"]["mean"] == pytest.approx(0.01 * 4.5)
    assert cc["ttft_p50_ms"]["mean"] == pytest.approx(45.0)  # the pooled median, not a mean
    assert cc["storage_bytes"] == 150  # per-run storage: the shards' mean
    assert w["paired"]["kl_removed"]["cachecraft"]["mean"] == pytest.approx(1 - 1 / 3)
    with pytest.raises(BadRequestError, match="appears in two shards"):
        merge_results([_shard(range(3), 0), _shard(range(3), 0)], ["a", "b"])
    other = _shard(range(3, 6), 1)
    del other["workloads"]["w"]["requests"]["naive"]
    with pytest.raises(BadRequestError, match="same arms"):
        merge_results([_shard(range(3), 0), other], ["a", "b"])


def test_merge_refuses_shards_of_different_configurations() -> None:
    """Requests and seeds may differ between shards; any other setting may not (pooling a
    run at one alpha with one at another would report an experiment nobody ran)."""
    a, b = _shard(range(0, 3), 0), _shard(range(3, 6), 1)
    a["config"] |= {"model": "tiny", "max_tokens": 8}
    b["config"] |= {"model": "tiny", "max_tokens": 8}
    a["config"]["reuse"]["alpha"] = b["config"]["reuse"]["alpha"] = 0.5
    assert merge_results([a, b], ["a", "b"])["config"]["seeds"] == [0, 1]
    b["config"]["reuse"]["alpha"] = 0.7
    b["config"]["max_tokens"] = 128
    with pytest.raises(BadRequestError, match="different configurations") as err:
        merge_results([a, b], ["a.json", "b.json"])
    assert "reuse.alpha: 0.5 in a.json, 0.7 in b.json" in str(err.value)
    assert "max_tokens: 8 in a.json, 128 in b.json" in str(err.value)


def test_answers_vs_gold_are_paired_with_full() -> None:
    def recs(f1: list[float]) -> list[dict]:
        return [
            {"id": f"r{i}", "tf_kl": 0.1, "f1": v, "em": float(v == 1), "contains": float(v > 0)}
            for i, v in enumerate(f1)
        ]

    requests = {
        "full": recs([1.0, 0.5, 0.0, 1.0]),
        "naive": recs([0.0, 0.5, 0.0, 0.5]),
        "cachecraft": recs([1.0, 0.5, 0.0, 1.0]),
    }
    vs_full = paired_summary(requests)["vs_full"]
    assert set(vs_full) == {"naive", "cachecraft"}
    assert vs_full["naive"]["f1"]["mean"] == pytest.approx(-1.5 / 4)
    assert vs_full["naive"]["em"]["mean"] == pytest.approx(-2 / 4)
    assert vs_full["cachecraft"]["contains"]["mean"] == 0.0
    no_gold = {k: [{**r, "f1": None} for r in v] for k, v in requests.items()}
    assert paired_summary(no_gold)["vs_full"] == {}


def test_ttft_over_full_is_a_median_of_per_request_ratios(tmp_path: Path) -> None:
    def recs(ttft: list[float]) -> list[dict]:
        return [{"id": f"r{i}", "tf_kl": 0.1, "ttft_ms": t} for i, t in enumerate(ttft)]

    # one long prompt (r3): a ratio of means would follow it, the median of ratios does not
    requests = {
        "full": recs([100.0, 200.0, 300.0, 10_000.0]),
        "naive": recs([10.0, 20.0, 30.0, 1_000.0]),
        "cachecraft": recs([50.0, 100.0, 150.0, 9_000.0]),
    }
    ttft = paired_summary(requests)["ttft_vs_full"]
    assert set(ttft) == {"naive", "cachecraft"}
    assert ttft["naive"]["median"] == pytest.approx(0.1) and ttft["naive"]["n"] == 4
    assert ttft["cachecraft"]["median"] == pytest.approx(0.5)
    lo, hi = ttft["cachecraft"]["ci95"]
    assert 0.5 <= lo <= 0.5 <= hi <= 0.9
    # without the reference arm the ratios are still there, and nothing else is
    alone = paired_summary({k: v for k, v in requests.items() if k != "cachecraft"})
    assert set(alone) == {"ttft_vs_full"} and alone["ttft_vs_full"]["naive"]["n"] == 4
    untimed = {k: [{**r, "ttft_ms": None} for r in v] for k, v in requests.items()}
    assert paired_summary(untimed)["ttft_vs_full"] == {}
    workloads = {"w": {"modes": {}, "paired": paired_summary(requests)}}
    write_report({"config": {}, "workloads": workloads}, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "| cachecraft | 0.500x [" in report and "| naive | 0.100x [" in report
