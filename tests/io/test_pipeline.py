"""``ple.io._pipeline``: the checkpoint writer's overlap (the next block made ahead, the disk's writeback started).

`ahead`: the items in order, at most one made ahead of the caller, a producer's exception raised in the caller
as raised, an early close stopping the thread and closing the source, no autograd graph in the thread.
`WriteBack`: the ranges it starts and waits for, as the file grows. `write_file` through the overlap: files
safetensors reads back exactly, its errors, and a write killed (SIGKILL) in the middle leaving the file
that was there before, whole.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from _helpers import random_entries
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from ple.io import _pipeline
from ple.io._pipeline import WriteBack, ahead
from ple.io.writer import Entry, write_file
from ple.testing.numerics import assert_bitwise_equal

ROOT = Path(__file__).resolve().parents[2]


def _pipeline_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ple-ahead"]


# ---- ahead --------------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(items=st.lists(st.integers(), max_size=40))
def test_ahead_gives_the_items_in_order(items):
    assert list(ahead(items)) == items
    assert list(ahead(iter(items))) == items
    assert not _pipeline_threads()


def test_ahead_makes_at_most_one_item_ahead():
    """A slow caller: the source is never more than one item past the one the caller holds."""
    made = []

    def source():
        for i in range(12):
            made.append(i)
            yield i

    for i, x in enumerate(ahead(source())):
        assert x == i
        time.sleep(0.01)                                     # time for a thread that ran ahead to show it
        assert len(made) <= i + 2, (i, made)
    assert made == list(range(12))


def test_ahead_raises_the_producers_exception_where_it_happened():
    err = ValueError("shard_3: its scales are not finite")

    def source():
        yield 1
        yield 2
        raise err

    got = []
    with pytest.raises(ValueError) as info:
        for x in ahead(source()):
            got.append(x)
    assert info.value is err and got == [1, 2]
    assert not _pipeline_threads()


def test_ahead_closed_early_stops_the_thread_and_closes_the_source():
    state = {"closed": False, "made": 0}

    def source():
        try:
            for i in range(100):
                state["made"] += 1
                yield i
        finally:
            state["closed"] = threading.current_thread().name      # closed by the thread that made the items

    stream = ahead(source())
    assert [next(stream), next(stream)] == [0, 1]
    stream.close()
    assert state["closed"] == "ple-ahead" and state["made"] <= 3     # in the thread, before close() returned
    assert not _pipeline_threads()

    with pytest.raises(KeyError):                            # an exception in the caller closes it too
        for x in ahead(source()):
            if x == 1:
                raise KeyError(x)
    assert not _pipeline_threads()


def test_ahead_makes_items_without_a_graph():
    w = torch.ones(3, requires_grad=True)
    out = list(ahead(w * k for k in range(3)))
    assert not any(t.requires_grad for t in out) and torch.is_grad_enabled()


# ---- WriteBack ----------------------------------------------------------------------------------------------
def test_write_back_starts_every_new_range_and_waits_lag_behind():
    calls = []
    with mock.patch.object(_pipeline, "_SYNC_RANGE", lambda fd, off, n, flags: calls.append((off, n, flags)) or 0):
        back = WriteBack(7, lag=100)
        for end in (10, 10, 80, 250, 251, 400):
            back.wrote(end)
            starts = [(o, n) for o, n, f in calls if f == _pipeline._WRITE]
            waits = [(o, n) for o, n, f in calls if f == _pipeline._WAIT]
            assert sum(n for _, n in starts) == end and all(n > 0 for _, n in starts)      # [0, end), each once
            assert [o for o, _ in starts] == [sum(n for _, n in starts[:i]) for i in range(len(starts))]
            assert sum(n for _, n in waits) == max(0, end - 100)                           # [0, end - lag)
            assert [o for o, _ in waits] == [sum(n for _, n in waits[:i]) for i in range(len(waits))]


def test_write_back_without_sync_file_range_does_nothing():
    with mock.patch.object(_pipeline, "_SYNC_RANGE", None):
        back = WriteBack(7)
        back.wrote(1 << 30)
        assert not back.active and back.started == 0


# ---- write_file through the overlap -------------------------------------------------------------------------
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_overlapped_write_file_matches_safetensors(tmp_path_factory, data):
    """Every file through the overlap (``PIPELINE_BYTES`` 0, small write pieces): safetensors reads it back
    exactly, and the writeback was started over the whole of it."""
    dtypes = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool]
    tensors, entries = random_entries(data, dtypes, max_dim=9)
    path = tmp_path_factory.mktemp("w") / "x.safetensors"
    started = []
    real = _pipeline._SYNC_RANGE

    def spy(fd, off, n, flags):
        if flags == _pipeline._WRITE:
            started.append((off, n))
        return real(fd, off, n, flags) if real is not None else 0

    with mock.patch.object(_pipeline, "PIPELINE_BYTES", 0), mock.patch.object(_pipeline, "WRITE_CHUNK", 16), \
            mock.patch.object(_pipeline, "_SYNC_RANGE", spy):
        write_file(path, entries, {"k": "v"})
    back = load_file(str(path))
    for k, t in tensors.items():
        assert_bitwise_equal(back[k], t, name=k)
    data_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert sum(n for _, n in started) == (path.stat().st_size if data_bytes else 0)      # header and data
    assert not _pipeline_threads()


def test_overlapped_write_file_errors(tmp_path, monkeypatch):
    """A producer's error comes out as it raised it; a short producer is a ValueError naming the tensor; the
    temporary file is gone and no thread is left."""
    monkeypatch.setattr(_pipeline, "PIPELINE_BYTES", 0)

    def failing():
        yield torch.zeros(2, 3)
        raise ValueError("t1: the base's row 7 is damaged")

    kept = []                                  # the errors and their tracebacks kept: no thread left even so
    with pytest.raises(ValueError, match="row 7 is damaged") as info:
        write_file(tmp_path / "a.safetensors", [Entry("t0", torch.float32, (2,), lambda: iter([torch.ones(2)])),
                                                Entry("t1", torch.float32, (4, 3), failing)])
    kept.append(info)
    with pytest.raises(ValueError, match=r"t0: the producer gave 8 bytes, expected 12") as info:
        write_file(tmp_path / "b.safetensors", [Entry("t0", torch.float32, (3,), lambda: iter([torch.ones(2)]))])
    kept.append(info)
    with pytest.raises(TypeError, match=r"t0: a block came as torch.float16") as info:
        write_file(tmp_path / "c.safetensors", [Entry("t0", torch.float32, (2,),
                                                      lambda: iter([torch.ones(2, dtype=torch.float16)])),
                                                Entry("t1", torch.float32, (2,), lambda: iter([torch.ones(2)]))])
    kept.append(info)
    assert sorted(p.name for p in tmp_path.iterdir()) == [] and not _pipeline_threads()


def test_a_write_failing_at_the_disk_is_an_error_and_the_old_file_stays(tmp_path, monkeypatch):
    """A write the disk refused (no space: found by `WriteBack`'s wait, which reports it once per open file, so
    the final fsync would not) is an ``OSError`` from write_file; the file at the path is the old one."""
    path = tmp_path / "x.safetensors"
    write_file(path, [Entry("t", torch.float32, (4,), lambda: iter([torch.arange(4.0)]))])
    calls = []

    def refuse(fd, off, n, flags):
        calls.append(flags)
        if flags == _pipeline._WAIT:
            ctypes.set_errno(errno.ENOSPC)
            return -1
        return 0

    monkeypatch.setattr(_pipeline, "PIPELINE_BYTES", 0)
    monkeypatch.setattr(_pipeline, "WRITE_CHUNK", 64)
    monkeypatch.setattr(_pipeline, "_SYNC_RANGE", refuse)
    monkeypatch.setattr(_pipeline.WriteBack.__init__, "__defaults__", (256,))          # lag 256 bytes
    with pytest.raises(OSError) as info:
        write_file(path, [Entry("t", torch.float32, (4096,), lambda: iter(torch.ones(4096).split(512)))])
    assert info.value.errno == errno.ENOSPC and _pipeline._WAIT in calls
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"] and not _pipeline_threads()
    assert_bitwise_equal(load_file(str(path))["t"], torch.arange(4.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_blocks_are_made_on_the_callers_cuda_stream():
    side = torch.cuda.Stream()
    seen = []

    def source():
        for _ in range(3):
            seen.append(torch.cuda.current_stream())
            yield 0

    with torch.cuda.stream(side):
        list(ahead(source()))
    assert seen == [side] * 3


CHILD = """
import sys, time, torch
from ple.io import _pipeline
from ple.io.writer import Entry, write_file
_pipeline.PIPELINE_BYTES = 0

def blocks():
    for i in range(200):
        if i == 3:
            print("writing", flush=True)
        time.sleep(0.02)
        yield torch.full((1024,), float(i))

write_file(sys.argv[1], [Entry("t", torch.float32, (200 * 1024,), blocks)])
"""


def test_killed_in_an_overlapped_write_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "x.safetensors"
    old = {"t": torch.arange(10.0)}
    write_file(path, [Entry("t", torch.float32, (10,), lambda: iter([old["t"]]))])
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert child.stdout is not None and child.stdout.readline().strip() == "writing"
    time.sleep(0.1)
    tmp = path.with_name(path.name + ".tmp")
    assert tmp.exists() and tmp.stat().st_size > 0             # killed in the middle of writing the new file
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert_bitwise_equal(load_file(str(path))["t"], old["t"])
