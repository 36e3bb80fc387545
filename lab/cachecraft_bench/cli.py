"""`cachecraft bench ...` and `cachecraft calibrate`: the lab's commands, added to the product's
command line through the `cachecraft.commands` entry point (see `register`)."""

from __future__ import annotations

import argparse
import json

from cachecraft_bench.chaos import add_bench_chaos_parser
from cachecraft_bench.chat_bench import add_bench_chat_parser
from cachecraft_bench.decode_bench import add_bench_decode_parser
from cachecraft_bench.quality_cli import add_bench_quality_parser, add_calibrate_parser
from cachecraft_bench.report_cli import add_bench_report_parser
from cachecraft_bench.serve_cli import add_bench_serve_parser
from cachecraft_bench.store_bench import add_bench_store_parser


def _bench_model(args: argparse.Namespace) -> int:
    from cachecraft.api import load_model
    from cachecraft_bench.model_bench import run_model_bench

    lengths = tuple(int(x) for x in args.lengths.split(","))
    result = run_model_bench(load_model(args.model), lengths, args.repeats)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"model {result['model']}, {result['threads']} threads, median of {args.repeats}")
    print(f"max |logit diff| vs HF: {result['max_abs_logit_diff']:.2e}")
    print(f"32 greedy tokens identical to HF generate: {result['greedy_match']}")
    for n, row in result["prefill"].items():
        print(
            f"  {n:>5} tokens: ours {row['ours_ms']:8.1f} ms, HF {row['hf_ms']:8.1f} ms, "
            f"speedup {row['speedup']:.2f}x, peak +{row['ours_peak_mib']} / +{row['hf_peak_mib']} MiB"
        )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench` (model | quality | store | serve | decode | chat | report | chaos) and
    `calibrate`
    to the `cachecraft` command's subparsers."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    model = bench.add_parser("model", help="our prefill vs HF transformers, side by side")
    model.add_argument("--model", default=None)
    model.add_argument("--lengths", default="512,1024,2048")
    model.add_argument("--repeats", type=int, default=5)
    model.add_argument("--json", action="store_true")
    model.set_defaults(func=_bench_model)
    for add in (
        add_bench_quality_parser,
        add_bench_store_parser,
        add_bench_serve_parser,
        add_bench_decode_parser,
        add_bench_chat_parser,
        add_bench_report_parser,
        add_bench_chaos_parser,
    ):
        add(bench)
    add_calibrate_parser(sub)
