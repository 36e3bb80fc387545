"""Quality benchmark: JSON keys per mode, full == full, full recompute == full, matched budgets,
sweeps, ablation arms, calibration on a toy curve, config file, CLI output and errors."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from cachecraft.api import CachecraftParams
from cachecraft.config import ReuseConfig
from cachecraft.config_file import load_reuse_overrides, read_config, write_config
from cachecraft.errors import BadRequestError
from cachecraft.llm import LLM, reuse_config
from cachecraft.model.loader import LoadedModel
from cachecraft.request import Chunk, RagRequest
from cachecraft_bench.calibrate import (
    SELECTOR_RULES,
    calibrate,
    pick_alpha,
    pick_rule,
    selector_settings,
)
from cachecraft_bench.item import WorkloadItem, estimate_tokens
from cachecraft_bench.matching import MAX_TRIALS
from cachecraft_bench.modes import LAB_MODES as MODES
from cachecraft_bench.paired import paired_difference
from cachecraft_bench.quality import ABLATIONS, build_arms, run_quality
from cachecraft_bench.quality_cli import add_bench_quality_parser, add_calibrate_parser
from cachecraft_bench.quality_summary import FLAT_KEYS, flat_summary
from cachecraft_bench.strategies import arm_settings
from cachecraft_bench.workloads import build_workload, write_workload_file

ISSUE_KEYS = (
    "computed_fraction",
    "ttft_ms_p50",
    "ttft_speedup_vs_full",
    "rouge_l_vs_full",
    "first_token_kl_vs_full",
    "tf_kl_vs_full",
    "tf_agreement_vs_full",
    "f1_vs_gold",
    "em_vs_gold",
    "n",
)
FACTS = [
    "The Eiffel Tower in Paris was designed by the engineering company of Gustave Eiffel and "
    "finished in 1889 for the World's Fair.",
    "The Sydney Opera House, designed by the Danish architect Jorn Utzon, opened in 1973 on "
    "Bennelong Point in Sydney Harbour.",
    "The Taj Mahal in Agra was commissioned in 1631 by the Mughal emperor Shah Jahan for the "
    "tomb of his wife Mumtaz Mahal.",
    "The Parthenon on the Athenian Acropolis was built in the fifth century BC and was "
    "designed by the architects Ictinus and Callicrates.",
]
ORDERS = [(0, 1, 2), (2, 0, 1), (1, 2, 3), (3, 0, 2)]  # shared chunks in new orders and company


def _items(n: int = 4) -> list[WorkloadItem]:
    out = []
    for i, order in enumerate(ORDERS[:n]):
        chunks = [Chunk(FACTS[j], f"fact{j}") for j in order]
        request = RagRequest(f"Who designed landmark number {i}?", chunks)
        out.append(WorkloadItem(f"q{i}", request, answers=("Gustave Eiffel",) if i % 2 else None))
    return out


@pytest.fixture(scope="module")
def all_modes(tiny: LoadedModel) -> dict:
    return run_quality(tiny, _items(3), MODES, warmup=1, max_tokens=4, progress=False)


def test_json_has_every_issue_key_for_every_mode(all_modes: dict) -> None:
    summary = flat_summary(all_modes)
    assert set(summary["modes"]) == set(MODES)
    for mode, m in summary["modes"].items():
        for key in ISSUE_KEYS:
            assert key in m, (mode, key)
        assert m["n"] == 2
        assert set(m["ci95"]) <= set(FLAT_KEYS)
    json.dumps(summary)  # JSON-ready


def test_full_against_itself(all_modes: dict) -> None:
    full = flat_summary(all_modes)["modes"]["full"]
    assert full["tf_kl_vs_full"] == 0.0
    assert full["first_token_kl_vs_full"] == 0.0
    assert full["tf_agreement_vs_full"] == 1.0
    assert full["rouge_l_vs_full"] == 1.0
    assert full["computed_fraction"] == 1.0
    assert full["ttft_speedup_vs_full"] == 1.0
    assert full["f1_vs_gold"] is not None  # one measured request has gold answers


def test_matched_budgets_request_by_request(all_modes: dict) -> None:
    requests = all_modes["workloads"]["workload"]["requests"]
    ref = [r["token_layers_fraction"] for r in requests["cachecraft"]]
    assert any(r["chunk_hit_rate"] for r in requests["cachecraft"]), "no chunk was reused"
    assert min(ref) < 1.0
    # every arm computes as many token-layers in all: the others get cachecraft's probe rows
    # and its check's stopped candidates (by the layers they ran), prophet pays for its own
    # probe, CacheBlend for its candidates up to its check layer; EPIC's one k per chunk
    # comes within a token per reused chunk
    # (or as many as there are: a baseline out of reused tokens to recompute stops there)
    for mode, tol in (("random", 0.01), ("cacheblend", 0.02), ("prophet", 0.02), ("epic", 0.04)):
        for r, mine in zip(requests[mode], ref, strict=True):
            hits = [c for c in r["chunks"] if c["reason"] not in ("miss", "refresh")]
            spent = all(c["recomputed"] == c["tokens"] for c in hits)
            got = r["token_layers_fraction"]
            assert got == pytest.approx(mine, abs=tol) or (spent and got < mine), mode
    for r in requests["epic"]:  # EPIC's own shape: the same k in every reused chunk
        done = {c["recomputed"] for c in r["chunks"] if c["reason"] == "given"}
        assert len(done - {c["tokens"] for c in r["chunks"]}) <= 1
    assert all(r["probe_fraction"] > 0 for r in requests["prophet"])
    assert all(r["probe_fraction"] == 0 for r in requests["epic"])
    naive = [r["computed_fraction"] for r in requests["naive"]]
    assert all(n <= c for n, c in zip(naive, ref, strict=True))
    # each record keeps its plan per chunk: full computes every token, naive none it reused
    assert any(c["reason"] == "none" for r in requests["naive"] for c in r["chunks"])
    for full, nv in zip(requests["full"], requests["naive"], strict=True):
        assert full["chunks"] and all(c["recomputed"] == c["tokens"] for c in full["chunks"])
        assert [c["tokens"] for c in nv["chunks"]] == [c["tokens"] for c in full["chunks"]]
        assert all(c["recomputed"] == 0 for c in nv["chunks"] if c["reason"] == "none")


def test_matched_budgets_when_cachecraft_skips_its_probe(tiny: LoadedModel) -> None:
    skip = {"probe_max_cost": 0.0}  # every probe costs more: the check instead
    res = run_quality(
        tiny, _items(3), ["cachecraft", "cacheblend", "prophet"], warmup=1, max_tokens=4,
        configs={"cachecraft": skip}, progress=False,
    )  # fmt: skip
    requests = res["workloads"]["workload"]["requests"]
    ref = [r["computed_fraction"] for r in requests["cachecraft"]]
    assert any(r["chunk_hit_rate"] for r in requests["cachecraft"]), "no chunk was reused"
    assert all(r["probe_fraction"] == 0 for r in requests["cachecraft"])
    for mode in ("cacheblend", "prophet"):  # prophet's own probe out of the same total
        got = [r["token_layers_fraction"] for r in requests[mode]]
        ref = [r["token_layers_fraction"] for r in requests["cachecraft"]]
        assert got == pytest.approx(ref, abs=0.02), mode


def test_cachecraft_recomputing_everything_equals_full(tiny: LoadedModel) -> None:
    cfg = {"alpha": 1e6, "min_fix": 1.0, "early_termination": False}
    res = run_quality(
        tiny, _items(3), ["cachecraft"], warmup=1, max_tokens=4, configs={"cachecraft": cfg},
        progress=False,
    )  # fmt: skip
    cc = flat_summary(res)["modes"]["cachecraft"]
    assert cc["chunk_hit_rate"] > 0  # chunks were reused, then recomputed in full
    assert cc["tf_kl_vs_full"] < 1e-6
    assert cc["tf_agreement_vs_full"] == 1.0


def test_sweep_has_a_point_per_parameter(tiny: LoadedModel) -> None:
    grid = {"cachecraft": [0.1, 2.0], "epic": [2, 8], "cacheblend": [0.1]}
    modes = ["cachecraft", "epic", "cacheblend", "random"]
    res = run_quality(
        tiny, _items(3), modes, warmup=1, max_tokens=2, sweep=grid, include_base=False,
        progress=False,
    )  # fmt: skip
    sweep = res["workloads"]["workload"]["sweep"]
    assert {m: [p["param"] for p in pts] for m, pts in sweep.items()} == {
        "cachecraft": [0.1, 2.0],
        "epic": [2.0, 8.0],
        "cacheblend": [0.1],
        "random": [0.1, 2.0],
    }
    for pts in sweep.values():
        for p in pts:
            assert {"computed_fraction", "tf_kl", "rouge_l"} <= set(p)
    cc = sweep["cachecraft"]
    assert cc[0]["computed_fraction"] <= cc[1]["computed_fraction"]
    # random at cachecraft's budgets, its probe's and check's token-layers added where the
    # reused chunks have room (at alpha 2 they are recomputed whole: no room, so random
    # computes less)
    low, high = zip(cc, sweep["random"], strict=True)
    key = "token_layers_fraction"
    assert low[1][key] == pytest.approx(low[0][key], abs=0.01)
    assert high[1][key] <= high[0][key] + 1e-9


def test_equal_flops_arms_are_matched_by_position(tiny: LoadedModel) -> None:
    probe = {"cachecraft": {"probe_depth": 0.5, "probe_check": 3.0, "probe_skip_wide": False}}
    arms = ["cachecraft", "epic", "epic-flops", "cacheblend", "cacheblend-flops", "prophet-flops"]
    res = run_quality(tiny, _items(4), arms, configs=probe, warmup=1, max_tokens=2, progress=False)
    requests = res["workloads"]["workload"]["requests"]
    cc = requests["cachecraft"]
    assert any(r["chunk_hit_rate"] for r in cc), "no chunk was reused"

    def gaps(records: list[dict]) -> list[float]:
        pairs = zip(records, cc, strict=True)
        return [abs(r["flops_fraction"] - m["flops_fraction"]) for r, m in pairs]

    for arm in ("epic", "cacheblend"):
        # matched on token-layers, the arm's FLOPs differ by position; searched by FLOPs,
        # never further off and closer in all
        gap, gap_f = gaps(requests[arm]), gaps(requests[f"{arm}-flops"])
        assert all(f <= t + 1e-12 for f, t in zip(gap_f, gap, strict=True)), arm
        assert sum(gap_f) < sum(gap), arm
        assert max(r["answers_tried"] for r in requests[f"{arm}-flops"]) > 1, arm
    for arm in ("epic-flops", "cacheblend-flops", "prophet-flops"):
        # within a token's FLOPs (a ~100-token prompt: about 1.5% of its FLOPs each)
        assert max(gaps(requests[arm])) < 0.02, arm
        assert all(1 <= r["answers_tried"] <= MAX_TRIALS + 1 for r in requests[arm])


def test_arms_order_ablations_and_budget_source() -> None:
    arms = build_arms(["random"], ReuseConfig(), ablations=True)
    names = [a.name for a in arms]
    assert names[0] == "full" and "cachecraft" in names  # added: random takes its budgets
    assert names.index("cachecraft") < names.index("random")
    assert set(ABLATIONS) <= set(names)
    by_name = {a.name: a for a in arms}
    assert by_name["random"].budget_from == "cachecraft"
    assert "cachecraft-no-focus" not in by_name  # a no-op under the global split: removed
    assert by_name["cachecraft-half-probe"].strategy.params.probe_depth == 0.5
    assert by_name["random"].match == "tokens"
    flops = build_arms(["epic-flops", "cacheblend-global-flops"], ReuseConfig())
    by_flops = {a.name: a for a in flops}
    assert by_flops["epic-flops"].mode == "epic" and by_flops["epic-flops"].match == "flops"
    cbg = by_flops["cacheblend-global-flops"]
    assert (
        cbg.mode == "cacheblend" and cbg.strategy.params.cacheblend_global and cbg.match == "flops"
    )
    assert cbg.budget_from == "cachecraft"
    assert by_name["cachecraft-one-variant"].max_variants_per_chunk == 1
    assert not by_name["cachecraft-no-order"].strategy.params.use_order_penalty
    assert by_name["cachecraft-empty-paper"].strategy.params.empty_s_old == "paper"
    assert by_name["cachecraft-need"].strategy.params.probe_split == "need"
    assert by_name["cachecraft-need"].mode == "cachecraft"
    blend = by_name["cacheblend-global"]
    assert blend.mode == "cacheblend" and blend.strategy.params.cacheblend_global
    assert blend.budget_from == "cachecraft"
    paper = build_arms(["cachecraft-paper", "prophet"])
    assert [(a.name, a.mode) for a in paper][1:] == [
        ("cachecraft", "cachecraft"),
        ("cachecraft-paper", "cachecraft-paper"),
        ("prophet", "prophet"),
    ]
    assert paper[-1].budget_from == "cachecraft" and paper[2].budget_from is None
    own = build_arms(["epic"], match_budget=False)
    assert [a.name for a in own] == ["full", "epic"] and own[1].budget_from is None
    with pytest.raises(BadRequestError, match="unknown mode"):
        build_arms(["bogus"])


@pytest.mark.parametrize(
    ("name", "kw"),
    [
        ("wiki-qa", {"k": 2}),
        ("synthetic", {"k": 2, "chunk_tokens": (32, 48)}),
        ("sharegpt", {"chunk_tokens": 48, "max_chunks": 2}),
    ],
)
def test_builtin_workloads_smoke(tiny: LoadedModel, name: str, kw: dict) -> None:
    items = build_workload(name, 2, **kw)
    res = run_quality(tiny, items, ["cachecraft"], warmup=1, max_tokens=2, progress=False)
    assert flat_summary(res)["modes"]["cachecraft"]["n"] == 1


def test_calibration_picks_smallest_alpha_reaching_target(caplog) -> None:
    curve = {0.1: 0.5, 0.25: 0.85, 0.5: 0.91, 1.0: 0.89, 2.0: 0.97}
    asked = []

    def fake(alphas):
        asked.append(list(alphas))
        return {a: curve[a] for a in alphas}

    assert calibrate(None, [], 0.9, list(curve), evaluate=fake) == 0.5
    assert asked == [list(curve)]
    assert calibrate(None, [], 0.95, list(curve), evaluate=fake) == 2.0
    with caplog.at_level(logging.WARNING):
        assert pick_alpha(curve, 0.99) == 2.0  # none reaches: the largest, with a warning
    assert "no alpha reached" in caplog.text
    with pytest.raises(BadRequestError):
        calibrate(None, [], 1.5, [0.5], evaluate=fake)


def test_a_selector_rule_is_adopted_only_when_it_is_clearly_better() -> None:
    def records(values: list[float]) -> list[dict]:
        return [{"id": f"q{i}", "tf_kl": v} for i, v in enumerate(values)]

    default = records([0.30, 0.20, 0.25, 0.40, 0.35, 0.30])
    better = records([0.10, 0.05, 0.08, 0.12, 0.10, 0.09])
    best = records([0.05, 0.02, 0.04, 0.06, 0.05, 0.04])
    tie = records([0.10, 0.50, 0.08, 0.60, 0.10, 0.40])
    worse = records([0.40, 0.30, 0.35, 0.50, 0.45, 0.40])

    def pick(**arms: list[dict]) -> str | None:
        return pick_rule({k: paired_difference(v, default, "tf_kl") for k, v in arms.items()})

    assert pick(a=better, b=tie, c=worse) == "a"
    assert pick(a=better, b=best) == "b"  # the one that lowers it most
    assert pick(a=tie, b=worse) is None  # a tie keeps the default
    assert pick_rule({"a": paired_difference(records([0.0]), default[:1], "tf_kl")}) is None


def test_selector_settings_name_every_parameter_the_rules_touch() -> None:
    rules = {"a": {"probe_sink_kept": False}, "b": {"probe_check_power": 1.5}}
    assert selector_settings(rules, "b") == {"probe_sink_kept": True, "probe_check_power": 1.5}
    assert selector_settings(rules, None) == {"probe_sink_kept": True, "probe_check_power": 0.75}
    assert selector_settings(SELECTOR_RULES, None).keys() == {
        key for rule in SELECTOR_RULES.values() for key in rule
    }


def test_config_file_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "cachecraft.json"
    path.write_text(json.dumps({"reuse": {"refresh_error": 0.5}, "other": 1}))
    write_config(path, 0.25, target=0.9)
    data = read_config(path)
    assert data["other"] == 1 and data["calibration"] == {"target": 0.9}
    assert load_reuse_overrides(path) == {"refresh_error": 0.5, "alpha": 0.25}
    write_config(path, 0.5, {"probe_sink_kept": False})  # a strategy's parameter beside alpha
    assert load_reuse_overrides(path) == {
        "refresh_error": 0.5,
        "alpha": 0.5,
        "probe_sink_kept": False,
    }
    path.write_text(json.dumps({"reuse": {"alpah": 1}}))
    with pytest.raises(BadRequestError, match="alpah"):
        reuse_config(**load_reuse_overrides(path))
    path.write_text("{not json")
    with pytest.raises(BadRequestError, match="not valid JSON"):
        read_config(path)
    with pytest.raises(BadRequestError, match="does not exist"):
        read_config(tmp_path / "missing.json")


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cachecraft")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_quality_parser(sub.add_parser("bench").add_subparsers(dest="bench"))
    add_calibrate_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_json_out_and_errors(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    wl = write_workload_file(_items(3), tmp_path / "wl.jsonl")
    cfg = tmp_path / "cfg.json"
    common = ["--workload-file", str(wl), "--model", str(tiny_dir), "--config", str(cfg)]
    common += ["--warmup", "1", "--max-tokens", "2", "--no-progress"]
    cfg.write_text(json.dumps({"reuse": {"alpha": 0.3}}))
    out_dir = tmp_path / "out"
    rc = _cli(
        ["bench", "quality", *common, "--modes", "full,epic", "--out", str(out_dir), "--json"]
        + ["--store-mib", "64"]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["modes"]) == {"full", "cachecraft", "epic"}
    results = json.loads((out_dir / "results.json").read_text())
    assert results["config"]["reuse"]["alpha"] == 0.3  # read from the config file
    assert results["config"]["store_bytes"] == 64 << 20  # each arm's store
    assert (out_dir / "report.md").exists() and list(out_dir.glob("*.png"))

    assert _cli(["bench", "quality", *common, "--modes", "full,bogus"]) == 2
    assert _cli(["bench", "quality", "--workload-file", str(tmp_path / "nope.jsonl")]) == 2
    assert _cli(["bench", "quality", "--workload", "synthetic", "--chunk-tokens", "64"]) == 2
    assert _cli(["bench", "quality", "--workload", "wiki-qa", "--chunk-tokens", "64,96"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("error: ") for line in err)
    assert "bogus" in err[0] and "nope.jsonl" in err[1]
    assert "MIN,MAX" in err[2] and "synthetic only" in err[3]


def test_arm_flag_adds_an_arm_with_its_own_reuse_options(
    tiny_dir: Path, tmp_path: Path, capsys
) -> None:
    from cachecraft_bench.quality_cli import parse_arm

    base = ReuseConfig(alpha=0.3)
    name, cfg = parse_arm("cachecraft-x:probe_max_cost=none, probe_trim=true,alpha=0.7", base)
    assert name == "cachecraft-x"
    assert cfg == {"probe_max_cost": None, "probe_trim": True, "alpha": 0.7}
    strategy, config, _ = arm_settings("cachecraft", cfg, base)
    assert config == replace(base, alpha=0.7)
    assert strategy.params == CachecraftParams(probe_max_cost=None, probe_trim=True)
    _, cfg = parse_arm("cachecraft-y:probe_split=need", base)
    assert cfg == {"probe_split": "need"}
    _, cfg = parse_arm("cachecraft-paper-y:et_layer=3", base)
    assert arm_settings("cachecraft-paper", cfg, base)[0].params.et_layer == 3
    for bad in ("cachecraft-x", "cachecraft-x:", "cachecraft-x:bogus=1", "cachecraft-x:alpha",
                "cachecraft-x:alpha=high", "cachecraft-x:probe_split=both",
                "cachecraft-x:probe_trim=maybe", "cachecraft-x:seed=3",
                "cachecraft-x:probe_skip_share=2", "cachecraft-x:et_layer=3",
                "cachecraft-x:probe=1"):  # fmt: skip
        with pytest.raises(BadRequestError, match="--arm"):
            parse_arm(bad, base)
    for bad, says in (("probe_trim=maybe", "true or false"), ("alpha=high", "a number"),
                      ("probe_split=both", "one of need, global, chunk"),
                      ("probe_last_layer=x", "an integer or none")):  # fmt: skip
        with pytest.raises(BadRequestError, match=says):
            parse_arm(f"cachecraft-x:{bad}", base)

    wl = write_workload_file(_items(3), tmp_path / "wl.jsonl")
    common = ["--workload-file", str(wl), "--model", str(tiny_dir), "--store-mib", "64"]
    common += ["--warmup", "1", "--max-tokens", "2", "--no-progress", "--json"]
    arm = "cachecraft-all:alpha=1.0,min_fix=1.0"  # recomputes every reused token
    rc = _cli(["bench", "quality", *common, "--modes", "full,naive", "--arm", arm])
    assert rc == 0
    modes = json.loads(capsys.readouterr().out)["modes"]
    assert set(modes) == {"full", "naive", "cachecraft-all"}
    assert modes["cachecraft-all"]["tf_kl_vs_full"] < 1e-6 < modes["naive"]["tf_kl_vs_full"]
    assert _cli(["bench", "quality", *common, "--arm", "bogus-x:alpha=1"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_chunk_tokens_flag_sets_synthetic_chunk_lengths() -> None:
    from cachecraft_bench.quality_cli import load_items

    parser = argparse.ArgumentParser()
    add_bench_quality_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["quality", "--workload", "synthetic", "--requests", "6", "--chunk-tokens", "40,48"]
    )
    _, items = load_items(args)
    sizes = [estimate_tokens(c.text) for item in items for c in item.request.chunks]
    assert len(items) == 6 and min(sizes) >= 36 and max(sizes) <= 64
    assert {len(item.request.chunks) for item in items} == {5}
    for permute in ([], ["--permute"]):
        args = parser.parse_args(
            ["quality", "--workload", "synthetic", "--requests", "6", "--chunks-per-request", "9"]
            + permute
        )
        _, items = load_items(args)
        assert {len(item.request.chunks) for item in items} == {9}
    for bad in (
        ["--workload", "wiki-qa"],
        ["--workload", "synthetic", "--chunks-per-request", "0"],
    ):
        with pytest.raises(BadRequestError, match="chunks-per-request"):
            load_items(parser.parse_args(["quality", "--chunks-per-request", "3", *bad]))


def test_shared_warmup_gives_every_arm_the_same_warm_store(tiny: LoadedModel) -> None:
    from cachecraft_bench.quality import build_arms, run_arms

    items = _items()
    arms = build_arms(["naive", "cachecraft"])
    out = run_arms(tiny, items, arms, warmup=2, max_tokens=2, progress=False, shared_warmup=True)
    sizes = {name: len(store) for name, (_, store) in out.items() if name != "full"}
    assert len(set(sizes.values())) == 1 and min(sizes.values()) > 0
    hits = [r["chunk_hit_rate"] for r in out["naive"][0]]
    assert len(hits) == len(items) - 2 and max(hits) > 0


def test_shared_warmup_measures_each_arms_layers(tiny: LoadedModel) -> None:
    from cachecraft_bench.quality import build_arms, run_arms

    arms = build_arms(["cachecraft", "cachecraft-stats-all"], match_budget=False)
    out = run_arms(tiny, _items(), arms, warmup=2, max_tokens=2, progress=False, shared_warmup=True)
    for name, layers in (("cachecraft", {(1,)}), ("cachecraft-stats-all", {()})):
        store = out[name][1]
        metas = [store.load(v).meta for v in store.variant_ids()]
        assert metas and {m.stats_layers for m in metas} == layers  # 4 layers: stride 3 -> (1,)


def test_int8_disk_store_changes_reuse_fidelity(tiny: LoadedModel, tmp_path: Path) -> None:
    from cachecraft.store.config import StoreConfig
    from cachecraft_bench.quality import build_arms, run_arms

    items, arms = _items(), build_arms(["naive"])
    int8 = StoreConfig(cache_dir=str(tmp_path), memory_bytes=0, int8=True, doorkeeper_threshold=1)
    kw = dict(warmup=2, max_tokens=2, progress=False, shared_warmup=True)
    fp16 = run_arms(tiny, items, arms, **kw)["naive"][0]
    q8 = run_arms(tiny, items, arms, store_config=int8, **kw)["naive"][0]
    assert list(tmp_path.rglob("*.safetensors"))  # the arms really kept K/V on disk
    assert [r["chunk_hit_rate"] for r in q8] == [r["chunk_hit_rate"] for r in fp16]
    assert [r["tf_kl"] for r in q8] != [r["tf_kl"] for r in fp16]


def test_calibrate_chooses_the_selector_and_writes_it(
    tiny_dir: Path, tmp_path: Path, capsys
) -> None:
    wl = write_workload_file(_items(4), tmp_path / "wl.jsonl")
    cfg = tmp_path / "cachecraft.json"
    cfg.write_text(json.dumps({"reuse": {"probe_check_power": 9.0}}))  # a stale choice
    argv = ["calibrate", "--workload-file", str(wl), "--model", str(tiny_dir), "--warmup", "1"]
    argv += ["--max-tokens", "2", "--no-progress", "--alphas", "0.5", "--write", str(cfg)]
    assert _cli([*argv, "--selector", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    diffs = out["selector_tf_kl_minus_default"]
    assert diffs.keys() == SELECTOR_RULES.keys()
    assert all(d["n"] == 3 and len(d["ci95"]) == 2 for d in diffs.values())
    reuse = load_reuse_overrides(cfg)
    chosen = selector_settings(SELECTOR_RULES, pick_rule(diffs))
    assert reuse == {"alpha": 0.5, **chosen}  # the stale power replaced
    assert read_config(cfg)["calibration"]["selector"] == diffs
    params = LLM(str(tiny_dir), **reuse).strategies.get("cachecraft").params  # it configures
    assert (params.probe_sink_kept, params.probe_check_power) == (
        chosen["probe_sink_kept"],
        chosen["probe_check_power"],
    )
