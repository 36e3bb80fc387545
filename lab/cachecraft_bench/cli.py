"""`cachecraft bench ...` and `cachecraft calibrate`: the lab's commands, added to the product's
command line through the `cachecraft.commands` entry point (see `register`)."""

from __future__ import annotations

import argparse
import json

from cachecraft.api import SHAPES
from cachecraft_bench.chaos import add_bench_chaos_parser
from cachecraft_bench.chat_bench import add_bench_chat_parser
from cachecraft_bench.decode_bench import add_bench_decode_parser
from cachecraft_bench.quality_cli import add_bench_quality_parser, add_calibrate_parser
from cachecraft_bench.records_cli import add_bench_records_parser
from cachecraft_bench.report_cli import add_bench_report_parser
from cachecraft_bench.serve_cli import add_bench_serve_parser
from cachecraft_bench.store_bench import add_bench_store_parser


def _bench_model(args: argparse.Namespace) -> int:
    from cachecraft.api import load_model
    from cachecraft_bench.host_overhead import host_overhead
    from cachecraft_bench.model_bench import run_model_bench

    if args.shape:  # random weights: nothing to compare with HF, only our own timings
        m = load_model(f"shape:{args.shape}", args.dtype, args.device)
        dtype = str(m.model.dtype).removeprefix("torch.")
        result = {"model": m.name, "device": args.device, "dtype": dtype}
        result.update(host_overhead(m, args.repeats))
        print(json.dumps(result) if args.json else json.dumps(result, indent=1))
        return 0
    lengths = tuple(int(x) for x in args.lengths.split(","))
    m = load_model(args.model, args.dtype, args.device)
    result = run_model_bench(m, lengths, args.repeats)
    result.update(host_overhead(m, args.repeats))
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
    print(f"host overhead (TTFT - forward, ms, {result['host_overhead_request']}):")
    print("  " + ", ".join(f"{k} {v}" for k, v in result["host_overhead_ms"].items()))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench` (model | quality | store | serve | decode | chat | report | records | chaos)
    and `calibrate` to the `cachecraft` command's subparsers."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    model = bench.add_parser("model", help="our prefill vs HF transformers, side by side")
    model.add_argument("--model", default=None)
    model.add_argument("--lengths", default="512,1024,2048")
    model.add_argument("--repeats", type=int, default=5)
    model.add_argument("--json", action="store_true")
    model.add_argument(
        "--shape",
        choices=SHAPES,
        default=None,
        help="a model of this shape with random weights: the host-overhead meter alone",
    )
    model.add_argument("--device", default="cpu", help="cpu or cuda")
    model.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="default: bfloat16 on a GPU, float32 on a CPU",
    )
    model.set_defaults(func=_bench_model)
    for add in (
        add_bench_quality_parser,
        add_bench_store_parser,
        add_bench_serve_parser,
        add_bench_decode_parser,
        add_bench_chat_parser,
        add_bench_report_parser,
        add_bench_records_parser,
        add_bench_chaos_parser,
    ):
        add(bench)
    add_calibrate_parser(sub)
