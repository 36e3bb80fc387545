"""`bench model`'s peak-memory reading: the growth of one run over the RSS before it, even
when the process peaked higher earlier (the model load), so it is never a flat 0."""

from __future__ import annotations

import torch

from cachecraft.bench.model_bench import _peak_since


def test_peak_counts_what_a_run_touches_after_a_higher_earlier_peak() -> None:
    big = torch.ones(96 << 18)  # 96 MiB touched, then freed: an earlier, higher peak
    del big

    def run() -> None:
        x = torch.ones(48 << 18)  # 48 MiB, freed before the run returns
        assert float(x[-1]) == 1.0

    peak = _peak_since(run)
    assert 40 << 20 <= peak <= 80 << 20
    assert _peak_since(lambda: None) < 16 << 20
