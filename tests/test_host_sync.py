"""No host synchronisation inside the layer loop: every row decision of a cachecraft hit (the
probe's measure, the check's keep, rows stopping, the rows whose output is read) is made
before the loop or kept on the device.

On a GPU a read of device data (`item`, `tolist`, `bool`, `int`, `nonzero`, a boolean mask
as an index) waits for every queued kernel. The test makes each such read raise while a
layer runs (`_layer`, `_compact` and the layer loaders are the loop's body) and answers the
same requests as without: the same rows computed, the same tokens, the same first-token
logits. tests/test_gpu.py runs the same forward under CUDA's sync debug mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from cachecraft.engine.sampling import SamplingParams
from cachecraft.llm import LLM
from cachecraft.model.loader import LoadedModel
from cachecraft.request import Chunk, RagRequest
from cachecraft.store.memory import memory_config

READS = ("item", "tolist", "__bool__", "nonzero", "__int__", "__float__", "__index__", "cpu",
         "numpy")  # fmt: skip


class HostRead(AssertionError):
    """A layer read device data back to the host."""


def _is_mask(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool and p.dim() > 0 for p in parts)


@contextlib.contextmanager
def reads_fail_in_layers(model: Any) -> Iterator[list[str]]:
    """While `model`'s layer loop runs, every host read of a tensor raises HostRead (and is
    listed); outside it they work as ever."""
    inside = [0]
    seen: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in READS}
    saved_get, saved_set = torch.Tensor.__getitem__, torch.Tensor.__setitem__
    saved_nonzero = torch.nonzero

    def guard(name: str, fn: Any) -> Any:
        def read(*args: Any, **kwargs: Any) -> Any:
            if inside[0]:
                seen.append(name)
                raise HostRead(f"Tensor.{name} inside the layer loop")
            return fn(*args, **kwargs)

        return read

    def getitem(self: torch.Tensor, index: Any) -> Any:
        if inside[0] and _is_mask(index):
            seen.append("mask index")
            raise HostRead("a boolean mask index inside the layer loop")
        return saved_get(self, index)

    def setitem(self: torch.Tensor, index: Any, value: Any) -> None:
        if inside[0] and _is_mask(index):
            seen.append("mask assignment")
            raise HostRead("a boolean mask assignment inside the layer loop")
        saved_set(self, index, value)

    def armed(fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            inside[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] -= 1

        return run

    for name, fn in saved.items():
        setattr(torch.Tensor, name, guard(name, fn))
    torch.Tensor.__getitem__, torch.Tensor.__setitem__ = getitem, setitem  # type: ignore[method-assign]
    torch.nonzero = guard("torch.nonzero", saved_nonzero)
    before = {name: vars(model).get(name) for name in ("_layer", "_compact")}
    model._layer, model._compact = armed(model._layer), armed(model._compact)
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.Tensor.__getitem__, torch.Tensor.__setitem__ = saved_get, saved_set  # type: ignore[method-assign]
        torch.nonzero = saved_nonzero
        for name, fn in before.items():
            if fn is None:
                delattr(model, name)
            else:
                setattr(model, name, fn)


def _texts(m: LoadedModel, n: int, tokens: int) -> list[str]:
    words = ["river", "harbor", "tower", "garden", "castle", "meadow", "engine", "valley"]
    out = []
    for i in range(n):
        text = " ".join(f"{words[(i + j) % len(words)]}{j % 7}" for j in range(tokens))
        ids = m.tokenizer(f"Passage {i}: {text}", add_special_tokens=False)["input_ids"][:tokens]
        out.append(m.tokenizer.decode(ids))
    return out


def _answers(
    m: LoadedModel, reuse: dict[str, Any], guarded: bool
) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """Rows computed per chunk, tokens and first-token logits of two cachecraft hits (their
    chunks cached in another order), the layer loop guarded or not."""
    chunks = [Chunk(t, id=f"c{i}") for i, t in enumerate(_texts(m, 4, 48))]
    llm = LLM(m, store=memory_config(1 << 30), **reuse)  # the cachecraft strategy's settings
    four = SamplingParams(max_tokens=4)
    llm.generate(RagRequest("Which passage names a tower?", chunks), four, "cachecraft")
    hits = [
        RagRequest("Where is the castle?", chunks[::-1]),
        RagRequest("Which comes first?", [chunks[2], chunks[0], chunks[3], chunks[1]]),
    ]
    context = reads_fail_in_layers(m.model) if guarded else contextlib.nullcontext([])
    with context as seen:
        outs = llm.generate(hits, four, "cachecraft", keep_logits=True)
    assert not seen
    rows = [[c.tokens_recomputed for c in o.report.chunks] for o in outs]
    probed = reuse.get("probe_skip_wide", True) is False  # short chunks: else no probe
    for o in outs:  # every chunk hit and ran the check, and the probe where it runs
        assert all(c.is_hit for c in o.report.chunks)
        assert (o.report.probe_tokens > 0) == probed
    logits = [o.first_token_logits for o in outs]
    assert all(x is not None for x in logits)
    return rows, [o.token_ids for o in outs], logits  # type: ignore[return-value]


@pytest.mark.parametrize(
    "reuse",
    [
        {"probe_check_layer": 1, "probe_skip_wide": False},  # rows stop after layer 1 of 4
        {
            "probe_check_layer": 1,
            "probe_depth": 0.5,
            "probe_split": "need",
            "probe_skip_wide": False,
        },
        {"probe_skip_wide": False},
        {},  # these chunks are short: the check of every reused token, no probe
    ],
    ids=["check-layer-1", "shallow-probe", "probe", "default"],
)
def test_a_cachecraft_hit_reads_nothing_back_inside_the_layer_loop(
    tiny: LoadedModel, reuse: dict[str, Any]
) -> None:
    rows, tokens, logits = _answers(tiny, reuse, guarded=False)
    got_rows, got_tokens, got_logits = _answers(tiny, reuse, guarded=True)
    assert got_rows == rows and got_tokens == tokens
    for a, b in zip(got_logits, logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(r < 48 for per in rows for r in per)  # a partial prefill, not a full one


def test_the_guard_catches_a_read_in_a_layer(tiny: LoadedModel) -> None:
    """The guard is live: a layer that reads a row count back fails under it."""
    model = tiny.model
    inner = model._layer

    def reading(h: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        int(h.shape[0] + torch.zeros(1, dtype=torch.long).sum())
        return inner(h, *args, **kwargs)

    model._layer = reading
    try:
        with reads_fail_in_layers(model), pytest.raises(HostRead):
            from cachecraft.model.reference import prefill

            prefill(tiny, torch.arange(8))
    finally:
        del model._layer
