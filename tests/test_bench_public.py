"""The benchmarks that drive the engine through the public surface (cachecraft.api) run end to
end on the tiny model: the TTFT-per-tier and miss-TTFT measurements, and LLM.warm / LLM.answer
that the quality benchmark is built on."""

from __future__ import annotations

import pytest
import torch

from cachecraft.api import LLM, LoadedModel, SamplingParams, memory_config
from cachecraft.config import ReuseConfig
from cachecraft.errors import BadRequestError
from cachecraft.request import Chunk, RagRequest
from cachecraft_bench.model_bench import MISS_MODES, miss_ttft
from cachecraft_bench.tier_ttft import run_tier_ttft

REQUEST = RagRequest(
    "Which river flows north?",
    [
        Chunk("Paris is the capital of France and sits on the Seine. " * 3, id="paris"),
        Chunk("The Nile flows north through Egypt into the Mediterranean. " * 3, id="nile"),
    ],
)


def test_tier_ttft_measures_every_tier(tiny: LoadedModel) -> None:
    res = run_tier_ttft(tiny, REQUEST, repeats=1)
    tiers = ["memory", "disk_layerwise_readahead", "disk_no_readahead", "disk_prefetched"]
    assert list(res) == [*tiers, "full_recompute"]
    # each tier is what it names: nothing read from disk when the chunks are in memory; read
    # layer by layer from disk with read-ahead (a store reopened per repeat): measured
    assert res["memory"]["layer_read_ms_per_request"] == 0.0
    assert res["memory"]["layer_read_hidden_fraction"] is None
    layerwise = res["disk_layerwise_readahead"]
    assert layerwise["layer_read_ms_per_request"] > 0
    assert 0.0 <= layerwise["layer_read_hidden_fraction"] <= 1.0


def test_miss_ttft_runs_every_mode(tiny: LoadedModel) -> None:
    res = miss_ttft(tiny, repeats=1, chunk_tokens=16)
    assert set(res["ttft_ms"]) == set(MISS_MODES)
    assert all(v > 0 for v in res["ttft_ms"].values())
    # one request: the paired ratio and the ratio of medians are the same number, up to the
    # rounding of the milliseconds the latter is taken from (0.05 ms each) and of both ratios
    paired, of_medians = res["miss_ttft_ratio"], res["miss_ttft_ratio_of_medians"]
    assert set(paired) == set(of_medians) == {"cachecraft_over_full", "prefix_over_full"}
    ms = res["ttft_ms"]
    for key in paired:
        mode = key.removesuffix("_over_full")
        rounding = paired[key] * (0.05 / ms[mode] + 0.05 / ms["full"]) + 0.001
        assert abs(paired[key] - of_medians[key]) <= rounding


def test_warm_then_answer_reuses_every_chunk(tiny: LoadedModel) -> None:
    llm = LLM(tiny, store=memory_config(1 << 24))
    ids = llm.warm(REQUEST)
    assert len(ids) == len(REQUEST.chunks)
    out = llm.answer(REQUEST, SamplingParams(max_tokens=3), "naive", forced=[5, 6])
    assert [c.variant_id for c in out.report.chunks] == ids
    assert out.forced_logits is not None and out.forced_logits.shape[0] == 2
    # naive computes only the question: the computed rows lie after the last chunk
    last_chunk_end = out.plan.chunks[-1].slot.end
    assert bool(torch.all(out.rows >= last_chunk_end))
    assert out.rows.shape == out.rows_last_layer.shape


def test_llm_takes_reuse_settings_once(tiny: LoadedModel) -> None:
    with pytest.raises(BadRequestError, match="given twice"):
        LLM(tiny, config=ReuseConfig(), alpha=0.5)
