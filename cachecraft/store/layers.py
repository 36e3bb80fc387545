"""Layer-wise readers: hand the runner one layer's K/V at a time, reading the next one ahead.

Owns lazy per-layer access (`k.{l}`, `v.{l}` safetensors tensors) and the measure of load time
hidden behind compute; never decides which variant to read or where it lives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
from safetensors import safe_open

from cachecraft.store import codec

logger = logging.getLogger(__name__)


class LayerReader(Protocol):
    num_layers: int

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of `layer`, each [num_kv_heads, num_tokens, head_dim]."""
        ...

    def close(self) -> None: ...


class TensorLayerReader:
    """Layers of a variant already in memory: slices, nothing to read."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values
        self.num_layers = int(keys.shape[0])

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer], self.values[layer]

    def close(self) -> None:
        pass


def all_layers(reader: LayerReader) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of every layer, each [num_layers, num_kv_heads, num_tokens, head_dim]: a variant in
    memory as it is held (no copy), any other reader's layers stacked."""
    if isinstance(reader, TensorLayerReader):
        return reader.keys, reader.values
    layers = [reader.layer(layer) for layer in range(reader.num_layers)]
    return torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers])


class FileLayerReader:
    """Reads one layer's tensors from a safetensors file on demand, each checked against the
    file's own header (which is checked against its own checksum when the file is opened) and
    for finite values; a mismatch raises CorruptVariantError and calls `on_corrupt`."""

    def __init__(
        self,
        path: str,
        device: torch.device | str = "cpu",
        on_corrupt: Callable[[str], None] | None = None,
    ) -> None:
        self._file = safe_open(path, framework="pt", device="cpu")
        self._header = self._file.metadata()
        self._layout = codec.verified_layout(self._header, self._file.keys())
        self._device = device
        self._on_corrupt = on_corrupt
        self._lock = threading.Lock()
        self.num_layers = sum(1 for name in self._layout if name.startswith("k."))

    def _get(self, name: str) -> torch.Tensor:
        t = self._file.get_tensor(name)
        codec.check_tensor(name, t, self._layout)
        return t

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            try:
                return codec.decode_layer(self._get, self._header, layer, self._device)
            except codec.CorruptVariantError as exc:
                if self._on_corrupt is not None:
                    self._on_corrupt(str(exc))
                raise

    def close(self) -> None:
        self._file = None  # safe_open handles close when collected


class ReadAheadLayerReader:
    """Wraps a reader: asking for layer l starts reading layer l+1 on a worker thread.

    read_s: seconds spent reading layers; wait_s: seconds the caller blocked. hidden_s =
    read_s - wait_s is load time overlapped with the caller's compute.
    """

    def __init__(self, inner: LayerReader, on_close: Callable[[float, float], None] | None = None):
        self.inner = inner
        self.num_layers = inner.num_layers
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layer-read")
        self._ahead: dict[int, Future[tuple[tuple[torch.Tensor, torch.Tensor], float]]] = {}
        self._on_close = on_close
        self.read_s = 0.0
        self.wait_s = 0.0

    def _timed(self, layer: int) -> tuple[tuple[torch.Tensor, torch.Tensor], float]:
        t0 = time.perf_counter()
        kv = self.inner.layer(layer)
        return kv, time.perf_counter() - t0

    def _start(self, layer: int) -> None:
        if 0 <= layer < self.num_layers and layer not in self._ahead:
            self._ahead[layer] = self._pool.submit(self._timed, layer)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._start(layer)
        self._start(layer + 1)
        t0 = time.perf_counter()
        kv, took = self._ahead.pop(layer).result()
        self.wait_s += time.perf_counter() - t0
        self.read_s += took
        return kv

    @property
    def hidden_s(self) -> float:
        return max(0.0, self.read_s - self.wait_s)

    def close(self) -> None:
        for fut in self._ahead.values():
            fut.cancel()
        self._pool.shutdown(wait=True)
        self.inner.close()
        if self._on_close is not None:
            self._on_close(self.read_s, self.wait_s)
            self._on_close = None
