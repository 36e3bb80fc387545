"""`bench model`'s peak-memory reading: the growth of one run over the RSS before it, even
when the process peaked higher earlier (the model load), so it is never a flat 0."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# In a process of its own: RSS is process-wide, and memory that threads left behind by other
# tests free meanwhile (a server's, a store writer's) offsets what the run touches.
MEASURE = """
import json, torch
from cachecraft_bench.model_bench import _peak_since
big = torch.ones(96 << 18)  # 96 MiB touched, then freed: an earlier, higher peak
del big

def run():
    x = torch.ones(48 << 18)  # 48 MiB, freed before the run returns
    assert float(x[-1]) == 1.0

print(json.dumps([_peak_since(run), _peak_since(lambda: None)]))
"""


def test_peak_counts_what_a_run_touches_after_a_higher_earlier_peak() -> None:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE], capture_output=True, text=True, timeout=120, check=True
    )
    peak, idle = json.loads(done.stdout.strip().splitlines()[-1])
    assert 40 << 20 <= peak <= 80 << 20
    assert idle < 16 << 20


def test_hf_computes_the_last_positions_logits_only_in_our_dtype(tiny, tiny_hf) -> None:
    """The comparison HF gets: the LM head over the last row alone (as ours), the same
    numbers as its full forward's last row, in our model's dtype."""
    import torch

    from cachecraft_bench.model_bench import hf_prefill, load_hf

    ids = torch.arange(3, 40)
    hf = load_hf(tiny)
    assert next(hf.parameters()).dtype == tiny.model.dtype
    last = hf_prefill(hf, ids)
    assert last.shape == (1, 1, tiny_hf.config.vocab_size)
    with torch.inference_mode():
        every = tiny_hf(ids[None]).logits
    torch.testing.assert_close(last[0, 0], every[0, -1], rtol=1e-4, atol=1e-4)


def test_model_bench_compares_with_hf_side_by_side(tiny) -> None:
    from cachecraft_bench.model_bench import run_model_bench

    result = run_model_bench(tiny, lengths=(24,), repeats=1)
    assert json.loads(json.dumps(result)) == result
    # the random tiny model's near-tied logits make HF's cached generate drift from a full
    # forward (not ours: tests/test_model_forward.py); the bundled model matches token for token
    assert isinstance(result["greedy_match"], bool) and result["max_abs_logit_diff"] < 1e-3
    assert result["dtype"] == "float32" and "logits_to_keep=1" in result["hf_logits"]
    row = result["prefill"]["24"]
    assert row["speedup"] == pytest.approx(row["hf_ms"] / row["ours_ms"], rel=0.05, abs=0.01)
    # both peaks measured (a failed measurement is None, never a flat 0)
    assert row["ours_peak_mib"] is not None and row["hf_peak_mib"] is not None
