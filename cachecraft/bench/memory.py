"""Peak resident memory of a block of code, sampled from /proc by a background thread."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


class PeakRss:
    peak_delta_bytes: int = 0


@contextmanager
def peak_rss(interval_s: float = 0.002) -> Iterator[PeakRss]:
    """Yield a PeakRss whose `peak_delta_bytes` is set to the peak RSS growth inside the block."""
    result = PeakRss()
    base = rss_bytes()
    peak = [base]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes())
            stop.wait(interval_s)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        yield result
    finally:
        stop.set()
        t.join()
        result.peak_delta_bytes = max(peak[0], rss_bytes()) - base
