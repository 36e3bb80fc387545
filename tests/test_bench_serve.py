"""The serving bench end to end against the fake OpenAI server (our modes and a fake vLLM)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import pytest
from fake_openai import MODE_COMPUTED, serve_fake

from cachecraft.errors import CachecraftError
from cachecraft.model.loader import resolve_model_dir
from cachecraft.request import Chunk, RagRequest
from cachecraft_bench import serve_bench
from cachecraft_bench.item import WorkloadItem
from cachecraft_bench.peer_vllm import PeerConfig
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
        tput = min(rate, capacity)
        return _summary(e2e) | {"throughput_rps": tput, "offered_rps": rate, "e2e_ms": [e2e]}

    return run_at


def _parts(n: int) -> list[list[WorkloadItem]]:
    return [[WorkloadItem(str(i), RagRequest(f"q{i}?", [Chunk("c")]))] for i in range(n)]


def test_systems_take_turns_run_by_run_then_bursts_then_fractions_of_capacity() -> None:
    """Systems whose ramps stop at different points: each point's repeats run on every system
    still ramping, run by run, each over its own part of the stream (the same parts on every
    system); then the bursts round by round; then each system at half its own capacity."""
    opts = {"max_runs": 3, "latency_bound": 3.0, "bursts": 2, "repeats": 2, "fractions": (0.5,)}
    assert serve_bench.Parts.of(opts).total == 3 * 2 + 2 + 2
    seen: list[tuple[str, str, float]] = []
    systems = {"slow": _system(seen, "slow", 0.1), "fast": _system(seen, "fast", 100.0)}
    out = serve_bench._take_turns(systems, _parts(10), [0.5], opts)
    assert seen == [
        ("slow", "0", 0.5),  # saturated at once: its ramp ends after this point
        ("fast", "0", 0.5),
        ("slow", "1", 0.5),  # the point's second run: the next part, on both
        ("fast", "1", 0.5),
        ("fast", "2", 1.0),
        ("fast", "3", 1.0),
        ("fast", "4", 2.0),
        ("fast", "5", 2.0),
        ("slow", "6", math.inf),
        ("fast", "6", math.inf),
        ("slow", "7", math.inf),
        ("fast", "7", math.inf),
        ("slow", "8", 0.05),  # half of each one's own capacity: 0.1 and 100
        ("fast", "8", 50.0),
        ("slow", "9", 0.05),
        ("fast", "9", 50.0),
    ]
    assert list(out["slow"]) == ["0.5", "burst", "fractions"]
    assert list(out["fast"]) == ["0.5", "1", "2", "burst", "fractions"]
    assert out["fast"]["2"]["num_runs"] == 2 and out["slow"]["0.5"]["throughput_rps"] == 0.1
    assert [s["throughput_rps"] for s in out["slow"]["burst"]] == [0.1, 0.1]
    assert out["fast"]["fractions"]["0.5"]["offered_rps"] == 50.0
    seen.clear()
    out = serve_bench._take_turns(systems, _parts(10), [0.5], opts | {"bursts": 0})
    assert all("burst" not in r for r in out.values()) and math.inf not in [r for *_, r in seen]


def test_refining_points_bisect_between_the_common_rate_and_the_next() -> None:
    """After the ramps, every system runs at the geometric midpoint between the highest rate
    all sustained and the lowest one some system failed above it; each refining point takes
    its own parts of the stream (after the ramp's, before the bursts'), and a sustained
    midpoint raises the lower end."""
    opts = {"max_runs": 4, "latency_bound": 3.0, "bursts": 1, "refine": 2}
    seen: list[tuple[str, str, float]] = []

    systems = {n: _system(seen, n, cap) for n, cap in (("a", 1.3), ("b", 1.6), ("c", 100.0))}
    out = serve_bench._take_turns(systems, _parts(7), [0.25, 0.5], opts)
    refined = [(name, item, rate) for name, item, rate in seen if item in ("4", "5")]
    # 1.0 sustained by all, 2.0 failed by a and b: 1.41 (a fails it), then 1.19 (all sustain)
    assert refined == [(n, "4", 1.41) for n in "abc"] + [(n, "5", 1.19) for n in "abc"]
    assert [(n, r) for n, item, r in seen if item == "6"] == [(n, math.inf) for n in "abc"]
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


def _fake_vllm(url: str, tried: list | None = None):
    @contextmanager
    def start(config: PeerConfig) -> Iterator[SimpleNamespace]:
        if tried is not None:
            tried.append(config)
        yield SimpleNamespace(
            base_url=url, model_dir=resolve_model_dir(None), model_name="p", startup_s=1.0
        )

    return start


def test_serve_bench_per_mode_and_vllm_peer(fake_url: str) -> None:
    modes = ("full", "prefix", "cachecraft")
    result = run_serve_bench(
        {m: fake_url for m in modes},
        modes=modes,
        peer="vllm",
        rates=[2.0, 1.0],
        items=_items(),
        num_requests=3,
        max_tokens=3,
        peer_server=_fake_vllm(fake_url),
        peer_configs=[PeerConfig()],
        max_runs=2,
        repeats=2,
        bursts=3,
        refine=0,  # the rates are the ramp's alone, however the shared machine's load moves
        fractions=(0.5,),
    )
    assert json.loads(json.dumps(result)) == result  # JSON-clean
    assert result["rates"] == [1.0, 2.0] and set(result["per_rate"]) == {"1", "2"}
    for by_mode in result["per_rate"].values():
        assert set(by_mode) == {*modes, "vllm"}
        for mode in modes:
            s = by_mode[mode]  # two runs of three requests, pooled
            assert (s["num_completed"], s["num_errors"], s["output_tokens"]) == (6, 0, 18)
            assert s["num_runs"] == 2 and len(s["e2e_ms"]) == 6
            assert s["computed_fraction"] == pytest.approx(MODE_COMPUTED[mode], abs=0.01)
            lo, hi = s["e2e_ms_p50_ci"]
            assert min(s["e2e_ms"]) <= lo <= s["e2e_ms_p50"] <= hi <= max(s["e2e_ms"])
        # the repeat hits the fake vLLM's prefix cache (warm across runs: one salt per stream)
        cache = by_mode["vllm"]["prefix_cache"]
        assert 0 < cache["hits"] < cache["queries"] == by_mode["vllm"]["prompt_tokens"]
    at = result["modes"]
    assert at == result["per_rate"][serve_bench.rate_key(result["common_rate"])]
    cc, prefix, vllm = at["cachecraft"], at["prefix"], at["vllm"]
    expected = round(prefix["e2e_ms_p50"] / cc["e2e_ms_p50"], 3)
    assert result["e2e_p50_ratio_prefix_over_cachecraft"] == expected
    lo, hi = result["e2e_p50_ratio_prefix_over_cachecraft_ci"]
    assert lo <= expected <= hi
    tput, capacity = result["max_throughput_rps"], result["capacity_rps"]
    assert set(tput) == set(capacity) == set(result["burst"]) == {*modes, "vllm"}
    for m in tput:
        runs = {r: result["per_rate"][r][m]["throughput_rps"] for r in ("1", "2")}
        runs["burst"] = result["burst"][m]["throughput_rps"]
        assert result["burst"][m]["num_completed"] == 3
        each = result["burst_throughputs_rps"][m]
        assert len(each) == 3 and capacity[m] == runs["burst"] == sorted(each)[1]
        assert tput[m] == max(runs.values()) == runs[result["max_throughput_run"][m]]
        assert result["computed_tokens_per_s"][m] is not None
        assert result["work_tokens_per_s"][m] >= result["computed_tokens_per_s"][m]
        # latencies at half of each system's own capacity, not at one common rate
        half = result["at_capacity_fraction"]["0.5"][m]
        assert half["offered_rps"] == pytest.approx(capacity[m] / 2, rel=0.35)
    # the ratios are of the capacities, their CIs over the burst rounds, paired by round
    assert result["throughput_ratio_vs_vllm"] == round(capacity["cachecraft"] / capacity["vllm"], 3)
    pairs = zip(
        result["burst_throughputs_rps"]["cachecraft"],
        result["burst_throughputs_rps"]["vllm"],
        strict=True,
    )
    per_round = [a / b for a, b in pairs]
    lo, hi = result["throughput_ratio_vs_vllm_ci"]
    assert min(per_round) - 1e-3 <= lo <= hi <= max(per_round) + 1e-3
    assert result["throughput_ratio_vs_prefix_ci"] is not None
    fraction_ratio = result["e2e_p50_ratio_vllm_over_cachecraft_at_capacity_fraction"]["0.5"]
    assert fraction_ratio == round(
        result["at_capacity_fraction"]["0.5"]["vllm"]["e2e_ms_p50"]
        / result["at_capacity_fraction"]["0.5"]["cachecraft"]["e2e_ms_p50"],
        3,
    )
    assert result["vllm_prefix_cache"] == vllm["prefix_cache"]
    assert result["cachecraft_reused_tokens"] == cc["prompt_tokens"] - cc["computed_tokens"] > 0
    assert result["peer"]["name"] == "vllm" and result["peer"]["configs_tried"] == []
    assert result["peer"]["config"] == PeerConfig().as_dict()


def test_every_answer_is_checked_against_a_full_prefill(fake_url: str) -> None:
    """After the measured runs, every distinct measured prompt is answered once in full
    mode; each system's answers are compared with those (a repeat shares its prompt's). The fake chat answers the same in
    every mode, the fake vLLM something else: agreement 1.0 for ours, and less for vLLM."""
    before = len(httpx.get(fake_url + "/fake/modes").json())
    result = run_serve_bench(
        {"cachecraft": fake_url},
        modes=("cachecraft",),
        peer="vllm",
        peer_server=_fake_vllm(fake_url),
        peer_configs=[PeerConfig()],
        rates=[20.0],
        items=_items(),
        num_requests=3,
        max_tokens=3,
        max_runs=1,
        repeats=1,
        bursts=1,
        refine=0,
        fractions=(),
    )
    modes = httpx.get(fake_url + "/fake/modes").json()[before:]
    # two distinct prompts (request 2 repeats 0's), each once, after the measured runs
    assert modes.count("full") == 2 and modes[-2:] == ["full"] * 2
    check = result["answer_agreement_vs_full"]
    cc, vllm = check["cachecraft"], check["vllm"]
    assert cc["num_answers"] == 3 + 3 and cc["exact_match_rate"] == 1.0  # ramp run and burst
    assert cc["token_agreement"] == 1.0
    assert vllm["exact_match_rate"] == 0.0 and vllm["token_agreement"] < 0.5
    assert {r["id"] for r in vllm["per_request"]} == {"0", "1", "2"}


def test_vllm_is_run_in_the_best_configuration_it_was_tried_in(fake_url: str) -> None:
    """Each configuration is tried on one burst of the same requests; the fastest is run,
    and every trial is recorded. A configuration that does not start is not a candidate."""
    tried: list[PeerConfig] = []
    failing = PeerConfig(enforce_eager=False)

    @contextmanager
    def start(config: PeerConfig) -> Iterator[SimpleNamespace]:
        tried.append(config)
        if config == failing:
            raise CachecraftError("vLLM exited with code 1 while starting")
        with _fake_vllm(fake_url)(config) as srv:
            yield srv

    result = run_serve_bench(
        {"cachecraft": fake_url},
        modes=("cachecraft",),
        peer="vllm",
        peer_server=start,
        peer_configs=[PeerConfig(), failing, PeerConfig(reserved_cpus=1)],
        rates=[20.0],
        items=_items(),
        num_requests=2,
        max_tokens=2,
        max_runs=1,
        repeats=1,
        bursts=1,
        refine=0,
        fractions=(),
        check_answers=False,
    )
    trials = result["peer"]["configs_tried"]
    assert [t["label"] for t in trials] == [c.label() for c in tried[:3]]
    assert "error" in trials[1] and "capacity_rps" not in trials[1]
    best = max((t for t in trials if "capacity_rps" in t), key=lambda t: t["capacity_rps"])
    assert result["peer"]["config"] == best["config"]
    assert tried[3] == PeerConfig(**best["config"])  # the winner, started for the real run


def test_a_fresh_server_per_mode_from_the_factory(fake_url: str) -> None:
    started: list[str] = []

    @contextmanager
    def start(mode: str) -> Iterator[str]:
        started.append(mode)
        yield fake_url

    result = run_serve_bench(
        start,
        rates=[10.0],
        items=_items()[:2],
        num_requests=2,
        max_tokens=1,
        max_runs=1,
        repeats=1,
        bursts=1,
        fractions=(),
        check_answers=False,
    )
    assert started == ["prefix", "cachecraft"]
    assert "throughput_ratio_vs_vllm" not in result and "vllm_prefix_cache" not in result
    with pytest.raises(CachecraftError, match="rates"):
        run_serve_bench(start, rates=[0.0], items=_items())
    with pytest.raises(CachecraftError, match="peer"):
        run_serve_bench(start, peer="sglang", items=_items())
    with pytest.raises(CachecraftError, match="repeats"):
        run_serve_bench(start, repeats=0, items=_items())
    with pytest.raises(CachecraftError, match="fractions"):
        run_serve_bench(start, fractions=(1.5,), items=_items())
    with pytest.raises(CachecraftError, match="env_tuning"):
        run_serve_bench(start, env_tuning="some", items=_items())


def test_cli_parses_and_prints_json(fake_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    tunings: list[bool] = []

    @contextmanager
    def start(mode: str, tuned: bool) -> Iterator[str]:
        tunings.append(tuned)
        yield fake_url

    parser = argparse.ArgumentParser()
    add_bench_serve_parser(parser.add_subparsers(dest="bench"), start)
    args = parser.parse_args(["serve", "--json", "--rates", "20,40", "--requests", "2"])
    assert (args.rates, args.requests, args.peer, args.json) == ([20.0, 40.0], 2, None, True)
    gpu = parser.parse_args(["serve", "--peer", "none", "--device", "cuda", "--shape", "llama-1b"])
    assert (gpu.peer, gpu.device, gpu.shape) == ("none", "cuda", "llama-1b")
    for bad in ("fast", "-1", "0.1,0", "nan"):  # refused before any workload is built
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--rates", bad])
    bursts = [
        parser.parse_args(["serve", *a]).bursts for a in ([], ["--no-burst"], ["--bursts", "5"])
    ]
    assert bursts == [serve_bench.DEFAULT_BURSTS, 0, 5]

    defaults = parser.parse_args(["serve"])
    assert (defaults.repeats, defaults.capacity_fractions) == (3, [0.5, 0.8])
    assert (defaults.max_tokens, defaults.env_tuning, defaults.peer_config) == (8, "none", "search")
    assert parser.parse_args(["serve", "--capacity-fractions", ""]).capacity_fractions == []
    for bad in ("0", "1.5", "half"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--capacity-fractions", bad])
    args = parser.parse_args(
        ["serve", "--json", "--rates", "20", "--requests", "2", "--warmup", "1", "--max-runs", "1"]
        + ["--repeats", "1", "--bursts", "1", "--capacity-fractions", "0.5", "--env-tuning", "ours"]
    )
    assert args.func(args) == 0
    assert tunings == [True, True]  # every system the same tuning
    assert args.server_factory is start
    captured = capsys.readouterr()
    out = json.loads(captured.out)  # stdout stays pure JSON; progress goes to stderr
    assert "[bench serve] cachecraft: warming up with 1 requests" in captured.err
    assert "[bench serve] prefix: 20 req/s offered: 2 done" in captured.err
    assert "[bench serve] prefix: burst (all at once): 2 done" in captured.err
    assert out["config"]["num_requests"] == 2 and out["chosen_rate"] == 20.0
    assert out["config"]["env_tuning"] == "ours" and out["config"]["repeats"] == 1
    assert set(out["at_capacity_fraction"]["0.5"]) == {"prefix", "cachecraft"}
    assert out["answer_agreement_vs_full"]["cachecraft"]["exact_match_rate"] == 1.0
    assert (
        out["config"]["warmup"] == 1 and out["per_rate"]["20"]["cachecraft"]["num_completed"] == 2
    )
    assert main_serve_bench is args.func


def test_cli_dtype_starts_our_servers_and_names_vllms(
    fake_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[tuple[str, tuple[str, ...]]] = []

    @contextmanager
    def start(mode: str, extra_args: tuple[str, ...] = (), tuned: bool = True) -> Iterator[str]:
        started.append((mode, tuple(extra_args)))
        yield fake_url

    parser = argparse.ArgumentParser()
    add_bench_serve_parser(parser.add_subparsers(dest="bench"), start)
    base = ["serve", "--json", "--rates", "20", "--requests", "1", "--warmup", "0"]
    base += ["--max-runs", "1", "--no-burst", "--modes", "prefix", "--repeats", "1"]
    base += ["--refine", "0", "--capacity-fractions", "", "--no-answer-check"]
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
    warm, runs = serve_bench.split_stream(items, warmup=2, num_requests=2, num_parts=3)
    assert [it.id for it in warm] == ["0", "1"]
    assert [[it.id for it in run] for run in runs] == [["2", "3"], ["4", "5"], ["6", "2"]]
    warm, runs = serve_bench.split_stream(items[:1], warmup=3, num_requests=2, num_parts=1)
    assert [it.id for it in warm] == ["0"] and [it.id for it in runs[0]] == ["0", "0"]


def test_the_parts_of_the_stream_never_overlap() -> None:
    """Ramp points, refining points, bursts and fraction points each replay parts of their
    own: together exactly 0 .. total - 1, once each."""
    parts = serve_bench.Parts(max_runs=3, repeats=2, refine=2, bursts=3, fractions=2)
    used = [k for i in range(3) for k in parts.ramp(i)]
    used += [k for i in range(2) for k in parts.refine_point(i)]
    used += [parts.burst(i) for i in range(3)]
    used += [k for i in range(2) for k in parts.fraction(i)]
    assert sorted(used) == list(range(parts.total)) and parts.total == 6 + 4 + 3 + 4


def test_warm_up_requests_are_replayed_but_not_measured(fake_url: str) -> None:
    result = run_serve_bench(
        {"cachecraft": fake_url},
        modes=("cachecraft",),
        peer="vllm",
        peer_server=_fake_vllm(fake_url),
        peer_configs=[PeerConfig()],
        rates=[20.0],
        items=_items(),  # warm-up: requests 0 and 1; the run: request 2, a repeat of 0
        num_requests=1,
        warmup=2,
        max_tokens=2,
        max_runs=1,
        repeats=1,
        bursts=0,
        refine=0,
        fractions=(),
        check_answers=False,
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
