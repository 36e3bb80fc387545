"""Calibration of cachecraft for one model (docs/algorithm.md).

`calibrate` picks the smallest alpha whose mean ROUGE-L vs full reaches a target; `selector_rule`
(`cachecraft calibrate --selector`) the selector's choices that the tuning set showed to depend
on the model (`SELECTOR_RULES`). The result is written to the config file by
`cachecraft.config_file.write_config`; `ask`, `bench` and the server read it back through
`config_file.load_reuse_overrides`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cachecraft.errors import BadRequestError
from cachecraft_bench.item import WorkloadItem

if TYPE_CHECKING:
    from cachecraft.api import LoadedModel

log = logging.getLogger(__name__)

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
    from cachecraft_bench.quality import run_sweep  # torch-heavy; keep config I/O light

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


SELECTOR_RULES: dict[str, dict[str, Any]] = {
    "cachecraft-judged": {"probe_sink_kept": False},
    "cachecraft-power1.5": {"probe_check_power": 1.5},
    "cachecraft-judged-power1.5": {"probe_sink_kept": False, "probe_check_power": 1.5},
    "cachecraft-judged-power1.5-probe": {
        "probe_sink_kept": False,
        "probe_check_power": 1.5,
        "probe_skip_wide": False,
    },
}
"""The selector's choices that the tuning set showed to depend on the model (docs/reuse.md),
each an arm of `cachecraft calibrate --selector` run against the default on the same requests:
whether the check keeps each chunk's first tokens, how much the question's attention weighs
against the K/V deviation in its rank, and whether a probe runs where its candidates would be
every reused token (the check of every token without it is where the 1.5B's worst answers
came from)."""


def pick_rule(diffs: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The rule to adopt from each rule's paired TF-KL difference rule - default
    (`paired.paired_difference`) on the same requests: among the rules that lower it with a
    95% CI excluding 0, the one that lowers it most; None (keep the default) if none does (a
    calibration set is small: a tie keeps the default)."""
    clear = {
        name: d
        for name, d in diffs.items()
        if d["n"] > 1 and d["ci95"][1] is not None and d["ci95"][1] < 0
    }
    return min(clear, key=lambda name: (clear[name]["mean"], name), default=None)


def selector_settings(rules: Mapping[str, Mapping[str, Any]], chosen: str | None) -> dict[str, Any]:
    """Every parameter the rules touch, at the chosen rule's value or else the default (so a
    file calibrated before keeps no stale choice)."""
    from cachecraft.api import CachecraftParams

    default = CachecraftParams()
    out = {key: getattr(default, key) for rule in rules.values() for key in rule}
    out.update(rules[chosen] if chosen is not None else {})
    return out


def selector_rule(
    loaded: LoadedModel,
    items: Sequence[WorkloadItem],
    rules: Mapping[str, Mapping[str, Any]] = SELECTOR_RULES,
    **kw: Any,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(the selector's settings for this model, per rule the paired TF-KL difference rule -
    default) for cachecraft on `items`; `kw` goes to `run_quality` (warmup, max_tokens, base,
    progress, ...)."""
    from cachecraft_bench.paired import paired_difference
    from cachecraft_bench.quality import run_quality  # torch-heavy; keep config I/O light

    configs = {name: dict(rule) for name, rule in rules.items()}
    res = run_quality(
        loaded, items, ["cachecraft", *rules], configs=configs, match_budget=False, **kw
    )
    records = next(iter(res["workloads"].values()))["requests"]
    diffs = {
        name: paired_difference(records[name], records["cachecraft"], "tf_kl") for name in rules
    }
    return selector_settings(rules, pick_rule(diffs)), diffs
