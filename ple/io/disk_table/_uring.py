"""Positional reads through one ``io_uring`` per batch, for `ple.io.disk_table._reads.pread_rows`: `ring_reads`.

A pool of threads doing ``preadv`` spends some microseconds of Python on each request (taking the next, building
its buffer slice, the GIL handed back and forth); on a machine of two cores that, not the disk, limits a cold
gather. An ``io_uring`` takes the requests as records in a ring shared with the kernel: here a whole batch's
records are built at once as a numpy array (file, offset, address, length per request), and one thread copies
the next ones into the ring's free slots and, with one ``io_uring_enter``, submits them and waits for some of
the earlier ones to complete, keeping ``depth`` in flight; the completions are copied out of the ring as they
come (a slice of it), and checked all at once at the end. So the Python work is per few dozen requests, not per
request. The reads are ordinary buffered reads of the table's own descriptors (the page cache is used as before:
a page it holds is a copy, not a disk read; ``POSIX_FADV_RANDOM`` still applies) into memory the caller owns.

The rings are made through the raw system calls (``io_uring_setup``, ``io_uring_enter``; the rings mapped with
``mmap``), as the standard library has no binding: `available` says whether the kernel allows them (a container's
seccomp filter, ``kernel.io_uring_disabled`` or an old kernel refuse them; only x86-64, whose ordering of memory
accesses the ring's head and tail updates rely on); `pread_rows` falls back to its threads where not. Each batch
makes its ring and closes it (its descriptor and mappings), having waited for every request it submitted, so no
read lands in a buffer after the call returns, whatever interrupted it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import threading
from dataclasses import dataclass

import numpy as np

__all__ = ["available", "ring_reads", "Completions"]

_SYS_SETUP, _SYS_ENTER = 425, 426               # the same on every architecture (the unified table)
_ENTER_GETEVENTS = 1
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_FEAT_SINGLE_MMAP, _FEAT_RW_CUR_POS = 1 << 0, 1 << 3   # the latter: 5.6, with IORING_OP_READ
_OP_READ = 22
_SETUP_FLAGS = ((1 << 13) | (1 << 12), 0)       # SINGLE_ISSUER | COOP_TASKRUN (6.0), else none

_libc: ctypes.CDLL | None = None
_state: dict[str, tuple[bool, str, int]] = {}   # "probe": (allowed, why not, setup flags), once probed
_lock = threading.Lock()


class _Params(ctypes.Structure):
    _fields_ = [("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("sq_thread_cpu", ctypes.c_uint32), ("sq_thread_idle", ctypes.c_uint32),
                ("features", ctypes.c_uint32), ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
                ("sq_off", ctypes.c_uint32 * 10), ("cq_off", ctypes.c_uint32 * 10)]
    # sq_off: head, tail, ring_mask, ring_entries, flags, dropped, array, resv1, user_addr (u64)
    # cq_off: head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1, user_addr (u64)


def _sys() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)          # releases the GIL during each call
        lib.syscall.restype = ctypes.c_long
        _libc = lib
    return _libc


def _setup(entries: int, flags: int) -> tuple[int, _Params]:
    p = _Params()
    p.flags = flags
    fd = _sys().syscall(ctypes.c_long(_SYS_SETUP), ctypes.c_uint(entries), ctypes.byref(p))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"io_uring_setup: {os.strerror(e)}")
    return int(fd), p


def available() -> bool:
    """Whether this process may read through an ``io_uring`` (probed once: a ring made and closed)."""
    if "probe" not in _state:
        with _lock:
            if "probe" not in _state:
                _state["probe"] = _probe()
    return _state["probe"][0]


def why_not() -> str:
    """Why `available` is false ("" where it is true)."""
    available()
    return _state["probe"][1]


def _probe() -> tuple[bool, str, int]:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False, f"not Linux on x86-64 ({platform.system()} {platform.machine()})", 0
    last = ""
    for flags in _SETUP_FLAGS:
        try:
            fd, p = _setup(8, flags)
        except OSError as e:
            last = str(e)
            if e.errno == errno.EINVAL:                  # an older kernel: those flags unknown
                continue
            return False, last, 0
        os.close(fd)
        need = _FEAT_SINGLE_MMAP | _FEAT_RW_CUR_POS
        if p.features & need != need:
            return False, f"io_uring features {p.features:#x} lack {need:#x} (a kernel before 5.6)", 0
        return True, "", flags
    return False, last, 0


class _Ring:
    """One ``io_uring`` of ``entries`` slots: its descriptor and the numpy views of its mapped rings."""

    def __init__(self, entries: int) -> None:
        self.fd = -1
        self.maps: list[mmap.mmap] = []
        self.fd, p = _setup(entries, _state["probe"][2])
        try:
            so, co = list(p.sq_off), list(p.cq_off)
            ring_bytes = max(so[6] + p.sq_entries * 4, co[5] + p.cq_entries * 16)   # one map (SINGLE_MMAP)
            ring = self._map(ring_bytes, _OFF_SQ_RING)
            sqes = self._map(p.sq_entries * 64, _OFF_SQES)
            u32 = np.frombuffer(ring, dtype=np.uint32)
            self.sq_head, self.sq_tail = u32[so[0] // 4: so[0] // 4 + 1], u32[so[1] // 4: so[1] // 4 + 1]
            self.cq_head, self.cq_tail = u32[co[0] // 4: co[0] // 4 + 1], u32[co[1] // 4: co[1] // 4 + 1]
            self.sq_mask, self.cq_mask = int(u32[so[2] // 4]), int(u32[co[2] // 4])
            self.sq_n, self.cq_n = int(p.sq_entries), int(p.cq_entries)
            u32[so[6] // 4: so[6] // 4 + self.sq_n] = np.arange(self.sq_n, dtype=np.uint32)   # slot i: sqe i
            self.sqes = np.frombuffer(sqes, dtype=np.uint64).reshape(self.sq_n, 8)
            self.cqes = np.frombuffer(ring, dtype=np.uint64, count=self.cq_n * 2, offset=co[5]).reshape(-1, 2)
        except BaseException:
            self.close()
            raise

    def _map(self, nbytes: int, offset: int) -> mmap.mmap:
        m = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        self.maps.append(m)
        return m

    def enter(self, to_submit: int, min_complete: int) -> int:
        """Submit ``to_submit`` records (already in the ring) and wait for ``min_complete`` completions; the
        number submitted. A signal (``EINTR``) is retried: the requests in flight must be waited for."""
        flags = _ENTER_GETEVENTS if min_complete else 0
        while True:
            r = _sys().syscall(ctypes.c_long(_SYS_ENTER), ctypes.c_int(self.fd), ctypes.c_uint(to_submit),
                               ctypes.c_uint(min_complete), ctypes.c_uint(flags), None, ctypes.c_size_t(0))
            if r >= 0:
                return int(r)
            e = ctypes.get_errno()
            if e == errno.EINTR:
                if to_submit == 0:
                    continue
                return 0                                 # none taken: they are submitted again
            if e in (errno.EAGAIN, errno.EBUSY) and min_complete == 0:
                return 0
            raise OSError(e, f"io_uring_enter: {os.strerror(e)}")

    def close(self) -> None:
        for name in ("sq_head", "sq_tail", "cq_head", "cq_tail", "sqes", "cqes"):
            self.__dict__.pop(name, None)                # the numpy views, before their maps
        for m in self.maps:
            m.close()
        self.maps = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class Completions:
    """What `ring_reads` got: ``res[j]``, request j's result (bytes read, or ``-errno``)."""
    res: np.ndarray


def ring_reads(fds: np.ndarray, offs: np.ndarray, lens: np.ndarray, addrs: np.ndarray, depth: int,
               batch: int) -> Completions:
    """Request j: ``lens[j]`` bytes at ``offs[j]`` of descriptor ``fds[j]`` into the memory at address
    ``addrs[j]`` (which the caller keeps alive), every j, up to ``depth`` in flight: the ring refilled each time
    at least ``batch`` have completed (so ``depth - batch`` or more are always in flight while enough remain).
    Every request is waited for before this returns or raises; the results are not checked (`Completions`)."""
    if not available():
        raise OSError(errno.ENOSYS, f"no io_uring here: {why_not()}")
    m = int(offs.size)
    recs = np.zeros((m, 8), dtype=np.uint64)
    recs[:, 0] = np.uint64(_OP_READ) | (fds.astype(np.uint64) << np.uint64(32))
    recs[:, 1] = offs.astype(np.uint64)
    recs[:, 2] = addrs.astype(np.uint64)
    recs[:, 3] = lens.astype(np.uint64)
    recs[:, 4] = np.arange(m, dtype=np.uint64)
    log = np.empty((m, 2), dtype=np.uint64)                         # the completions, in the order they came
    ring = _Ring(depth)
    sent = done = 0
    try:
        sq_mask, cq_mask = ring.sq_mask, ring.cq_mask         # (no local names for the ring's views: closed after)
        tail = int(ring.sq_tail[0])
        head = start = int(ring.cq_head[0])
        while done < m:
            k = min(depth - (sent - done), m - sent, ring.sq_n)
            if k:
                s = tail & sq_mask
                a = min(k, ring.sq_n - s)
                ring.sqes[s: s + a] = recs[sent: sent + a]
                if a < k:
                    ring.sqes[: k - a] = recs[sent + a: sent + k]
                ring.sq_tail[0] = tail + k                                # after the records (x86-64: stores in order)
            flight = sent + k - done
            got = ring.enter(k, min(batch, flight) if sent + k < m else flight)   # the last: wait for all
            if got < k:                                              # not all taken: the rest go again
                ring.sq_tail[0] = tail + got
            tail += got
            sent += got
            t = int(ring.cq_tail[0])
            n = (t - head) & 0xFFFFFFFF
            if n:
                c = head & cq_mask
                a = min(n, ring.cq_n - c)
                log[done: done + a] = ring.cqes[c: c + a]
                if a < n:
                    log[done + a: done + n] = ring.cqes[: n - a]
                head = (head + n) & 0xFFFFFFFF
                ring.cq_head[0] = head
                done += n
    finally:
        try:
            # Interrupted (or done): wait for every request the kernel took, by its own count (the ring's
            # submission head), which may be ahead of sent (taken, then interrupted before counted).
            while True:
                flight = (int(ring.sq_head[0]) - start - ((head - start) & 0xFFFFFFFF)) & 0xFFFFFFFF
                if not flight:
                    break
                ring.enter(0, flight)
                head = int(ring.cq_tail[0])
                ring.cq_head[0] = head
        finally:
            ring.close()
    res = np.full(m, -errno.EIO, dtype=np.int64)
    res[log[:, 0].astype(np.int64)] = (log[:, 1] & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)
    return Completions(res)
