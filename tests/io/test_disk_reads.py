"""``ple.io.disk_table._reads``: a disk table's cold reads, ``READ_DEPTH`` positional reads in flight into its own
buffers.

The bytes: those of the in-memory table and of a plain mapped read, bit for bit, for every table dtype, whole or
over several files; the coalescing corners (rows in one page, adjacent pages, the first and last row of a file and
of a shard, duplicates, nothing); a file cut while its rows are read; the requests really in flight; the prefetch
still overlapping the caller; the file's pages never counted in the process's resident memory.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _tier import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import ple.io as pio
from ple import PLEConfig
from ple.io.disk_table import _reads, _uring
from ple.io.disk_table._reads import MAX_RUN_BYTES, PAGE, READ_DEPTH, RING_BATCH, RING_DEPTH, plan_runs, pread_rows
from ple.io.disk_table.mapped import READ_THREADS, map_view
from ple.io.disk_table.table import DiskTable
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

TINY = PLEConfig.preset("tiny")          # 6128 rows of D = 4 (8 bytes a bfloat16 row), two PLE layers
SCHEMES = [None, "fp8", "int8", "nf4"]
MODES = ["ring", "threads"]              # PLE_READS: the io_uring (where the kernel allows it) or the reader threads


def save(path: Path, scheme: str | None, parts: int, **kw) -> Path:
    layers = [random_layer(TINY, i, torch.bfloat16, 5 + i) for i in range(TINY.num_ple_layers)]
    for layer in layers:
        if scheme is not None:
            layer.ple_embedding.quantize_(scheme)
    pio.save(layers, path, parts=parts, ple_only=scheme is not None, **kw)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("reads")
    return {(s, parts): save(root / f"{s}-{parts}", s, parts, **({"max_file_bytes": 20_000} if parts else {}))
            for s in SCHEMES for parts in (0, 3)}


def table_of(layer) -> DiskTable:
    table = layer.table
    assert isinstance(table, DiskTable)
    return table


def mapped_rows(table: DiskTable, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``[n, row bytes]`` (uint8) as the table read them before: out of the read-only mappings."""
    out = torch.empty((ids.numel(), table._row_bytes), dtype=torch.uint8)
    for i, r in enumerate(ids.tolist()):
        p = next(p for p in table._pieces if p.start <= r < p.stop)
        view = map_view(p.file, p.offset, p.stop - p.start, table._row_bytes, torch.uint8)
        out[i] = view[r - p.start]
    return out


def corner_ids(table: DiskTable) -> torch.Tensor:
    """First and last rows of every piece (shard) and file, rows sharing a page, rows in adjacent pages."""
    per_page = max(1, PAGE // table._row_bytes)
    rows = {0, table.num_rows - 1, 1, 2, per_page - 1, per_page, per_page + 1, 2 * per_page, 5 * per_page + 3}
    for p in table._pieces:
        rows |= {p.start, p.stop - 1, min(p.start + 1, p.stop - 1)}
    return torch.tensor(sorted(r for r in rows if 0 <= r < table.num_rows))


# ---- bits ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parts", [0, 3])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_rows_equal_the_in_memory_table_and_the_mapped_read(checkpoints, scheme, parts):
    path = checkpoints[scheme, parts]
    mem = pio.load_layer(path, ple_layer_index=1)
    disk = pio.load_layer(path, ple_layer_index=1, offload="disk", cache_bytes=0)
    table = table_of(disk)
    assert len(table.files) == (1 if not parts else len({p.file.path for p in table._pieces}))
    assert parts == 0 or len(table.files) >= 2
    gen = torch.Generator().manual_seed(len(SCHEMES) * parts + SCHEMES.index(scheme))
    dense = torch.randperm(table.num_rows, generator=gen)[:1500]            # many neighbours: coalesced runs
    for ids in (corner_ids(table), torch.randint(0, table.num_rows, (40,), generator=gen), dense,
                torch.arange(table.num_rows)):
        ids2 = ids.view(-1, 1)
        raw = table.gather(ids2)[0].contiguous().view(torch.uint8).view(ids.numel(), -1)
        assert torch.equal(raw, mapped_rows(table, ids)), "the rows differ from a mapped read's"
        for dtype in (torch.bfloat16, torch.float32):
            assert_bitwise_equal(disk.embed(ids2, dtype), mem.embed(ids2, dtype), name=f"{scheme} rows as {dtype}")


def test_coalescing_plan():
    rb = 160                                                                 # 25.6 rows a page
    offs = torch.tensor([0, 1, 24, 26, 80, 180, 180, 179, 0]) * rb + 1000
    files = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 1])
    order, starts, counts = plan_runs(files, offs, rb)
    runs = [sorted(order[s: s + c].tolist()) for s, c in zip(starts.tolist(), counts.tolist(), strict=True)]
    # 0, 1 share a page, 2 and 3 are on the next one (they join); 4 is two pages on (its own run); 7, 5 and 6
    # (a duplicate) join; the other file's row is alone
    assert runs == [[0, 1, 2, 3], [4], [5, 6, 7], [8]]
    _, starts, counts = plan_runs(torch.zeros(3, dtype=torch.int64), torch.tensor([0, 80, 160]), 160)
    assert counts.tolist() == [1, 1, 1]                                     # 80 is no whole row from 0 or 160
    dense = torch.arange(3 * MAX_RUN_BYTES // rb) * rb                      # three blocks' worth of neighbours
    _, starts, counts = plan_runs(torch.zeros_like(dense), dense, rb)
    assert counts.numel() == 3 and counts.sum() == dense.numel()            # cut at the block boundaries


@pytest.mark.parametrize("mode", MODES)
def test_pread_rows_corners(tmp_path, mode, monkeypatch):
    monkeypatch.setenv("PLE_READS", mode)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (3 * MAX_RUN_BYTES + 77,), dtype=torch.uint8, generator=gen)
    f = tmp_path / "rows.bin"
    f.write_bytes(data.numpy().tobytes())
    fd = os.open(f, os.O_RDONLY)

    class File:
        def __init__(self):
            self.fd, self.path = fd, f

    try:
        rb = 12
        last = (data.numel() - 7 - rb) // rb * rb + 7                      # the last whole row
        for offs in ([], [7], [7, 7, 19, last, 7], [last, 7 + rb * 341, 7 + rb * 342, 7 + rb * 700],
                     list(range(7, data.numel() - rb, rb))):
            o = torch.tensor(offs, dtype=torch.int64)
            out = torch.empty((len(offs), rb), dtype=torch.uint8)
            pread_rows([File()], torch.zeros_like(o), o, rb, out)
            want = torch.stack([data[a: a + rb] for a in offs]) if offs else out
            assert torch.equal(out, want), offs
        with pytest.raises(ValueError, match="out: expected a contiguous CPU tensor of 2 rows of 12 bytes"):
            pread_rows([File()], torch.zeros(2, dtype=torch.int64), torch.tensor([0, 12]), rb, torch.empty(3))
        with pytest.raises(ValueError, match=rf"rows: .*{f.name} ended at byte {data.numel()} "):
            o = torch.tensor([7, data.numel() - 5])                              # the last row runs past the end
            pread_rows([File()], torch.zeros_like(o), o, rb, torch.empty((2, rb), dtype=torch.uint8))
    finally:
        os.close(fd)


# ---- the io_uring path and its fallback -------------------------------------------------------------------------
needs_ring = pytest.mark.skipif(not _uring.available(), reason=f"no io_uring here: {_uring.why_not()}")

_BLOB = 32 * MAX_RUN_BYTES + 4096 + 1234          # a file of random bytes: 32 blocks, a page and a partial one


@pytest.fixture(scope="module")
def blob(tmp_path_factory):
    data = torch.randint(0, 256, (_BLOB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    path = tmp_path_factory.mktemp("blob") / "rows.bin"
    path.write_bytes(data.numpy().tobytes())
    return path, data


class _Opened:
    """A file as `pread_rows` takes it (``fd``, ``path``), opened read-only; closed by `close`."""

    def __init__(self, path: Path) -> None:
        self.path, self.fd = path, os.open(path, os.O_RDONLY)

    def close(self) -> None:
        os.close(self.fd)


def _rows_of(data: torch.Tensor, offs: list[int], rb: int) -> torch.Tensor:
    return torch.stack([data[a: a + rb] for a in offs]) if offs else torch.empty((0, rb), dtype=torch.uint8)


@st.composite
def row_sets(draw):
    """A row width and row offsets into `_BLOB` bytes: random rows, runs of neighbours, duplicates, the first and
    the last whole row, rows across a page edge, or none."""
    rb = draw(st.sampled_from([1, 7, 12, 160, 320, 4096, 5000]))
    origin = draw(st.integers(0, 3))
    last = (_BLOB - origin - rb) // rb                                       # the last whole row's index
    rows = draw(st.lists(st.integers(0, last), max_size=300))
    for start, length in draw(st.lists(st.tuples(st.integers(0, last), st.integers(1, 40)), max_size=4)):
        rows += list(range(start, min(last, start + length) + 1))            # neighbours: coalesced runs
    edge = [r for r in range(PAGE // rb - 1, PAGE // rb + 2) if 0 <= r <= last]   # across the first page edge
    rows += draw(st.lists(st.sampled_from([0, last, *edge]), max_size=6))
    rows += draw(st.lists(st.sampled_from(rows), max_size=20)) if rows else []   # duplicates
    rows = draw(st.permutations(rows))
    return rb, [origin + r * rb for r in rows]


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=examples(30))
@given(case=row_sets())
def test_property_the_rows_are_a_plain_reads_bytes(blob, mode, case):
    """Either path returns exactly the bytes a plain read of each row gives, whatever the rows (more requests
    than the ring has slots: its submission and completion rings wrap around)."""
    if mode == "ring" and not _uring.available():
        pytest.skip(f"no io_uring here: {_uring.why_not()}")
    path, data = blob
    rb, offs = case
    f = _Opened(path)
    old = os.environ.get("PLE_READS")
    os.environ["PLE_READS"] = mode                       # (not monkeypatch: a function-scoped fixture under given)
    try:
        o = torch.tensor(offs, dtype=torch.int64)
        out = torch.full((len(offs), rb), 0xA5, dtype=torch.uint8)
        pread_rows([f], torch.zeros_like(o), o, rb, out)
        assert torch.equal(out, _rows_of(data, offs, rb))
    finally:
        f.close()
        if old is None:
            os.environ.pop("PLE_READS", None)
        else:
            os.environ["PLE_READS"] = old


def _spread(data_len: int, rb: int = 160, n: int = 400) -> list[int]:
    """``n`` rows two pages and more apart (no two coalesce): ``n`` requests."""
    assert (n * 3 + 1) * PAGE < data_len
    return [(i * 3 * PAGE + 17) // rb * rb for i in range(n)]


def _open_fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


def _uring_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "io_uring" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


def test_the_ring_is_used_where_the_kernel_allows_it():
    """Where a raw ``io_uring_setup`` succeeds (this test's own, on Linux x86-64), `available` says so: a probe
    that wrongly refuses would leave every batch on the slower threads, with every test still passing."""
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        pytest.skip("the ring is used on Linux x86-64 only")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    params = ctypes.create_string_buffer(120)
    fd = libc.syscall(ctypes.c_long(425), ctypes.c_uint(4), params)
    if fd < 0:
        assert not _uring.available()
        pytest.skip(f"io_uring refused here: {os.strerror(ctypes.get_errno())}")
    os.close(fd)
    assert _uring.available(), _uring.why_not()


@needs_ring
@settings(max_examples=examples(40))
@given(depth=st.integers(1, 80), batch=st.integers(1, 80), data=st.data())
def test_property_the_ring_reads_every_request_whatever_its_depth(blob, depth, batch, data):
    """``ring_reads`` at any depth and refill batch (rings of 1 to 128 slots, refills that do and do not line up
    with the ring's end: both rings wrap around mid-batch) reads every request exactly once, into its place:
    requests of random offsets and lengths (some past the file's end: short) into one buffer."""
    path, ref = blob
    size = ref.numel()
    n = data.draw(st.integers(0, 400))
    lens = np.array(data.draw(st.lists(st.integers(1, 9000), min_size=n, max_size=n)), dtype=np.int64)
    offs = np.array(data.draw(st.lists(st.integers(0, size - 1), min_size=n, max_size=n)), dtype=np.int64)
    dest = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if n else np.zeros(0, dtype=np.int64)
    buf = torch.full((int(lens.sum()) + 1,), 0xA5, dtype=torch.uint8)
    fds = _open_fds()
    fd = os.open(path, os.O_RDONLY)
    try:
        if data.draw(st.booleans()):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)              # from the disk: completions spread
        res = _uring.ring_reads(np.full(n, fd, dtype=np.int64), offs, lens, buf.data_ptr() + dest,
                                max(depth, 1), min(batch, depth)).res
    finally:
        os.close(fd)
    want = np.minimum(lens, size - offs)                                    # a read past the end: short
    assert np.array_equal(res, want), (np.flatnonzero(res != want)[:5], depth, batch)
    for j in range(n):
        got = buf[dest[j]: dest[j] + want[j]]
        assert torch.equal(got, ref[offs[j]: offs[j] + want[j]]), (j, depth, batch)
        assert bool((buf[dest[j] + want[j]: dest[j] + lens[j]] == 0xA5).all())    # nothing past a short read
    assert buf[-1] == 0xA5
    assert _open_fds() == fds                                               # the ring's descriptor closed


@needs_ring
def test_the_ring_keeps_ring_depth_in_flight_and_closes_its_ring(blob, monkeypatch):
    """The ring path reads every request with none of ``preadv``, keeps `RING_DEPTH` in flight (never fewer
    than 32 while more remain), and leaves no descriptor open (its ring's, checked after many batches)."""
    assert RING_DEPTH >= 32 and RING_DEPTH - RING_BATCH >= 32
    path, data = blob
    f = _Opened(path)
    calls, flights = [], []
    real = _uring._Ring.enter

    def enter(ring, to_submit, min_complete):
        flight = (int(ring.sq_tail[0]) - int(ring.cq_head[0])) & 0xFFFFFFFF   # submitted, not yet taken out
        flights.append((flight, min_complete))
        return real(ring, to_submit, min_complete)

    def no_preadv(*a):
        raise AssertionError("preadv on the ring path")

    monkeypatch.setenv("PLE_READS", "ring")
    monkeypatch.setattr(_uring._Ring, "enter", enter)
    monkeypatch.setattr(_reads, "_preadv", no_preadv)
    try:
        offs = _spread(data.numel())
        o = torch.tensor(offs)
        fds = _open_fds()
        for _ in range(20):
            out = torch.empty((len(offs), 160), dtype=torch.uint8)
            pread_rows([f], torch.zeros_like(o), o, 160, out)
            assert torch.equal(out, _rows_of(data, offs, 160))
            calls.append(len(flights))
        assert _open_fds() == fds and _uring_fds() == 0
    finally:
        f.close()
    assert max(fl for fl, _ in flights) == RING_DEPTH
    waits = flights[: calls[0]]                                              # the first batch's
    assert all(fl - w >= RING_DEPTH - RING_BATCH for fl, w in waits[:-1]), waits   # all but the last wait
    assert waits[-1][0] == waits[-1][1]                                       # the last: the rest, all of it


@needs_ring
def test_threads_reading_at_once_each_get_their_own_rows(blob, monkeypatch):
    """Several threads in `pread_rows` at once (a prefetch and a lookup, say) each make their own ring: every
    thread's rows are right and no descriptor is left."""
    path, data = blob
    monkeypatch.setenv("PLE_READS", "ring")
    fds = _open_fds()
    f = _Opened(path)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(4):
                offs = _spread(data.numel(), rb=160 + 16 * k, n=200 + 13 * i)
                o = torch.tensor(offs)
                out = torch.empty((len(offs), 160 + 16 * k), dtype=torch.uint8)
                pread_rows([f], torch.zeros_like(o), o, 160 + 16 * k, out)
                assert torch.equal(out, _rows_of(data, offs, 160 + 16 * k)), (k, i)
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        f.close()
    assert not errors, errors
    assert _open_fds() == fds


@needs_ring
def test_an_interrupted_ring_waits_for_its_reads_then_closes(blob, monkeypatch):
    """An exception in the middle of a batch (a signal's, say) still waits for every read submitted, then
    closes the ring: the exception comes out, no descriptor stays open, and the next batch reads right."""
    path, data = blob
    fds = _open_fds()
    f = _Opened(path)
    os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)                   # from the disk: reads stay in flight
    real = _uring._Ring.enter
    seen = {"n": 0, "drained": 0}

    def enter(ring, to_submit, min_complete):
        seen["n"] += 1
        if seen["n"] == 3:
            real(ring, to_submit, 0)                                         # submitted, then interrupted
            raise KeyboardInterrupt
        if seen["n"] > 3:
            seen["drained"] += 1
        return real(ring, to_submit, min_complete)

    monkeypatch.setenv("PLE_READS", "ring")
    monkeypatch.setattr(_uring._Ring, "enter", enter)
    offs = _spread(data.numel())
    o = torch.tensor(offs)
    try:
        with pytest.raises(KeyboardInterrupt):
            pread_rows([f], torch.zeros_like(o), o, 160, torch.empty((len(offs), 160), dtype=torch.uint8))
        assert seen["drained"] >= 1 and _uring_fds() == 0
        monkeypatch.setattr(_uring._Ring, "enter", real)
        out = torch.empty((len(offs), 160), dtype=torch.uint8)
        pread_rows([f], torch.zeros_like(o), o, 160, out)
        assert torch.equal(out, _rows_of(data, offs, 160))
    finally:
        f.close()
    assert _open_fds() == fds


@pytest.mark.parametrize("how", ["refused", "no ring now", "env"])
def test_the_fallback_reads_with_the_threads(blob, monkeypatch, how):
    """Where the kernel refuses ``io_uring_setup`` (seccomp: ``EPERM``), where a ring cannot be made for a
    batch (``ENOMEM``), or with ``PLE_READS=threads``, the reader threads read the rows: the same bytes."""
    path, data = blob
    if how == "refused":
        def refused(entries, flags):
            raise OSError(1, "io_uring_setup: Operation not permitted")
        monkeypatch.setattr(_uring, "_state", {})
        monkeypatch.setattr(_uring, "_setup", refused)
        assert not _uring.available() and "not permitted" in _uring.why_not()
    elif how == "no ring now":
        if not _uring.available():
            pytest.skip(f"no io_uring here: {_uring.why_not()}")

        def no_ring(self, entries):
            raise OSError(12, "io_uring_setup: Cannot allocate memory")
        monkeypatch.setattr(_uring._Ring, "__init__", no_ring)
    else:
        monkeypatch.setenv("PLE_READS", "threads")
    spy = InFlight(hold=0.0)
    monkeypatch.setattr(_reads, "_preadv", spy)
    fds = _open_fds()
    f = _Opened(path)
    try:
        offs = _spread(data.numel())
        o = torch.tensor(offs)
        out = torch.empty((len(offs), 160), dtype=torch.uint8)
        pread_rows([f], torch.zeros_like(o), o, 160, out)
        assert torch.equal(out, _rows_of(data, offs, 160))
    finally:
        f.close()
    assert spy.calls == len(offs)
    assert _open_fds() == fds
    assert _uring_fds() == 0


@needs_ring
def test_the_ring_reads_short_and_failed_requests_again_or_names_the_file(blob, monkeypatch):
    """A request the ring read short (the kernel may, on a signal) is read again whole with ``preadv`` (the
    right bytes); one that failed (``-EIO``) is a ``ValueError`` naming the file and the bytes."""
    path, data = blob
    real = _uring.ring_reads

    def tampered(fds, offs, lens, addrs, depth, batch, *, fail):
        done = real(fds, offs, lens, addrs, depth, batch)
        half = int(lens[3]) // 2
        done.res[3] = half if not fail else -5
        ctypes.memset(int(addrs[3]) + half, 0x5A, int(lens[3]) - half)        # a short read: the rest not there
        return done

    f = _Opened(path)
    monkeypatch.setenv("PLE_READS", "ring")
    try:
        offs = _spread(data.numel())
        o = torch.tensor(offs)
        out = torch.empty((len(offs), 160), dtype=torch.uint8)
        monkeypatch.setattr(_uring, "ring_reads", lambda *a: tampered(*a, fail=False))
        pread_rows([f], torch.zeros_like(o), o, 160, out)
        assert torch.equal(out, _rows_of(data, offs, 160))
        monkeypatch.setattr(_uring, "ring_reads", lambda *a: tampered(*a, fail=True))
        with pytest.raises(ValueError, match=rf"weights: .*{path.name} could not be read at bytes \[\d+, \d+\) "
                                             r"\(\[Errno 5\] Input/output error\)"):
            pread_rows([f], torch.zeros_like(o), o, 160, out, what="weights")
    finally:
        f.close()


# ---- a file cut while being read ---------------------------------------------------------------------------
def test_a_file_cut_between_the_check_and_the_read_is_named_and_nothing_is_cached(tmp_path):
    path = save(tmp_path / "ck", "fp8", parts=3, max_file_bytes=20_000)
    disk = pio.load_layer(path, offload="disk", cache_bytes=10**6)
    table = table_of(disk)
    last = table._pieces[-1]
    victim = last.file
    ids = torch.tensor([[0, last.stop - 1]])
    table.gather(torch.tensor([[1, 2]]))
    before, cached = table.stats(), table.cache.keys.clone()
    os.truncate(victim.path, last.offset + (last.stop - last.start) * table._row_bytes - 1)   # into the last row
    st = os.stat(victim.path)
    victim.size, victim.mtime_ns = st.st_size, st.st_mtime_ns                 # the check sees the new file
    with pytest.raises(ValueError, match=rf"{last.key}.*{victim.path.name} ended at byte {st.st_size} while"):
        table.gather(ids)
    assert table.stats() == before and torch.equal(table.cache.keys, cached)  # nothing counted or cached


def test_a_read_error_is_named_and_nothing_is_cached(wide, monkeypatch):
    disk = pio.load_layer(wide, offload="disk", cache_bytes=10**6)
    table = table_of(disk)
    before = table.stats()

    def failing(fd, buffers, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setenv("PLE_READS", "threads")                             # the ring reads without preadv
    monkeypatch.setattr(_reads, "_preadv", failing)
    with pytest.raises(ValueError, match=r"shard_0\.weight.*model\.safetensors could not be read at bytes .*"
                                         r"Input/output error"):
        table.gather(spread_ids(64))
    assert table.stats() == before and len(table.cache) == 0


# ---- requests in flight; the prefetch ------------------------------------------------------------------------
class InFlight:
    """An ``os.preadv`` that counts the requests in flight (and holds each a little, or until ``gate`` is set)."""

    def __init__(self, hold: float = 0.004) -> None:
        self.lock, self.now, self.most, self.calls = threading.Lock(), 0, 0, 0
        self.hold, self.gate = hold, threading.Event()
        self.gate.set()

    def __call__(self, fd, buffers, offset):
        with self.lock:
            self.now += 1
            self.calls += 1
            self.most = max(self.most, self.now)
        try:
            self.gate.wait()
            time.sleep(self.hold)
            return os.preadv(fd, buffers, offset)
        finally:
            with self.lock:
                self.now -= 1


WIDE = PLEConfig(vocab_size=32_000, hidden_size=32, hc_count=1, eos_token_id=0, ple_embed_dim=2560,
                 ngram_vocab_size_base=1_000, ple_layer_ids=(1,), split_ngram_parts=2)   # 16,000 rows of 320 bytes


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide") / "ck"
    pio.save(random_layer(WIDE, 0, torch.bfloat16, 1), path)
    return path


def spread_ids(n: int, gap: int = 32) -> torch.Tensor:
    """``n`` rows ``gap`` rows apart (``gap`` * 320 bytes: more than two pages, so no two coalesce), as ids [T, 16]."""
    return (torch.arange(n) * gap).view(-1, 16)


def test_a_cold_gather_keeps_read_depth_requests_in_flight(wide, monkeypatch):
    assert READ_DEPTH >= 32 and READ_THREADS == 8
    mem = pio.load_layer(wide)
    disk = pio.load_layer(wide, offload="disk", cache_bytes=0)
    spy = InFlight()
    monkeypatch.setenv("PLE_READS", "threads")
    monkeypatch.setattr(_reads, "_preadv", spy)
    ids = spread_ids(480)
    assert_bitwise_equal(disk.embed(ids, torch.float32), mem.embed(ids, torch.float32), name="rows")
    assert spy.calls == 480 and spy.most == READ_DEPTH, (spy.calls, spy.most)


def test_the_prefetch_overlaps_the_callers_work(wide, monkeypatch):
    """``prefetch`` returns while its reads are in flight (the previous layer computes meanwhile); the rows it
    then hands over are the in-memory table's."""
    mem = pio.load_layer(wide)
    disk = pio.load_layer(wide, offload="disk", cache_bytes=0)
    table = table_of(disk)
    spy = InFlight(hold=0.0)
    spy.gate.clear()                                                        # the "disk" holds every read
    monkeypatch.setenv("PLE_READS", "threads")
    monkeypatch.setattr(_reads, "_preadv", spy)
    ids = spread_ids(320)
    try:
        t0 = time.perf_counter()
        table.prefetch(ids, torch.device("cpu"))
        assert time.perf_counter() - t0 < 1.0
        deadline = time.monotonic() + 20
        while spy.now < READ_DEPTH and time.monotonic() < deadline:
            time.sleep(0.01)
        assert spy.now == READ_DEPTH                                        # in flight while the caller runs
    finally:
        spy.gate.set()
    assert_bitwise_equal(disk.embed(ids, torch.float32), mem.embed(ids, torch.float32), name="prefetched rows")
    assert table.stats()["gathers"] == 1 and spy.calls == 320               # the prefetch's, used by the lookup


@needs_ring
def test_the_prefetch_overlaps_the_callers_work_through_the_ring(wide, monkeypatch):
    """The ring waits in ``io_uring_enter`` (the GIL released) on the prefetch's thread: ``prefetch`` returns while
    the ring is held, and the rows it hands over are the in-memory table's."""
    mem = pio.load_layer(wide)
    disk = pio.load_layer(wide, offload="disk", cache_bytes=0)
    table = table_of(disk)
    gate, entered = threading.Event(), threading.Event()
    real = _uring._Ring.enter

    def held(ring, to_submit, min_complete):
        entered.set()
        gate.wait()
        return real(ring, to_submit, min_complete)

    monkeypatch.setenv("PLE_READS", "ring")
    monkeypatch.setattr(_uring._Ring, "enter", held)
    ids = spread_ids(320)
    try:
        t0 = time.perf_counter()
        table.prefetch(ids, torch.device("cpu"))
        assert time.perf_counter() - t0 < 1.0
        assert entered.wait(20)                                             # the ring's first wait: in flight
        x = torch.ones(256, 256)
        for _ in range(5):
            x = x @ x / 256                                                 # the caller computes meanwhile
    finally:
        gate.set()
    assert_bitwise_equal(disk.embed(ids, torch.float32), mem.embed(ids, torch.float32), name="prefetched rows")
    assert table.stats()["gathers"] == 1


# ---- resident memory -----------------------------------------------------------------------------------------
_RSS = textwrap.dedent("""
    import json, sys, torch
    import ple.io as pio
    from ple.io.disk_table.mapped import map_view, read_rows

    def rss_file():
        for line in open("/proc/self/status"):
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024

    layer = pio.load_layer(sys.argv[1], offload="disk", cache_bytes=0)
    table = layer.table
    ids = torch.arange(table.num_rows).view(-1, 1)
    table.gather(ids[:64])                                           # threads and buffers in place
    table.drop_page_cache()
    before = rss_file()
    table.gather(ids)                                                # every row: cold
    after = rss_file()
    p = table._pieces[0]
    view = map_view(p.file, p.offset, p.stop - p.start, table._units, table._unit)
    read_rows([(view, torch.arange(p.stop - p.start), torch.empty_like(view))])   # the old way: mapped
    print(json.dumps({"pread": after - before, "mapped": rss_file() - after,
                      "bytes_read": table.stats()["bytes_read"], "piece": view.nbytes}))
""")


def test_cold_reads_leave_the_files_pages_out_of_the_processs_memory(tmp_path):
    """A cold gather of a whole 17 MiB table grows the process's RssFile by far less than the bytes it read
    (the pages are the page cache's); the same rows read through the mapping would add them (checked too)."""
    cfg = PLEConfig(vocab_size=32_000, hidden_size=32, hc_count=1, eos_token_id=0, ple_embed_dim=2560,
                    ngram_vocab_size_base=3_300, ple_layer_ids=(1,), split_ngram_parts=1)
    pio.save(random_layer(cfg, 0, torch.bfloat16, 0), tmp_path / "ck")
    done = subprocess.run([sys.executable, "-c", _RSS, str(tmp_path / "ck")], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["bytes_read"] > 16 << 20
    assert r["pread"] < r["bytes_read"] / 16, r
    assert r["mapped"] > r["piece"] / 2, r                                 # the control: a mapped read counts


@pytest.mark.deep
def test_benchmark_cold_reads_smoke(tmp_path, monkeypatch):
    """``bench_disk_table.py --smoke --cold-reads N``: cold gathers against fio's queue-depth-32 reads, one run."""
    if shutil.which("fio") is None:
        pytest.skip("needs fio")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    sys.modules.pop("bench_disk_table", None)
    import bench_disk_table

    threads = torch.get_num_threads()
    try:
        assert bench_disk_table.main(["--smoke", "--cold-reads", "512", "--cold-rounds", "1", "--dir", str(tmp_path),
                                      "--json", str(tmp_path / "r.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    rec = json.loads((tmp_path / "r.json").read_text())["cold_reads"]
    assert rec["rows"] == 512 and len(rec["rounds"]) == 1 and rec["ratio"] > 0
    assert rec["rounds"][0]["fio_iops"] > 0 and rec["rounds"][0]["rows_per_s"] > 0
    assert not list(tmp_path.glob("fp8-*"))                                # the checkpoint deleted
