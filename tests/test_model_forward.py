"""Our forward against HF transformers, and partial prefill against full prefill."""

from __future__ import annotations

import copy

import pytest
import torch

from cachecraft.errors import ContextLengthError
from cachecraft.model.kv import KVCache
from cachecraft.model.loader import LoadedModel
from cachecraft.model.reference import greedy_tokens
from cachecraft.model.step import SeqWork


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g)


def _full(m: LoadedModel, ids: torch.Tensor, logits_for: str = "all") -> tuple:
    kv = KVCache(m.arch, len(ids), torch.float32, "cpu")
    res = m.model.forward_step([SeqWork(kv, ids, torch.arange(len(ids)), logits_for=logits_for)])
    return res[0], kv


def test_logits_match_hf_tiny(tiny: LoadedModel, tiny_hf) -> None:
    ids = _ids(200)  # past original_max_position_embeddings=64: llama3 scaling matters
    ours, _ = _full(tiny, ids)
    with torch.no_grad():
        ref = tiny_hf(ids[None]).logits[0]
    assert (ours.logits - ref).abs().max() < 1e-4


def _greedy_ours(m: LoadedModel, ids: torch.Tensor, n: int) -> list[int]:
    res, kv = _full(m, ids, "last")
    kv.ensure_capacity(len(ids) + n)
    return greedy_tokens(m, kv, res.logits[-1], n)


def _greedy_hf(hf, ids: torch.Tensor, n: int) -> list[int]:
    out = hf.generate(
        ids[None], max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None
    )
    return out[0, len(ids) :].tolist()


def test_greedy_matches_hf_generate_tiny(tiny: LoadedModel, tiny_hf) -> None:
    ids = _ids(40, seed=1)
    assert _greedy_ours(tiny, ids, 32) == _greedy_hf(tiny_hf, ids, 32)


def test_partial_prefill_all_positions_equals_full(tiny: LoadedModel) -> None:
    ids = _ids(90)
    full, full_kv = _full(tiny, ids)
    kv = KVCache(tiny.arch, 90, torch.float32, "cpu")
    kv.k.normal_()  # garbage everywhere: every position is recomputed anyway
    kv.v.normal_()
    kv.length = 90
    res = tiny.model.forward_step([SeqWork(kv, ids, torch.arange(90), logits_for="all")])[0]
    assert (res.logits - full.logits).abs().max() < 1e-5
    assert (kv.k - full_kv.k).abs().max() < 1e-5


def test_partial_prefill_suffix_continues_prefix_cache(tiny: LoadedModel) -> None:
    ids = _ids(120, seed=2)
    full, full_kv = _full(tiny, ids)
    kv = KVCache(tiny.arch, 50, torch.float32, "cpu")
    tiny.model.forward_step([SeqWork(kv, ids[:50], torch.arange(50), logits_for="none")])
    pos = torch.arange(50, 120)
    res = tiny.model.forward_step([SeqWork(kv, ids[50:], pos, logits_for="all")])[0]
    assert (res.logits - full.logits[50:]).abs().max() < 1e-4
    assert (kv.v[:, :, :120] - full_kv.v).abs().max() < 1e-5


def test_partial_prefill_scattered_positions(tiny: LoadedModel) -> None:
    ids = _ids(100, seed=3)
    full, full_kv = _full(tiny, ids)
    pos = torch.tensor([3, 4, 17, 40, 41, 42, 77, 98, 99])
    kv = KVCache(tiny.arch, 100, torch.float32, "cpu")
    kv.write(0, full_kv.k, full_kv.v)
    kv.k[:, :, pos] = torch.randn_like(kv.k[:, :, pos])  # must be overwritten, never read
    res = tiny.model.forward_step([SeqWork(kv, ids[pos], pos, logits_for="all")])[0]
    assert (res.logits - full.logits[pos]).abs().max() < 1e-4
    assert (kv.k - full_kv.k).abs().max() < 1e-5


def test_scattered_rows_see_exact_absolute_mask(tiny: LoadedModel) -> None:
    """A computed row must not see keys after it, even if those are computed in the same pass."""
    ids = _ids(60, seed=4)
    full, full_kv = _full(tiny, ids)
    pos = torch.tensor([10, 30, 59])
    kv = KVCache(tiny.arch, 60, torch.float32, "cpu")
    kv.write(0, full_kv.k, full_kv.v)
    kv.k[:, :, 11:30] += 5.0  # later positions corrupted: row 10 must not be affected
    res = tiny.model.forward_step([SeqWork(kv, ids[pos], pos, logits_for="all")])[0]
    assert (res.logits[0] - full.logits[10]).abs().max() < 1e-4
    assert (res.logits[1] - full.logits[30]).abs().max() > 1e-3


def test_per_span_last_layer_keeps_given_kv_above(tiny: LoadedModel) -> None:
    ids = _ids(80, seed=5)
    full, full_kv = _full(tiny, ids)
    pos = torch.arange(20, 80)
    last = torch.full((60,), 3)
    last[:20] = 1  # positions 20..39 stop after layer 1
    kv = KVCache(tiny.arch, 80, torch.float32, "cpu")
    kv.write(0, full_kv.k, full_kv.v)
    res = tiny.model.forward_step([SeqWork(kv, ids[20:], pos, last_layer=last)])[0]
    assert (res.logits[-1] - full.logits[-1]).abs().max() < 1e-4  # given K/V were exact
    assert res.rows_last_layer[:20].tolist() == [1] * 20
    # now with wrong given K/V above layer 1: they must be kept, not recomputed
    kv2 = KVCache(tiny.arch, 80, torch.float32, "cpu")
    kv2.write(0, full_kv.k, full_kv.v)
    kv2.v[2:, :, 20:40] = 7.0
    tiny.model.forward_step([SeqWork(kv2, ids[20:], pos, last_layer=last)])
    assert bool((kv2.v[2:, :, 20:40] == 7.0).all())
    assert (kv2.v[:2, :, 20:40] - full_kv.v[:2, :, 20:40]).abs().max() < 1e-5


def test_rows_nobody_reads_skip_the_rest_of_their_layer(tiny: LoadedModel) -> None:
    """A row's o-proj and MLP at a layer run only if the next layer or the logits read them:
    at the top layer only the logit rows, at a row's last layer none of it; the K/V and the
    logits are those of the forward that runs every row through."""
    layers = tiny.model.layers
    seen: dict[int, list[int]] = {}

    class Count:
        def __init__(self, i: int) -> None:
            self.i, self.inner = i, layers[i].o

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            seen.setdefault(self.i, []).append(x.shape[0])
            return self.inner(x)

    ids = _ids(60, seed=8)
    ref, ref_kv = _full(tiny, ids, "all")
    top = len(layers) - 1
    originals = list(layers)
    try:
        for i in (1, top):
            layers[i] = layers[i]._replace(o=Count(i))
        res, kv = _full(tiny, ids, "last")
        assert seen == {1: [60], top: [1]}
        assert (res.logits[-1] - ref.logits[-1]).abs().max() < 1e-4
        assert torch.equal(kv.k, ref_kv.k) and torch.equal(kv.v, ref_kv.v)
        seen.clear()
        last = torch.full((60,), top)
        last[10:50] = 1  # 40 rows stop after layer 1: their layer-1 MLP is never read
        kv2 = KVCache(tiny.arch, 60, torch.float32, "cpu")
        work = SeqWork(kv2, ids, torch.arange(60), last_layer=last, logits_for="last")
        out = tiny.model.forward_step([work])[0]
        assert seen == {1: [20], top: [1]}
        assert out.rows_last_layer.tolist() == last.tolist()
        assert torch.equal(kv2.k[:2], ref_kv.k[:2]) and torch.equal(kv2.v[:2], ref_kv.v[:2])
    finally:
        layers[:] = originals


def test_aligned_rows_change_no_result(tiny: LoadedModel) -> None:
    """Rows rounded up to a multiple of row_align (copies of the first row, never read) give
    the logits and K/V of the rows as they are: a full prefill, and a partial one whose rows
    stop at different layers (compacted, and a layer's o-proj and MLP on a subset)."""
    aligned = copy.copy(tiny.model)
    aligned.row_align = 16
    ids = _ids(45, seed=11)
    outs = []
    for model in (tiny.model, aligned):
        kv = KVCache(tiny.arch, 45, torch.float32, "cpu")
        full = model.forward_step([SeqWork(kv, ids, torch.arange(45), logits_for="all")])[0]
        last = torch.full((37,), tiny.arch.num_layers - 1)
        last[5:20] = 1
        kv2 = KVCache(tiny.arch, 45, torch.float32, "cpu")
        kv2.write(0, kv.k, kv.v)
        work = SeqWork(kv2, ids[8:], torch.arange(8, 45), last_layer=last, logits_for="last")
        part = model.forward_step([work])[0]
        outs.append((full.logits, kv.k, kv.v, part.logits, kv2.k, kv2.v))
    assert aligned._aligned(torch.arange(37)).shape[0] == 48  # the case is really padded
    for want, got in zip(*outs, strict=True):
        assert want.shape == got.shape
        assert (want - got).abs().max() < 1e-5


def test_kernels_are_warmed_once_per_aligned_count(tiny: LoadedModel) -> None:
    """warm_kernels runs the products at each aligned count not yet warmed, up to a step's
    most rows, and nothing where rows are not aligned (float32's default)."""
    assert tiny.model.row_align == 1 and tiny.model.warm_kernels(2048) == 0
    aligned = copy.copy(tiny.model)
    aligned.row_align = 16
    assert aligned.warm_kernels(64) == 4  # 16, 32, 48, 64
    assert aligned.warm_kernels(70) == 0
    assert aligned.warm_kernels(100) == 2  # 80, 96


def test_batched_step_equals_separate(tiny: LoadedModel) -> None:
    a, b = _ids(70, seed=6), _ids(30, seed=7)
    ra, _ = _full(tiny, a)
    rb, _ = _full(tiny, b)
    kva = KVCache(tiny.arch, 70, torch.float32, "cpu")
    kvb = KVCache(tiny.arch, 30, torch.float32, "cpu")
    res = tiny.model.forward_step(
        [
            SeqWork(kva, a, torch.arange(70), logits_for="all"),
            SeqWork(kvb, b, torch.arange(30), logits_for="all"),
        ]
    )
    assert (res[0].logits - ra.logits).abs().max() < 1e-4
    assert (res[1].logits - rb.logits).abs().max() < 1e-4


def test_context_length_error_names_both_numbers(tiny: LoadedModel) -> None:
    kv = KVCache(tiny.arch, 8, torch.float32, "cpu")
    pos = torch.tensor([5000])
    with pytest.raises(ContextLengthError, match="5001 tokens.*4096 tokens"):
        tiny.model.forward_step([SeqWork(kv, torch.tensor([5]), pos)])


def test_bundled_logits_and_greedy_match_hf(bundled: LoadedModel) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(bundled.source, dtype=torch.float32).eval()
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    ids = torch.tensor(
        bundled.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    )
    ours, _ = _full(bundled, ids)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (ours.logits - ref).abs().max() < 1e-3
    assert _greedy_ours(bundled, ids, 32) == _greedy_hf(hf, ids, 32)


def test_batched_decode_equals_per_sequence_decode(tiny: LoadedModel) -> None:
    """Greedy decode of three sequences of mixed context lengths, all in one step each time
    (beside a partial prefill of a fourth), equals decoding each alone: tokens and logits."""
    prompts = [_ids(n, seed=20 + n) for n in (9, 57, 130)]
    steps = 6

    def prefill(ids: torch.Tensor) -> tuple[KVCache, int]:
        kv = KVCache(tiny.arch, len(ids) + steps, torch.float32, "cpu")
        res = tiny.model.forward_step([SeqWork(kv, ids, torch.arange(len(ids)))])[0]
        return kv, int(res.logits[-1].argmax())

    alone_tokens, alone_logits = [], []
    for ids in prompts:
        kv, tok = prefill(ids)
        toks, logits = [tok], []
        for _ in range(steps):
            pos = torch.tensor([kv.length])
            out = tiny.model.forward_step([SeqWork(kv, torch.tensor([toks[-1]]), pos)])[0]
            logits.append(out.logits[0])
            toks.append(int(out.logits[0].argmax()))
        alone_tokens.append(toks)
        alone_logits.append(torch.stack(logits))

    kvs, toks = zip(*(prefill(ids) for ids in prompts), strict=True)
    tokens = [[t] for t in toks]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    other = _ids(40, seed=99)
    other_kv = KVCache(tiny.arch, 40, torch.float32, "cpu")
    for step in range(steps):
        works = [
            SeqWork(kv, torch.tensor([t[-1]]), torch.tensor([kv.length]))
            for kv, t in zip(kvs, tokens, strict=True)
        ]
        if step < 2:  # a prefill in two parts shares the first two steps
            rows = torch.arange(20 * step, 20 * step + 20)
            works.insert(step, SeqWork(other_kv, other[rows], rows))
        results = tiny.model.forward_step(works)
        if step < 2:
            results.pop(step)
        for i, res in enumerate(results):
            logits[i].append(res.logits[0])
            tokens[i].append(int(res.logits[0].argmax()))
    assert tokens == alone_tokens
    for mine, ref in zip(logits, alone_logits, strict=True):
        assert (torch.stack(mine) - ref).abs().max() < 1e-4
    full, _ = _full(tiny, other, logits_for="last")
    last = tiny.model.forward_step([SeqWork(other_kv, other[-1:], torch.tensor([39]))])[0]
    assert (last.logits - full.logits).abs().max() < 1e-4
