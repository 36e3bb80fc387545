"""RamTier: variants held as tensors on one device (accelerator memory or host RAM).

Owns the tensors and a per-chunk index; never chooses victims: `put` evicts what the caller's
`choose` picks (the tiered store's eviction policy). Not thread-safe: the store locks.

A host tier beside a CUDA memory tier keeps its tensors in pinned (page-locked) memory
(`pin`): a copy from pageable memory to the GPU is staged through a bounce buffer and blocks
the host, so only a pinned variant's promotion overlaps with the running forward.
"""

from __future__ import annotations

import torch

from cachecraft.store.meta import VariantMeta
from cachecraft.store.policy import VariantStats
from cachecraft.store.tier import Chooser
from cachecraft.store.variant import Variant


class RamTier:
    def __init__(
        self, name: str, capacity_bytes: int, device: torch.device | str = "cpu", pin: bool = False
    ) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.device = torch.device(device)
        if pin and self.device.type != "cpu":
            raise ValueError("only a host tier pins its tensors")
        self.pin = pin
        """Host tensors are kept page-locked (needs CUDA: the tier beside a CUDA memory tier)."""
        self._variants: dict[str, Variant] = {}
        self._by_chunk: dict[str, list[str]] = {}
        self.nbytes = 0

    def __contains__(self, variant_id: object) -> bool:
        return variant_id in self._variants

    def __len__(self) -> int:
        return len(self._variants)

    def ids(self) -> list[str]:
        return list(self._variants)

    def chunk_ids(self, chunk_key: str) -> list[str]:
        return list(self._by_chunk.get(chunk_key, ()))

    def metas(self, chunk_key: str) -> list[VariantMeta]:
        return [self._variants[v].meta for v in self._by_chunk.get(chunk_key, ())]

    def get(self, variant_id: str, device: torch.device | str | None = None) -> Variant | None:
        """The variant as held here (`device` is this tier's; the argument is for the shape)."""
        return self._variants.get(variant_id)

    def free_bytes(self) -> int:
        return self.capacity_bytes - self.nbytes

    def put(self, variant: Variant, stats: VariantStats, choose: Chooser) -> list[str] | None:
        vid = variant.variant_id
        if vid in self._variants:
            return []
        if variant.nbytes > self.capacity_bytes:
            return None
        evicted: list[str] = []
        need = variant.nbytes - self.free_bytes()
        if need > 0:
            residents = [
                VariantStats(v.variant_id, v.chunk_key, v.meta.num_tokens, v.nbytes)
                for v in self._variants.values()
            ]
            victims = choose(residents, need)
            if victims is None:
                return None
            for victim in victims:
                self.delete(victim.variant_id)
                evicted.append(victim.variant_id)
        self._place(variant)
        return evicted

    def _place(self, variant: Variant) -> None:
        vid = variant.variant_id
        if variant.keys.device != self.device:
            # asynchronous only towards an accelerator (its later kernels wait for the copy);
            # a host copy from one must be complete before anything reads it
            ahead = self.device.type != "cpu"
            variant = Variant(
                variant.meta,
                variant.keys.to(self.device, non_blocking=ahead),
                variant.values.to(self.device, non_blocking=ahead),
            )
        if self.pin and not variant.keys.is_pinned():
            variant = Variant(variant.meta, variant.keys.pin_memory(), variant.values.pin_memory())
        self._variants[vid] = variant
        self._by_chunk.setdefault(variant.chunk_key, []).append(vid)
        self.nbytes += variant.nbytes

    def delete(self, variant_id: str) -> bool:
        variant = self._variants.pop(variant_id, None)
        if variant is None:
            return False
        self.nbytes -= variant.nbytes
        ids = self._by_chunk[variant.chunk_key]
        ids.remove(variant_id)
        if not ids:
            del self._by_chunk[variant.chunk_key]
        return True

    def clear(self) -> None:
        self._variants.clear()
        self._by_chunk.clear()
        self.nbytes = 0

    def check_integrity(self) -> None:
        total = sum(v.nbytes for v in self._variants.values())
        assert total == self.nbytes, f"{self.name}: nbytes {self.nbytes} != {total}"
        assert self.nbytes <= self.capacity_bytes, f"{self.name} over capacity"
        indexed = sorted(v for ids in self._by_chunk.values() for v in ids)
        assert indexed == sorted(self._variants), f"{self.name}: chunk index disagrees"
        for chunk_key, ids in self._by_chunk.items():
            assert ids and all(self._variants[v].chunk_key == chunk_key for v in ids)
