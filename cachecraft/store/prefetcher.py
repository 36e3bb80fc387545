"""Prefetcher: brings variants from slow tiers into memory on a background thread while their
request waits in the queue, so that its `load` finds them there.

Owns the fetch thread, the fetches in flight (a `load` of one waits for it rather than reading
twice) and the background seconds of fetches not yet used (how much load time prefetching
hid). How a variant is fetched and placed is the store's (`fetch`); this only schedules it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from cachecraft.store.stats import StoreStats


class Prefetcher:
    """`fetch(variant_id)` reads a variant and places it in memory, returning True if it is
    there now; it runs on the prefetch thread without the store's lock. `lock` is the store's
    (it guards `stats` too)."""

    def __init__(
        self, lock: threading.RLock, fetch: Callable[[str], bool], stats: StoreStats
    ) -> None:
        self._lock = lock
        self._fetch = fetch
        self._stats = stats
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-prefetch")
        self._inflight: dict[str, Future[float]] = {}
        self._prefetched: dict[str, float] = {}  # id -> background load seconds, not yet used

    def start(self, variant_ids: Iterable[str]) -> None:
        """Queue a fetch of each id not in flight already; returns at once. Caller holds the
        lock (and left out what memory or a pin holds)."""
        for vid in variant_ids:
            if vid not in self._inflight:
                self._inflight[vid] = self._pool.submit(self._run, vid)

    def _run(self, variant_id: str) -> float:
        t0 = time.perf_counter()
        placed = self._fetch(variant_id)
        took = time.perf_counter() - t0
        with self._lock:
            self._stats.prefetch_loads += 1
            self._stats.prefetch_load_s += took
            if placed:
                self._prefetched[variant_id] = took
        return took

    def wait(self, variant_id: str) -> tuple[float, float | None]:
        """Wait for the variant's fetch if one is in flight; the caller must not hold the lock.

        Returns:
            (seconds waited, the fetch's background seconds if it placed the variant and no
            earlier `wait` took them, else None).
        """
        with self._lock:
            fut = self._inflight.get(variant_id)
        waited = 0.0
        if fut is not None:
            t0 = time.perf_counter()
            fut.result()
            waited = time.perf_counter() - t0
        with self._lock:
            self._inflight.pop(variant_id, None)
            return waited, self._prefetched.pop(variant_id, None)

    def wait_all(self) -> None:
        """Block until every queued fetch has ended."""
        with self._lock:
            futs = list(self._inflight.values())
        for fut in futs:
            fut.result()

    def close(self) -> None:
        """Finish the queued fetches and stop the thread."""
        self._pool.shutdown(wait=True)
