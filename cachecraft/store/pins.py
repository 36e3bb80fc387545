"""PinSet: the variants a store keeps whatever admission and capacity say, and who pinned them.

Owns the pinned variants (their tensors: a pin is served from here), the namespace (tenant)
each pin counts against and the per-namespace byte cap. It stores nothing anywhere else: the
store decides what a pin means for its tiers (a disk copy a restart pins again, room in the
chunk's cap). Thread-safe on its own lock, which is never held while another lock is taken.
"""

from __future__ import annotations

import threading

from cachecraft.errors import PinLimitError
from cachecraft.store.meta import VariantMeta
from cachecraft.store.variant import Variant


class PinSet:
    """Pinned variants by id. `max_bytes_per_namespace` None: no cap."""

    def __init__(self, max_bytes_per_namespace: int | None = None) -> None:
        self.max_bytes_per_namespace = max_bytes_per_namespace
        self._pinned: dict[str, Variant] = {}
        self._namespace: dict[str, str] = {}  # variant id -> the namespace that pinned it
        self._lock = threading.Lock()

    def add(self, variant: Variant, namespace: str) -> bool:
        """Pin `variant` for `namespace`.

        Returns:
            False if it was pinned already (nothing changes), True if pinned now.
        Raises:
            PinLimitError, pinning nothing, when the namespace's pinned bytes would pass
            `max_bytes_per_namespace`.
        """
        cap, vid = self.max_bytes_per_namespace, variant.variant_id
        with self._lock:
            if vid in self._pinned:
                return False
            if cap is not None:
                used = sum(
                    self._pinned[i].nbytes for i, ns in self._namespace.items() if ns == namespace
                )
                if used + variant.nbytes > cap:
                    raise PinLimitError(
                        f"namespace {namespace!r} has {used} bytes pinned; pinning "
                        f"{variant.nbytes} more would pass max_pinned_bytes_per_namespace={cap}: "
                        "unpin chunks (DELETE /v1/chunks/{chunk_key}) or raise "
                        "--max-pinned-bytes-per-namespace"
                    )
            self._pinned[vid] = variant
            self._namespace[vid] = namespace
            return True

    def get(self, variant_id: str) -> Variant | None:
        """The pinned variant, or None if `variant_id` is not pinned."""
        with self._lock:
            return self._pinned.get(variant_id)

    def __contains__(self, variant_id: object) -> bool:
        with self._lock:
            return variant_id in self._pinned

    def __len__(self) -> int:
        with self._lock:
            return len(self._pinned)

    def discard(self, variant_id: str) -> bool:
        """Release one pin. Returns False if `variant_id` was not pinned."""
        with self._lock:
            self._namespace.pop(variant_id, None)
            return self._pinned.pop(variant_id, None) is not None

    def discard_chunk(self, chunk_key: str) -> set[str]:
        """Release every pin of `chunk_key`. Returns the variant ids released."""
        with self._lock:
            ids = {i for i, v in self._pinned.items() if v.chunk_key == chunk_key}
            for i in ids:
                del self._pinned[i]
                self._namespace.pop(i, None)
            return ids

    def clear(self) -> None:
        with self._lock:
            self._pinned.clear()
            self._namespace.clear()

    def metas(self, chunk_key: str) -> list[VariantMeta]:
        """Metadata of the pinned variants of `chunk_key`."""
        with self._lock:
            return [v.meta for v in self._pinned.values() if v.chunk_key == chunk_key]

    def variant_ids(self) -> set[str]:
        """Ids of every pinned variant."""
        with self._lock:
            return set(self._pinned)

    def chunk_keys(self) -> set[str]:
        """Chunk keys with at least one pinned variant."""
        with self._lock:
            return {v.chunk_key for v in self._pinned.values()}

    def nbytes(self, chunk_keys: set[str] | None = None) -> int:
        """Bytes pinned for variants of these chunk keys (one tenant's share); all pinned
        bytes when `chunk_keys` is None."""
        with self._lock:
            return sum(
                v.nbytes
                for v in self._pinned.values()
                if chunk_keys is None or v.chunk_key in chunk_keys
            )
