"""`cachecraft bench report RESULTS.json...`: redraw report.md and the plots from results.json.

Reruns nothing: the per-request records kept in results.json are summarised again (paired
comparisons included), so a report from an older version, or one whose plots were lost, is
brought up to date in seconds. Several files are merged first (bench/merge.py): shards of one
benchmark, e.g. one per seed, run side by side.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cachecraft.errors import BadRequestError
from cachecraft_bench.merge import merge_results
from cachecraft_bench.paired import paired_summary
from cachecraft_bench.report import write_report


def refresh(results: dict) -> dict:
    """`results` with each workload's paired comparison recomputed from its records."""
    for wl in (results.get("workloads") or {}).values():
        requests = (wl or {}).get("requests") or {}
        modes = (wl or {}).get("modes") or {}
        if requests:
            wl["paired"] = paired_summary({m: requests[m] for m in modes if m in requests})
    return results


def load_results(path: str) -> dict:
    try:
        results = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BadRequestError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequestError(f"{path} is not a readable results.json: {e}") from None
    if not isinstance(results, dict) or not isinstance(results.get("workloads"), dict):
        raise BadRequestError(f"{path} has no 'workloads': not a bench quality results.json")
    return results


def main_bench_report(args: argparse.Namespace) -> int:
    if len(args.results) > 1 and not args.out:
        raise BadRequestError("merging several results needs --out DIR")
    loaded = [load_results(path) for path in args.results]
    results = refresh(loaded[0]) if len(loaded) == 1 else merge_results(loaded, args.results)
    out = Path(args.out) if args.out else Path(args.results[0]).parent
    for path in write_report(results, out):
        print(path)
    return 0


def add_bench_report_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `report` to the `bench` subcommands; sets `func`."""
    p = subparsers.add_parser("report", help="redraw report.md and plots from a results.json")
    p.add_argument(
        "results", nargs="+", help="results.json written by bench quality --out (several: merged)"
    )
    p.add_argument("--out", default=None, help="directory to write (default: the file's own)")
    p.set_defaults(func=main_bench_report)
    return p
