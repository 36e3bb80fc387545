"""LayerLoader: fill reused chunks' K/V into a request's KVCache one layer at a time.

Called by the forward right before each layer, so a disk reader's read-ahead of layer l+1
overlaps the compute of layer l. Keys arrive before RoPE and are rotated to the chunk's new
positions here; values need no fix.
"""

from __future__ import annotations

import torch

from cachecraft.model.kv import KVCache
from cachecraft.model.rope import Rope
from cachecraft.store.layers import LayerReader, TensorLayerReader, all_layers


class LayerLoader:
    def __init__(self, kv: KVCache, rope: Rope) -> None:
        self.kv = kv
        self.rope = rope
        self._spans: list[tuple[LayerReader, int, int, torch.Tensor, torch.Tensor]] = []

    @property
    def num_readers(self) -> int:
        return len(self._spans)

    @property
    def reads_only_memory(self) -> bool:
        """Every chunk is already in memory: filling a layer reads no file, so it cannot fail
        a checksum halfway through a forward that other requests share."""
        return all(isinstance(span[0], TensorLayerReader) for span in self._spans)

    def add(self, reader: LayerReader, start: int, end: int) -> None:
        """Place `reader`'s chunk at positions start..end-1."""
        cos, sin = self.rope.cos_sin_range(start, end, self.kv.k.dtype)
        self._spans.append((reader, start, end, cos, sin))
        self.kv.ensure_capacity(end)

    def fill_layer(self, layer: int) -> None:
        dtype, device = self.kv.k.dtype, self.kv.k.device
        for reader, start, end, cos, sin in self._spans:
            k, v = reader.layer(layer)  # [Hkv, T, D], keys before RoPE
            self.kv.k[layer, :, start:end] = Rope.apply(k.to(device, dtype), cos, sin)
            self.kv.v[layer, :, start:end] = v.to(device, dtype)

    def fill_all(self) -> None:
        """Every layer now (a probe reads them all before the prefill): per chunk, all its
        layers rotated in one pass rather than one small rotation per layer (a request's
        reused chunks x layers: thousands of tiny ops per burst), read as the memory tier
        holds them (stacking the layers first would copy them once more); values are
        converted by the write itself."""
        dtype, device = self.kv.k.dtype, self.kv.k.device
        for reader, start, end, cos, sin in self._spans:
            keys, values = all_layers(reader)
            self.kv.k[:, :, start:end] = Rope.apply(keys.to(device, dtype), cos, sin)
            self.kv.v[:, :, start:end] = values.to(device)

    def close(self) -> None:
        for reader, *_ in self._spans:
            reader.close()
        self._spans.clear()
