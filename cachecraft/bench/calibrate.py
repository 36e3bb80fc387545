"""Calibration of cachecraft's alpha, and the small JSON config file that stores it.

`calibrate` picks the smallest alpha whose mean ROUGE-L vs full reaches a target (cache-craft.md
§3). The file (default `./cachecraft.json`) holds `{"reuse": {ReuseConfig field: value},
"calibration": {...}}`; `ask`, `bench` and the server read the "reuse" part through
`load_reuse_overrides`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cachecraft.bench.item import WorkloadItem
from cachecraft.config import ReuseConfig
from cachecraft.errors import BadRequestError
from cachecraft.model.loader import LoadedModel

log = logging.getLogger(__name__)

DEFAULT_CONFIG_PATH = Path("cachecraft.json")
"""Where `cachecraft calibrate` writes and every command looks by default (the working dir)."""
DEFAULT_ALPHAS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)

Evaluate = Callable[[Sequence[float]], Mapping[float, float]]
"""alphas -> {alpha: mean ROUGE-L vs full}."""


def pick_alpha(scores: Mapping[float, float | None], target: float) -> float:
    """The smallest alpha whose score reaches `target`; if none does, the largest (warned)."""
    if not scores:
        raise BadRequestError("calibration needs at least one alpha")
    ordered = sorted(scores)
    for alpha in ordered:
        score = scores[alpha]
        if score is not None and score >= target:
            return alpha
    best = max((s for s in scores.values() if s is not None), default=None)
    log.warning(
        "no alpha reached ROUGE-L %.3f (best %s); using the largest, %g", target, best, ordered[-1]
    )
    return ordered[-1]


def calibration_curve(
    loaded: LoadedModel, items: Sequence[WorkloadItem], alphas: Sequence[float], **kw: Any
) -> list[dict[str, Any]]:
    """Sweep points of cachecraft over `alphas` (param, rouge_l, computed_fraction, tf_kl, ...);
    `kw` goes to `run_quality` (warmup, max_tokens, base, progress, ...)."""
    from cachecraft.bench.quality import run_sweep  # torch-heavy; keep config I/O light

    return run_sweep(loaded, items, {"cachecraft": list(alphas)}, **kw).get("cachecraft", [])


def calibrate(
    loaded: LoadedModel | None,
    items: Sequence[WorkloadItem],
    target: float = 0.9,
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    *,
    evaluate: Evaluate | None = None,
    **kw: Any,
) -> float:
    """Smallest alpha in `alphas` whose mean ROUGE-L vs full on `items` reaches `target`.
    `evaluate` replaces the benchmark (tests); otherwise `loaded` runs a cachecraft sweep."""
    if not 0 < target <= 1:
        raise BadRequestError(f"target must be in (0, 1], got {target}")
    if not alphas or any(a < 0 for a in alphas):
        raise BadRequestError("alphas must be a non-empty list of numbers >= 0")
    if evaluate is None:
        if loaded is None:
            raise BadRequestError("calibrate needs a model or an evaluate function")
        points = calibration_curve(loaded, items, alphas, **kw)
        scores: Mapping[float, float | None] = {p["param"]: p["rouge_l"] for p in points}
    else:
        scores = evaluate(alphas)
    alpha = pick_alpha(scores, target)
    log.info("calibrated alpha %g for ROUGE-L target %.3f: %s", alpha, target, dict(scores))
    return alpha


def read_config(path: str | Path | None = None) -> dict[str, Any]:
    """The config file as a dict; {} when `path` is None and the default file does not exist."""
    p = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    if not p.is_file():
        if path is None:
            return {}
        raise BadRequestError(f"config file {p} does not exist")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequestError(f"config file {p} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequestError(f"config file {p} must hold a JSON object")
    return data


def write_config(path: str | Path | None, alpha: float, **calibration: Any) -> Path:
    """Set reuse.alpha in the config file (other keys kept) and record how it was calibrated."""
    p = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    data = read_config(p) if p.is_file() else {}
    reuse = data.get("reuse")
    data["reuse"] = {**(reuse if isinstance(reuse, dict) else {}), "alpha": float(alpha)}
    if calibration:
        data["calibration"] = calibration
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(p)  # atomic: a reader never sees half a file
    return p


def load_reuse_overrides(path: str | Path | None = None) -> dict[str, Any]:
    """The "reuse" section of the config file: ReuseConfig field -> value ({} without a file).
    Unknown fields raise BadRequestError naming them."""
    data = read_config(path)
    reuse = data.get("reuse", {})
    if not isinstance(reuse, dict):
        raise BadRequestError("config file: 'reuse' must be an object")
    known = {f.name for f in dataclasses.fields(ReuseConfig)}
    unknown = sorted(set(reuse) - known)
    if unknown:
        raise BadRequestError(f"config file: unknown reuse option(s) {unknown}")
    return dict(reuse)


def add_calibrate_parser(subparsers: Any) -> Any:
    """Add `cachecraft calibrate` (the parser lives in quality_cli.py; cli.py looks here)."""
    from cachecraft.bench.quality_cli import add_calibrate_parser as add

    return add(subparsers)
