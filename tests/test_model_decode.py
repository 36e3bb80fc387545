"""Batched decode over a KVPool (one attention call per layer per slot group) against decoding
each sequence alone, and the pool's slot bookkeeping."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys

import pytest
import torch

from cachecraft.model.decode import plan_decode
from cachecraft.model.kv import KVCache
from cachecraft.model.kv_pool import KVPool
from cachecraft.model.llama import LlamaModel
from cachecraft.model.loader import LoadedModel
from cachecraft.model.step import DecodeBatch, SeqWork


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g)


def _prefill(model: LlamaModel, kv: KVCache, ids: torch.Tensor) -> int:
    res = model.forward_step([SeqWork(kv, ids, torch.arange(len(ids)))])[0]
    return int(res.logits[-1].argmax())


def _alone(model: LlamaModel, ids: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits of each decode step, one sequence, per-sequence path."""
    kv = KVCache(model.arch, len(ids) + steps, torch.float32, "cpu")
    tokens, logits = [_prefill(model, kv, ids)], []
    for _ in range(steps):
        pos = torch.tensor([kv.length])
        out = model.forward_step([SeqWork(kv, torch.tensor(tokens[-1:]), pos)])[0]
        logits.append(out.logits[0])
        tokens.append(int(out.logits[0].argmax()))
    return tokens, torch.stack(logits)


def _batched(
    model: LlamaModel,
    prompts: list[torch.Tensor],
    steps: int,
    hole_slots: int = 2,
    transposed_keys: bool = True,
) -> tuple[list[list[int]], list[torch.Tensor], KVPool]:
    """The same sequences in a pool with free slots between them, fed in an order that is not
    the slot order, beside a two-part prefill of another sequence in the first two steps."""
    pool = KVPool(
        model.arch, len(prompts) + hole_slots, torch.float32, "cpu", 1 << 30, transposed_keys
    )
    placeholders = [pool.acquire(8) for _ in range(hole_slots)]
    kvs = []
    for ids in prompts:
        kv = pool.acquire(len(ids) + steps)
        assert kv is not None
        kvs.append(kv)
    for p in placeholders:  # free slots 0..hole_slots-1: they lie inside a group's range
        assert p is not None
        pool.release(p)
    tokens = [[_prefill(model, kv, ids)] for kv, ids in zip(kvs, prompts, strict=True)]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    other = _ids(40, seed=99)
    other_kv = KVCache(model.arch, 40, torch.float32, "cpu")
    order = list(range(len(prompts)))[::-1]
    for step in range(steps):
        works = []
        if step < 2:
            rows = torch.arange(20 * step, 20 * step + 20)
            works.append(SeqWork(other_kv, other[rows], rows))
        ids = torch.tensor([tokens[i][-1] for i in order])
        pos = torch.tensor([kvs[i].length for i in order])
        out = model.step(works, DecodeBatch([kvs[i] for i in order], ids, pos))
        assert out.decode_logits is not None and len(out.results) == len(works)
        for row, i in enumerate(order):
            logits[i].append(out.decode_logits[row])
            tokens[i].append(int(out.decode_logits[row].argmax()))
        pool.check_integrity()
    return tokens, [torch.stack(x) for x in logits], pool


@pytest.mark.parametrize(
    ("window", "row_align", "transposed_keys"),
    [(None, 1, True), (48, 1, True), (None, 16, True), (None, 1, False), (48, 1, False)],
)
def test_batched_decode_equals_per_sequence_decode(
    tiny: LoadedModel, window: int | None, row_align: int, transposed_keys: bool
) -> None:
    """Greedy tokens equal and logits within 1e-4 for mixed context lengths (several slot
    groups, padded keys, free slots inside a group), with and without a sliding window; with
    the batched steps' rows aligned (a prefill's 20 rows and 5 decode rows run as 32) against
    the unaligned per-sequence path; and over a pool of untransposed keys (bfloat16's layout,
    read by SDPA)."""
    model = copy.copy(tiny.model)
    if window is not None:
        model.arch = dataclasses.replace(model.arch, sliding_window=window)
    ref_model = copy.copy(model)
    model.row_align = row_align
    prompts = [_ids(n, seed=30 + n) for n in (9, 57, 60, 130, 400)]
    steps = 5
    tokens, logits, pool = _batched(model, prompts, steps, transposed_keys=transposed_keys)
    assert pool.k.shape == pool.v.shape and pool.k.is_contiguous() == (not transposed_keys)
    for i, ids in enumerate(prompts):
        ref_tokens, ref_logits = _alone(ref_model, ids, steps)
        assert tokens[i] == ref_tokens
        assert (logits[i] - ref_logits).abs().max() < 1e-4


def test_equal_lengths_form_one_group_without_mask(tiny: LoadedModel) -> None:
    pool = KVPool(tiny.arch, 4, torch.float32, "cpu", 1 << 30)
    kvs = [pool.acquire(64) for _ in range(4)]
    assert all(kv is not None for kv in kvs)
    pos = torch.full((4,), 50)
    plan = plan_decode(DecodeBatch(kvs, torch.ones(4, dtype=torch.long), pos), None, 4096)
    assert len(plan.groups) == 1
    g = plan.groups[0]
    assert (g.first, g.end, g.length, g.at, g.hidden) == (0, 4, 51, None, None)
    assert [kv.length for kv in kvs] == [51] * 4


def test_far_apart_lengths_split_into_groups(tiny: LoadedModel) -> None:
    pool = KVPool(tiny.arch, 3, torch.float32, "cpu", 1 << 30)
    kvs = [pool.acquire(3000) for _ in range(3)]
    pos = torch.tensor([2900, 10, 20])
    plan = plan_decode(DecodeBatch(kvs, torch.ones(3, dtype=torch.long), pos), None, 4096)
    assert [(g.first, g.end, g.length) for g in plan.groups] == [(0, 1, 2901), (1, 3, 21)]
    hidden = plan.groups[1].hidden  # lengths 11 and 21 in one group: keys 11..20 of slot 1
    assert hidden is not None and hidden[0].sum() == 10 and hidden[1].sum() == 0


@pytest.mark.parametrize("transposed_keys", [True, False])
def test_pool_slots_growth_and_release(tiny: LoadedModel, transposed_keys: bool) -> None:
    arch = tiny.arch
    pool = KVPool(arch, 3, torch.float32, "cpu", 1 << 30, transposed_keys, reserve=False)
    a = pool.acquire(10)
    b = pool.acquire(10)
    assert a is not None and b is not None and (a.slot, b.slot) == (0, 1)
    a.write(
        0, torch.full((arch.num_layers, arch.num_kv_heads, 10, arch.head_dim), 3.0), a.k[:, :, :10]
    )
    grown = pool.capacity
    pool.k[:, 2] = 7.0  # what a request that held slot 2 left behind
    c = pool.acquire(grown + 5)  # grows every slot; a's contents survive the move
    assert c is not None and c.slot == 2 and pool.capacity >= grown + 5
    assert bool((a.k[:, :, :10] == 3.0).all()) and a.capacity == pool.capacity
    assert not bool(c.k.any())  # a free slot is not copied: handed out empty
    # transposed keys live with capacity last, so a decode step reads K^T as a plain operand
    stored = pool.k_t if transposed_keys else pool.k
    assert stored.is_contiguous() and pool.k_t.shape[-1] == pool.capacity
    assert bool((pool.k_t[:, a.slot, :, :, :10] == 3.0).all())
    assert bool((pool.k_t[:, a.slot, :, :, 10:] == 0).all())
    pool.check_integrity()
    assert pool.acquire(4) is None  # no free slot
    pool.release(b)
    assert b.capacity == 0 and b.slot is None
    with pytest.raises(ValueError):
        pool.release(b)
    d = pool.acquire(4)
    assert d is not None and d.slot == 1  # the lowest free slot
    pool.check_integrity()


def test_a_cpu_pool_reserves_its_room_once_and_never_moves(tiny: LoadedModel) -> None:
    arch = tiny.arch
    budget = 3 * 1000 * 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4
    pool = KVPool(arch, 3, torch.float32, "cpu", budget)
    a = pool.acquire(10)
    assert a is not None and pool.capacity == 1000  # all that fits the budget, at once
    a.k[:, :, :10] = 3.0
    address = pool.k.data_ptr()
    b = pool.acquire(900)  # a longer sequence: no growth, no copy, a untouched
    assert b is not None and pool.k.data_ptr() == address and pool.capacity == 1000
    assert bool((a.k[:, :, :10] == 3.0).all()) and not bool(b.k.any())
    assert pool.acquire(1001) is None  # past the budget: the caller keeps a cache of its own
    whole = KVPool(arch, 3, torch.float32, "cpu", 1 << 40)
    assert whole.acquire(1) is not None and whole.capacity == arch.max_position_embeddings


_REFUSED_RESERVATION = """
import resource, torch
from cachecraft.model.arch import ModelArch
from cachecraft.model.kv_pool import KVPool
arch = ModelArch(  # the bundled model's shape
    model_type="llama", num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
    num_kv_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5,
    max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
    sliding_window=None,
)
with open("/proc/self/statm") as f:
    mapped = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
pool = KVPool(arch, 16, torch.float32, "cpu", 8 << 30)  # reserving would map 6 GiB
a = pool.acquire(900)
assert a is not None and pool.capacity == 900 and not pool.reserve, pool.capacity
a.k[:, :, :900] = 1.0
assert pool.acquire(9000) is None  # past the context: refused, not raised
huge = KVPool(arch, 16, torch.float32, "cpu", 8 << 30, reserve=False)
assert huge.acquire(5000) is None  # not even the exact size can be mapped: no slot, no raise
print("fell back")
"""


def test_a_reservation_the_os_refuses_falls_back_to_growing() -> None:
    # a small machine: the address space is capped 1 GiB above what the process has mapped, so
    # the OS refuses the 6 GiB reservation (as it refuses a map past RAM + swap) for real
    done = subprocess.run(
        [sys.executable, "-c", _REFUSED_RESERVATION], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "fell back" in done.stdout, done.stderr[-2000:]


def test_pool_refuses_past_its_byte_budget(tiny: LoadedModel) -> None:
    pool = KVPool(tiny.arch, 2, torch.float32, "cpu", max_bytes=0)
    assert pool.acquire(16) is None
    small = KVPool(tiny.arch, 2, torch.float32, "cpu", max_bytes=1 << 30)
    assert small.acquire(5000) is None  # past the model's context length (4096)
