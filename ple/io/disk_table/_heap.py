"""Freed heap handed back to the kernel: `release_freed` (glibc's ``malloc_trim``; nothing elsewhere).

The C allocator keeps memory a program frees for its next allocations; glibc hands back only the top of each
heap, so a small block still in use above a large freed one (a segment's fences made after a spill's chunks)
pins the freed memory under it. Over a long training run the overlay's spills, merges and flushes free tens
of MB of temporaries each, in many heaps (one per thread that allocates, up to eight per core), and what stays
pinned grew with the rows trained: about 45 bytes a row in the process's anonymous memory on the real table,
none of it in use. ``malloc_trim(0)`` returns every whole free page of every heap to the kernel (it walks the
free lists: milliseconds at a GiB of heap); the overlay calls it after each spill, merge and flush, and after
opening and verifying (the ids streamed and the checksums read: 27 MB kept at 2M rows, in the opening thread's
heap, where ``ple.io.merge``'s blocks, made in a thread of their own, cannot reuse it).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Callable

__all__ = ["release_freed"]


def _find_trim() -> Callable[[int], int] | None:
    with contextlib.suppress(OSError, AttributeError, TypeError):
        name = ctypes.util.find_library("c")
        trim = ctypes.CDLL(name).malloc_trim if name else None
        if trim is not None:
            trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        return trim
    return None


_TRIM = _find_trim()


def release_freed() -> bool:
    """Hand the allocator's whole free pages back to the kernel; True where it could (glibc), else False."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
