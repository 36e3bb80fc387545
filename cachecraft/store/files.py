"""Small file helpers of the disk tier: whether a process that left a temp file is alive, and
dropping a written file's pages from the page cache."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs (its temp files are then not ours to remove)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def drop_cached_pages(fd: int) -> None:
    """Let the kernel drop a just-written file's pages from its page cache. A variant written
    through is still in the memory tier above, so the cached copy only duplicates it until that
    tier evicts it; and filling the page cache costs fresh memory, which on a VM whose host
    backs guest memory lazily is far dearer than reusing the few pages dropped write after
    write (docs/performance.md). A later read then comes from the device."""
    if hasattr(os, "posix_fadvise"):  # Linux, the BSDs; not macOS
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
