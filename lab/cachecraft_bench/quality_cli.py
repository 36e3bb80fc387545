"""CLI plumbing for `cachecraft bench quality` and `cachecraft calibrate`.

Parses flags (ReuseConfig flags one-to-one from its fields; a strategy's own parameters through
`--arm NAME:FIELD=VALUE`), loads the workload
and model, calls the library, prints JSON or a table on stdout. Errors: one line, exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import typing
from pathlib import Path
from typing import Any

from cachecraft.config import ReuseConfig
from cachecraft.config_file import add_reuse_flags, reuse_overrides
from cachecraft.errors import BadRequestError, CachecraftError
from cachecraft.llm import reuse_config
from cachecraft.store.config import StoreConfig
from cachecraft_bench.item import WorkloadItem
from cachecraft_bench.modes import LAB_MODES

log = logging.getLogger(__name__)

DEFAULT_REQUESTS = 60
"""Requests drawn from a built-in workload when --requests is not given (20 warm the caches)."""
DEFAULT_WARMUP = 20
"""--warmup when not given (with --set: each shape's own, eval_sets.py)."""


def reuse_config_from_args(args: argparse.Namespace) -> ReuseConfig:
    """ReuseConfig from the config file (--config or ./cachecraft.json), then the flags."""
    return reuse_config(**reuse_overrides(args))


def _seed(args: argparse.Namespace) -> int | None:
    """--seed, else the command's default (None with --set: the set's first seed)."""
    if getattr(args, "seed", None) is not None or getattr(args, "set", None):
        return getattr(args, "seed", None)
    return getattr(args, "default_seed", None)


def _warmup(args: argparse.Namespace) -> int:
    return DEFAULT_WARMUP if args.warmup is None else args.warmup


def parse_arm(text: str, base: ReuseConfig) -> tuple[str, dict[str, Any]]:
    """`--arm NAME:FIELD=VALUE,...` -> (NAME, the settings changed): ReuseConfig fields and
    the parameters of NAME's strategy. Values: numbers, true/false, none, or a choice's name;
    a bad one, or a setting that strategy does not take, is a BadRequestError."""
    from cachecraft_bench.quality import mode_of
    from cachecraft_bench.strategies import arm_settings, register

    name, sep, spec = text.partition(":")
    name = name.strip()
    if not name or not sep or not spec.strip():
        raise BadRequestError(f"--arm {text!r}: expected NAME:FIELD=VALUE[,FIELD=VALUE...]")
    strategy = register().get(mode_of(name))
    hints = {**typing.get_type_hints(type(strategy.params)), **typing.get_type_hints(ReuseConfig)}
    fields: dict[str, Any] = {}
    for pair in spec.split(","):
        key, eq, raw = (x.strip() for x in pair.partition("="))
        if key not in hints or not _is_scalar(hints[key]) or not eq:
            raise BadRequestError(
                f"--arm {name}: {pair.strip()!r} is not FIELD=VALUE of a reuse option of "
                f"{strategy.name}"
            )
        fields[key] = _value(name, key, raw, hints[key])
    try:  # the settings check themselves
        arm_settings(mode_of(name), fields, base)
    except BadRequestError as e:
        raise BadRequestError(f"--arm {name}: {e}") from None
    return name, fields


def _is_scalar(hint: Any) -> bool:
    """A setting given as one value on the command line (not a nested dataclass)."""
    if typing.get_origin(hint) is typing.Literal:
        return True
    return all(t in (bool, int, float, str, type(None)) for t in typing.get_args(hint) or (hint,))


def _value(arm: str, key: str, raw: str, hint: Any) -> Any:
    """`raw` as a value of the ReuseConfig field `key` (type `hint`)."""
    options = typing.get_args(hint)
    if raw.lower() == "none" and type(None) in options:
        return None
    if hint is bool and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    if typing.get_origin(hint) is typing.Literal and raw in options:
        return raw
    if hint is not bool and typing.get_origin(hint) is not typing.Literal:
        try:
            return int(raw) if int in (hint, *options) else float(raw)
        except ValueError:
            pass
    raise BadRequestError(f"--arm {arm}: {key}={raw!r} is not {_expected(hint)}")


def _expected(hint: Any) -> str:
    """What a value of a field typed `hint` looks like, in words."""
    if hint is bool:
        return "true or false"
    options = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(str, options))
    kind = "an integer" if int in (hint, *options) else "a number"
    return kind + (" or none" if type(None) in options else "")


def _add_common_flags(parser: argparse.ArgumentParser, seed: int) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument(
        "--workload", default="wiki-qa",
        help="wiki-qa | synthetic | sharegpt | two-hop | many-short | long-doc | FILE",
    )  # fmt: skip
    src.add_argument("--workload-file", default=None, help="a JSONL workload file")
    parser.add_argument(
        "--requests", "--limit", dest="requests", type=int, default=None,
        help=f"requests to use, warm-up included (built-ins: {DEFAULT_REQUESTS}; files: all)",
    )  # fmt: skip
    parser.add_argument(
        "--seed", type=int, default=None, help=f"workload and random-mode seed (default {seed})"
    )
    parser.set_defaults(default_seed=seed)
    parser.add_argument(
        "--chunk-tokens", default=None, metavar="MIN,MAX",
        help="synthetic only: tokens per chunk (default 128,512)",
    )  # fmt: skip
    parser.add_argument(
        "--chunks-per-request", type=int, default=None, metavar="K",
        help="synthetic only: distinct chunks in each request (default 5)",
    )  # fmt: skip
    parser.add_argument(
        "--permute", action="store_true",
        help="synthetic only: the same chunk sets recur, each time in a new order",
    )  # fmt: skip
    parser.add_argument(
        "--warmup", type=int, default=None,
        help=f"first N requests only warm caches (default {DEFAULT_WARMUP})",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy answer length")
    parser.add_argument(
        "--model", default=None, help="HF dir, .gguf or a named model (default: bundled)"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="default: bfloat16 on a GPU, float32 on a CPU",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", default=None, help="config file (default ./cachecraft.json)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_reuse_flags(parser)


def add_bench_quality_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `quality` to the `bench` subcommands; sets `func`."""
    p = subparsers.add_parser("quality", help="quality vs computation of every reuse mode")
    _add_common_flags(p, seed=0)
    p.add_argument("--modes", default=",".join(LAB_MODES), help="comma-separated modes / ablations")
    p.add_argument(
        "--set", choices=("tuning", "report"), default=None,
        help="run every shape of a set (docs/evaluation.md) at its seed; --seed, --requests "
        "and --warmup override the set's",
    )  # fmt: skip
    p.add_argument(
        "--match-budget", action=argparse.BooleanOptionalAction, default=True,
        help="random/cacheblend/epic recompute as many tokens as cachecraft, request by request",
    )  # fmt: skip
    p.add_argument("--sweep", action="store_true", help="sweep each mode's recompute budget")
    p.add_argument("--ablations", action="store_true", help="add the cachecraft ablations")
    p.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="NAME:FIELD=VALUE,...",
        help="an extra arm: NAME (a mode, or MODE-anything) run with the reuse options or its "
        "strategy's parameters given changed, e.g. cachecraft-pmc1:probe_max_cost=1.0 "
        "(repeatable)",
    )
    p.add_argument(
        "--shared-warmup",
        action="store_true",
        help="warm every arm with the same variants (warm-up requests computed once, in full)",
    )
    p.add_argument(
        "--int8-store",
        metavar="DIR",
        default=None,
        help="each arm keeps its chunk-caches on disk under DIR as int8 (memory tier off)",
    )
    p.add_argument(
        "--store-mib",
        type=int,
        default=1024,  # bench.quality.DEFAULT_STORE_BYTES (not imported: it loads torch)
        help="each arm's in-memory chunk store, MiB (every arm holds its own)",
    )
    p.add_argument("--out", default=None, help="write results.json, report.md and plots here")
    p.set_defaults(func=main_bench_quality)
    return p


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the top-level `calibrate` subcommand; sets `func`."""
    from cachecraft_bench.calibrate import DEFAULT_ALPHAS

    p = subparsers.add_parser("calibrate", help="pick the smallest alpha reaching a ROUGE-L target")
    _add_common_flags(p, seed=1)  # seed 1: a different sample from bench's default seed 0
    p.add_argument("--target", type=float, default=0.9, help="mean ROUGE-L vs full to reach")
    p.add_argument("--alphas", default=",".join(f"{a:g}" for a in DEFAULT_ALPHAS))
    p.add_argument(
        "--write", default=None, help="file to write (default: --config or ./cachecraft.json)"
    )
    p.add_argument(
        "--selector",
        action="store_true",
        help="also choose the selector's per-model rules at the chosen alpha (the sink rule, "
        "the check's attention power, a probe over every reused token): one only when it "
        "lowers the TF-KL with a paired CI excluding 0; models differ, docs/reuse.md",
    )
    p.set_defaults(func=main_calibrate)
    return p


def load_items(args: argparse.Namespace) -> tuple[str, list[WorkloadItem]]:
    """(workload name, items) from --workload / --workload-file and --requests."""
    from cachecraft_bench.synthetic import parse_chunk_tokens
    from cachecraft_bench.workloads import BUILTIN_WORKLOADS, build_workload, load_workload_file

    if args.requests is not None and args.requests < 1:
        raise BadRequestError("--requests must be >= 1")
    if args.workload_file:
        items = load_workload_file(args.workload_file)
        return Path(args.workload_file).stem, items[: args.requests] if args.requests else items
    n = args.requests
    if args.workload in BUILTIN_WORKLOADS and n is None:
        n = DEFAULT_REQUESTS
    kw = {}
    if args.chunk_tokens is not None:
        _synthetic_only(args, "--chunk-tokens")
        kw["chunk_tokens"] = parse_chunk_tokens(args.chunk_tokens)
    if args.chunks_per_request is not None:
        _synthetic_only(args, "--chunks-per-request")
        if args.chunks_per_request < 1:
            raise BadRequestError("--chunks-per-request must be >= 1")
        kw["k"] = args.chunks_per_request
    if getattr(args, "permute", False):
        _synthetic_only(args, "--permute")
        kw["permute"] = True
    items = build_workload(args.workload, n, seed=_seed(args) or 0, **kw)
    name = args.workload if args.workload in BUILTIN_WORKLOADS else Path(args.workload).stem
    if kw.get("permute"):
        name = "synthetic-permute"
    return name, items


def _synthetic_only(args: argparse.Namespace, flag: str) -> None:
    if args.workload != "synthetic":
        raise BadRequestError(f"{flag} applies to --workload synthetic only")


def _split(text: str, kind: type) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadRequestError(f"cannot parse {text!r} as a comma-separated list") from None


def _load_model(args: argparse.Namespace) -> Any:
    from cachecraft.api import load_model

    return load_model(args.model, args.dtype, args.device)


def _print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cols = ("computed_fraction", "flops_fraction", "ttft_ms_p50", "ttft_speedup_vs_full",
            "rouge_l_vs_full", "tf_kl_vs_full", "tf_agreement_vs_full", "f1_vs_gold",
            "contains_vs_gold")  # fmt: skip
    table = Table(title=f"bench quality: {summary['workload']} ({summary['model']})")
    table.add_column("mode")
    for c in cols:
        table.add_column(c.replace("_vs_full", "").replace("_", " "), justify="right")
    for mode, m in summary["modes"].items():
        table.add_row(mode, *("–" if m[c] is None else f"{m[c]:.3f}" for c in cols))
    Console().print(table)


def _int8_store(cache_dir: str | None) -> StoreConfig | None:
    if cache_dir is None:
        return None
    return StoreConfig(cache_dir=cache_dir, memory_bytes=0, int8=True, doorkeeper_threshold=1)


def _bench_quality(args: argparse.Namespace) -> int:
    from cachecraft_bench.quality import mode_of, run_quality
    from cachecraft_bench.quality_summary import flat_summary
    from cachecraft_bench.report import write_report

    base = reuse_config_from_args(args)
    configs = dict(parse_arm(text, base) for text in args.arm)
    modes = list(dict.fromkeys([*_split(args.modes, str), *configs]))
    for m in modes:
        mode_of(m)  # unknown modes fail before the model loads
    if args.set:
        from cachecraft_bench.eval_sets import set_workloads

        runs = set_workloads(args.set, args.seed, args.requests, args.warmup)
    else:
        runs = [(*load_items(args), _warmup(args))]
    loaded = _load_model(args)
    results: dict[str, Any] = {}
    for name, items, warmup in runs:
        got = run_quality(
            loaded, items, modes, warmup=warmup, match_budget=args.match_budget,
            max_tokens=args.max_tokens, base=base, configs=configs, ablations=args.ablations,
            sweep=args.sweep, progress=not args.no_progress, workload=name,
            shared_warmup=args.shared_warmup, seed=_seed(args) or 0,
            store_config=_int8_store(args.int8_store), store_bytes=args.store_mib << 20,
        )  # fmt: skip
        results = results or {"config": got["config"], "workloads": {}}
        results["workloads"].update(got["workloads"])
    if args.set:
        results["config"].update(set=args.set, workload=[name for name, _, _ in runs])
    if args.out:
        paths = write_report(results, Path(args.out))
        log.info("wrote %s", ", ".join(str(p) for p in paths))
    summaries = [
        flat_summary({"config": results["config"], "workloads": {name: wl}})
        for name, wl in results["workloads"].items()
    ]
    if args.json:
        print(json.dumps(summaries[0] if len(summaries) == 1 else summaries, indent=2))
    else:
        for summary in summaries:
            _print_table(summary)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from cachecraft.config_file import write_config
    from cachecraft_bench.calibrate import calibration_curve, pick_alpha, selector_rule

    if not 0 < args.target <= 1:
        raise BadRequestError(f"--target must be in (0, 1], got {args.target}")
    alphas = _split(args.alphas, float)
    if not alphas:
        raise BadRequestError("--alphas is empty")
    base = reuse_config_from_args(args)
    name, items = load_items(args)
    model = _load_model(args)
    run = dict(warmup=_warmup(args), max_tokens=args.max_tokens, progress=not args.no_progress)
    points = calibration_curve(model, items, alphas, base=base, workload=name, **run)
    alpha = pick_alpha({p["param"]: p["rouge_l"] for p in points}, args.target)
    curve = [{k: p[k] for k in ("param", "rouge_l", "computed_fraction", "tf_kl")} for p in points]
    reached = any(p["param"] == alpha and (p["rouge_l"] or 0) >= args.target for p in points)
    settings, rules = {}, None
    if args.selector:
        at_alpha = dataclasses.replace(base, alpha=alpha)
        settings, rules = selector_rule(model, items, base=at_alpha, workload=name, **run)
    path = write_config(
        args.write or args.config, alpha, settings, target=args.target, reached=reached,
        workload=name, requests=len(items), warmup=_warmup(args), curve=curve,
        selector=rules,
    )  # fmt: skip
    out = {"alpha": alpha, "target": args.target, "reached": reached, "config": str(path)}
    out.update(settings, curve=curve)
    if rules is not None:
        out["selector_tf_kl_minus_default"] = rules
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"alpha {alpha:g} (target ROUGE-L {args.target}, reached: {reached}) -> {path}")
        if rules is not None:
            print("selector " + ", ".join(f"{k} {v}" for k, v in settings.items()))
            for rule, d in rules.items():
                if d["mean"] is None:
                    print(f"  {rule}: no request measured")
                    continue
                mean, (lo, hi) = d["mean"], d["ci95"]
                print(f"  {rule}: TF-KL - default {mean:+.4f} [{lo:+.4f}, {hi:+.4f}]")
        for p in curve:
            rouge, frac = p["rouge_l"], p["computed_fraction"]
            print(f"  alpha {p['param']:<6g} ROUGE-L {rouge:.3f}  computed {frac:.3f}")
    return 0


def _guard(fn: Any, args: argparse.Namespace) -> int:
    try:
        return fn(args)
    except CachecraftError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def main_bench_quality(args: argparse.Namespace) -> int:
    return _guard(_bench_quality, args)


def main_calibrate(args: argparse.Namespace) -> int:
    return _guard(_calibrate, args)
