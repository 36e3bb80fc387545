"""`cachecraft bench serve` on the command line: the argument parser and the table or JSON output.

Wire it with `add_bench_serve_parser(bench_subparsers)`; the work is `run_serve_bench`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys

from cachecraft.api import SHAPES, default_dtype
from cachecraft.errors import CachecraftError
from cachecraft_bench.own_server import server_process
from cachecraft_bench.peer_vllm import PeerConfig
from cachecraft_bench.serve_bench import (
    DEFAULT_BURSTS,
    DEFAULT_FRACTIONS,
    DEFAULT_MAX_RUNS,
    DEFAULT_MODES,
    DEFAULT_RATES,
    DEFAULT_REFINE,
    DEFAULT_REPEATS,
    ENV_TUNINGS,
    PEERS,
    ServerFactory,
    run_serve_bench,
)
from cachecraft_bench.serve_parts import Parts
from cachecraft_bench.trace import CLIENTS


def _parse_rates(text: str) -> list[float]:
    """--rates: positive requests/s, comma-separated (checked before any workload is built)."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or not all(r > 0 and math.isfinite(r) for r in rates):
        raise argparse.ArgumentTypeError(
            f"--rates takes positive numbers like 0.1,0.2, got {text!r}"
        )
    return rates


def _parse_fractions(text: str) -> list[float]:
    """--capacity-fractions: numbers in (0, 1], comma-separated; empty: none."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = [-1.0]
    if not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"--capacity-fractions takes numbers in (0, 1] like 0.5,0.8, got {text!r}"
        )
    return values


def add_bench_serve_parser(
    subparsers: argparse._SubParsersAction, server_factory: ServerFactory = server_process
) -> argparse.ArgumentParser:
    """`server_factory(mode)` starts one of our servers per mode: by default `cachecraft serve`
    in a child process (tests pass a fake one)."""
    parser = subparsers.add_parser(
        "serve", help="open-loop Poisson RAG trace per mode, rates ramped to saturation (vs vLLM)"
    )
    parser.add_argument("--json", action="store_true", help="print the result dict as JSON")
    parser.add_argument(
        "--peer",
        choices=("none", *PEERS),
        default=None,
        help="add a real peer as a mode (none: our modes alone, e.g. on a GPU host)",
    )
    parser.add_argument(
        "--rates",
        type=_parse_rates,
        default=list(DEFAULT_RATES),
        help="first rates of the ramp, requests/s, e.g. 0.1,0.2 (then doubling)",
    )
    parser.add_argument(
        "--max-runs",
        type=int,
        default=DEFAULT_MAX_RUNS,
        help="rates per system at most (the ramp stops earlier once a system saturates)",
    )
    parser.add_argument("--requests", type=int, default=8, help="requests per run")
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help="runs per point of a curve (a system at a rate), each over its own requests; "
        "CIs are over them",
    )
    parser.add_argument(
        "--capacity-fractions",
        type=_parse_fractions,
        default=list(DEFAULT_FRACTIONS),
        help="after the bursts, a point per system at these fractions of its own capacity "
        "(latencies compared at equal load; empty: none)",
    )
    parser.add_argument(
        "--peer-config",
        choices=("search", "first"),
        default="search",
        help="search: try vLLM's plausible configurations (eager or compiled, its batched-token "
        "limit ours or its default, a front-end core reserved or not) on one burst each and "
        "keep the best; first: eager, 2,048 batched tokens, no reserved core, untried",
    )
    parser.add_argument(
        "--env-tuning",
        choices=ENV_TUNINGS,
        default="none",
        help="OpenMP waiting and allocator tuning, the same for every system: none (each "
        "library's defaults) or ours (cachecraft's, given to vLLM too)",
    )
    parser.add_argument(
        "--no-answer-check",
        dest="check_answers",
        action="store_false",
        help="skip replaying the measured requests in full mode to check every answer",
    )
    parser.add_argument(
        "--bursts",
        type=int,
        default=DEFAULT_BURSTS,
        help="runs per system, after the ramp, that send a run's requests all at once; its "
        "capacity is their median (0: none)",
    )
    parser.add_argument(
        "--no-burst",
        dest="bursts",
        action="store_const",
        const=0,
        help="the same as --bursts 0",
    )
    parser.add_argument(
        "--refine",
        type=int,
        default=DEFAULT_REFINE,
        help="runs after the ramp, on every system, at a rate between the highest one all "
        "sustained and the next (each halves the gap; 0: none)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=8,
        help="requests of the stream replayed first, one by one and unmeasured, to warm caches",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-tokens", type=int, default=8, help="answer tokens per request (8, or 128 for long)"
    )
    parser.add_argument(
        "--workload",
        choices=("wiki-qa", "repeats", "synthetic", "chat", "shared-prefix"),
        default="wiki-qa",
        help="wiki-qa: FanOutQA questions with Zipf popularity over BM25 top-5 Wikipedia "
        "passages (a repeat retrieves k of its top 2k in a new order); repeats: the same, but "
        "a repeat retrieves the same passages in the same order (exact repeats: prefix "
        "caching is enough); synthetic: Zipf chunk popularity (--chunk-tokens); chat: multi-turn "
        "ShareGPT chats, six at a time, every turn sent with the ones before; shared-prefix: "
        "one long message each, one of 4 shared ~1,500-token beginnings and its own question",
    )
    parser.add_argument(
        "--client",
        choices=CLIENTS,
        default="documents",
        help="how our servers get a request's passages: the documents field, pasted into the "
        "user message (LangChain's stuff prompt; llamaindex: LlamaIndex's question-answering "
        "prompt), or into the system message (LangChain's retrieval chain), cut into chunks by "
        "the server; vLLM gets the same prompt tokens (not with --workload chat or "
        "shared-prefix)",
    )
    parser.add_argument("--zipf", type=float, default=1.0, help="wiki-qa question popularity")
    parser.add_argument(
        "--questions", type=int, default=24, help="wiki-qa: distinct questions in the pool"
    )
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help="our modes, comma list")
    parser.add_argument("--peer-python", default=None, help="python of the peer venv")
    parser.add_argument(
        "--chunk-tokens",
        default="128,512",
        help="min,max tokens per chunk of the synthetic Zipf workload",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="weights and compute of every system, vLLM included (default: bfloat16 on a GPU, "
        "float32 on a CPU)",
    )
    parser.add_argument(
        "--device", default="cpu", help="where our servers run (cpu, cuda); vLLM runs on a CPU"
    )
    parser.add_argument(
        "--shape",
        choices=SHAPES,
        default=None,
        help="our servers run a model of this shape with random weights (speed only: no "
        "download, no peer; cachecraft/model/shapes.py)",
    )
    parser.set_defaults(func=main_serve_bench, server_factory=server_factory)
    return parser


def _items(args: argparse.Namespace) -> list:
    """The whole stream: the warm-up, then `requests` for each run the ramp may make."""
    parts = Parts(
        args.max_runs, args.repeats, args.refine, args.bursts, len(args.capacity_fractions)
    )
    n = args.warmup + parts.total * args.requests
    if args.workload in ("wiki-qa", "repeats"):
        from cachecraft_bench.wiki_qa import wiki_qa_zipf

        return wiki_qa_zipf(
            n,
            seed=args.seed,
            zipf_s=args.zipf,
            num_questions=args.questions,
            exact_repeats=args.workload == "repeats",
        )
    if args.workload == "chat":
        from cachecraft_bench.chat import chat_workload

        return chat_workload(n)
    if args.workload == "shared-prefix":
        from cachecraft_bench.shared_prefix import shared_prefix

        return shared_prefix(n, seed=args.seed)
    from cachecraft_bench.synthetic import parse_chunk_tokens, synthetic

    return synthetic(n, chunk_tokens=parse_chunk_tokens(args.chunk_tokens), seed=args.seed)


def _print_progress(system: str, message: str) -> None:
    """A long run (tens of minutes) says what it is doing, on stderr (stdout may be JSON)."""
    print(f"[bench serve] {system}: {message}", file=sys.stderr, flush=True)


def main_serve_bench(args: argparse.Namespace) -> int:
    if args.client != "documents" and args.workload in ("chat", "shared-prefix"):
        raise CachecraftError(f"--client {args.client} pastes passages; {args.workload} has none")
    if args.repeats < 1 or args.requests < 1:
        raise CachecraftError("--repeats and --requests must be >= 1")
    peer = None if args.peer in (None, "none") else args.peer
    if peer is not None and (args.shape or args.device != "cpu"):
        raise CachecraftError("--shape and --device are for our servers alone: use --peer none")
    items = _items(args)
    # our servers in vLLM's dtype, with the environment tuning every system gets
    factory = functools.partial(args.server_factory, tuned=args.env_tuning == "ours")
    extra: list[str] = []
    dtype = args.dtype or default_dtype(args.device)
    if dtype != "float32":
        extra += ["--dtype", dtype]
    if args.device != "cpu":
        extra += ["--device", args.device]
    if args.shape:
        extra += ["--model", f"shape:{args.shape}"]
    if extra:
        factory = functools.partial(factory, extra_args=tuple(extra))
    result = run_serve_bench(
        factory,
        peer=peer,
        rates=args.rates,
        num_requests=args.requests,
        seed=args.seed,
        modes=[m.strip() for m in args.modes.split(",") if m.strip()],
        max_tokens=args.max_tokens,
        peer_python=args.peer_python,
        items=items,
        max_runs=args.max_runs,
        warmup=args.warmup,
        progress=_print_progress,
        bursts=args.bursts,
        refine=args.refine,
        dtype=dtype,
        client=args.client,
        repeats=args.repeats,
        fractions=args.capacity_fractions,
        peer_configs=[PeerConfig()] if args.peer_config == "first" else None,
        check_answers=args.check_answers,
        env_tuning=args.env_tuning,
    )
    result["config"]["workload"] = args.workload
    if args.json:
        print(json.dumps(result, indent=2))  # CLI output, not library logging
        return 0
    from rich.console import Console
    from rich.table import Table

    cfg = result["config"]
    table = Table(
        title=f"serving: {cfg['num_requests']} RAG requests per run after {cfg['warmup']} warm-up"
    )
    for col in (
        "rate",
        "mode",
        "req/s",
        "TTFT p50/p95 ms",
        "e2e p50/p95 ms",
        "computed",
        "computed tok/s",
        "work tok/s",
        "rej/err",
    ):
        table.add_column(col, justify="right")
    runs = list(result["per_rate"].items())
    if "burst" in result:
        runs.append(("burst (median)", result["burst"]))
    for rate, by_mode in runs:
        for mode, s in by_mode.items():
            frac = s["computed_fraction"]
            table.add_row(
                rate,
                mode,
                f"{s['throughput_rps']:.3f}",
                f"{s['ttft_ms_p50']} / {s['ttft_ms_p95']}",
                f"{s['e2e_ms_p50']} / {s['e2e_ms_p95']}",
                "-" if frac is None else f"{frac:.3f}",
                str(s.get("computed_tokens_per_s")),
                str(s.get("work_tokens_per_s")),
                f"{s['num_rejected']}/{s['num_errors']}",
            )
    console = Console()
    console.print(table)
    keys = (
        "max_throughput_rps",
        "max_throughput_run",
        "computed_tokens_per_s",
        "work_tokens_per_s",
        "sustained_rate",
    )
    for key in (*keys, "burst_throughputs_rps", "saturated"):
        if key in result:
            console.print(f"{key}: {result[key]}")
    common = result["common_rate"]
    note = "" if result["common_rate_is_sustained"] else " (not sustained by every system)"
    console.print(f"highest rate every system sustains: {common}{note}")
    for key, value in result.items():
        if "ratio" in key or key in ("vllm_prefix_cache", "cachecraft_reused_tokens"):
            console.print(f"{key}: {value}")
    if "peer" in result:
        console.print(f"vLLM configuration: {result['peer'].get('config_label')}")
        for trial in result["peer"].get("configs_tried", []):
            got = trial.get("capacity_rps", trial.get("error"))
            console.print(f"  tried {trial['label']}: {got}")
    for system, check in result.get("answer_agreement_vs_full", {}).items():
        console.print(
            f"answers vs full, {system}: exact {check['exact_match_rate']}, "
            f"token agreement {check['token_agreement']} over {check['num_answers']}"
        )
    console.print(f"wall time: {result['wall_s']} s")
    return 0
