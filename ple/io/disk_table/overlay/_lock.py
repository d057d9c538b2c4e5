"""The overlay directory's lock (``overlay.lock``): one writer at a time, readers shared.

Held with ``fcntl.flock`` (exclusive for a writer, shared for a reader) for as long as a store is open:
released at its close, when it is garbage-collected, and by the kernel when the process dies. A writer refused
says whether the holder is this process, and how to release it.
"""

from __future__ import annotations

import fcntl
import os
import weakref
from pathlib import Path

__all__ = ["LOCK", "DirLock"]

LOCK = "overlay.lock"


_HELD: dict[tuple[int, int], int] = {}
"""The lock files this process holds (device, inode) and how many times: to tell a user that the holder of an
overlay is in this process, and how to let it go."""


def _unlock(fd: int, key: tuple[int, int]) -> None:
    """Release a `DirLock`'s ``flock`` (closing its descriptor releases it): at `DirLock.release`, or when the
    lock is garbage-collected (a store, a table or a layer dropped without being closed)."""
    n = _HELD.get(key, 0) - 1
    if n > 0:
        _HELD[key] = n
    else:
        _HELD.pop(key, None)
    os.close(fd)


class DirLock:
    """``flock`` on ``overlay.lock``: exclusive for a writer, shared for readers, never waiting. Released by
    `release` or when the lock is garbage-collected, and by the kernel when the process dies."""

    def __init__(self, directory: Path, *, shared: bool) -> None:
        self.fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        st = os.fstat(self.fd)
        key = (st.st_dev, st.st_ino)
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = -1
            raise RuntimeError(_refusal(directory, key in _HELD)) from None
        _HELD[key] = _HELD.get(key, 0) + 1
        self._finalizer: weakref.finalize | None = weakref.finalize(self, _unlock, self.fd, key)

    @classmethod
    def unlocked(cls, directory: Path) -> DirLock:
        """No lock: a reader of the last flushed generation while a writer holds the directory."""
        lock = cls.__new__(cls)
        lock.fd = -1
        lock._finalizer = None
        return lock

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()                            # once: closing the descriptor releases the flock
            self._finalizer = None
        self.fd = -1


def _refusal(directory: Path, here: bool) -> str:
    """The message of a second writer refused: who holds ``directory`` and how to let it go."""
    if here:
        return (f"overlay: {directory} is held by this process: a layer loaded with load_layer(..., overlay=...) "
                f"(or an OverlayStore) still has it open, and an overlay has one writer at a time. Release it with "
                f"layer.table.close() (store.close(); updates since the last flush are dropped: "
                f"layer.table.flush() first keeps them); a layer deleted (del layer, and its optimizer) releases "
                f"it once garbage-collected")
    return (f"overlay: {directory} is held by another process: an overlay has one writer at a time; close it there "
            f"(layer.table.close()) or end that process (its lock goes with it)")
