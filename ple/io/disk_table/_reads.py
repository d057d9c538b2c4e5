"""Row reads at the device's queue depth, for `ple.io.DiskTable`: `pread_rows`.

A cold row read waits on the disk (a random 4 KiB read: tens to hundreds of microseconds), and a disk serves
many such reads at once: its IOPS grow with the requests in flight (its queue depth). `pread_rows` sorts the
rows' byte ranges by file and offset and coalesces neighbouring rows into one request (rows whose bytes lie in
the same or adjacent 4 KiB pages of one file: the kernel reads those pages anyway); a request of one row is read
straight into its row of ``out``, a coalesced run into a scratch buffer its rows are then copied out of (one
``index_copy_``). So the bytes are the file's bytes, exactly, whatever the dtype. The requests are read

* through an ``io_uring`` (``ple.io.disk_table._uring``), where the kernel allows one: the whole batch's requests
  built at once as records, `RING_DEPTH` in flight from the calling thread, refilled every `RING_BATCH` completions, so
  the Python work is per a dozen or so requests, not per request (on a machine of two cores, the reader threads'
  Python, not the disk, limited the cold reads: ``docs/disk.md``). Buffered reads of the table's own
  descriptors: the page cache serves the pages it holds, as ``preadv`` does;
* else (a kernel or seccomp filter that refuses ``io_uring_setup``, no ring to be had for a batch, or
  ``PLE_READS=threads``) by `READ_DEPTH` reader threads, each taking the next request and reading it with
  ``os.preadv``, which releases the GIL while it waits.

Either way into memory the call owns, and either way the calling thread can be a prefetch's (the ring's wait
releases the GIL too).

Why not the memory maps: a mapped read faults one page at a time in the reading thread (so only as many
reads are in flight as threads fault), and every page it touches counts in the process's resident memory
(``RssFile``: 17 GB of a 47.7 GB table's pages, measured) until the kernel takes it back. A read copies
the row out of the page cache into the process's own buffer and maps nothing: the file's pages stay the page
cache's, not the process's. (Why not ``O_DIRECT`` and Linux's native AIO: its reads skip the page cache, so a
page the cache holds would be read from the disk again; buffered native AIO waits in ``io_submit``.)

A file that ends before a row's bytes (truncated while being read, after the caller's size check) gives a
short read: a ``ValueError`` naming the file, never garbage or a crash (a request the ring read short is read
again with ``preadv``, which tells a cut file from a partial read). ``MappedFile`` sets ``POSIX_FADV_RANDOM`` on
its descriptor, so a row read brings in its pages and no readahead around them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from . import _uring

__all__ = ["READ_DEPTH", "RING_DEPTH", "RING_BATCH", "PAGE", "MAX_RUN_BYTES", "pread_rows"]

READ_DEPTH = 64
"""Positional reads a cold gather keeps in flight (reader threads). A disk reaches its random-read IOPS at a
queue depth of about 32 (fio's ``iodepth=32``); a thread spends part of each request in Python (taking the
next, waiting for the GIL), so twice that many keep 32 or more at the disk (measured: ``docs/disk.md``)."""

PAGE = 4096
"""Rows whose bytes lie in the same or adjacent pages of this size are read by one request."""

MAX_RUN_BYTES = 256 << 10
"""A coalesced request never crosses a boundary of this many bytes in its file (so one request is at most
this plus a row: a dense gather is still read by many threads)."""

RING_DEPTH = 64
"""Requests in flight through the ``io_uring`` (``ple.io.disk_table._uring``): as many as the reader threads keep."""

RING_BATCH = 16
"""The ring is refilled each time this many of its requests have completed: at least ``RING_DEPTH - RING_BATCH``
stay in flight, and the Python work (a submission, the completions copied out) is per this many requests."""

_INLINE = 2                        # requests at most read in the calling thread (no hand-off to the pool)

_preadv = os.preadv                # the read itself (tests count the requests in flight through it)

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


class _File(Protocol):
    fd: int
    path: Path


def reader_pool() -> ThreadPoolExecutor:
    """The `READ_DEPTH` reader threads (made once, shared by every table, all started at once: a thread started
    later, by a larger gather, would add its stack to the process's memory then)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            pool = ThreadPoolExecutor(max_workers=READ_DEPTH, thread_name_prefix="ple-pread")
            start = threading.Barrier(READ_DEPTH, timeout=30)
            wait([pool.submit(_started, start) for _ in range(READ_DEPTH)])   # each waits: a new thread each
            _POOL = pool
        return _POOL


def _started(barrier: threading.Barrier) -> None:
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass


def plan_runs(file_of: torch.Tensor, offsets: torch.Tensor, row_bytes: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The requests of rows at ``offsets`` (bytes, int64) of files ``file_of``: ``(order, starts, counts)``.

    ``order`` sorts the rows by file then offset; the requests are the runs ``order[starts[j]:][:counts[j]]``.
    A run goes on while the next row is in the same file, begins in the page its predecessor ends in or the
    next one, lies a whole number of rows after it (so the run's rows sit at multiples of ``row_bytes`` in
    a buffer of its bytes) and stays in the same `MAX_RUN_BYTES` block. Duplicates join their twin's run.
    """
    key = file_of.to(torch.int64) * (1 << 48) + offsets        # a file's offsets stay below 2**48 (256 TiB)
    order = torch.argsort(key, stable=True)
    so, sf = offsets.index_select(0, order), file_of.index_select(0, order)
    n = so.numel()
    brk = torch.ones(n, dtype=torch.bool)
    if n > 1:
        prev, cur = so[:-1], so[1:]
        brk[1:] = ((sf[1:] != sf[:-1]) | (cur // PAGE > (prev + row_bytes - 1) // PAGE + 1)
                   | ((cur - prev) % row_bytes != 0) | (cur // MAX_RUN_BYTES != prev // MAX_RUN_BYTES))
    starts = brk.nonzero().squeeze(1)
    counts = torch.diff(starts, append=torch.tensor([n]))
    return order, starts, counts


def pread_rows(files: Sequence[_File], file_of: torch.Tensor, offsets: torch.Tensor, row_bytes: int,
               out: torch.Tensor, *, what: str | Sequence[str] = "rows") -> None:
    """``out`` row i = the ``row_bytes`` bytes at ``offsets[i]`` of ``files[file_of[i]]``, read with `RING_DEPTH`
    requests in flight through an ``io_uring`` (else `READ_DEPTH` ``preadv`` reader threads), neighbouring rows
    coalesced (module docstring).

    ``out``: a contiguous CPU tensor of ``len(offsets) * row_bytes`` bytes (any dtype and shape; written as
    bytes). ``what`` names the rows in errors (a tensor's key; or one name per file). A short read (the file
    ends before a row's last byte) or a failed read is a ``ValueError`` naming the file (``out`` partly written).
    """
    n = offsets.numel()
    if file_of.numel() != n or out.nbytes != n * row_bytes or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"out: expected a contiguous CPU tensor of {n} rows of {row_bytes} bytes "
                         f"({n * row_bytes} bytes), got {tuple(out.shape)} {out.dtype} on {out.device}")
    if n == 0:
        return
    order, starts, counts = plan_runs(file_of, offsets, row_bytes)
    first = order.index_select(0, starts)                       # each run's first row (an index into out)
    run_off = offsets.index_select(0, first)
    run_len = offsets.index_select(0, order.index_select(0, starts + counts - 1)) - run_off + row_bytes
    run_file = file_of.index_select(0, first)
    # A run of one row is read straight into its row of out (buffer 0); longer runs into a scratch buffer
    # (buffer 1), one after the other, their rows copied into out after.
    single = counts == 1
    dest = first * row_bytes
    kind = torch.zeros_like(dest)
    scratch = None
    if not bool(single.all()):
        multi = (~single).nonzero().squeeze(1)
        lens_m = run_len.index_select(0, multi)
        at = torch.cumsum(lens_m, 0) - lens_m
        scratch = torch.empty(int(lens_m.sum()), dtype=torch.uint8)
        dest.index_copy_(0, multi, at)
        kind.index_fill_(0, multi, 1)
    rows = out.view(-1).view(torch.uint8).view(n, row_bytes)
    _read_runs(files, run_file, run_off, run_len, [rows, scratch], kind, dest, what)
    if scratch is not None:                                     # the rows of the longer runs, into their places
        where = torch.zeros(starts.numel(), dtype=torch.int64)
        where.index_copy_(0, multi, at // row_bytes)
        in_multi = torch.repeat_interleave(~single, counts)     # per row in sorted order
        run_of = torch.repeat_interleave(where - run_off // row_bytes, counts)     # + offsets[r] // rb: its row
        r = order[in_multi]
        rows.index_copy_(0, r, scratch.view(-1, row_bytes).index_select(
            0, offsets.index_select(0, r) // row_bytes + run_of[in_multi]))


def _ring_wanted() -> bool:
    """Whether a batch goes through an ``io_uring`` (`RING_DEPTH` in flight from one thread): where the kernel
    allows it and ``PLE_READS`` is not ``threads`` (which keeps the reader threads: for comparisons and tests)."""
    return os.environ.get("PLE_READS", "") != "threads" and _uring.available()


def _read_runs(files: Sequence[_File], run_file: torch.Tensor, run_off: torch.Tensor, run_len: torch.Tensor,
               buffers: list[torch.Tensor | None], kind: torch.Tensor, dest: torch.Tensor,
               what: str | Sequence[str]) -> None:
    """Request j: ``run_len[j]`` bytes at ``run_off[j]`` of ``files[run_file[j]]`` into ``buffers[kind[j]]`` at
    byte ``dest[j]``, for every j: through an ``io_uring`` where allowed (`_ring_wanted`), else (or where the
    ring cannot be made) by the reader threads. A request the ring read short is read again with ``preadv``
    (a file cut: the short read's error; else the rest); a failed one is a ``ValueError`` naming the file."""
    m = run_off.numel()
    fds_all = [files[k].fd for k in range(len(files))]
    failures: list[tuple[int, int, BaseException | None]] = []
    if m > _INLINE and _ring_wanted():
        base = torch.tensor([b.data_ptr() if b is not None else 0 for b in buffers], dtype=torch.int64)
        addrs = (base.index_select(0, kind) + dest).numpy()
        lens = run_len.numpy()
        try:
            res = _uring.ring_reads(torch.tensor(fds_all, dtype=torch.int64).index_select(0, run_file).numpy(),
                                    run_off.numpy(), lens, addrs, RING_DEPTH, RING_BATCH).res
        except OSError:
            res = None                                   # no ring to be had now (memory, descriptors): the threads
        if res is not None:
            bad = np.flatnonzero(res != lens)
            if not bad.size:
                return
            fds, offs, lens_l, kinds, dests = _as_lists(fds_all, run_file, run_off, run_len, kind, dest)
            again = [j for j in bad.tolist() if res[j] >= 0]     # short: read again, whole, as the threads do
            if again:
                with _views(buffers) as views:
                    _reader(fds, offs, lens_l, views, kinds, dests, iter(again).__next__, m, failures)
            failures += [(j, 0, OSError(-int(res[j]), os.strerror(-int(res[j])))) for j in bad.tolist() if res[j] < 0]
            _raise_first(failures, files, offs, lens_l, run_file.tolist(), what)
            return
    fds, offs, lens_l, kinds, dests = _as_lists(fds_all, run_file, run_off, run_len, kind, dest)
    with _views(buffers) as views:
        _run_requests(fds, offs, lens_l, views, kinds, dests, failures)
    _raise_first(failures, files, offs, lens_l, run_file.tolist(), what)


def _as_lists(fds_all: list[int], run_file: torch.Tensor, run_off: torch.Tensor, run_len: torch.Tensor,
              kind: torch.Tensor, dest: torch.Tensor) -> tuple[list[int], ...]:
    """The requests as the reader threads take them: ``fds, offs, lens, kind, dest`` (lists)."""
    return ([fds_all[k] for k in run_file.tolist()], run_off.tolist(), run_len.tolist(), kind.tolist(),
            dest.tolist())


@contextlib.contextmanager
def _views(buffers: list[torch.Tensor | None]) -> Iterator[list[memoryview]]:
    """The buffers' bytes as memoryviews (for ``preadv``), released after."""
    views = [b.view(-1).view(torch.uint8).numpy().data for b in buffers if b is not None]
    try:
        yield views
    finally:
        for v in views:
            try:
                v.release()
            except BufferError:                                 # interrupted while readers hold slices of it
                pass


def _run_requests(fds: list[int], offs: list[int], lens: list[int], views: list[memoryview], kind: list[int],
                  dest: list[int], failures: list[tuple[int, int, BaseException | None]]) -> None:
    """Request j's ``lens[j]`` bytes at ``offs[j]`` of ``fds[j]`` into ``views[kind[j]]`` at ``dest[j]``, for every
    j: up to `READ_DEPTH` in flight, each reader thread taking the next request as it finishes one. (The reader
    threads allocate nothing but small objects: a buffer of their own would come from a malloc arena per
    thread, which keeps what it freed.)"""
    m = len(offs)
    if m <= _INLINE:
        _reader(fds, offs, lens, views, kind, dest, iter(range(m)).__next__, m, failures)
    else:
        take = itertools.count().__next__                   # atomic under the GIL: each request once
        pool = reader_pool()
        futures = [pool.submit(_reader, fds, offs, lens, views, kind, dest, take, m, failures)
                   for _ in range(min(READ_DEPTH, m))]
        wait(futures)                                       # every reader done with the buffer, then
        for f in futures:
            f.result()                                      # (an unexpected error: raised as it is)


def _raise_first(failures: list[tuple[int, int, BaseException | None]], files: Sequence[_File], offs: list[int],
                 lens: list[int], file_index: list[int], what: str | Sequence[str]) -> None:
    """The first failed request (by its place in the sorted requests) as a ``ValueError`` naming its file."""
    if failures:
        j, done, err = min(failures, key=lambda t: t[0])
        path = files[file_index[j]].path
        name = what if isinstance(what, str) else what[file_index[j]]
        span = f"bytes [{offs[j]}, {offs[j] + lens[j]})"
        if err is not None:
            raise ValueError(f"{name}: {path} could not be read at {span} ({err}); nothing was cached") from None
        raise ValueError(f"{name}: {path} ended at byte {offs[j] + done} while its {span} were being read "
                         f"(truncated while the rows were read?); nothing was cached: load the layer again")


def _reader(fds: list[int], offs: list[int], lens: list[int], views: list[memoryview], kind: list[int],
            dest: list[int], take, m: int, failures: list[tuple[int, int, BaseException | None]]) -> None:
    pread = _preadv
    while not failures:
        try:
            j = take()
        except StopIteration:
            return
        if j >= m:
            return
        buf = views[kind[j]][dest[j]: dest[j] + lens[j]]
        try:
            got = pread(fds[j], [buf], offs[j])
            while got < len(buf):                               # a short read: the rest, else the file ended
                more = pread(fds[j], [buf[got:]], offs[j] + got)
                if more <= 0:
                    failures.append((j, got, None))
                    return
                got += more
        except OSError as e:
            failures.append((j, 0, e))
            return
        finally:
            buf.release()
