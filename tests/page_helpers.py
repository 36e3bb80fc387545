"""Test helper: which pages of a stretch of this process's memory the OS has in memory
(mincore), for anonymous memory (mapped or not) and file maps (in the page cache or not)."""

from __future__ import annotations

import ctypes
import mmap


def resident(addr: int, nbytes: int) -> list[bool]:
    """Per page from the one holding `addr` through the one holding addr + nbytes - 1."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = addr // mmap.PAGESIZE * mmap.PAGESIZE
    num_pages = -(-(addr + nbytes - start) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * num_pages)()
    rc = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(addr + nbytes - start), vec)
    assert rc == 0, ctypes.get_errno()
    return [bool(b & 1) for b in vec]
