"""`cachecraft bench records FILE`: keep slim per-request records of runs, and pool them.

`--add NAME=RESULTS.json` slims a `bench quality` results.json (records.py) into FILE under
NAME (one entry per workload: `NAME` when the run has one, `NAME/WORKLOAD` otherwise). An entry
of that name holding other requests is replaced; one holding the same requests gains the run's
other arms (a later run of one more arm), provided the arms both hold agree record by record
(else the runs differ in code or settings and pooling them would mislead: an error).
`--pool NAME,NAME,...` prints, over the named entries' requests together, each arm's share of
naive reuse's TF-KL removed (bootstrap 95% CI, and how many requests it left further off than
naive), its mean F1 and what it recomputed, and the paired TF-KL difference of `--against`
(default: the first cachecraft arm) minus each arm.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cachecraft.errors import BadRequestError
from cachecraft_bench.paired import kl_removed, paired_summary
from cachecraft_bench.records import expand, slim
from cachecraft_bench.report_cli import load_results


def _read(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequestError(f"{path} is not a records file: {e}") from None
    if not isinstance(data, dict):
        raise BadRequestError(f"{path} is not a records file")
    return data


def _add(data: dict[str, Any], spec: str) -> list[str]:
    name, sep, results = spec.partition("=")
    if not sep or not name or not results:
        raise BadRequestError(f"--add takes NAME=RESULTS.json, got {spec!r}")
    workloads = slim(load_results(results))
    added = []
    for workload, entry in workloads.items():
        key = name if len(workloads) == 1 else f"{name}/{workload}"
        data[key] = _joined(data.get(key), entry, key)
        added.append(key)
    return added


def _joined(old: Any, entry: dict[str, Any], key: str) -> dict[str, Any]:
    """`entry`, with the arms of `old` when it holds the same requests (module doc)."""
    if not isinstance(old, dict) or old.get("ids") != entry["ids"]:
        return entry
    shared = sorted(set(old["arms"]) & set(entry["arms"]))
    differ = [arm for arm in shared if old["arms"][arm] != entry["arms"][arm]]
    if differ:
        raise BadRequestError(
            f"{key} holds these requests with other records for {differ}: "
            "another code or settings; add the run under another name"
        )
    return {"ids": entry["ids"], "arms": {**old["arms"], **entry["arms"]}}


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def pool_lines(data: dict[str, Any], names: list[str], against: str | None) -> list[str]:
    """The `--pool` table as lines of text."""
    missing = [n for n in names if n not in data]
    if missing:
        raise BadRequestError(f"no entries {missing}; the file holds {sorted(data)}")
    pooled = expand({n: data[n] for n in names})
    if "naive" not in pooled:
        raise BadRequestError("the pooled runs have no naive arm to measure removal against")
    ref = against or next((a for a in pooled if a.startswith("cachecraft")), None)
    if ref is not None and ref not in pooled:
        raise BadRequestError(f"--against {ref!r}: the arms are {sorted(pooled)}")
    summary = paired_summary(pooled, ref=ref) if ref is not None else {}
    removed, against_ref = summary.get("kl_removed", {}), summary.get("arms", {})
    lines = [f"{len(pooled['naive'])} requests from {', '.join(names)}"]
    for arm, records in pooled.items():
        line = f"{arm:28s} F1 {_fmt(_mean(records, 'f1'))}"
        if arm in ("full", "naive"):
            lines.append(line)
            continue
        k = removed.get(arm) or kl_removed(records, pooled["naive"])
        lo, hi = k["ci95"]
        line += (
            f"  removed {_fmt(k['mean'], '.0%')} [{_fmt(lo, '.0%')}, {_fmt(hi, '.0%')}]"
            f" worse {k['worse']}/{k['n']}"
            f"  recomputed {_fmt(_mean(records, 'reused_recompute_fraction'))}"
            f" + probe {_fmt(_mean(records, 'probe_fraction'))}"
        )
        if arm in against_ref:  # paired_summary gives arm - ref; printed the other way
            d = against_ref[arm]["tf_kl"]
            mean, lo, hi = (None if x is None else -x for x in (d["mean"], *d["ci95"]))
            line += (
                f"  {ref} minus it {_fmt(mean, '+.4f')} [{_fmt(hi, '+.4f')}, {_fmt(lo, '+.4f')}]"
            )
        lines.append(line)
    return lines


def main_bench_records(args: argparse.Namespace) -> int:
    path = Path(args.file)
    data = _read(path)
    if not args.add and not args.pool:
        raise BadRequestError("give --add NAME=RESULTS.json or --pool NAME,...")
    if args.add:
        for spec in args.add:
            for key in _add(data, spec):
                print(f"added {key}")
        path.write_text(json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n")
    if args.pool:
        names = [n for n in args.pool.split(",") if n]
        print("\n".join(pool_lines(data, names, args.against)))
    return 0


def add_bench_records_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `records` to the `bench` subcommands; sets `func`."""
    p = subparsers.add_parser("records", help="keep slim per-request records of runs; pool them")
    p.add_argument("file", help="the records file (JSON; created by the first --add)")
    p.add_argument("--add", action="append", default=[], metavar="NAME=RESULTS.json")
    p.add_argument("--pool", default=None, metavar="NAME,NAME,...")
    p.add_argument("--against", default=None, help="the arm the others are paired with")
    p.set_defaults(func=main_bench_records)
    return p
