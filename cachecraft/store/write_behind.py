"""WriteBehind: the slow-tier writes (disk, Redis) that `offer(..., wait=False)` leaves to one
writer thread, so a serving path never waits for file writes and fsyncs.

Owns the queue of pending writes (bounded: past `max_pending` the caller writes itself), the
writer thread, and cancellation: a variant removed while its write waits is not written, and
what was written meanwhile goes again. It writes through callbacks the store gives it and
shares the store's lock, so "queued", "cancelled" and "written" change under one lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from cachecraft.store.policy import VariantStats
from cachecraft.store.variant import Variant

logger = logging.getLogger(__name__)

WriteFn = Callable[[Variant, VariantStats], tuple[bool, str | None]]
"""Write a variant to the slow tiers: (a tier stored it, the disk's write error or None)."""
SettleFn = Callable[[Variant, bool, str | None], object]
"""Count a write's outcome: (variant, stored anywhere, write error)."""


@dataclasses.dataclass(slots=True)
class _Pending:
    """A variant whose slow-tier writes wait on the writer thread. `cancelled`: it was
    removed meanwhile, so it is not written, or what was written goes again."""

    variant: Variant
    cancelled: bool = False


class WriteBehind:
    """Methods named "caller holds the lock" expect the store's lock (`lock`) held."""

    def __init__(
        self,
        lock: threading.RLock,
        write: WriteFn,
        settle: SettleFn,
        discard: Callable[[str], None],
        max_pending: int = 32,
    ) -> None:
        self.max_pending = max_pending
        """Writes that may wait on the writer thread; more are written by the caller."""
        self._lock = lock
        self._write, self._settle, self._discard = write, settle, discard
        self._pending: dict[str, _Pending] = {}
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-writer")

    def __contains__(self, variant_id: object) -> bool:
        return variant_id in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, variant: Variant, st: VariantStats, in_memory: bool) -> bool:
        """Queue the variant's slow-tier writes; one queued already is un-cancelled instead.
        Caller holds the lock.

        Returns:
            True if the writes are (or stay) queued; False when the queue is full (the caller
            writes them itself).
        """
        vid = variant.variant_id
        pending = self._pending.get(vid)
        if pending is not None:  # offered again while its write waits: that write does
            pending.cancelled = False
            return True
        if len(self._pending) >= self.max_pending:
            return False
        pending = self._pending[vid] = _Pending(variant)
        self._writer.submit(self._run, pending, st, in_memory)
        return True

    def requeue(self, variant_id: str) -> bool:
        """Un-cancel a write still queued for `variant_id`. Returns False if none is queued.
        Caller holds the lock."""
        pending = self._pending.get(variant_id)
        if pending is None:
            return False
        pending.cancelled = False
        return True

    def waiting(self, chunk_key: str) -> dict[str, Variant]:
        """The chunk's variants that wait for the writer and were not removed. Caller holds
        the lock."""
        return {
            vid: p.variant
            for vid, p in self._pending.items()
            if p.variant.chunk_key == chunk_key and not p.cancelled
        }

    def held(self, variant_id: str) -> Variant | None:
        """The variant if it waits for the writer and was not removed, else None. Caller holds
        the lock."""
        pending = self._pending.get(variant_id)
        return None if pending is None or pending.cancelled else pending.variant

    def will_write(self, variant_id: str) -> bool:
        """The writer is to write this variant. Caller holds the lock."""
        return self.held(variant_id) is not None

    def cancel(self, variant_id: str) -> None:
        """A removed variant's queued write must not bring it back. Caller holds the lock."""
        pending = self._pending.get(variant_id)
        if pending is not None:
            pending.cancelled = True

    def cancel_all(self) -> None:
        """Cancel every queued write. Caller holds the lock."""
        for pending in self._pending.values():
            pending.cancelled = True

    def _run(self, pending: _Pending, st: VariantStats, in_memory: bool) -> None:
        """The writer thread's half of `offer(..., wait=False)`."""
        variant = pending.variant
        vid = variant.variant_id
        stored, write_error = False, None
        try:
            if not pending.cancelled:
                stored, write_error = self._write(variant, st)
        except Exception as e:  # never lose the writer thread to one variant
            logger.exception("writing variant %s behind failed", vid)
            write_error = f"{type(e).__name__}: {e}"
        with self._lock:  # one hold: an offer of the same id cannot write between the two
            self._pending.pop(vid, None)
            if pending.cancelled:  # removed while queued or written: its copies go too
                self._discard(vid)
                return
        self._settle(variant, in_memory or stored, write_error)

    def flush(self) -> None:
        """Wait until every write queued so far has ended."""
        with contextlib.suppress(RuntimeError):  # shut down by close(), which finished them
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the queued writes and stop the writer thread."""
        self._writer.shutdown(wait=True)
