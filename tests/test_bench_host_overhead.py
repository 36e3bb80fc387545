"""The host-overhead meter (`bench model`'s host_overhead_ms): TTFT minus the time inside the
model's forward passes, per mode, with prefix and cachecraft seeing every chunk hit."""

from __future__ import annotations

import torch

from cachecraft.model.loader import LoadedModel
from cachecraft.model.reference import prefill
from cachecraft_bench.host_overhead import MODES, ForwardClock, host_overhead


def test_the_meter_splits_ttft_into_forward_and_host(tiny: LoadedModel) -> None:
    out = host_overhead(tiny, repeats=1, num_chunks=3, chunk_tokens=40)
    assert set(out["host_overhead_ms"]) == set(MODES)
    for mode in MODES:
        d = out["host_overhead_detail"][mode]
        assert d["forward_ms"] > 0 and d["ttft_ms"] >= d["forward_ms"]
        host = out["host_overhead_ms"][mode]
        assert abs(host - (d["ttft_ms"] - d["forward_ms"])) < 0.05
    computed = {m: out["host_overhead_detail"][m]["computed_fraction"] for m in MODES}
    assert computed["full"] == 1.0
    assert computed["prefix"] < 0.3  # every chunk an exact hit: the question alone
    assert computed["prefix"] < computed["cachecraft"] < 1.0  # hits at new places: partial


def test_the_clock_times_every_step_and_leaves_the_model_as_it_was(tiny: LoadedModel) -> None:
    model = tiny.model
    clock = ForwardClock(model)
    with clock.timing():
        prefill(tiny, torch.arange(6))
        prefill(tiny, torch.arange(3))
    assert clock.calls == 2 and clock.seconds > 0
    assert "step" not in vars(model)
