"""``ple.io.disk_table._reads``: a disk table's cold reads, ``READ_DEPTH`` positional reads in flight into its own
buffers.

The bytes: those of the in-memory table and of a plain mapped read, bit for bit, for every table dtype, whole or
over several files; the coalescing corners (rows in one page, adjacent pages, the first and last row of a file and
of a shard, duplicates, nothing); a file cut while its rows are read; the requests really in flight; the prefetch
still overlapping the caller; the file's pages never counted in the process's resident memory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import ple.io as pio
from ple import PLEConfig
from ple.io.disk_table import _reads
from ple.io.disk_table._reads import MAX_RUN_BYTES, PAGE, READ_DEPTH, plan_runs, pread_rows
from ple.io.disk_table.mapped import READ_THREADS, map_view
from ple.io.disk_table.table import DiskTable
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

TINY = PLEConfig.preset("tiny")          # 6128 rows of D = 4 (8 bytes a bfloat16 row), two PLE layers
SCHEMES = [None, "fp8", "int8", "nf4"]


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


def test_pread_rows_corners(tmp_path):
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
