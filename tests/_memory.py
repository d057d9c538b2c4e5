"""A process's own memory, for the tests that bound it in a fresh process (``tests/`` is on ``sys.path``):
`rss_anon` (``RssAnon`` of /proc/self/status: anonymous memory, not the file pages the kernel caches) and
`Sampler` (its peak, sampled every millisecond by a thread, inside flushes and merges too)."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from pathlib import Path

__all__ = ["rss_anon", "Sampler", "HAS_PROC"]

HAS_PROC = Path("/proc/self/status").exists()


def rss_anon(trim: bool = False) -> int:
    """The process's RssAnon; ``trim``: after handing freed heap back (glibc's ``malloc_trim``), so that what is
    measured is memory held, not the allocator's keeping of freed temporaries (up to tens of MB, whose size
    depends on the order of allocations, not on the rows trained)."""
    if trim:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


class Sampler:
    """The highest RssAnon seen, sampled every millisecond by a thread (inside flushes and merges too)."""

    def __init__(self) -> None:
        self.peak, self._stop = rss_anon(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss_anon())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_anon())
