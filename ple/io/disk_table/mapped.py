"""The checkpoint's files opened read only, for `ple.io.DiskTable`: `MappedFile` (one file, mapped read
only, its header checked again from the mapping, its size and modification time watched), `TablePiece` (rows
of the table in one file), `map_view` (a tensor over the mapping, no copy) and `read_rows` (row gathers out of
tensors such as those views, split over `READ_THREADS` threads: the overlay's segment files are read so).

A `DiskTable` does not read its rows through the mapping: it reads them with positional reads, `READ_DEPTH`
in flight, into buffers it owns (``ple.io.disk_table._reads.pread_rows``), so the file's pages are never the process's
resident memory and a cold gather keeps the disk's queue full. The mapping serves the header checks (and
`map_view` for readers of small files).

Safety. The files are mapped read only and never written. When a file is mapped, its header is
read again from the mapping and checked against what ``load_layer`` validated (dtype, shape,
offsets), and its size against the header (the data must end exactly at the end of the file,
as safetensors requires). Before every read of a table's rows the file is checked (one ``os.fstat``
per file): a size or modification time that differs from the mapped file's is a ``ValueError``
naming the file and the tensor, raised before anything is read or changed (the cache and the
counters stay as they were). A file truncated *during* a table's read (between the check and the
read) gives a short read: a ``ValueError`` naming the file, nothing cached. A memory-mapped read
(`map_view`, `read_rows` over one) of a page past the end of a file truncated after mapping kills
the process (SIGBUS), as any memory-mapped reader would, so callers check the file first; and a file
replaced by another (a rename over it) is not an error: the descriptor and the mapping hold the old
file, whose rows are still the ones loaded.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from ..files import ST_DTYPES, dtype_name
from ._reads import READ_DEPTH

__all__ = ["MappedFile", "TablePiece", "map_view", "read_rows", "READ_THREADS", "READ_DEPTH"]

READ_THREADS = 8
"""Threads of `read_rows` (gathers out of mapped views: the overlay's segment files). A `DiskTable`'s own reads
keep `READ_DEPTH` positional reads in flight instead (``ple.io.disk_table._reads``)."""

_MIN_CHUNK = 16                 # rows a reader thread is given at least

_READERS: ThreadPoolExecutor | None = None
_READERS_LOCK = threading.Lock()


def readers() -> ThreadPoolExecutor:
    """The reader threads (made once)."""
    global _READERS
    with _READERS_LOCK:
        if _READERS is None:
            _READERS = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="ple-disk-read")
        return _READERS


class MappedFile:
    """One safetensors file opened and mapped read only, its header parsed from the mapping, its size and mtime
    kept; ``fd`` (read with ``os.preadv`` by `DiskTable`) is advised for random reads (no readahead)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        # A file garbage-collected unclosed gives its descriptor back too (its mapping closes itself).
        self._release_fd = weakref.finalize(self, os.close, self.fd)
        try:
            st = os.fstat(self.fd)
            self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
            if self.size < 8:
                raise ValueError(f"path: {path} is {self.size} bytes, too short for a safetensors file "
                                 f"(truncated since it was opened?)")
            self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
            if len(self.map) != self.size:
                raise ValueError(f"path: {path} changed size while it was being mapped")
            if hasattr(self.map, "madvise"):
                # Rows are read at random: no readahead around each page read (it would read up to
                # read_ahead_kb for a 160-byte row).
                self.map.madvise(mmap.MADV_RANDOM)
            if hasattr(os, "posix_fadvise"):              # the same for positional reads of the descriptor
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
            n = struct.unpack("<Q", self.map[:8])[0]
            if 8 + n > self.size:
                raise ValueError(f"path: {path}: its header length {n} does not fit its {self.size} bytes "
                                 f"(truncated since it was opened?)")
            try:
                header = json.loads(self.map[8: 8 + n].decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"path: {path}: its header is no longer JSON ({e}); rewritten since it "
                                 f"was opened?") from None
        except BaseException:
            self.close()
            raise
        self.data_start = 8 + n
        header.pop("__metadata__", None)
        self.header: dict[str, Any] = header
        end = max((int(e["data_offsets"][1]) for e in header.values()), default=0)
        if self.data_start + end != self.size:
            self.close()
            raise ValueError(f"path: {path} is {self.size} bytes and its header describes "
                             f"{self.data_start + end}: truncated or rewritten since it was opened?")

    def span(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int]:
        """The absolute byte range ``[begin, end)`` of ``key``, checked against the dtype and shape expected."""
        entry = self.header.get(key)
        if entry is None:
            raise ValueError(f"{key}: not in {self.path} any more (rewritten since it was opened?)")
        begin, end = (int(x) for x in entry["data_offsets"])
        got = (ST_DTYPES.get(entry["dtype"]), tuple(int(d) for d in entry["shape"]))
        numel = 1
        for d in shape:
            numel *= d
        if got != (dtype, shape) or end - begin != numel * dtype.itemsize:
            raise ValueError(f"{key}: {self.path} now says {entry['dtype']} {list(got[1])} at bytes "
                             f"{[begin, end]}, expected {dtype_name(dtype)} {list(shape)} (rewritten since "
                             f"it was opened?)")
        return self.data_start + begin, self.data_start + end

    def check(self, key: str) -> None:
        """Raise ``ValueError`` if the file's size or mtime changed since it was opened (before any read)."""
        try:
            st = os.fstat(self.fd)
        except (OSError, ValueError) as e:
            raise ValueError(f"{key}: {self.path} can no longer be read ({e})") from None
        if st.st_size != self.size:
            raise ValueError(f"{key}: {self.path} is {st.st_size} bytes now, {self.size} when it was mapped "
                             f"(truncated or rewritten since it was loaded?); its rows are not read: load "
                             f"the layer again")
        if st.st_mtime_ns != self.mtime_ns:
            raise ValueError(f"{key}: {self.path} was modified after it was mapped (its modification time "
                             f"changed), so its rows may not be the ones loaded: load the layer again")

    def drop_page_cache(self) -> None:
        """Unmap this process's pages of the file and ask the kernel to drop the file from the page cache."""
        if hasattr(self.map, "madvise"):
            self.map.madvise(mmap.MADV_DONTNEED)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        m = getattr(self, "map", None)
        if m is not None:
            m.close()
            self.map = None  # type: ignore[assignment]
        if self.fd >= 0:
            self._release_fd()                          # os.close, once
            self.fd = -1


@dataclass
class TablePiece:
    """Rows ``[start, stop)`` of the table are ``key``, at byte ``offset`` of ``file``."""

    start: int
    stop: int
    key: str
    file: MappedFile
    offset: int                          # absolute byte offset in the file


def map_view(file: MappedFile, offset: int, nrows: int, units: int, unit: torch.dtype) -> torch.Tensor:
    """A tensor over bytes of the (read-only) mapping: no copy. It is never written (that would fault)."""
    if nrows == 0:
        return torch.empty((0, units), dtype=unit)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(cast(Any, file.map), dtype=unit, count=nrows * units, offset=offset)
    return flat.view(nrows, units)


def read_rows(jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """``out[i] = source[rows[i]]`` for each ``(source, rows, out)``. Many rows are split over the reader threads
    (a cold read waits on the disk, and several threads keep several reads in flight; the copies release the
    GIL); a few are read here."""
    n = sum(rows.numel() for _, rows, _ in jobs)
    if n < 2 * _MIN_CHUNK:
        for source, rows, out in jobs:
            torch.index_select(source, 0, rows, out=out)
        return
    chunk = max(_MIN_CHUNK, -(-n // READ_THREADS))
    work = [(source, rows[a: a + chunk], out[a: a + chunk]) for source, rows, out in jobs
            for a in range(0, rows.numel(), chunk)]
    list(readers().map(lambda job: torch.index_select(job[0], 0, job[1], out=job[2]), work))
