"""`bench decode` (ours): engine steps with exactly B sequences decoding are found and timed."""

from __future__ import annotations

import pytest

from cachecraft.bench.decode_bench import run_decode_bench
from cachecraft.errors import CachecraftError
from cachecraft.model.loader import LoadedModel


def test_decode_bench_times_steps_of_each_batch_size(tiny: LoadedModel) -> None:
    result = run_decode_bench(tiny, batches=(1, 3), context=24, steps=3)
    ours = result["step_ms"]["ours"]
    assert set(ours) == {"1", "3"} and all(ms is not None and ms > 0 for ms in ours.values())
    assert result["tokens_per_s"]["ours"]["3"] == pytest.approx(3000 / ours["3"], rel=0.01)
    assert "step_ratio_vs_vllm" not in result


def test_decode_bench_rejects_bad_sizes(tiny: LoadedModel) -> None:
    with pytest.raises(CachecraftError, match="batch sizes"):
        run_decode_bench(tiny, batches=(0,))
    with pytest.raises(CachecraftError, match="no peer venv"):
        run_decode_bench(tiny, batches=(1,), context=16, steps=2, peer="vllm", peer_python="/nope")
