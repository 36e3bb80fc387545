"""Merge the results.json of several `bench quality` runs (shards) into one.

Shards are runs of the same arms on disjoint requests, e.g. one per workload seed run side by
side on a multi-core machine, in the same configuration: shards whose configurations differ
in anything but their requests and seeds are refused (`config_differences`), since pooling
them would average two experiments into one that never ran. Their per-request records are pooled and summarised again, so
the merged means, CIs, percentiles, sweep points and paired comparisons are those of one run
over all the requests. Storage is per run (each shard had its own caches): the merged value is
the shards' mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cachecraft.errors import BadRequestError
from cachecraft_bench.paired import paired_summary
from cachecraft_bench.quality_summary import add_speedups, summarize_records, sweep_point


def _merge_workload(name: str, shards: Sequence[dict[str, Any]]) -> dict[str, Any]:
    arms = [list((s.get("requests") or {}).keys()) for s in shards]
    if not arms[0] or any(a != arms[0] for a in arms):
        raise BadRequestError(f"workload {name!r}: the shards must run the same arms, got {arms}")
    requests: dict[str, list[dict[str, Any]]] = {}
    for arm in arms[0]:
        pooled = [r for s in shards for r in s["requests"][arm]]
        ids = [r["id"] for r in pooled]
        if len(set(ids)) != len(ids):
            raise BadRequestError(f"workload {name!r}: a request appears in two shards")
        requests[arm] = pooled
    summaries = {arm: summarize_records(recs) for arm, recs in requests.items()}
    add_speedups(summaries)
    modes = {}
    for arm in shards[0].get("modes") or {}:
        entry = summaries[arm]
        for key in ("storage_bytes", "num_variants"):
            values = [(s["modes"].get(arm) or {}).get(key) for s in shards]
            values = [v for v in values if isinstance(v, int | float)]
            entry[key] = sum(values) / len(values) if values else None
        modes[arm] = entry
    sweep: dict[str, list[dict[str, Any]]] = {}
    for mode, points in (shards[0].get("sweep") or {}).items():
        sweep[mode] = [sweep_point(p["arm"], p["param"], summaries[p["arm"]]) for p in points]
    paired = paired_summary({m: requests[m] for m in modes})
    return {"modes": modes, "sweep": sweep, "paired": paired, "requests": requests}


SHARD_KEYS = frozenset({"requests", "merged_from", "seeds", "seed"})
"""Config keys (top level, and `seed` inside `reuse`) in which shards may differ."""


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in config.items() if k not in SHARD_KEYS}
    if isinstance(out.get("reuse"), dict):
        out["reuse"] = {k: v for k, v in out["reuse"].items() if k != "seed"}
    return out


def config_differences(configs: Sequence[dict[str, Any]], sources: Sequence[str]) -> list[str]:
    """One line per setting in which a shard's configuration differs from the first's
    (requests and seeds aside), e.g. "reuse.alpha: 0.5 in a.json, 0.7 in b.json"."""
    first = _comparable(configs[0])
    lines = []
    for config, source in zip(configs[1:], sources[1:], strict=True):
        other = _comparable(config)
        for key in sorted(set(first) | set(other)):
            a, b = first.get(key), other.get(key)
            if isinstance(a, dict) and isinstance(b, dict):
                for sub in sorted(set(a) | set(b)):
                    if a.get(sub) != b.get(sub):
                        lines.append(
                            f"{key}.{sub}: {a.get(sub)!r} in {sources[0]}, {b.get(sub)!r} in {source}"
                        )
            elif a != b:
                lines.append(f"{key}: {a!r} in {sources[0]}, {b!r} in {source}")
    return lines


def merge_results(results: Sequence[dict[str, Any]], sources: Sequence[str]) -> dict[str, Any]:
    """One results dict (bench/report.py schema) from several with the same workloads and
    the same configuration (`config_differences`)."""
    names = [list(r["workloads"]) for r in results]
    if any(n != names[0] for n in names):
        raise BadRequestError(f"the results hold different workloads: {names}")
    differ = config_differences([r.get("config") or {} for r in results], sources)
    if differ:
        raise BadRequestError(
            "the shards ran different configurations; merging them would pool two "
            "experiments:\n" + "\n".join(differ)
        )
    config = dict(results[0].get("config") or {})
    config["requests"] = sum(int((r.get("config") or {}).get("requests") or 0) for r in results)
    config["merged_from"] = list(sources)
    seeds = [(r.get("config") or {}).get("reuse", {}).get("seed") for r in results]
    config["seeds"] = seeds
    workloads = {
        name: _merge_workload(name, [r["workloads"][name] for r in results]) for name in names[0]
    }
    return {"config": config, "workloads": workloads}
