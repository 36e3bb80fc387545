"""`bench serve`'s result: per-rate curves, capacities, the common rate, and cachecraft's
ratios over the other systems with their CIs. Pure arithmetic over the runs; owns no I/O.

Keys: `per_rate` {rate: {system: point}} (the curves of latency against offered load; each
point has `e2e_ms_p50_ci`, `throughput_rps_ci`), `burst` (each system's median burst),
`capacity_rps` (that burst's throughput), `max_throughput_rps`, `common_rate` (the highest
rate every system sustained) and `modes` (the points there), `at_capacity_fraction`
{fraction: {system: point}}, and cachecraft's `throughput_ratio_vs_X` (+ `_ci`),
`e2e_p50_ratio_X_over_cachecraft` (+ `_ci`) and `..._at_capacity_fraction` (+ `_ci`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cachecraft_bench.ramp import BURST, median_run, rate_key, saturated, sustained_rate
from cachecraft_bench.serve_stats import paired_ratio_ci, ratio_of_medians_ci

FRACTIONS = "fractions"
OTHERS = ("prefix", "vllm")


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num is not None and den else None


def summarize_bench(
    per_system: Mapping[str, dict[str, Any]],
    config: dict[str, Any],
    rates: Sequence[float],
    latency_bound: float,
) -> dict[str, Any]:
    """The result dict from each system's runs ({rate key: point, BURST: [runs],
    FRACTIONS: {fraction: point}})."""
    per_system = {name: dict(runs) for name, runs in per_system.items()}
    systems = list(per_system)
    bursts = {m: per_system[m].pop(BURST) for m in systems if BURST in per_system[m]}
    fractions = {m: per_system[m].pop(FRACTIONS, {}) for m in systems}
    result: dict[str, Any] = {"config": config}
    ran = sorted({float(k) for runs in per_system.values() for k in runs})
    result["rates"] = ran
    per_rate = {
        rate_key(r): {
            m: per_system[m][rate_key(r)] for m in systems if rate_key(r) in per_system[m]
        }
        for r in ran
    }
    result["per_rate"] = per_rate
    result["sustained_rate"] = {m: sustained_rate(per_rate, ran, m, latency_bound) for m in systems}
    result["saturated"] = {
        m: saturated(
            per_system[m][max(per_system[m], key=float)],
            per_system[m][min(per_system[m], key=float)].get("e2e_ms_p50"),
            latency_bound,
        )
        for m in systems
    }
    median = {m: median_run(runs) for m, runs in bursts.items()}
    if median:
        result["burst"] = median
        result["burst_throughputs_rps"] = {
            m: [s["throughput_rps"] for s in runs] for m, runs in bursts.items()
        }
        result["capacity_rps"] = {m: s["throughput_rps"] for m, s in median.items()}
    best = {
        m: max(
            [*per_system[m].items(), *([(BURST, median[m])] if m in median else [])],
            key=lambda kv: kv[1]["throughput_rps"],
        )
        for m in systems
    }
    result["max_throughput_rps"] = {m: best[m][1]["throughput_rps"] for m in systems}
    result["max_throughput_run"] = {m: best[m][0] for m in systems}
    for key in ("computed_tokens_per_s", "work_tokens_per_s"):
        result[key] = {m: best[m][1].get(key) for m in systems}
    sustained = [result["sustained_rate"][m] for m in systems]
    common = min(sustained) if all(r is not None for r in sustained) else None  # type: ignore[type-var]
    result["common_rate"] = common if common is not None else min(rates)
    result["common_rate_is_sustained"] = common is not None
    result["chosen_rate"] = result["common_rate"]  # older name of the same rate
    at = per_rate.get(rate_key(result["common_rate"]), {})
    result["modes"] = at
    if any(fractions.values()):
        keys = sorted({f for by in fractions.values() for f in by}, key=float)
        result["at_capacity_fraction"] = {
            f: {m: fractions[m][f] for m in systems if f in fractions[m]} for f in keys
        }
    result.update(_ratios(result, at, bursts))
    return result


def _ratios(
    result: Mapping[str, Any],
    at: Mapping[str, Mapping[str, Any]],
    bursts: Mapping[str, Sequence[Mapping[str, Any]]],
) -> dict[str, Any]:
    """cachecraft over each other system: throughput (capacity: the median bursts, CI over
    the rounds paired; without bursts the best points, no CI), p50 e2e at the common rate and
    at each fraction of each system's own capacity (CIs over the requests)."""
    out: dict[str, Any] = {}
    systems = result["max_throughput_rps"]
    if "cachecraft" not in systems:
        return out
    capacity = result.get("capacity_rps") or result["max_throughput_rps"]
    fractions = result.get("at_capacity_fraction", {})
    for other in OTHERS:
        if other not in systems:
            continue
        out[f"throughput_ratio_vs_{other}"] = _ratio(
            capacity.get("cachecraft"), capacity.get(other)
        )
        cc_b = [s["throughput_rps"] for s in bursts.get("cachecraft", [])]
        other_b = [s["throughput_rps"] for s in bursts.get(other, [])]
        paired = len(cc_b) == len(other_b)
        out[f"throughput_ratio_vs_{other}_ci"] = paired_ratio_ci(cc_b, other_b) if paired else None
        key = f"e2e_p50_ratio_{other}_over_cachecraft"
        cc, o = at.get("cachecraft", {}), at.get(other, {})
        out[key] = _ratio(o.get("e2e_ms_p50"), cc.get("e2e_ms_p50"))
        out[f"{key}_ci"] = ratio_of_medians_ci(o.get("e2e_ms") or [], cc.get("e2e_ms") or [])
        if fractions:
            by_f = {f: (p.get(other, {}), p.get("cachecraft", {})) for f, p in fractions.items()}
            out[f"{key}_at_capacity_fraction"] = {
                f: _ratio(o.get("e2e_ms_p50"), c.get("e2e_ms_p50")) for f, (o, c) in by_f.items()
            }
            out[f"{key}_at_capacity_fraction_ci"] = {
                f: ratio_of_medians_ci(o.get("e2e_ms") or [], c.get("e2e_ms") or [])
                for f, (o, c) in by_f.items()
            }
    if "vllm" in at and "cachecraft" in at:
        cc = at["cachecraft"]
        prompt, computed = cc.get("prompt_tokens"), cc.get("computed_tokens")
        out["vllm_prefix_cache"] = at["vllm"].get("prefix_cache")
        out["cachecraft_reused_tokens"] = (
            prompt - computed if prompt is not None and computed is not None else None
        )
        out["cachecraft_prompt_tokens"] = prompt
    return out
