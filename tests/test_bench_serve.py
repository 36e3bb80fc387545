"""The serving bench end to end against the fake OpenAI server (our modes and a fake vLLM)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from fake_openai import MODE_COMPUTED, serve_fake

from cachecraft.errors import CachecraftError
from cachecraft.model.loader import resolve_model_dir
from cachecraft.request import Chunk, RagRequest
from cachecraft_bench import serve_bench
from cachecraft_bench.item import WorkloadItem
from cachecraft_bench.serve_bench import Ramp, run_serve_bench, sustained_rate
from cachecraft_bench.serve_cli import add_bench_serve_parser, main_serve_bench


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with serve_fake() as url:
        yield url


def _items() -> list[WorkloadItem]:
    a, b, c = Chunk("Alpha is a letter."), Chunk("Beta follows alpha."), Chunk("Gamma is third.")
    return [
        WorkloadItem("0", RagRequest("first?", [a, b])),
        WorkloadItem("1", RagRequest("second?", [c])),
        WorkloadItem("2", RagRequest("first?", [a, b])),  # an exact repeat: a prefix hit
    ]


def _summary(e2e: float | None, rejected: int = 0, errors: int = 0) -> dict:
    return {"e2e_ms_p50": e2e, "num_rejected": rejected, "num_errors": errors}


def test_sustained_rate_is_the_highest_rate_within_the_bound() -> None:
    per_rate = {
        "0.1": {"prefix": _summary(100.0)},
        "0.2": {"prefix": _summary(250.0)},
        "0.4": {"prefix": _summary(301.0)},
        "0.8": {"prefix": _summary(200.0, rejected=1)},
    }
    rates = [0.4, 0.1, 0.8, 0.2]
    assert sustained_rate(per_rate, rates, "prefix", latency_bound=3.0) == 0.2
    assert sustained_rate(per_rate, rates, "prefix", latency_bound=3.1) == 0.4
    per_rate["0.1"]["prefix"] = _summary(None, errors=3)  # nothing completed at the lowest rate
    assert sustained_rate(per_rate, rates, "prefix") is None


def ramp_rates(run_at, rates: list[float], max_runs: int, latency_bound: float) -> dict:
    """One system's whole ramp, run by run, as `bench serve` drives each system's `Ramp`."""
    ramp = Ramp(rates, max_runs, latency_bound)
    while (rate := ramp.next_rate()) is not None:
        ramp.record(rate, run_at(rate))
    return ramp.runs


def test_ramp_stops_at_the_first_saturated_rate_and_doubles_past_the_ladder() -> None:
    seen: list[float] = []

    def run_at(capacity: float):
        def run(rate: float) -> dict:
            seen.append(rate)
            # past capacity a queue builds: latency grows and throughput stays at capacity
            e2e = 100.0 if rate <= capacity else 1000.0
            return _summary(e2e) | {"throughput_rps": min(rate, capacity), "offered_rps": rate}

        return run

    out = ramp_rates(run_at(1.0), [0.25, 0.5], max_runs=6, latency_bound=3.0)
    assert seen == [0.25, 0.5, 1.0, 2.0] and list(out) == ["0.25", "0.5", "1", "2"]
    seen.clear()
    out = ramp_rates(run_at(100.0), [0.5], max_runs=3, latency_bound=3.0)
    assert seen == [0.5, 1.0, 2.0]  # never saturated: stops after max_runs
    seen.clear()
    ramp_rates(run_at(0.1), [0.5, 1.0], max_runs=5, latency_bound=3.0)
    assert seen == [0.5]  # saturated from the first run: it cannot keep up with the offer
    seen.clear()

    def slow_but_keeping_up(rate: float) -> dict:
        seen.append(rate)
        return _summary(100.0 * 4 * rate) | {"throughput_rps": rate, "offered_rps": rate}

    out = ramp_rates(slow_but_keeping_up, [0.25, 1.0], max_runs=3, latency_bound=3.0)
    assert seen == [0.25, 1.0, 2.0]  # past the latency bound at 1.0 but not yet saturated
    assert out["1"]["e2e_ms_p50"] > 3.0 * out["0.25"]["e2e_ms_p50"]


def _system(seen: list, name: str, capacity: float) -> serve_bench.RunAt:
    """A fake system of `capacity` req/s: past it latency jumps 10x and throughput stays at
    capacity; every run is noted in `seen` as (name, first item id, rate)."""

    def run_at(items: list[WorkloadItem], rate: float) -> dict:
        seen.append((name, items[0].id, rate))
        e2e = 100.0 if rate <= capacity else 1000.0
        return _summary(e2e) | {"throughput_rps": min(rate, capacity), "offered_rps": rate}

    return run_at


def test_systems_take_turns_rate_by_rate_then_bursts_over_the_same_requests() -> None:
    """Systems whose ramps stop at different runs: each rate runs on every system still
    ramping before the next rate, each ramp run takes the next part of the stream, and the
    bursts go round by round, burst i replaying one part of the stream after any ramp."""
    runs = [[WorkloadItem(str(i), RagRequest(f"q{i}?", [Chunk("c")]))] for i in range(5)]
    opts = {"max_runs": 3, "latency_bound": 3.0, "bursts": 2}
    seen: list[tuple[str, str, float]] = []

    systems = {"slow": _system(seen, "slow", 0.1), "fast": _system(seen, "fast", 100.0)}
    out = serve_bench._take_turns(systems, runs, [0.5], opts)
    assert seen == [
        ("slow", "0", 0.5),  # saturated at once: its ramp ends here
        ("fast", "0", 0.5),
        ("fast", "1", 1.0),
        ("fast", "2", 2.0),
        ("slow", "3", math.inf),
        ("fast", "3", math.inf),
        ("slow", "4", math.inf),
        ("fast", "4", math.inf),
    ]
    assert list(out["slow"]) == ["0.5", "burst"] and list(out["fast"]) == ["0.5", "1", "2", "burst"]
    assert [s["throughput_rps"] for s in out["slow"]["burst"]] == [0.1, 0.1]
    seen.clear()
    out = serve_bench._take_turns(systems, runs, [0.5], opts | {"bursts": 0})
    assert all("burst" not in r for r in out.values()) and math.inf not in [r for *_, r in seen]


def test_refining_runs_bisect_between_the_common_rate_and_the_next() -> None:
    """After the ramps, every system runs at the geometric midpoint between the highest rate
    all sustained and the lowest one some system failed above it; each refining run takes its
    own part of the stream after the burst's, and a sustained midpoint raises the lower end."""
    runs = [[WorkloadItem(str(i), RagRequest(f"q{i}?", [Chunk("c")]))] for i in range(8)]
    opts = {"max_runs": 4, "latency_bound": 3.0, "bursts": 1, "refine": 2}
    seen: list[tuple[str, str, float]] = []

    systems = {n: _system(seen, n, cap) for n, cap in (("a", 1.3), ("b", 1.6), ("c", 100.0))}
    out = serve_bench._take_turns(systems, runs, [0.25, 0.5], opts)
    refined = [(name, item, rate) for name, item, rate in seen if item in ("5", "6")]
    # 1.0 sustained by all, 2.0 failed by a and b: 1.41 (a fails it), then 1.19 (all sustain)
    assert refined == [(n, "5", 1.41) for n in "abc"] + [(n, "6", 1.19) for n in "abc"]
    assert [(n, r) for n, item, r in seen if item == "4"] == [(n, math.inf) for n in "abc"]
    assert set(out["a"]) == {"0.25", "0.5", "1", "2", "1.41", "1.19", "burst"}
    per_rate = {k: {"a": v} for k, v in out["a"].items() if k != "burst"}
    assert sustained_rate(per_rate, [float(k) for k in per_rate], "a") == 1.19
    assert serve_bench.refine_rate(out, 3.0) == 1.3  # the next step would split 1.19..1.41
    # nothing to refine: a system that sustained nothing, or nobody failing above the common rate
    never = {"a": {"0.5": _summary(None, errors=1)}, "c": out["c"]}
    assert serve_bench.refine_rate(never, 3.0) is None
    assert (
        serve_bench.refine_rate({"c": {"0.5": _summary(100.0), "1": _summary(100.0)}}, 3.0) is None
    )
    assert (
        serve_bench.refine_rate({"a": {"1": _summary(100.0), "1.01": _summary(900.0)}}, 3.0) is None
    )


def test_serve_bench_per_mode_and_vllm_peer(fake_url: str) -> None:
    @contextmanager
    def fake_vllm() -> Iterator[SimpleNamespace]:
        yield SimpleNamespace(
            base_url=fake_url, model_dir=resolve_model_dir(None), model_name="p", startup_s=1.0
        )

    modes = ("full", "prefix", "cachecraft")
    result = run_serve_bench(
        {m: fake_url for m in modes},
        modes=modes,
        peer="vllm",
        rates=[2.0, 1.0],
        items=_items(),
        num_requests=3,
        max_tokens=3,
        peer_server=fake_vllm,
        max_runs=2,
    )
    assert json.loads(json.dumps(result)) == result  # JSON-clean
    assert result["rates"] == [1.0, 2.0] and set(result["per_rate"]) == {"1", "2"}
    for by_mode in result["per_rate"].values():
        assert set(by_mode) == {*modes, "vllm"}
        for mode in modes:
            s = by_mode[mode]
            assert (s["num_completed"], s["num_errors"], s["output_tokens"]) == (3, 0, 9)
            assert s["computed_fraction"] == pytest.approx(MODE_COMPUTED[mode], abs=0.01)
        # the repeat hits the fake vLLM's prefix cache (warm across runs: one salt per stream)
        cache = by_mode["vllm"]["prefix_cache"]
        assert 0 < cache["hits"] < cache["queries"] == by_mode["vllm"]["prompt_tokens"]
    assert result["chosen_rate"] in (1.0, 2.0)
    at = result["modes"]
    assert at == result["per_rate"][serve_bench.rate_key(result["chosen_rate"])]
    cc, prefix, vllm = at["cachecraft"], at["prefix"], at["vllm"]
    expected = round(prefix["e2e_ms_p50"] / cc["e2e_ms_p50"], 3)
    assert result["e2e_p50_ratio_prefix_over_cachecraft"] == expected
    tput = result["max_throughput_rps"]
    assert set(tput) == {*modes, "vllm"}
    assert set(result["burst"]) == {*modes, "vllm"}
    for m in tput:
        runs = {r: result["per_rate"][r][m]["throughput_rps"] for r in ("1", "2")}
        runs["burst"] = result["burst"][m]["throughput_rps"]
        assert result["burst"][m]["num_completed"] == 3
        each = result["burst_throughputs_rps"][m]
        assert len(each) == serve_bench.DEFAULT_BURSTS and runs["burst"] == sorted(each)[1]
        assert tput[m] == max(runs.values()) == runs[result["max_throughput_run"][m]]
        assert result["computed_tokens_per_s"][m] is not None
        assert result["work_tokens_per_s"][m] >= result["computed_tokens_per_s"][m]
    assert result["throughput_ratio_vs_vllm"] == round(tput["cachecraft"] / tput["vllm"], 3)
    for key in ("throughput_ratio_vs_prefix", "e2e_p50_ratio_vllm_over_cachecraft"):
        assert result[key] is not None
    assert result["vllm_prefix_cache"] == vllm["prefix_cache"]
    assert result["cachecraft_reused_tokens"] == cc["prompt_tokens"] - cc["computed_tokens"] > 0
    assert result["peer"] == {"name": "vllm", "startup_s": 1.0}


def test_a_fresh_server_per_mode_from_the_factory(fake_url: str) -> None:
    started: list[str] = []

    @contextmanager
    def start(mode: str) -> Iterator[str]:
        started.append(mode)
        yield fake_url

    result = run_serve_bench(
        start, rates=[10.0], items=_items()[:2], num_requests=2, max_tokens=1, max_runs=1
    )
    assert started == ["prefix", "cachecraft"]
    assert "throughput_ratio_vs_vllm" not in result and "vllm_prefix_cache" not in result
    with pytest.raises(CachecraftError, match="rates"):
        run_serve_bench(start, rates=[0.0], items=_items())
    with pytest.raises(CachecraftError, match="peer"):
        run_serve_bench(start, peer="sglang", items=_items())


def test_cli_parses_and_prints_json(fake_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    @contextmanager
    def start(mode: str) -> Iterator[str]:
        yield fake_url

    parser = argparse.ArgumentParser()
    add_bench_serve_parser(parser.add_subparsers(dest="bench"), start)
    args = parser.parse_args(["serve", "--json", "--rates", "20,40", "--requests", "2"])
    assert (args.rates, args.requests, args.peer, args.json) == ([20.0, 40.0], 2, None, True)
    for bad in ("fast", "-1", "0.1,0", "nan"):  # refused before any workload is built
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--rates", bad])
    bursts = [
        parser.parse_args(["serve", *a]).bursts for a in ([], ["--no-burst"], ["--bursts", "5"])
    ]
    assert bursts == [serve_bench.DEFAULT_BURSTS, 0, 5]

    args = parser.parse_args(
        ["serve", "--json", "--rates", "20", "--requests", "2", "--warmup", "1", "--max-runs", "1"]
    )
    assert args.func(args) == 0
    assert args.server_factory is start
    captured = capsys.readouterr()
    out = json.loads(captured.out)  # stdout stays pure JSON; progress goes to stderr
    assert "[bench serve] cachecraft: warming up with 1 requests" in captured.err
    assert "[bench serve] prefix: 20 req/s offered: 2 done" in captured.err
    assert "[bench serve] prefix: burst (all at once): 2 done" in captured.err
    assert out["config"]["num_requests"] == 2 and out["chosen_rate"] == 20.0
    assert (
        out["config"]["warmup"] == 1 and out["per_rate"]["20"]["cachecraft"]["num_completed"] == 2
    )
    assert main_serve_bench is args.func


def test_cli_dtype_starts_our_servers_and_names_vllms(
    fake_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[tuple[str, tuple[str, ...]]] = []

    @contextmanager
    def start(mode: str, extra_args: tuple[str, ...] = ()) -> Iterator[str]:
        started.append((mode, tuple(extra_args)))
        yield fake_url

    parser = argparse.ArgumentParser()
    add_bench_serve_parser(parser.add_subparsers(dest="bench"), start)
    base = ["serve", "--json", "--rates", "20", "--requests", "1", "--warmup", "0"]
    base += ["--max-runs", "1", "--no-burst", "--modes", "prefix"]
    args = parser.parse_args([*base, "--dtype", "bfloat16"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["config"]["dtype"] == "bfloat16"
    args = parser.parse_args(base)
    assert args.func(args) == 0
    assert started == [("prefix", ("--dtype", "bfloat16")), ("prefix", ())]
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--dtype", "float64"])


def test_the_stream_warms_up_then_feeds_each_run_the_next_requests() -> None:
    items = [WorkloadItem(str(i), RagRequest(f"q{i}?", [Chunk(f"c{i}")])) for i in range(7)]
    warm, runs = serve_bench.split_stream(items, warmup=2, num_requests=2, max_runs=3)
    assert [it.id for it in warm] == ["0", "1"]
    assert [[it.id for it in run] for run in runs] == [["2", "3"], ["4", "5"], ["6", "2"]]
    warm, runs = serve_bench.split_stream(items[:1], warmup=3, num_requests=2, max_runs=1)
    assert [it.id for it in warm] == ["0"] and [it.id for it in runs[0]] == ["0", "0"]


def test_warm_up_requests_are_replayed_but_not_measured(fake_url: str) -> None:
    @contextmanager
    def fake_vllm() -> Iterator[SimpleNamespace]:
        yield SimpleNamespace(
            base_url=fake_url, model_dir=resolve_model_dir(None), model_name="p", startup_s=1.0
        )

    result = run_serve_bench(
        {"cachecraft": fake_url},
        modes=("cachecraft",),
        peer="vllm",
        peer_server=fake_vllm,
        rates=[20.0],
        items=_items(),  # warm-up: requests 0 and 1; the run: request 2, a repeat of 0
        num_requests=1,
        warmup=2,
        max_tokens=2,
        max_runs=1,
        seed=7,  # a cache salt no other test used
    )
    run = result["per_rate"]["20"]
    assert result["config"]["warmup"] == 2
    assert run["cachecraft"]["num_completed"] == run["vllm"]["num_completed"] == 1
    cache = run["vllm"]["prefix_cache"]  # the run's own request only, a hit thanks to warm-up
    assert 0 < cache["hits"] < cache["queries"] == run["vllm"]["prompt_tokens"]


def test_the_median_burst_is_a_run_that_happened() -> None:
    runs = [{"throughput_rps": t, "id": i} for i, t in enumerate((2.0, 1.0, 3.0, 1.5))]
    assert serve_bench.median_run(runs[:3])["id"] == 0  # 1.0 2.0 3.0
    assert serve_bench.median_run(runs)["id"] == 3  # the lower middle of 1.0 1.5 2.0 3.0
    assert serve_bench.median_run(runs[1:2])["id"] == 1
