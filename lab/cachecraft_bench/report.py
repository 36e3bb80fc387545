"""Write benchmark results as results.json, report.md (a table per workload) and PNG plots.

Schema of `results` (every metric may be missing or None; a sweep may be empty):

    {"config": {str: any},
     "workloads": {name: {
         "modes": {mode: {metric: {"mean": float, "ci95": [lo, hi], "n": int} | float | None}},
         "sweep": {mode: [{"param": x, "computed_fraction": f, "tf_kl": f, "rouge_l": f}, ...]},
         "paired": {"reference": arm, "arms": {arm: {metric: summary}}, "kl_removed": {...},
                    "vs_full": {arm: {"f1" | "em" | "contains": summary}}}}}}

Metrics read: computed_fraction, flops_fraction, reused_recompute_fraction, probe_fraction,
chunk_hit_rate, ttft_p50_ms, ttft_p95_ms, rouge_l (vs full),
first_token_kl, tf_kl, tf_agreement, f1, em, contains (vs gold), storage_bytes (see COLUMNS).
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from cachecraft_bench.flops import compute_label

logger = logging.getLogger(__name__)

COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("computed_fraction", "computed frac", "{:.3f}"),
    ("flops_fraction", "FLOPs frac", "{:.3f}"),
    ("reused_recompute_fraction", "reused recomputed", "{:.3f}"),
    ("probe_fraction", "probe frac", "{:.3f}"),
    ("chunk_hit_rate", "hit rate", "{:.3f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
    ("ttft_p95_ms", "TTFT p95 ms", "{:.1f}"),
    ("rouge_l", "ROUGE-L vs full", "{:.3f}"),
    ("first_token_kl", "first-token KL", "{:.4f}"),
    ("tf_kl", "TF-KL", "{:.4f}"),
    ("tf_agreement", "TF agreement", "{:.3f}"),
    ("f1", "F1", "{:.3f}"),
    ("em", "EM", "{:.3f}"),
    ("contains", "contains gold", "{:.3f}"),
    ("storage_bytes", "storage", "bytes"),
)
"""(metric key, column header, format) of the report table, in order."""


def metric_value(entry: Any) -> float | None:
    """The number behind a metric entry: a summary's mean, or the number itself."""
    if isinstance(entry, dict):
        entry = entry.get("mean")
    if isinstance(entry, bool) or not isinstance(entry, int | float):
        return None
    return None if math.isnan(entry) else float(entry)


def metric_ci(entry: Any) -> tuple[float, float] | None:
    if not isinstance(entry, dict):
        return None
    ci = entry.get("ci95")
    if not isinstance(ci, list | tuple) or len(ci) != 2:
        return None
    lo, hi = (metric_value(v) for v in ci)
    return None if lo is None or hi is None else (lo, hi)


def _fmt_number(value: float, fmt: str) -> str:
    if fmt == "bytes":
        for unit in ("B", "KiB", "MiB", "GiB"):
            if abs(value) < 1024 or unit == "GiB":
                return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
            value /= 1024
    return fmt.format(value)


def format_cell(entry: Any, fmt: str) -> str:
    """`mean [lo, hi]`, a bare number, or "–" when the metric is missing."""
    value = metric_value(entry)
    if value is None:
        return "–"
    ci = metric_ci(entry)
    text = _fmt_number(value, fmt)
    if ci is not None:
        text += f" [{_fmt_number(ci[0], fmt)}, {_fmt_number(ci[1], fmt)}]"
    return text


def markdown_table(modes: dict[str, dict[str, Any]]) -> str:
    header = "| mode | " + " | ".join(label for _, label, _ in COLUMNS) + " |"
    rule = "|---" * (len(COLUMNS) + 1) + "|"
    rows = [
        f"| {mode} | " + " | ".join(format_cell((m or {}).get(k), f) for k, _, f in COLUMNS) + " |"
        for mode, m in modes.items()
    ]
    return "\n".join([header, rule, *rows])


PAIRED_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("tf_kl", "Δ TF-KL", "{:+.4f}"),
    ("first_token_kl", "Δ first-token KL", "{:+.4f}"),
    ("rouge_l", "Δ ROUGE-L", "{:+.3f}"),
    ("tf_agreement", "Δ TF agreement", "{:+.3f}"),
    ("computed_fraction", "Δ computed frac", "{:+.3f}"),
    ("flops_fraction", "Δ FLOPs frac", "{:+.3f}"),
)
"""(metric, header, format) of the paired table: arm minus the reference, per request."""


def paired_table(paired: dict[str, Any]) -> str:
    """The paired comparison (bench/paired.py) as markdown: one row per arm, then the share of
    naive reuse's TF-KL each arm removes, and whether the arm spent the reference's FLOPs
    (within `flops.FLOPS_TOLERANCE`, by the mean paired difference) or is labelled not
    compute-equal."""
    ref = paired.get("reference", "cachecraft")
    removed = paired.get("kl_removed") or {}
    header = (
        "| arm | "
        + " | ".join(label for _, label, _ in PAIRED_COLUMNS)
        + f" | {ref} lower TF-KL | naive TF-KL removed | worse than naive | compute |"
    )
    rows = [header, "|---" * (len(PAIRED_COLUMNS) + 5) + "|"]
    names = [*(paired.get("arms") or {}), *([ref] if ref in removed else [])]
    for name in names:
        diffs = (paired.get("arms") or {}).get(name, {})
        cells = [format_cell(diffs.get(k), f) for k, _, f in PAIRED_COLUMNS]
        share = (diffs.get("tf_kl") or {}).get("ref_lower")
        cells.append("–" if share is None else f"{share:.0%}")
        cells.append(format_cell(removed.get(name), "{:.2f}"))
        gone = removed.get(name) or {}  # results written before the count have no "worse"
        cells.append(f"{gone['worse']}/{gone['n']}" if "worse" in gone else "–")
        delta = (diffs.get("flops_fraction") or {}).get("mean")
        cells.append(
            "–" if name == ref else compute_label(delta, 0.0 if delta is not None else None)
        )
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


GOLD_COLUMNS: tuple[tuple[str, str], ...] = (
    ("f1", "Δ F1"),
    ("em", "Δ EM"),
    ("contains", "Δ contains gold"),
)
"""(metric, header) of the answers-vs-gold table: arm minus full, per request."""


def gold_table(vs_full: dict[str, Any]) -> str:
    """Each arm's loss against gold relative to the full prefill, request by request."""
    rows = ["| arm | " + " | ".join(h for _, h in GOLD_COLUMNS) + " |"]
    rows.append("|---" * (len(GOLD_COLUMNS) + 1) + "|")
    for name, diffs in vs_full.items():
        cells = [format_cell((diffs or {}).get(k), "{:+.3f}") for k, _ in GOLD_COLUMNS]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def ttft_table(ratios: dict[str, Any]) -> str:
    """Each arm's TTFT over full's on the same requests (`paired.median_ratio`)."""
    rows = ["| arm | TTFT / full's, median | requests |", "|---|---|---|"]
    for name, r in ratios.items():
        cell = "–"
        if r["median"] is not None:
            lo, hi = r["ci95"]
            cell = f"{r['median']:.3f}x [{lo:.3f}, {hi:.3f}]"
        rows.append(f"| {name} | {cell} | {r['n']} |")
    return "\n".join(rows)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_") or "workload"


def _jsonable(x: Any) -> Any:
    """NaN/inf -> None, numpy scalars -> Python numbers, tuples -> lists, Paths -> str."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Path):
        return str(x)
    return x


def _pareto_plot(name: str, wl: dict, path: Path) -> bool:
    sweep = wl.get("sweep") or {}
    modes = wl.get("modes") or {}
    # a bare Figure renders with Agg and leaves pyplot's global state and backend alone
    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, 2)
    drawn = False
    for ax, key, label in (
        (axes[0], "tf_kl", "TF-KL (lower is better)"),
        (axes[1], "rouge_l", "ROUGE-L vs full"),
    ):
        for i, mode in enumerate(dict.fromkeys([*modes, *sweep])):
            color = f"C{i % 10}"
            pts = [
                (metric_value(p.get("computed_fraction")), metric_value(p.get(key)))
                for p in sweep.get(mode) or []
            ]
            pts = sorted((x, y) for x, y in pts if x is not None and y is not None)
            line = None
            if pts:
                line = ax.plot(*zip(*pts, strict=True), marker="o", color=color, label=mode)[0]
                drawn = True
            x = metric_value((modes.get(mode) or {}).get("computed_fraction"))
            y = metric_value((modes.get(mode) or {}).get(key))
            if x is not None and y is not None:
                ax.scatter([x], [y], marker="*", s=120, color=color, label=None if line else mode)
                drawn = True
        ax.set_xlabel("computed fraction of prefill tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"{name}: quality vs computation (lines: sweep, stars: operating points)")
    fig.tight_layout()
    if drawn:
        fig.savefig(path, dpi=100)
    return drawn


def _bar_plot(name: str, modes: dict, keys: list[tuple[str, str]], ylabel: str, path: Path) -> bool:
    names = list(modes)
    series = [
        (label, [metric_value((modes[m] or {}).get(k)) for m in names], k) for k, label in keys
    ]
    series = [s for s in series if any(v is not None for v in s[1])]
    if not names or not series:
        return False
    fig = Figure(figsize=(max(5, 1.1 * len(names) * len(series)), 4))
    ax = fig.subplots()
    width = 0.8 / len(series)
    for j, (label, values, key) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(names))]
        heights = [v if v is not None else 0.0 for v in values]
        errs = []
        for m, h in zip(names, heights, strict=True):
            ci = metric_ci((modes[m] or {}).get(key))
            errs.append((max(h - ci[0], 0.0), max(ci[1] - h, 0.0)) if ci else (0.0, 0.0))
        ax.bar(xs, heights, width, label=label, yerr=list(zip(*errs, strict=True)), capsize=3)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(name)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def _plots(name: str, wl: dict, out_dir: Path) -> list[Path]:
    """Draw the workload's plots; a plot with no data is skipped."""
    slug, modes = _slug(name), wl.get("modes") or {}
    ttft = [("ttft_p50_ms", "p50"), ("ttft_p95_ms", "p95")]
    frac = [("computed_fraction", "computed tokens"), ("flops_fraction", "FLOPs")]
    out = []
    if _pareto_plot(name, wl, path := out_dir / f"pareto_{slug}.png"):
        out.append(path)
    if _bar_plot(name, modes, ttft, "TTFT (ms)", path := out_dir / f"ttft_{slug}.png"):
        out.append(path)
    if _bar_plot(
        name, modes, frac, "fraction of full prefill", path := out_dir / f"computed_{slug}.png"
    ):
        out.append(path)
    return out


def write_report(results: dict, out_dir: Path) -> list[Path]:
    """Write results.json, report.md and per-workload plots into `out_dir`; return the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(_jsonable(results), indent=2, sort_keys=False) + "\n")
    written.append(json_path)

    lines = ["# cachecraft benchmark report", ""]
    config = results.get("config") or {}
    if config:
        lines += ["## Configuration", ""]
        lines += [f"- {k}: `{json.dumps(_jsonable(v))}`" for k, v in config.items()]
        lines.append("")
    plots: list[Path] = []
    for name, wl in (results.get("workloads") or {}).items():
        wl = wl or {}
        modes = wl.get("modes") or {}
        lines += [f"## Workload `{name}`", ""]
        lines += [markdown_table(modes) if modes else "_no modes were run_", ""]
        paired = wl.get("paired") or {}
        if paired.get("arms") or paired.get("kl_removed"):
            ref = paired.get("reference", "cachecraft")
            lines += [
                f"### Paired with `{ref}` on the same requests",
                "",
                f"Each Δ is the arm minus `{ref}`, averaged over requests, with a bootstrap 95% "
                f"CI (a CI that excludes 0 is a real difference). `{ref} lower TF-KL`: share of "
                "requests where its TF-KL is strictly lower. `naive TF-KL removed`: "
                "1 - mean(arm TF-KL) / mean(naive TF-KL). `worse than naive`: requests whose "
                "TF-KL is above naive reuse's (the tails a ratio of means hides).",
                "",
                paired_table(paired),
                "",
            ]
        if paired.get("vs_full"):
            lines += [
                "### Answers against gold, paired with `full`",
                "",
                "Each Δ is the arm's score against the gold answers minus full's, on the same "
                "requests, with a bootstrap 95% CI. `contains gold`: a gold answer appears in "
                "the answer as whole words.",
                "",
                gold_table(paired["vs_full"]),
                "",
            ]
        if paired.get("ttft_vs_full"):
            lines += [
                "### Time to first token over `full`'s, request by request",
                "",
                "The median over requests of each arm's TTFT divided by full's on the same "
                "request, with a bootstrap 95% CI. Timings compare only within one run on a "
                "machine that ran nothing else.",
                "",
                ttft_table(paired["ttft_vs_full"]),
                "",
            ]
        for path in _plots(name, wl, out_dir):
            plots.append(path)
            lines.append(f"![{path.stem}]({path.name})")
        lines.append("")
    md_path = out_dir / "report.md"
    md_path.write_text("\n".join(lines))
    written.append(md_path)
    logger.info("report written to %s (%d plots)", out_dir, len(plots))
    return written + plots
