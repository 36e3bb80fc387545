"""KVPool: the K/V of many sequences in one tensor pair, one slot per sequence.

With every decoding sequence's K/V in one tensor pair, one attention call per layer reads all
of them (model/decode.py); a slot is handed out as a `KVCache` whose k, v are views of the
slot, so splicing, prefill and variant code stay unchanged. Keys are stored transposed,
k_t [layers, slots, Hkv, D, capacity] (`k` is its [.., capacity, D] view): a decode step's
q.K^T then reads each key matrix as a plain (not transposed) GEMM operand, which keeps it
memory-bound instead of paying for a strided read. The price is paid by writers and prefill
readers, which write and read keys across the grain (splicing is slower, and a prefill copies
a slot's keys once per layer for SDPA); decode steps, which run far more often, gain more than
that costs (figures: docs/performance.md). The pool
grows (all slots at once) when a sequence needs more positions; `acquire` refuses (None)
when no slot is free or growing would pass `max_bytes`, and the caller then uses a plain
KVCache of its own.

On a CPU the pool's pages are taken only when first written (`lazy_zeros`), so its first growth
reserves every position that `max_bytes` and the context allow (`reserve`) and it never grows
again. Growing copies every live slot into fresh pages, which stalls every stream for as long
as the page faults take (far longer than the copy itself) and faults the old pool's pages in
once more afterwards. A
sequence's K/V still take only the pages it writes (for keys, whole pages of each head-dim row,
as already after the first doubling past 1,024 positions). Where the OS refuses so large a map
(past RAM + swap on a small machine), the pool grows by doubling as before.

bfloat16 keeps its keys as they come, k [layers, slots, Hkv, capacity, D] (`transposed_keys`
False): its batched matmuls copy every strided key and value slice before multiplying (a
large share of a decode step), while SDPA reads a slot range of
untransposed keys and values in place (model/decode.py).
"""

from __future__ import annotations

import heapq

import torch

from cachecraft.model.arch import ModelArch
from cachecraft.model.kv import KVCache, lazy_zeros, touch_pages


class KVPool:
    """v, k: [num_layers, num_slots, num_kv_heads, capacity, head_dim]; k_t: k's [..,
    head_dim, capacity] view. With `transposed_keys` k_t is the stored tensor (contiguous)
    and k its view; without, the other way round."""

    def __init__(
        self,
        arch: ModelArch,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_bytes: int,
        transposed_keys: bool | None = None,
        reserve: bool | None = None,
        warm_positions: int = 0,
    ) -> None:
        """transposed_keys: store keys transposed (None: all dtypes but bfloat16). reserve:
        the first growth takes every position that fits `max_bytes` and the context, so the
        pool never grows (copies) again (None: on a CPU, where untouched pages cost nothing).
        warm_positions: how many positions of every free slot `warm_step` maps."""
        if num_slots < 1:
            raise ValueError(f"a KV pool needs at least one slot, got {num_slots}")
        self.arch = arch
        self.num_slots = num_slots
        self.max_bytes = max_bytes
        self.max_positions = arch.max_position_embeddings
        if transposed_keys is None:
            transposed_keys = dtype != torch.bfloat16
        self.transposed_keys = transposed_keys
        self.reserve = torch.device(device).type == "cpu" if reserve is None else reserve
        shape = (arch.num_layers, num_slots, arch.num_kv_heads, 0, arch.head_dim)
        self._keys = torch.zeros(self._key_shape(shape), dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(num_slots))  # a heap: the lowest free slot goes first
        self._caches: dict[int, KVCache] = {}
        self.warm_positions = warm_positions
        self._touched = [0] * num_slots
        """Per slot, the positions whose pages are mapped (by `warm_step`, or written by a
        sequence that held it: a slot handed out is mapped lazily, as its positions are
        written, so a request asking for many tokens does not wait to map them all)."""
        self._warm_layers = [0] * num_slots
        """Per slot, the layers `warm_step` mapped past `_touched` so far."""

    def _key_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored keys' shape for v's `shape`."""
        return (*shape[:-2], shape[-1], shape[-2]) if self.transposed_keys else shape

    @property
    def k(self) -> torch.Tensor:
        """[num_layers, num_slots, num_kv_heads, capacity, head_dim]."""
        return self._keys.transpose(-1, -2) if self.transposed_keys else self._keys

    @property
    def k_t(self) -> torch.Tensor:
        """[num_layers, num_slots, num_kv_heads, head_dim, capacity]."""
        return self._keys if self.transposed_keys else self._keys.transpose(-1, -2)

    @property
    def capacity(self) -> int:
        return self.v.shape[3]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def bytes_for(self, capacity: int) -> int:
        """Bytes of k and v together at `capacity` positions per slot."""
        a = self.arch
        per_position = a.num_layers * self.num_slots * a.num_kv_heads * a.head_dim
        return 2 * per_position * capacity * self.v.element_size()

    def acquire(self, capacity: int) -> KVCache | None:
        """A free slot as an empty KVCache of at least `capacity` positions; None if no slot
        is free or the pool would grow past `max_bytes` (or the model's context length)."""
        if not self._free or capacity > self.max_positions:
            return None
        if capacity > self.capacity:
            if self.bytes_for(capacity) > self.max_bytes:
                return None
            try:
                self.grow(capacity)
            except (OSError, RuntimeError):  # not even `capacity` could be mapped
                return None
        slot = heapq.heappop(self._free)
        kv = KVCache(self.arch, 0, self.v.dtype, self.v.device)
        kv.pool, kv.slot = self, slot
        kv.k, kv.v = self.k[:, slot], self.v[:, slot]
        self._caches[slot] = kv
        return kv

    def _touch(self, slot: int, end: int, layer: int) -> None:
        """Map the pages of free `slot`'s positions `_touched[slot]`..end-1 in `layer`
        (`touch_pages`). They hold zeros or K/V a finished sequence wrote past its length,
        which no reader looks at, so the zeros written change nothing."""
        done, layers = self._touched[slot], slice(layer, layer + 1)
        if self.transposed_keys:
            touch_pages(self._keys[layers, slot, :, :, done:end])
        else:
            touch_pages(self._keys[layers, slot, :, done:end].flatten(-2))
        touch_pages(self.v[layers, slot, :, done:end].flatten(-2))

    def _warm_end(self) -> int:
        """Positions of each free slot `warm_step` maps: `warm_positions` within `max_bytes`
        and the context (0 off a CPU, where there are no such pages)."""
        if self.v.device.type != "cpu":
            return 0
        fit = self.max_bytes // max(self.bytes_for(1), 1)
        return min(self.warm_positions, self.max_positions, fit)

    def _unwarmed(self, end: int) -> list[int]:
        """Free slots whose first `end` positions are not all mapped."""
        return [slot for slot in self._free if self._touched[slot] < end]

    @property
    def num_unwarmed(self) -> int:
        """Free slots `warm_step` has yet to map."""
        end = self._warm_end()
        return len(self._unwarmed(end)) if end > 0 else 0

    def warm_step(self) -> bool:
        """Map one layer's pages of the lowest free slot whose first `warm_positions`
        positions are not mapped yet; False when none is left (nothing done). The step thread
        calls it while idle, so that a burst's prefills write into mapped pages: on a VM whose
        host backs guest memory lazily a fresh page costs about ten times as much to fault in
        as one the host already backs (docs/performance.md). One call maps one layer of one
        slot, so a request that arrives meanwhile waits at most that long."""
        end = self._warm_end()
        if end <= 0 or not self._free:
            return False
        if self.capacity < end:
            try:
                self.grow(end)
            except (OSError, RuntimeError):
                self.warm_positions = 0  # the OS refused: no warming, requests still served
                return False
        todo = self._unwarmed(end)
        if not todo:
            return False
        slot = min(todo)
        layer = self._warm_layers[slot]
        self._touch(slot, end, layer)
        if layer + 1 < self.arch.num_layers:
            self._warm_layers[slot] = layer + 1
        else:
            self._touched[slot], self._warm_layers[slot] = end, 0
        return True

    def release(self, kv: KVCache) -> None:
        """Give `kv`'s slot back. The cache is emptied (zero capacity), so a late write to it
        fails loudly instead of landing in the next sequence's slot."""
        if kv.pool is not self or kv.slot is None or self._caches.get(kv.slot) is not kv:
            raise ValueError("this KVCache is not a live slot of this pool")
        del self._caches[kv.slot]
        heapq.heappush(self._free, kv.slot)
        # its first `length` positions were written, so mapped: `warm_step` goes on from there
        self._touched[kv.slot] = max(self._touched[kv.slot], kv.length)
        kv.pool, kv.slot, kv.length = None, None, 0
        kv.k, kv.v = kv.k[:, :, :0], kv.v[:, :, :0]

    def grow(self, capacity: int) -> None:
        """At least `capacity` positions per slot: with `reserve` all that fit `max_bytes` and
        the context, else doubling while that fits `max_bytes` (fewer reallocations), else
        exactly `capacity` (a pooled cache is never refused growth). A size the OS refuses to
        map (a reservation past RAM + swap on a small machine) falls back to the next, and a
        refused reservation is not tried again. Live slots' contents kept, every live cache
        re-pointed. Free slots are not copied (a slot is empty when handed out): growing a
        16-slot pool with one request in it copies one slot, not sixteen, and the free slots'
        new pages stay untouched."""
        if capacity <= self.capacity:
            return
        most = min(self.max_bytes // max(self.bytes_for(1), 1), self.max_positions)
        doubled = min(max(capacity, 2 * self.capacity), most)
        tries = ([most] if self.reserve else []) + [doubled]
        for new_cap in dict.fromkeys([*(max(c, capacity) for c in tries), capacity]):
            shape = (*self.v.shape[:3], new_cap, self.v.shape[4])
            try:
                keys = lazy_zeros(self._key_shape(shape), self.v.dtype, self.v.device)
                v = lazy_zeros(shape, self.v.dtype, self.v.device)
                break
            except (OSError, RuntimeError):  # mmap's ENOMEM; torch's out of memory
                if new_cap == capacity:
                    raise
                self.reserve = False
        old = self.capacity
        for slot in self._caches:
            if self.transposed_keys:
                keys[:, slot, ..., :old] = self._keys[:, slot]
            else:
                keys[:, slot, :, :old] = self._keys[:, slot]
            v[:, slot, :, :old] = self.v[:, slot]
        self._keys, self.v = keys, v
        self._touched = [old if slot in self._caches else 0 for slot in range(self.num_slots)]
        self._warm_layers = [0] * self.num_slots
        for slot, kv in self._caches.items():
            kv.k, kv.v = self.k[:, slot], self.v[:, slot]

    def check_integrity(self) -> None:
        """Every slot is either free or held by exactly one live cache viewing it."""
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is free twice"
        assert not free & set(self._caches), "a slot is both free and held"
        assert free | set(self._caches) == set(range(self.num_slots)), "a slot went missing"
        for slot, kv in self._caches.items():
            assert kv.pool is self and kv.slot == slot
            assert kv.k.data_ptr() == self.k[:, slot].data_ptr(), "a cache views a stale pool"
