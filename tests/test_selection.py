"""The probe's selection on the device (engine/selection.py) makes exactly the choices of the
Python reference (reuse/selectors.select_by_question): same tokens, budgets, check weights and
reasons, over random attention with many ties, for every split, with and without the check,
sinks and blend."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
import torch
from plan_helpers import make_layout

from cachecraft.config import ReuseConfig
from cachecraft.engine.selection import select_on_device
from cachecraft.llm import split_settings
from cachecraft.reuse.cachecraft import CachecraftStrategy
from cachecraft.reuse.plan import DeviationCheck, RecomputePlan
from cachecraft.reuse.planner import plan_request
from cachecraft.reuse.selectors import select_by_question
from cachecraft.store.meta import VariantMeta

KEYS = ("A", "B", "C", "D", "E")
CHECK = DeviationCheck(0)  # stands in for no check when comparing


def _variant(key: str, size: int, rng: random.Random) -> VariantMeta:
    return VariantMeta(
        chunk_key=key,
        prefix_key="P",
        s_old=("Z",),
        s_old_sizes=(7,),
        num_tokens=size,
        num_layers=1,
        inter=((rng.uniform(0.2, 1.0),),),
        intra=(1.0,),
        token_scores=tuple(rng.choice((0.0, 0.25, 0.5, 1.0)) for _ in range(size)),
        cci=rng.uniform(0.2, 0.9),
        is_exact=True,
    )


def _case(seed: int, settings: dict[str, Any]) -> tuple[RecomputePlan, list, torch.Tensor]:
    """A plan with a probe over five chunks (some hit), the probe's key mass and spans."""
    rng = random.Random(seed)
    sizes = {k: rng.randint(3, 40) for k in KEYS}
    layout = make_layout(KEYS, sizes, "P")
    hits = {k: [_variant(k, sizes[k], rng)] for k in KEYS if rng.random() < 0.8}
    reuse, params, _ = split_settings(settings, CachecraftStrategy())
    strategy = CachecraftStrategy().with_params(**params)
    plan = plan_request(layout, hits, strategy, ReuseConfig(**reuse), 30, None)
    where, m = [], 3
    for cp in plan.chunks:
        if cp.variant is None:
            where.append(None)
        else:
            where.append((m, m + cp.slot.num_tokens))
            m += cp.slot.num_tokens
    # coarse values: many exact ties, which both must break the same way
    mass = torch.tensor([rng.choice((0.0, 0.01, 0.02, 0.05, 0.1)) for _ in range(m)])
    return plan, where, mass.float()


CONFIGS: dict[str, dict[str, Any]] = {  # ReuseConfig fields and the cachecraft strategy's
    "default": {},
    "need": {"probe_split": "need", "focus_threshold": 0.1},
    "chunk": {"probe_split": "chunk"},
    "no-check": {"probe_check": 0.0},
    "no-sink": {"probe_sink": 0, "probe_check_power": 1.0},
    "sink-judged": {"probe_sink_kept": False},
    "blend": {"probe_blend": 0.5, "probe_check_score": "deviation"},
    "need-no-check": {"probe_split": "need", "probe_check": 0.0, "focus_threshold": 0.0},
}


@pytest.mark.parametrize("name", CONFIGS)
def test_device_selection_equals_the_reference(name: str) -> None:
    compared = 0
    for seed in range(40):
        plan, where, mass = _case(seed, CONFIGS[name])
        if plan.probe is None:
            continue
        attention = [None if w is None else mass.tolist()[w[0] : w[1]] for w in where]
        want = select_by_question(plan, attention)
        got = select_on_device(plan, where, mass)
        assert got.chunks == want.chunks, (name, seed)
        # weights: torch's pow may round the last bit otherwise than C's; the check reads
        # them in float32
        assert replace(got.deviation or CHECK, weights=None) == replace(
            want.deviation or CHECK, weights=None
        )
        for a, b in zip(
            *(d.weights or () for d in (got.deviation or CHECK, want.deviation or CHECK)),
            strict=True,
        ):
            assert a == b or a == pytest.approx(b, rel=1e-12, abs=0), (name, seed)
        assert got.rows() == want.rows()
        compared += 1
    assert compared >= 20  # most cases have hits and a probe


def test_device_selection_checks_its_input() -> None:
    plan, where, mass = next(c for c in (_case(s, {}) for s in range(40)) if c[0].probe is not None)
    with pytest.raises(ValueError, match="entries"):
        select_on_device(plan, where[:-1], mass)
    hit = next(i for i, w in enumerate(where) if w is not None)
    bad = list(where)
    bad[hit] = (bad[hit][0], bad[hit][1] - 1)
    with pytest.raises(ValueError, match="one attention value per token"):
        select_on_device(plan, bad, mass)
