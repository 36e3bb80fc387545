"""`cachecraft bench report RESULTS.json`: redraw report.md and the plots from a results.json.

Reruns nothing: the per-request records kept in results.json are summarised again (paired
comparisons included), so a report from an older version, or one whose plots were lost, is
brought up to date in seconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cachecraft.bench.paired import paired_summary
from cachecraft.bench.report import write_report
from cachecraft.errors import BadRequestError


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
    results = refresh(load_results(args.results))
    out = Path(args.out) if args.out else Path(args.results).parent
    for path in write_report(results, out):
        print(path)
    return 0


def add_bench_report_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `report` to the `bench` subcommands; sets `func`."""
    p = subparsers.add_parser("report", help="redraw report.md and plots from a results.json")
    p.add_argument("results", help="a results.json written by bench quality --out")
    p.add_argument("--out", default=None, help="directory to write (default: the file's own)")
    p.set_defaults(func=main_bench_report)
    return p
