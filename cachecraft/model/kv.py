"""KVCache: one sequence's K/V for every layer, keys rotated at their absolute positions."""

from __future__ import annotations

import math
import mmap
from typing import Protocol

import torch

from cachecraft.model.arch import ModelArch


def lazy_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """torch.zeros(shape) whose pages the OS zeroes when first touched (CPU: an anonymous
    private mmap, page-aligned, plain 4 KiB pages), so a big KV buffer costs nothing up front
    and only the positions used ever take memory (torch.zeros writes every byte, and a large
    pool would charge that to the first request's time to first token). numpy's calloc is
    not used: it asks for transparent huge pages, whose faults zero 2 MiB at a time and may
    stall on compaction. Other devices: torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # keeps the map alive
    return raw.view(dtype).view(shape)


PAGE_BYTES = 4096
"""The smallest page a CPU maps (`touch_pages` writes one byte in every such stretch)."""


def touch_pages(t: torch.Tensor) -> None:
    """Have the OS map every page under t now: one zero byte is written into every
    `PAGE_BYTES` of each row (t's last dimension must be contiguous), so only memory whose
    bytes are zeros anyway (`lazy_zeros` pages never written) or do not matter may be touched.
    The writes are numpy's, on this thread alone, so torch's thread count (and oneDNN's
    kernels, keyed by it) are left alone. CPU tensors only; other devices have no such pages."""
    if t.device.type != "cpu" or t.numel() == 0:
        return
    rows = t.view(torch.uint8).numpy()  # [..., last * element size]
    rows[..., ::PAGE_BYTES] = 0
    rows[..., -1] = 0


class SlotOwner(Protocol):
    """What a cache needs of the pool it is a slot of (`KVPool`)."""

    def grow(self, capacity: int) -> None: ...


class KVCache:
    """k, v: [num_layers, num_kv_heads, capacity, head_dim]; positions [0, length) are valid.

    Writers fill any positions (a spliced cache is filled out of order); `length` is the
    number of leading positions a forward may read. A cache may be a slot of a `KVPool`
    (`pool`, `slot` set): then k, v are views into the pool's tensors and growing it grows the
    pool (the views are re-pointed, so never hold k or v across a call that may grow it); such
    a k is a transposed view (the pool stores keys [D, capacity]), so readers that need
    contiguous keys copy them.
    """

    def __init__(
        self, arch: ModelArch, capacity: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        shape = (arch.num_layers, arch.num_kv_heads, capacity, arch.head_dim)
        self.k = lazy_zeros(shape, dtype, device)
        self.v = lazy_zeros(shape, dtype, device)
        self.length = 0
        self.pool: SlotOwner | None = None
        self.slot: int | None = None

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def ensure_capacity(self, capacity: int) -> None:
        """Grow the buffers (keeping contents) so that `capacity` positions fit."""
        if capacity <= self.capacity:
            return
        if self.pool is not None:
            self.pool.grow(capacity)
            return
        new_cap = max(capacity, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = lazy_zeros((*old.shape[:2], new_cap, old.shape[3]), old.dtype, old.device)
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Place k, v [num_layers, num_kv_heads, n, head_dim] (already rotated) at start..start+n."""
        n = k.shape[2]
        self.ensure_capacity(start + n)
        self.k[:, :, start : start + n] = k.to(self.k.dtype)
        self.v[:, :, start : start + n] = v.to(self.v.dtype)
        self.length = max(self.length, start + n)
