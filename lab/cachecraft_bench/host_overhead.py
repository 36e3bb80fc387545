"""The host-overhead meter: a request's time to first token minus the time its forward passes
took, per mode (`bench model`'s `host_overhead_ms`).

What is left is the work around the model (tokenizing, store lookups, planning, splicing,
selection, building the work, sampling the first token): on a CPU the arithmetic hides it, on
a GPU it is most of the time to first token. The forward passes are timed by a wrapper around
the model's one entry point, `LlamaModel.step` (the probe's pass, the prefill and its in-forward
check all run through it), synchronising the device on CUDA before and after, so that a
forward's queued kernels count as forward time and nothing else does.

One request: 5 chunks of about 1,000 tokens. `prefix` and `cachecraft` see every chunk hit:
`prefix` after the same chunks in the same order (exact variants), `cachecraft` after them in
another order (every variant reused at a new position: probe, check and partial prefill run).
Each measured request has a question of its own (a prompt seen before is a repeat, planned
otherwise) and one answer token. Median over repeats, modes interleaved.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from cachecraft.api import LLM, LoadedModel, SamplingParams, memory_config
from cachecraft.request import Chunk, RagRequest

MODES = ("full", "prefix", "cachecraft")
NUM_CHUNKS = 5
CHUNK_TOKENS = 1000
WORDS = (
    "river",
    "mountain",
    "city",
    "engine",
    "harbor",
    "forest",
    "bridge",
    "tower",
    "market",
    "library",
    "garden",
    "station",
    "valley",
    "island",
    "castle",
    "museum",
    "canal",
)


class ForwardClock:
    """Seconds spent inside `model.step` while installed (`timing`), summed over calls."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.seconds = 0.0
        self.calls = 0

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    @contextlib.contextmanager
    def timing(self) -> Iterator[ForwardClock]:
        """Wrap the model's `step` (an instance attribute shadows the method) until exit."""
        inner = self.model.step

        def step(*args: Any, **kwargs: Any) -> Any:
            self._sync()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._sync()
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        self.model.step = step
        try:
            yield self
        finally:
            del self.model.step

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def chunk_texts(m: LoadedModel, n: int, tokens: int, seed: int = 0) -> list[str]:
    """`n` passages of exactly `tokens` tokens each (words cut at the token count)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [f"Passage {i}."] + [rng.choice(WORDS) for _ in range(tokens)]
        ids = m.tokenizer(" ".join(words), add_special_tokens=False)["input_ids"][:tokens]
        out.append(m.tokenizer.decode(ids))
    return out


def _request(chunks: list[Chunk], question: int) -> RagRequest:
    return RagRequest(f"Question {question}: which passage names a harbor first?", chunks)


def host_overhead(
    m: LoadedModel,
    repeats: int = 5,
    num_chunks: int = NUM_CHUNKS,
    chunk_tokens: int = CHUNK_TOKENS,
) -> dict[str, Any]:
    """Per mode, the median over `repeats` of (TTFT - time inside the model's forward passes)
    in ms (`host_overhead_ms`), beside the medians of TTFT and forward time and the computed
    share of the prompt. A warm-up request per mode runs first (and, for `prefix` and
    `cachecraft`, fills the store)."""
    texts = chunk_texts(m, num_chunks, chunk_tokens)
    chunks = [Chunk(t, id=f"c{i}") for i, t in enumerate(texts)]
    measured_order = {"full": chunks, "prefix": chunks, "cachecraft": chunks[::-1]}
    one = SamplingParams(max_tokens=1)
    llms = {mode: LLM(m, store=memory_config(1 << 34)) for mode in MODES}
    for mode, llm in llms.items():
        llm.generate(_request(chunks, -1), one, mode)  # warm-up; for reuse, the variants
    clock = ForwardClock(m.model)
    rows: dict[str, dict[str, list[float]]] = {
        mode: {"host": [], "ttft": [], "forward": [], "computed": []} for mode in MODES
    }
    with clock.timing():
        for r in range(repeats):
            for i in range(len(MODES)):
                mode = MODES[(r + i) % len(MODES)]
                clock.reset()
                request = _request(measured_order[mode], r)
                report = llms[mode].generate(request, one, mode)[0].report
                assert report is not None
                forward_ms = 1000 * clock.seconds
                row = rows[mode]
                row["ttft"].append(report.ttft_ms)
                row["forward"].append(forward_ms)
                row["host"].append(report.ttft_ms - forward_ms)
                row["computed"].append(report.computed_fraction)

    def med(mode: str, key: str, digits: int = 2) -> float:
        return round(statistics.median(rows[mode][key]), digits)

    return {
        "host_overhead_ms": {mode: med(mode, "host") for mode in MODES},
        "host_overhead_detail": {
            mode: {
                "ttft_ms": med(mode, "ttft"),
                "forward_ms": med(mode, "forward"),
                "computed_fraction": med(mode, "computed", 3),
            }
            for mode in MODES
        },
        "host_overhead_request": f"{num_chunks} x {chunk_tokens} tokens, {repeats} repeats",
    }
