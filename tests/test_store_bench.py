"""Store benchmark: shape of the result and the flood behaviour on a small deterministic trace."""

from __future__ import annotations

import argparse
import json

import pytest

from cachecraft_bench.store_bench import (
    TraceConfig,
    add_bench_store_parser,
    make_trace,
    run_store_bench,
    zipf_exponent,
)


def test_zipf_exponent_puts_the_mass_on_top() -> None:
    s = zipf_exponent(1000, 50, 0.6)
    w = [r**-s for r in range(1, 1001)]
    assert sum(w[:50]) / sum(w) == pytest.approx(0.6, abs=1e-6)


def test_trace_phases_and_flood() -> None:
    cfg = TraceConfig(num_chunks=100, requests_per_phase=50)
    trace = make_trace(cfg)
    assert len(trace) == 150 and all(len(set(c)) == 5 for _, c in trace)
    novel = [k for phase, c in trace for k in c if k.startswith("n")]
    assert novel and all(p == "flood" for p, c in trace for k in c if k.startswith("n"))
    assert len(novel) == len(set(novel))  # one-off chunks


def test_value_policy_keeps_hot_set_through_the_flood() -> None:
    out = run_store_bench(TraceConfig(num_chunks=300, requests_per_phase=300))
    pol = out["policies"]
    assert set(pol) == {"value", "lru", "lfu", "lru+doorkeeper"}  # type: ignore[arg-type]
    value, lru = pol["value"], pol["lru"]  # type: ignore[index]
    assert value["phases"]["flood"]["hit_rate"] > lru["phases"]["flood"]["hit_rate"]
    assert value["tokens_computed"] < lru["tokens_computed"]
    assert out["savings_ratio_value_vs_lru"] > 1.0
    for r in pol.values():  # type: ignore[union-attr]
        assert 0.0 <= r["hit_rate"] <= 1.0
        assert r["tokens_computed"] <= r["tokens_total"]


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_bench_store_parser(parser.add_subparsers())
    args = parser.parse_args(["store", "--json", "--requests-per-phase", "20"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"]["requests"] == 60 and "savings_ratio_value_vs_lru" in out
