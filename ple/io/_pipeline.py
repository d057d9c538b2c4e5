"""A file written while the next block is made: `ahead` and `WriteBack`, the checkpoint writer's overlap.

Writing a large checkpoint (``ple.io.merge`` of a trained table, ``convert``, ``save``) does three things per
block: make it (read the base's rows, put the overlay's in, cast or quantize), copy it into the page cache
(``write``), and the disk's own writing of those pages. Done one after the other, the disk sits idle while a
block is made, and nothing reaches it before the final ``fsync``, which then waits for the whole file
(measured: a 2 GiB merge spent 0.9 of its 3.7 s in that ``fsync``). Here:

* `ahead` makes the next block in a thread of its own while the caller writes the current one (the reads of
  the base file, the overlay's probes and the casts release the interpreter's lock);
* `WriteBack` has the kernel start writing each range of the file as soon as it is in the page cache
  (``sync_file_range``, Linux), and waits for the range ``lag`` bytes behind, so the dirty pages of the file
  stay under ``lag`` and the final ``fsync`` waits for the last ``lag`` bytes only. Elsewhere (no
  ``sync_file_range``) it does nothing, and the final ``fsync`` writes what is left, as before.

Memory: one block made ahead beside the one being written (`ahead` makes the next only once the current one is
taken), plus what making one needs; ``ple.io.disk_table.budget.MERGE_BLOCKS`` counts it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable, Generator, Iterable
from typing import Any, TypeVar

import torch

__all__ = ["ahead", "WriteBack", "write_chunks", "PIPELINE_BYTES", "WRITE_CHUNK", "WRITE_LAG"]

T = TypeVar("T")

PIPELINE_BYTES = 32 << 20
"""Files at least this large are written through the overlap; smaller ones inline (a thread costs more than it
saves there). Tests set it to 0 to run every write through it."""

WRITE_CHUNK = 16 << 20
"""The writer copies a block into the page cache in pieces this size, starting each one's writeback as it lands."""

WRITE_LAG = 64 << 20
"""How far behind the written end `WriteBack` waits for the disk: the most dirty pages one file keeps."""

_WRITE, _WAIT = 2, 1 | 2 | 4     # SYNC_FILE_RANGE_WRITE; WAIT_BEFORE | WRITE | WAIT_AFTER


def _find_sync_range() -> Callable[[int, int, int, int], int] | None:
    with contextlib.suppress(OSError, AttributeError, TypeError):
        name = ctypes.util.find_library("c")
        fn = ctypes.CDLL(name, use_errno=True).sync_file_range if name else None
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
        return fn
    return None


_SYNC_RANGE = _find_sync_range()


def ahead(items: Iterable[T]) -> Generator[T, None, None]:
    """``items`` in order, each next one made by a thread of its own while the caller works on the current one.

    At most one item waits made: the thread starts the next only once the caller has taken the last, so the
    memory is the caller's item and one more (and what making it needs). An exception raised making an item is
    raised here, in the caller, when it reaches that item (the same exception object: its type and message
    as ``items`` gave them). Closing this iterator early (``break``, an exception in the caller) stops the
    thread after the item it is making, and closes ``items`` there (an exception its closing raises is
    dropped). The thread makes items under ``torch.no_grad()`` (grad mode is per thread; an item to be
    written needs no graph) and on the caller's current CUDA stream (streams are per thread too).
    """
    source = iter(items)
    # The caller's CUDA stream, made the thread's current one (streams are per thread): a producer's copy off
    # the GPU is ordered after the caller's work on it, as it would be in the caller's thread.
    stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    cond = threading.Condition()
    box: list[tuple[str, Any]] = []              # at most one: ("item", x), ("end", None) or ("error", exc)
    state = {"stop": False}

    def hand(kind: str, value: Any) -> bool:
        """Put one thing in the box once it is empty; False where the caller has gone."""
        with cond:
            cond.wait_for(lambda: not box or state["stop"])
            if state["stop"]:
                return False
            box.append((kind, value))
            cond.notify_all()
            cond.wait_for(lambda: not box or state["stop"])     # taken: only now make the next
            return not state["stop"]

    def run() -> None:
        try:
            with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for x in source:
                    if not hand("item", x):
                        return
            hand("end", None)
        except BaseException as e:  # handed to the caller, raised there
            hand("error", e)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()

    thread = threading.Thread(target=run, name="ple-ahead", daemon=True)
    thread.start()
    try:
        while True:
            with cond:
                cond.wait_for(lambda: bool(box))
                kind, value = box.pop()
                cond.notify_all()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
            del value                            # the caller's item is not held while the next is made
    finally:
        with cond:
            state["stop"] = True
            cond.notify_all()
        thread.join()


class WriteBack:
    """The writeback of one file being written front to back (see the module docstring).

    ``wrote(end)`` after the bytes ``[0, end)`` are written: starts the disk writing what is new since the
    last call, and waits until the bytes before ``end - lag`` are on the disk. ``active`` is False where the
    system has no ``sync_file_range`` (then nothing is done). A failed call is an ``OSError`` here, at once:
    a wait that finds a failed write (no space, an I/O error) reports it once per open file, so the final
    ``fsync`` would not see it again, and the file would be renamed into place damaged.
    """

    def __init__(self, fd: int, lag: int = WRITE_LAG) -> None:
        self.fd, self.lag = fd, lag
        self.started = self.waited = 0
        self.active = _SYNC_RANGE is not None

    def wrote(self, end: int) -> None:
        if not self.active or end <= self.started:
            return
        self._call(self.started, end - self.started, _WRITE)
        self.started = end
        target = end - self.lag
        if target > self.waited:
            self._call(self.waited, target - self.waited, _WAIT)
            self.waited = target

    def _call(self, offset: int, nbytes: int, flags: int) -> None:
        if _SYNC_RANGE is not None and _SYNC_RANGE(self.fd, offset, nbytes, flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"writing bytes [{offset}, {offset + nbytes}) to disk failed: {os.strerror(err)}")


def write_chunks(write: Callable[[memoryview], int | None], data: memoryview, back: WriteBack | None,
                 at: int) -> None:
    """Write ``data`` (a byte view) with ``write`` in `WRITE_CHUNK` pieces, telling ``back`` after each (the
    file's first ``at`` bytes were written before)."""
    for a in range(0, len(data), WRITE_CHUNK):
        piece = data[a:a + WRITE_CHUNK]
        write(piece)
        at += len(piece)
        if back is not None:
            back.wrote(at)
