"""Training the table on disk (docs/spec.md 12: ``load_layer(..., offload="disk", overlay=DIR)``) against it in memory.

One run measures, on checkpoints written as ``bench_disk_table.py`` writes them (one layer, the real row width
D = 160 and NH = 16, the model's 128 shards, files of at most ``--file-gib``; a narrow hidden size, ``--hidden``,
one stream, as ``bench_table_training.py``), with ``RowwiseAdagrad`` on the table and ``Adam`` on the other
parameters, ``--batch`` x ``--length`` tokens a step drawn like text (Zipfian token ids, exponent ``--zipf``),
``--threads`` torch threads, in ``--dtype`` (bfloat16: the table written in bfloat16; float32: written in
bfloat16 and converted with ``ple.io.convert``), on the ``"torch"`` backend:

1. ``train``: a ``--table-gib`` table (default 4 GiB) trained from disk through an overlay (row cache
   ``--cache-mib``, overlay ``--overlay-mib``):

   * ``disk, cold``: the first ``--cold-steps`` steps, the files' pages dropped from the page cache
     (``DiskTable.drop_page_cache``: ``posix_fadvise(DONTNEED)``) and the row cache empty;
   * ``memory``: the same steps on the table read into memory (``load_layer(path)``, loaded after the cold
     pass; skipped when the table is more than 60 % of the machine's memory);
   * ``disk, warm`` and ``memory``: ``--warm-steps`` more steps, the file read into the page cache first, the
     two layers' steps interleaved step by step (this machine is shared: the ratio is of steps run side by side).

   Both layers see the same batches from the same start, so after the cold steps and again after the warm
   ones the disk layer is checked against the memory one bit for bit (float base): every row and Adagrad
   state the overlay holds against the memory table's, every other row of the memory table against the
   checkpoint's (no row changed outside the overlay), the other parameters and every step's loss. Then
   ``flush()`` is timed, and a cold lookup-only pass (``DiskTable.gather`` of new prefill chunks, page cache
   dropped, row cache emptied) measures the bare read rate.
2. ``flush``: ``flush()`` time against the rows changed since the last flush (``--flush-rows``), each on a
   fresh overlay (rows and their Adagrad state written to the overlay store directly: what ``flush`` costs is
   the rows it finds changed), on two tables (``--flush-small-gib`` and ``--table-gib``; with ``--real``, also
   the real one), plus a small flush on an overlay already holding the largest count.
3. ``merge``: ``ple.io.merge`` of the trained ``--table-gib`` table and its flushed overlay into a new
   checkpoint, the base's and overlay's pages dropped first: GB/s of the output checkpoint, beside the disk's
   sequential bandwidth measured by fio in the same run (1 MiB blocks, direct I/O, queue depth 16).
4. ``real`` (``--real``): the model's 320,001,536 rows, FP8 (47.7 GiB, written once and kept with
   ``--keep-file``), trained ``--real-steps`` steps from a cold start (row cache ``--real-cache-mib``, overlay
   ``--real-overlay-mib``), in a fresh process so its peak memory is its own: steps/s of the first
   ``--cold-steps`` steps and of the last half, the peak resident memory (``VmHWM``, which counts the file
   pages the process has mapped, and the peak ``RssAnon``, sampled every 10 ms) against the bound: the
   process before loading + the table's budget (``ple.io.disk_table.memory_budget``: row cache, reader threads,
   overlay, its index and constant) + the layer's parameters + a step's working memory; then
   ``flush()``: its time and the overlay's size on disk.
5. cold reads: rows read from the files per second during the cold steps (their ``DiskTable._read`` calls
   timed: the reads alone, and over the whole steps) and during the cold lookup-only passes, beside fio's
   random 4 KiB reads on a ``--fio-gib`` file in the same directory (direct I/O where the file system allows
   it, else buffered with the file's pages dropped first): queue depths 1, 8 and 32 (libaio, else io_uring)
   and 8 threads of synchronous reads (``psync``, as the disk table's 8 reader threads); and queue depths 1
   and 32 and psync x 8 again on the table's own files (read only), right after its part: a file just
   written, as fio's, may still be held by a cache below this machine (a virtual disk's host), the table's
   47.7 GiB not. A row (at most 320 bytes) is one 4 KiB page read where it misses. Beside fio, the page
   cache's own sequential rates: a write of 8 MiB blocks then fsync (as the checkpoint writer and ``merge``
   write), and a read after the pages were dropped.

The results print as markdown tables (``--md`` writes them too, ``--json`` the numbers). The checkpoints and
fio's file go to ``--dir`` (default ``$TMPDIR/ple_bench_disk_training``: the numbers are that disk's), deleted
at the end unless ``--keep-file``; an existing checkpoint of the same shape and dtype is reused.

    python benchmarks/bench_disk_training.py                             # parts 1-3 and 5 on a 4 GiB table
    python benchmarks/bench_disk_training.py --real --parts real --keep-file    # part 4 (and 5): 48 GiB on disk
    python benchmarks/bench_disk_training.py --smoke
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import bench_disk_table as bdt
import torch

import ple
import ple.io as pio
from ple import PLEConfig
from ple.io.disk_table import memory_budget
from ple.io.disk_table._heap import release_freed
from ple.io.disk_table.overlay.store import OverlayStore
from ple.io.disk_table.table import DiskTable
from ple.io.files import Checkpoint
from ple.reference.hashing import hash_params

REAL_ROWS = bdt.REAL_ROWS
RESULTS = Path(tempfile.gettempdir()) / "ple_bench_disk_training"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PARTS = ("train", "flush", "merge", "real")
LR = 0.01
NOTE = ("This machine: {cpus} cores shared with other work (other test runs went on beside this one), "
        "{mem:.0f} GiB of memory, {threads} torch threads; every ratio comes from this one run.")


# ---- the checkpoints ---------------------------------------------------------------------------------------------
def config_for(rows: int, hidden: int, smoke: bool) -> PLEConfig:
    """The real model's config (D 160, NH 16, 128 shards) with a narrow hidden size, one stream, and about
    ``rows`` rows (exactly the model's at ``REAL_ROWS``); the smoke run shrinks the vocabulary too."""
    real = PLEConfig.preset("qwen4exp")
    kw: dict[str, Any] = dict(hidden_size=hidden, hc_count=1)
    if smoke:
        kw.update(vocab_size=5000, eos_token_id=0)
    if rows != REAL_ROWS:
        kw["ngram_vocab_size_base"] = max(rows // real.num_ngram_heads, 8)
    return PLEConfig(**{**real.to_dict(), **kw})


def rows_for(gib: float, dtype: torch.dtype) -> int:
    return int(gib * 2**30) // (160 * dtype.itemsize)


def ensure_checkpoint(args, cfg: PLEConfig, table_dtype: str) -> tuple[Path, dict]:
    """The checkpoint of ``cfg`` with a ``table_dtype`` table (``bfloat16``, ``float32`` or ``fp8``) in
    ``--dir``: reused where a complete one is there, else written (``bench_disk_table.write_checkpoint``; a
    float32 one written in bfloat16, then converted by ``ple.io.convert``). Returns (path, how it was written)."""
    rows = hash_params(cfg, 0).num_rows
    path = Path(args.dir) / f"{table_dtype}-{rows}-h{cfg.hidden_size}"
    marker = path / "complete.json"
    if marker.exists():
        print(f"reusing {path}", flush=True)
        return path, {**json.loads(marker.read_text()), "reused": True}
    itemsize = 1 if table_dtype == "fp8" else DTYPES[table_dtype].itemsize
    need = rows * 160 * itemsize * (1.55 if table_dtype == "float32" else 1.05)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    if need > free:
        raise SystemExit(f"error: {need / 2**30:.1f} GiB do not fit the {free / 2**30:.1f} GiB free at {args.dir}")
    print(f"writing {rows:,} rows x 160 {table_dtype} ({rows * 160 * itemsize / 2**30:.2f} GiB) to {path}",
          flush=True)
    if table_dtype == "float32":
        tmp = path.with_name(path.name + ".bf16")
        seconds, _ = bdt.write_checkpoint(tmp, cfg, "bfloat16", args.file_gib)
        t0 = time.perf_counter()
        shutil.rmtree(path, ignore_errors=True)
        pio.convert(tmp, path, table_dtype=torch.float32, max_file_bytes=int(args.file_gib * 2**30))
        files = sorted(path.glob("*.safetensors"))
        for f in files:
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
        seconds = time.perf_counter() - t0
        nbytes = sum(f.stat().st_size for f in files)
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        seconds, nbytes = bdt.write_checkpoint(path, cfg, table_dtype, args.file_gib)
    info = {"seconds": seconds, "bytes": nbytes, "mb_per_s": nbytes / seconds / 1e6}
    marker.write_text(json.dumps(info))
    print(f"wrote {nbytes / 2**30:.2f} GiB in {seconds:.0f} s ({info['mb_per_s']:.0f} MB/s)", flush=True)
    return path, info


def overlay_store(table: DiskTable) -> OverlayStore:
    """The store of a disk table loaded with ``overlay=``."""
    store = table.overlay
    assert store is not None, "the table was loaded without an overlay"
    return store


def drop_files(paths: list[Path]) -> None:
    """Ask the kernel to drop these files' pages from the page cache (a hint; unmapped clean pages go)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ---- training ----------------------------------------------------------------------------------------------------
def make_batch(cfg: PLEConfig, args, i: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``i``'s batch: hidden states ``[B, L, C]`` and token ids ``[B, L]`` (Zipfian), the same for every
    layer trained on it."""
    gen = torch.Generator().manual_seed(10_000 + i)
    tokens = bdt.zipf_tokens(cfg, args.batch * args.length, args.zipf, gen).view(args.batch, args.length)
    hidden = torch.randn(args.batch, args.length, cfg.hc_hidden_size, generator=gen).to(dtype)
    return hidden, tokens


class Trainer:
    """A layer, ``RowwiseAdagrad`` on its table, ``Adam`` on the rest; `step` times one training step."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        self.opt = ple.optim.RowwiseAdagrad(layer, lr=LR)
        self.rest = torch.optim.Adam(ple.optim.other_parameters(layer), lr=1e-4)
        self.losses: list[torch.Tensor] = []

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        loss = self.layer(*batch).float().square().mean()
        loss.backward()
        self.opt.step()
        self.rest.step()
        self.opt.zero_grad()
        self.rest.zero_grad()
        seconds = time.perf_counter() - t0
        self.losses.append(loss.detach())
        return seconds


class ReadTimer:
    """Times a `DiskTable`'s reads from its files (its ``_read``: the misses of lookups and updates)."""

    def __init__(self, table: DiskTable) -> None:
        self.rows, self.seconds = 0, 0.0
        read = table._read

        def timed(ids: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                return read(ids)
            finally:
                self.seconds += time.perf_counter() - t0
                self.rows += ids.numel()

        table._read = timed  # type: ignore[method-assign]

    def snapshot(self) -> tuple[int, float]:
        return self.rows, self.seconds


class PeakSampler(threading.Thread):
    """Samples this process's RssAnon and RssFile every ``interval`` seconds; keeps the peaks."""

    def __init__(self, interval: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak_anon, self.peak_file = interval, 0, 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak_anon = max(self.peak_anon, bdt.rss_anon())
            self.peak_file = max(self.peak_file, bdt._kib_field("/proc/self/status", "RssFile"))
            self._done.wait(self.interval)

    def stop(self) -> None:
        self._done.set()
        self.join()
        self.peak_anon = max(self.peak_anon, bdt.rss_anon())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def verify(disk: Any, mem: Any, td: Trainer, tm: Trainer, path: Path) -> dict:
    """The disk layer against the memory layer, bit for bit: every overlay row and its Adagrad state, every
    other row against the checkpoint's (nothing changed outside the overlay), the other parameters, the losses."""
    store = overlay_store(disk.table)
    w = mem.table.weight.detach()
    s = tm.opt.state[mem.table.weight]["sum"]
    rows = bad_rows = bad_state = 0
    in_overlay = []
    for ids, values, states in store.items():
        bad_rows += int((_bits(values) != _bits(w.index_select(0, ids))).any(1).sum())
        bad_state += int((_bits(states["sum"]) != _bits(s.index_select(0, ids))).sum())
        rows += ids.numel()
        in_overlay.append(ids)
    overlay_ids = torch.cat(in_overlay) if in_overlay else torch.empty(0, dtype=torch.int64)
    ckpt = Checkpoint.open(path)
    changed = outside = 0
    for piece in disk.table._pieces:                                 # the memory table against the base, shard by shard
        base = ckpt.read(piece.key).to(w.dtype)
        diff = (_bits(w[piece.start: piece.stop]) != _bits(base)).any(1).nonzero().squeeze(1) + piece.start
        changed += diff.numel()
        outside += int((~torch.isin(diff, overlay_ids)).sum())
    others = all(torch.equal(_bits(a.detach()), _bits(b.detach())) for a, b in
                 zip(ple.optim.other_parameters(disk), ple.optim.other_parameters(mem), strict=True))
    losses = torch.equal(torch.stack(td.losses).view(torch.int32), torch.stack(tm.losses).view(torch.int32))
    ok = not bad_rows and not bad_state and not outside and others and losses and changed == rows
    return {"steps": len(td.losses), "overlay_rows": rows, "rows_differing": bad_rows, "state_differing": bad_state,
            "rows_changed_in_memory": changed, "changed_outside_overlay": outside, "other_params_equal": others,
            "losses_equal": losses, "bitwise_equal": ok}


def lookup_cold_pass(table: DiskTable, cfg: PLEConfig, args, seed: int) -> dict:
    """Gathers of new prefill chunks (``--length`` x ``--batch`` tokens each) right after the files' pages were
    dropped and the row cache emptied: the read rate without a training step around it."""
    steps = bdt.stream(cfg, "prefill", args.lookup_steps, 1, args.batch * args.length, args.zipf, seed)
    table.clear_cache()
    table.drop_page_cache()
    table.reset_stats()
    t0 = time.perf_counter()
    for ids in steps:
        table.gather(ids)
    seconds = time.perf_counter() - t0
    st = table.stats()
    return {"steps": len(steps), "seconds": seconds, "rows_read": st["rows_read"], "unique_rows": st["unique_rows"],
            "hit_rate": st["hit_rate"], "rows_per_s": st["rows_read"] / seconds}


def profile_steps(trainer: Trainer, cfg: PLEConfig, args, dtype: torch.dtype, first: int, n: int) -> str:
    """cProfile of ``n`` steps of ``trainer``: the top functions by their own time."""
    batches = [make_batch(cfg, args, first + i, dtype) for i in range(n)]
    prof = cProfile.Profile()
    prof.enable()
    for b in batches:
        trainer.step(b)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    return buf.getvalue()


def train_part(args, cfg: PLEConfig, path: Path, dtype: torch.dtype, out: dict) -> None:
    """Part 1 (see the module docstring); leaves the disk layer's overlay flushed in ``out["overlay_dir"]``."""
    rows = hash_params(cfg, 0).num_rows
    table_bytes = rows * 160 * dtype.itemsize
    ov = Path(args.dir) / "overlay-train"
    shutil.rmtree(ov, ignore_errors=True)
    before = bdt.rss_anon()
    disk = pio.load_layer(path, backend="torch", dtype=dtype, offload="disk", cache_bytes=int(args.cache_mib * 2**20),
                          overlay=ov, overlay_bytes=int(args.overlay_mib * 2**20))
    table = disk.table
    assert isinstance(table, DiskTable)
    timer = ReadTimer(table)
    td = Trainer(disk)
    res: dict[str, dict] = {}

    def record(name: str, times: list[float], st: dict | None, reads: tuple[int, float] | None) -> None:
        tokens = args.batch * args.length
        r = {"steps": len(times), "seconds": sum(times), "steps_per_s": len(times) / sum(times),
             "ms_per_step": 1e3 * sum(times) / len(times), "median_ms": 1e3 * statistics.median(times),
             "tokens_per_s": tokens * len(times) / sum(times)}
        if st is not None:
            r.update(hit_rate=st["hit_rate"], rows_read_per_step=st["rows_read"] / len(times),
                     unique_rows_per_step=st["unique_rows"] / len(times), stats=st)
        if reads is not None:
            r.update(rows_read=reads[0], read_seconds=reads[1], rows_per_s_reading=reads[0] / max(reads[1], 1e-9),
                     rows_per_s_of_steps=reads[0] / sum(times))
        res[name] = r

    batch = [make_batch(cfg, args, i, dtype) for i in range(args.cold_steps)]
    table.clear_cache()
    table.drop_page_cache()
    table.reset_stats()
    cold = [td.step(b) for b in batch]
    record("disk, cold", cold, table.stats(), timer.snapshot())
    out["disk_rss_anon_mib"] = (bdt.rss_anon() - before) / 2**20
    print(f"disk, cold: {res['disk, cold']['ms_per_step']:.0f} ms a step", flush=True)

    fits = table_bytes < 0.6 * bdt.memory_bytes() and not args.no_memory
    mem = tm = None
    if fits:
        t0 = time.perf_counter()
        mem = pio.load_layer(path, backend="torch", dtype=dtype)
        out["memory_load_s"] = time.perf_counter() - t0
        tm = Trainer(mem)
        record("memory (first steps)", [tm.step(b) for b in batch], None, None)
        out["check_after_cold"] = verify(disk, mem, td, tm, path)
        print(f"checked after the cold steps: {out['check_after_cold']}", flush=True)
    else:
        out["memory"] = "skipped: the table does not fit 60 % of this machine's memory" if not args.no_memory \
            else "skipped (--no-memory)"
    file_fits = table_bytes < 0.6 * bdt.memory_bytes()
    if file_fits:
        bdt.read_through(table)                                      # the whole file in the page cache
    table.reset_stats()
    r0 = timer.snapshot()
    warm_d, warm_m = [], []
    for i in range(args.cold_steps, args.cold_steps + args.warm_steps):
        b = make_batch(cfg, args, i, dtype)
        if tm is not None:
            warm_m.append(tm.step(b))
        warm_d.append(td.step(b))
    r1 = timer.snapshot()
    second = "disk, warm" if file_fits else "disk, after cold"
    record(second, warm_d, table.stats(), (r1[0] - r0[0], r1[1] - r0[1]))
    if tm is not None:
        record("memory", warm_m, None, None)
        out["check_after_warm"] = verify(disk, mem, td, tm, path)
        print(f"checked after the warm steps: {out['check_after_warm']}", flush=True)
    out["passes"] = res
    store = overlay_store(table)
    st0 = store.stats()
    t0 = time.perf_counter()
    table.flush()
    out["flush"] = {"seconds": time.perf_counter() - t0, "rows": st0["rows"], "stats": store.stats()}
    if args.profile:
        n = args.profile
        first = args.cold_steps + args.warm_steps
        out["profile_disk"] = profile_steps(td, cfg, args, dtype, first, n)
        if tm is not None:
            out["profile_memory"] = profile_steps(tm, cfg, args, dtype, first, n)
    out["lookup_cold"] = lookup_cold_pass(table, cfg, args, seed=77)
    out["overlay_dir"] = str(ov)
    out["rows"], out["table_bytes"] = rows, table_bytes
    del mem, tm
    table.close()


# ---- flush against rows changed -------------------------------------------------------------------------------
def distinct_ids(rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` distinct random row ids in ``[0, rows)`` (n <= rows)."""
    if rows <= 50_000_000:
        return torch.randperm(rows, generator=gen)[:n]
    ids = torch.empty(0, dtype=torch.int64)
    while ids.numel() < n:
        ids = torch.unique(torch.cat([ids, torch.randint(0, rows, (n + n // 8 + 16,), generator=gen)]))
    return ids[torch.randperm(ids.numel(), generator=gen)[:n]]


def flush_part(args, tables: list[tuple[str, Path, int]], dtype: torch.dtype) -> list[dict]:
    """Part 2: ``flush()`` of a fresh overlay after ``n`` rows changed, for each ``n`` of ``--flush-rows`` and
    each table; then, on the last overlay, a flush of the smallest ``n`` more rows."""
    results = []
    gen = torch.Generator().manual_seed(5)
    ov = Path(args.dir) / "overlay-flush"
    for label, path, rows in tables:
        counts = [n for n in args.flush_rows if n <= rows]
        for k, n in enumerate(counts):
            shutil.rmtree(ov, ignore_errors=True)
            layer = pio.load_layer(path, backend="torch", dtype=dtype, offload="disk", cache_bytes=0, overlay=ov,
                                   overlay_bytes=int(args.overlay_mib * 2**20))
            Trainer(layer)                                            # the overlay's rows hold Adagrad's state
            table = layer.table
            assert isinstance(table, DiskTable)
            store = overlay_store(table)
            runs = [(n, 0)] + ([(counts[0], n)] if k == len(counts) - 1 else [])
            for changed, prior in runs:
                ids = distinct_ids(rows, changed, gen)
                for a in range(0, changed, 65536):
                    part = ids[a: a + 65536]
                    store.update(part, torch.randn(part.numel(), 160, generator=gen).to(dtype),
                                 {"sum": torch.rand(part.numel(), generator=gen)})
                st0 = store.stats()
                t0 = time.perf_counter()
                table.flush()
                seconds = time.perf_counter() - t0
                st = store.stats()
                r = {"table": label, "table_rows": rows, "rows_changed": changed, "overlay_rows_before": prior,
                     "seconds": seconds, "bytes_written": st["bytes_written"] - st0["bytes_written"],
                     "merges": st["merges"] - st0["merges"], "segments": st["segments"],
                     "bytes_on_disk": st["bytes_on_disk"], "spilled_rows": st["spilled_rows"]}
                results.append(r)
                print(f"flush {label}: {changed:,} rows changed (overlay of {prior:,} before): {seconds * 1e3:.1f} ms",
                      flush=True)
            table.close()
    shutil.rmtree(ov, ignore_errors=True)
    return results


# ---- merge -----------------------------------------------------------------------------------------------------
MERGE_BAR = 0.8
"""The aim: a merge's output rate at least this fraction of the machine's buffered sequential write rate."""


def write_rate(path: Path, nbytes: int) -> float:
    """This machine's buffered sequential write rate where the merge writes, GB/s: ``nbytes`` written in 8 MiB
    blocks through the page cache, then fsynced (the seconds include the fsync, as the merge's writer's do), after
    an ``os.sync()``; the file deleted after."""
    block = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8).numpy().tobytes()
    n = max(1, -(-nbytes // len(block)))
    os.sync()
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(n):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return n * len(block) / seconds / 1e9


def copy_rate(files: list[Path], out: Path) -> float:
    """What this disk allows a job that reads as much as it writes, GB/s: the files copied cold (``os.sync()``,
    their pages dropped) into ``out`` with ``shutil.copyfile`` (the kernel's own copy) and fsynced; deleted
    after. A merge reads the base and writes as many bytes, on the same disk."""
    os.sync()
    drop_files(files)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    n = 0
    for f in files:
        dst = out / f.name
        shutil.copyfile(f, dst)
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        n += f.stat().st_size
    seconds = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return n / seconds / 1e9


def fio_read_write(base: Path, out: Path, nbytes: int) -> dict:
    """What this disk gives a sequential reader and a sequential writer (fio, buffered, 1 MiB blocks, as the merge
    reads and writes), each alone and both at once: the reader on the base's largest file (its pages dropped
    first), the writer on a new file of ``nbytes`` (fsynced at the end; deleted after). GB/s; {} without fio."""
    if shutil.which("fio") is None:
        return {}
    read = ["--name=read", f"--filename={base}", "--rw=read", "--bs=1m", "--ioengine=psync", "--invalidate=1"]
    write = ["--name=write", f"--filename={out}", "--rw=write", "--bs=1m", "--ioengine=psync",
             f"--size={nbytes}", "--end_fsync=1"]

    def run(*jobs: list[str]) -> dict:
        os.sync()
        drop_files([base])
        done = subprocess.run(["fio", "--output-format=json", *[a for job in jobs for a in job]],
                              capture_output=True, text=True, check=False)
        out.unlink(missing_ok=True)
        if done.returncode:
            raise RuntimeError(done.stderr.strip()[-500:] or done.stdout.strip()[-500:])
        got = json.loads(done.stdout[done.stdout.index("{"):])["jobs"]
        return {j["jobname"]: j[j["jobname"]]["bw_bytes"] / 1e9 for j in got}

    alone_r, alone_w, both = run(read), run(write), run(read, write)
    res = {"read_alone": alone_r["read"], "write_alone": alone_w["write"], "read_together": both["read"],
           "write_together": both["write"]}
    print("fio, buffered 1 MiB: read alone {read_alone:.2f}, write alone {write_alone:.2f}, at once: read "
          "{read_together:.2f} + write {write_together:.2f} GB/s".format(**res), flush=True)
    return res


def _spot_check(path: Path, ov: Path, out_dir: Path, dtype: torch.dtype) -> bool:
    """The merged table against the base read through the overlay, on 512 overlay rows and 512 others."""
    merged = pio.load_layer(out_dir, backend="torch", dtype=dtype, offload="disk", cache_bytes=0)
    trained = pio.load_layer(path, backend="torch", dtype=dtype, offload="disk", cache_bytes=0, overlay=ov)
    assert isinstance(trained.table, DiskTable)
    ids, _, _ = next(overlay_store(trained.table).items(512))
    other = torch.randint(0, merged.table.num_rows, (512,), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([ids, other]).view(-1, 1)
    with torch.no_grad():
        got = merged.table.lookup(ids, dtype, ops=ple.vectorized)
        want = trained.table.lookup(ids, dtype, ops=ple.vectorized)
    for layer in (merged, trained):
        assert isinstance(layer.table, DiskTable)
        layer.table.close()
    return torch.equal(_bits(got), _bits(want))


def merge_part(args, path: Path, ov: Path, dtype: torch.dtype) -> dict:
    """Part 3: ``--merge-rounds`` rounds of ``ple.io.merge(path, ov, OUT)``, each after an ``os.sync()`` with the
    base's and the overlay's pages dropped, and between two measurements of this machine's buffered sequential write
    rate (`write_rate`: as many bytes, in ``--dir``). A merge's ratio is its output rate over the mean of the two
    measurements beside it; the median ratio is checked against ``MERGE_BAR``. Each round also copies the base's
    files cold (`copy_rate`): a merge reads the base while it writes, and on a disk whose reads and writes share
    its bandwidth that copy, not the write alone, is the most a merge can reach (its ratio reported beside).
    The first output spot-checked (overlay rows and base rows); outputs deleted."""
    out_dir, probe = Path(args.dir) / "merged", Path(args.dir) / "write-rate.dat"
    in_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    res: dict[str, Any] = {"checkpoint_bytes_in": in_bytes, "overlay_bytes_in": dir_bytes(ov), "bar": MERGE_BAR,
                           "rounds": []}
    res["fio_read_write"] = {} if args.no_fio else fio_read_write(max(path.glob("*.safetensors"),
                                                                      key=lambda f: f.stat().st_size),
                                                                  Path(args.dir) / "fio-write.dat", in_bytes)
    last = write_rate(probe, in_bytes)
    for r in range(max(1, args.merge_rounds)):
        shutil.rmtree(out_dir, ignore_errors=True)
        os.sync()
        drop_files(sorted(path.glob("*.safetensors")) + [f for f in ov.rglob("*") if f.is_file()])
        t0 = time.perf_counter()
        pio.merge(path, ov, out_dir)
        seconds = time.perf_counter() - t0
        out_bytes = sum(f.stat().st_size for f in out_dir.glob("*.safetensors"))
        if "spot_check_equal" not in res:
            res["spot_check_equal"] = _spot_check(path, ov, out_dir, dtype)
        shutil.rmtree(out_dir, ignore_errors=True)
        after = write_rate(probe, out_bytes)
        copy = copy_rate(sorted(path.glob("*.safetensors")), Path(args.dir) / "copy-rate")
        rate = out_bytes / seconds / 1e9
        res["rounds"].append({"round": r, "kind": "merge", "seconds": seconds, "bytes_out": out_bytes,
                              "gb_per_s_out": rate, "write_before": last, "write_after": after,
                              "ratio_to_write": rate / ((last + after) / 2), "copy": copy,
                              "ratio_to_copy": rate / copy})
        print(f"merge, round {r}: {out_bytes / 2**30:.2f} GiB in {seconds:.2f} s ({rate:.2f} GB/s); buffered write + "
              f"fsync {last:.2f} GB/s before, {after:.2f} after: ratio {res['rounds'][-1]['ratio_to_write']:.2f}; "
              f"cold copy of the base {copy:.2f} GB/s: ratio {rate / copy:.2f}", flush=True)
        last = after
    res.update({k: statistics.median(x[k] for x in res["rounds"]) for k in ("seconds", "gb_per_s_out",
                                                                           "ratio_to_write", "copy",
                                                                           "ratio_to_copy")})
    res["bytes_out"], res["meets_bar"] = res["rounds"][0]["bytes_out"], res["ratio_to_write"] >= MERGE_BAR
    print(f"merge: median ratio to the buffered write rate {res['ratio_to_write']:.2f} (bar {MERGE_BAR}: "
          f"{'met' if res['meets_bar'] else 'NOT met'}), to a cold copy of the base {res['ratio_to_copy']:.2f}; "
          f"spot check "
          f"{'equal' if res['spot_check_equal'] else 'DIFFERS'}", flush=True)
    return res


# ---- the real table (a child process) -------------------------------------------------------------------------
def real_child(args) -> dict:
    """Part 4, in its own process: ``--real-steps`` steps from a cold start, the peak memory, a flush, then a
    cold lookup-only pass."""
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    cfg = config_for(args.real_rows, args.hidden, args.smoke)
    path = Path(args.real_path)
    ov = Path(args.dir) / "overlay-real"
    shutil.rmtree(ov, ignore_errors=True)
    base_anon, working = step_working_memory(args, dtype)          # RssAnon of the bare process, a step's needs
    cache, overlay = int(args.real_cache_mib * 2**20), int(args.real_overlay_mib * 2**20)
    release_freed()                                  # what the small layer of `step_working_memory` left freed
    loading_anon = bdt.rss_anon()                    # the baseline the bound starts from
    sampler = PeakSampler()
    sampler.start()
    t0 = time.perf_counter()
    disk = pio.load_layer(path, backend="torch", dtype=dtype, offload="disk", cache_bytes=cache, overlay=ov,
                          overlay_bytes=overlay)
    load_s = time.perf_counter() - t0
    table = disk.table
    assert isinstance(table, DiskTable)
    table.drop_page_cache()
    timer = ReadTimer(table)
    tr = Trainer(disk)
    times, reads, stats, anon, trained = [], [], [], [], []
    held: dict[int, tuple[int, int, int]] = {}      # growth mark -> (step, rows trained, RssAnon trimmed)
    for i in range(args.real_steps):
        b = make_batch(cfg, args, i, dtype)
        times.append(tr.step(b))
        anon.append(bdt.rss_anon())
        trained.append(overlay_store(table).num_rows)
        for mark in GROWTH_MARKS:
            if mark not in held and trained[-1] >= mark:       # the memory held there: freed heap handed back
                release_freed()
                held[mark] = (i + 1, trained[-1], bdt.rss_anon())
        reads.append(timer.snapshot())
        st = table.stats()
        stats.append((st["unique_rows"], st["hits"], st["rows_read"]))
        if (i + 1) % 50 == 0:
            print(f"real: step {i + 1}: {times[-1] * 1e3:.0f} ms, overlay {overlay_store(table).num_rows:,} rows",
                  flush=True, file=sys.stderr)
    store = overlay_store(table)
    st_before = store.stats()
    peak_steps = max(sampler.peak_anon, bdt.rss_anon())
    t0 = time.perf_counter()
    table.flush()
    flush_s = time.perf_counter() - t0
    st_after = store.stats()
    sampler.stop()
    hwm = bdt._kib_field("/proc/self/status", "VmHWM")
    params = sum(p.numel() * p.element_size() for p in ple.optim.other_parameters(disk))
    lookup = lookup_cold_pass(table, cfg, args, seed=78)
    n = len(times)
    k = min(args.cold_steps, n)
    tail = max(1, n // 2)

    def phase(a: int, b: int) -> dict:
        sec = sum(times[a:b])
        u0, h0, r0 = stats[a - 1] if a else (0, 0, 0)
        u1, h1, r1 = stats[b - 1]
        rd0 = reads[a - 1] if a else (0, 0.0)
        rd1 = reads[b - 1]
        return {"steps": b - a, "seconds": sec, "steps_per_s": (b - a) / sec, "ms_per_step": 1e3 * sec / (b - a),
                "hit_rate": (h1 - h0) / max(u1 - u0, 1), "rows_read_per_step": (r1 - r0) / (b - a),
                "rows_read": rd1[0] - rd0[0], "read_seconds": rd1[1] - rd0[1],
                "rows_per_s_reading": (rd1[0] - rd0[0]) / max(rd1[1] - rd0[1], 1e-9),
                "rows_per_s_of_steps": (rd1[0] - rd0[0]) / sec}

    budget = memory_budget(table, rows_on_disk=st_after["rows"])        # ple.io.disk_table.budget: every part
    bound = loading_anon + budget.total + params + working
    out = {"rows": table.num_rows, "load_s": load_s, "steps": n, "cold": phase(0, k), "steady": phase(n - tail, n),
           "all": phase(0, n), "step_ms": [t * 1e3 for t in times],
           "flush": {"seconds": flush_s, "rows": st_before["rows"], "bytes_written": st_after["bytes_written"]
                     - st_before["bytes_written"], "bytes_on_disk": st_after["bytes_on_disk"], "stats": st_after},
           "memory": {"baseline_rss_anon": base_anon, "rss_anon_before_loading": loading_anon,
                      "peak_rss_anon": sampler.peak_anon, "peak_rss_anon_steps": peak_steps,
                      "peak_rss_file": sampler.peak_file, "vmhwm": hwm, "cache_bytes": cache, "overlay_bytes": overlay,
                      "index_bytes": st_after["index_bytes"], "layer_params_bytes": params,
                      "step_working_bytes": working, "budget": budget.as_dict(), "bound": bound,
                      "within_bound": sampler.peak_anon <= bound,
                      "rss_anon_after_step": {f"{j + 1}": anon[j] for j in sorted({max(0, n * q // 4 - 1)
                                                                                   for q in (1, 2, 3, 4)})},
                      "growth": growth_between(held)},
           "lookup_cold": lookup}
    table.close()
    shutil.rmtree(ov, ignore_errors=True)
    return out


GROWTH_MARKS = (1_000_000, 4_000_000)
"""Rows trained between which the growth of the memory held per row is reported (the aim: at most 2 bytes a row;
with budgets still filling there, the growth is theirs: run with budgets full by the first mark to see the rest)."""


def growth_between(held: dict[int, tuple[int, int, int]]) -> dict:
    """The growth of the memory held (RssAnon after the allocator's freed pages are handed back, at the first step
    at which the overlay held at least each of `GROWTH_MARKS` rows) per row trained between the two marks (None
    where the run did not reach both)."""
    if len(held) < len(GROWTH_MARKS):
        return {"marks": list(GROWTH_MARKS), "bytes_per_row": None}
    (s0, n0, m0), (s1, n1, m1) = (held[m] for m in GROWTH_MARKS)
    return {"marks": list(GROWTH_MARKS), "steps": [s0, s1], "rows": [n0, n1], "rss_anon": [m0, m1],
            "bytes_per_row": (m1 - m0) / (n1 - n0) if n1 > n0 else None}


def step_working_memory(args, dtype: torch.dtype) -> tuple[int, int]:
    """The anonymous memory a training step needs beyond the table, its state and the layer (activations,
    gradients, the optimizers' buffers): the peak RssAnon of 3 steps on a small in-memory layer of the same
    widths, less the memory before them and its table, state and parameters. Returns (RssAnon before,
    the working memory)."""
    cfg = config_for(20_000 if args.smoke else 100_000, args.hidden, args.smoke)
    before = bdt.rss_anon()
    sampler = PeakSampler()
    sampler.start()
    layer = ple.PLELayer(cfg, 0, backend="torch", dtype=dtype)
    trainer = Trainer(layer)
    for i in range(3):
        trainer.step(make_batch(cfg, args, 1_000 + i, dtype))
    sampler.stop()
    w = layer.table.weight
    small = w.numel() * w.element_size() + w.shape[0] * 4 + sum(
        p.numel() * p.element_size() * 3 for p in ple.optim.other_parameters(layer))      # + Adam's two moments
    del trainer, layer
    return before, max(0, sampler.peak_anon - before - small)


def real_part(args, path: Path) -> dict:
    """Runs `real_child` in a fresh process (its peak memory its own)."""
    keys = ("dtype", "hidden", "batch", "length", "zipf", "threads", "dir", "real_steps", "real_cache_mib",
            "real_overlay_mib", "cold_steps", "lookup_steps", "real_rows")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-real", str(path)]
    cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys] + (["--smoke-config"] if args.smoke else [])
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False, env={**os.environ,
                          "OMP_NUM_THREADS": str(args.threads)})
    if done.returncode:
        raise RuntimeError(f"the real part failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- fio -----------------------------------------------------------------------------------------------------
FioJobs = tuple[tuple[str, dict[str, Any]], ...]
FIO_JOBS: FioJobs = (
    ("seq write, 1 MiB, qd 16", dict(rw="write", bs="1m", iodepth=16, end_fsync=1)),
    ("seq read, 1 MiB, qd 16", dict(rw="read", bs="1m", iodepth=16)),
    ("rand read, 4 KiB, qd 1", dict(rw="randread", bs="4k", iodepth=1, time_based=1)),
    ("rand read, 4 KiB, qd 8", dict(rw="randread", bs="4k", iodepth=8, time_based=1)),
    ("rand read, 4 KiB, qd 32", dict(rw="randread", bs="4k", iodepth=32, time_based=1)),
    ("rand read, 4 KiB, psync x 8 threads", dict(rw="randread", bs="4k", ioengine="psync", numjobs=8,
                                                 group_reporting=1, time_based=1)))


def _fio(path: Path | str, size: str | None, runtime: float, direct: int, engine: str, job: dict) -> dict:
    opts = {"name": "ple", "filename": str(path), "size": size, "direct": direct, "ioengine": engine,
            "runtime": f"{runtime:g}", "randrepeat": 0, "norandommap": 1, "invalidate": 1, **job}
    opts = {k: v for k, v in opts.items() if v is not None}
    cmd = ["fio", "--output-format=json"] + [f"--{k}" if v is True else f"--{k}={v}" for k, v in opts.items()]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr.strip()[-500:] or done.stdout.strip()[-500:])
    job_out = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0]
    side = job_out["write" if "write" in job["rw"] else "read"]
    if job_out.get("error"):
        raise RuntimeError(f"fio error {job_out['error']}")
    return {"iops": side["iops"], "bw_bytes": side["bw_bytes"], "lat_us": side["clat_ns"]["mean"] / 1e3}


TABLE_JOBS = ("rand read, 4 KiB, qd 1", "rand read, 4 KiB, qd 32", "rand read, 4 KiB, psync x 8 threads")


def fio_on_table(args, fio: dict, files: list[Path]) -> dict:
    """fio's random 4 KiB reads (``TABLE_JOBS``) on a table's own checkpoint files, read only, as the fio file's
    jobs ran (direct I/O or not): the same disk region as the table's cold reads (a file just written, as fio's
    own, may still sit in a cache below this machine: a virtual disk's host)."""
    if "jobs" not in fio or ":" in "".join(str(f) for f in files):
        return {}
    jobs = dict(FIO_JOBS)
    out = {}
    for name in TABLE_JOBS:
        if not fio["direct"]:
            drop_files(files)
        out[name] = _fio(":".join(str(f) for f in files), None, args.fio_seconds, fio["direct"], fio["engine"],
                         {**jobs[name], "readonly": True})
    print("fio on the table's files: " + ", ".join(f"{k.removeprefix('rand read, 4 KiB, ')} {v['iops']:,.0f} IOPS"
                                                     for k, v in out.items()), flush=True)
    return out


def buffered_rates(path: Path, nbytes: int) -> dict:
    """What the checkpoint writer and a cold sequential reader get: ``nbytes`` written through the page cache in
    8 MiB blocks then fsynced (the seconds include the fsync), and read back after its pages were dropped."""
    block = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8).numpy().tobytes()
    n = max(1, nbytes // len(block))
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(n):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    write_s = time.perf_counter() - t0
    drop_files([path])
    buf = bytearray(len(block))
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass
    read_s = time.perf_counter() - t0
    path.unlink()
    total = n * len(block)
    return {"bytes": total, "write_bw_bytes": total / write_s, "read_bw_bytes": total / read_s}


def fio_part(args) -> dict:
    """Part 5's (and 3's) reference: fio's sequential and random reads (and a sequential write) of a
    ``--fio-gib`` file in ``--dir``."""
    if shutil.which("fio") is None:
        return {"skipped": "fio is not installed"}
    f = Path(args.dir) / "fio.dat"
    size = f"{max(1, int(args.fio_gib * 1024))}m"
    out: dict[str, Any] = {"file_bytes": int(args.fio_gib * 2**30), "jobs": {}}
    modes = [(1, "libaio"), (1, "io_uring"), (0, "libaio"), (0, "io_uring")]
    try:
        for name, job in FIO_JOBS:
            while True:
                direct, engine = modes[0]
                try:
                    if not direct and "read" in job["rw"]:
                        drop_files([f])
                    out["jobs"][name] = _fio(f, size, args.fio_seconds, direct, engine, job)
                    break
                except RuntimeError as e:
                    out.setdefault("fallbacks", []).append(f"direct={direct} {engine}: {e}")
                    modes.pop(0)
                    if not modes:
                        return {"skipped": f"fio failed: {e}"}
            print(f"fio {name}: {out['jobs'][name]['iops']:,.0f} IOPS, "
                  f"{out['jobs'][name]['bw_bytes'] / 1e6:,.0f} MB/s", flush=True)
        out["direct"], out["engine"] = modes[0]
        out["buffered"] = buffered_rates(f, int(args.fio_gib * 2**30))
        print(f"buffered: write + fsync {out['buffered']['write_bw_bytes'] / 1e6:,.0f} MB/s, read "
              f"{out['buffered']['read_bw_bytes'] / 1e6:,.0f} MB/s", flush=True)
    finally:
        f.unlink(missing_ok=True)
    return out


# ---- the report --------------------------------------------------------------------------------------------------
def report(args, res: dict) -> str:
    L: list[str] = [NOTE.format(cpus=os.cpu_count(), mem=bdt.memory_bytes() / 2**30, threads=args.threads), ""]
    tokens = args.batch * args.length
    tr = res.get("train")
    if tr:
        L += [f"### Training steps: {tr['rows']:,} rows x 160 {args.dtype} ({tr['table_bytes'] / 2**30:.2f} GiB), "
              f"RowwiseAdagrad, {args.batch} x {args.length} tokens a step, row cache {args.cache_mib:g} MiB, "
              f"overlay {args.overlay_mib:g} MiB", "",
              "| table | steps | steps/s | ms/step (median) | tokens/s | disk / memory | row-cache hit rate | "
              "rows read / step |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        p = tr["passes"]
        mem = p.get("memory")
        for name, r in p.items():
            ratio = ""
            if name.startswith("disk") and mem:
                m = p["memory (first steps)"] if "cold" in name else mem
                ratio = f"{r['steps_per_s'] / m['steps_per_s']:.2f}"
            hit = f"{r['hit_rate']:.3f}" if "hit_rate" in r else ""
            read = f"{r['rows_read_per_step']:,.0f}" if "rows_read_per_step" in r else ""
            L.append(f"| {name} | {r['steps']} | {r['steps_per_s']:.2f} | {r['ms_per_step']:.0f} "
                     f"({r['median_ms']:.0f}) | {r['tokens_per_s']:,.0f} | {ratio} | {hit} | {read} |")
        L += ["", "Row-cache hit rate: of the distinct rows of the lookups and of the optimizer's update together (the "
              "update reads each step's rows again, from the cache: a rate near 0.5 means the lookups nearly all "
              "missed). Rows read / step: from the files (or their pages in the page cache).", ""]
        for when in ("after_cold", "after_warm"):
            c = tr.get(f"check_{when}")
            if c:
                L.append(f"Bit for bit after {c['steps']} steps ({when.replace('_', ' ')}): "
                         f"{'**equal**' if c['bitwise_equal'] else '**DIFFERENT**'} ({c['overlay_rows']:,} overlay "
                         f"rows and their Adagrad state against the memory table's; {c['rows_changed_in_memory']:,} "
                         f"rows changed in memory, {c['changed_outside_overlay']} outside the overlay; other "
                         f"parameters {'equal' if c['other_params_equal'] else 'differ'}, losses "
                         f"{'equal' if c['losses_equal'] else 'differ'}).")
        if "memory" in tr and isinstance(tr["memory"], str):
            L.append(f"Memory table: {tr['memory']}.")
        fl = tr["flush"]
        L += [f"The disk layer added {tr['disk_rss_anon_mib']:.0f} MiB of RssAnon over its cold steps. "
              f"flush() after the {fl['rows']:,} overlay rows of training: {fl['seconds'] * 1e3:.0f} ms, "
              f"{fl['stats']['bytes_on_disk'] / 2**20:.1f} MiB on disk.", ""]
    fls = res.get("flush")
    if fls:
        L += ["### flush() against the rows changed since the last flush", "",
              "| table | rows changed | overlay rows before | flush | rows/s | MiB written | merges |",
              "|---|---:|---:|---:|---:|---:|---:|"]
        for r in fls:
            L.append(f"| {r['table']} ({r['table_rows']:,} rows) | {r['rows_changed']:,} | "
                     f"{r['overlay_rows_before']:,} | {r['seconds'] * 1e3:,.1f} ms | "
                     f"{r['rows_changed'] / r['seconds']:,.0f} | {r['bytes_written'] / 2**20:,.1f} | {r['merges']} |")
        L.append("")
    fio = res.get("fio", {})
    jobs = fio.get("jobs", {})
    if jobs:
        L += [f"### fio on a {fio['file_bytes'] / 2**30:g} GiB file in {args.dir} "
              f"({'direct I/O' if fio.get('direct') else 'buffered, pages dropped'}, {fio.get('engine')})", "",
              "| job | IOPS | MB/s | mean latency |", "|---|---:|---:|---:|"]
        for name, j in jobs.items():
            L.append(f"| {name} | {j['iops']:,.0f} | {j['bw_bytes'] / 1e6:,.0f} | {j['lat_us']:,.0f} us |")
        bf = fio.get("buffered")
        if bf:
            L += [f"| seq write, 8 MiB blocks through the page cache + fsync (Python, as the checkpoint writer) | | "
                  f"{bf['write_bw_bytes'] / 1e6:,.0f} | |",
                  f"| seq read, 8 MiB blocks through the page cache, pages dropped (Python) | | "
                  f"{bf['read_bw_bytes'] / 1e6:,.0f} | |"]
        L.append("")
    elif fio:
        L += [f"fio: {fio.get('skipped')}", ""]
    mg = res.get("merge")
    if mg:
        L += ["### merge", ""]
        if "skipped" in mg:
            L += [f"merge: {mg['skipped']}.", ""]
        else:
            L += [f"{mg['checkpoint_bytes_in'] / 2**30:.2f} GiB + an overlay of {mg['overlay_bytes_in'] / 2**20:.1f} "
                  f"MiB, each merge cold (pages dropped) between two buffered writes + fsync of as many bytes, "
                  f"then a cold copy of the base's files (`shutil.copyfile` + fsync: reading as much as it writes):",
                  "", "| round | seconds | merge GB/s (output) | buffered write GB/s before / after | merge / write "
                  "| copy GB/s | merge / copy |", "|---|---:|---:|---|---:|---:|---:|"]
            for x in mg["rounds"]:
                L.append(f"| {x['round']} | {x['seconds']:.2f} | {x['gb_per_s_out']:.2f} | "
                         f"{x['write_before']:.2f} / {x['write_after']:.2f} | {x['ratio_to_write']:.2f} | "
                         f"{x['copy']:.2f} | {x['ratio_to_copy']:.2f} |")
            L.append(f"| median | {mg['seconds']:.2f} | {mg['gb_per_s_out']:.2f} | | "
                     f"**{mg['ratio_to_write']:.2f}** (aim {mg['bar']}) | {mg['copy']:.2f} | "
                     f"**{mg['ratio_to_copy']:.2f}** |")
            rw = mg.get("fio_read_write") or {}
            if rw:
                L += ["", f"fio on the same disk, buffered, 1 MiB blocks (the base's file read, a new file written "
                      f"and fsynced): a reader alone {rw['read_alone']:.2f} GB/s, a writer alone "
                      f"{rw['write_alone']:.2f}; both at once {rw['read_together']:.2f} + "
                      f"{rw['write_together']:.2f} GB/s."]
            L += ["", f"Merged rows spot-checked against the overlay and the base: "
                  f"{'equal' if mg['spot_check_equal'] else 'DIFFERENT'}.", ""]
    rl = res.get("real")
    if rl:
        m = rl["memory"]
        L += [f"### The real row count: {rl['rows']:,} rows FP8 ({rl['rows'] * 160 / 2**30:.1f} GiB), "
              f"{rl['steps']} steps, row cache {args.real_cache_mib:g} MiB, overlay {args.real_overlay_mib:g} MiB, "
              f"overlay dtype bfloat16", "",
              "| phase | steps | steps/s | ms/step | tokens/s | row-cache hit rate | rows read / step |",
              "|---|---:|---:|---:|---:|---:|---:|"]
        for name, key in ((f"cold start (first {rl['cold']['steps']})", "cold"),
                          (f"steady (last {rl['steady']['steps']})", "steady"), ("all", "all")):
            r = rl[key]
            L.append(f"| {name} | {r['steps']} | {r['steps_per_s']:.2f} | {r['ms_per_step']:.0f} | "
                     f"{tokens * r['steps_per_s']:,.0f} | {r['hit_rate']:.3f} | {r['rows_read_per_step']:,.0f} |")
        fl = rl["flush"]
        gib = 2**30
        margin = (m["bound"] - m["peak_rss_anon"]) / 2**20
        verdict = f"within, {margin:,.0f} MiB below" if margin >= 0 else f"**over** by {-margin:,.0f} MiB"
        L += ["", f"Memory: peak RssAnon {m['peak_rss_anon'] / gib:.2f} GiB against the bound "
              f"{m['bound'] / gib:.2f} GiB ({verdict}; {m.get('peak_rss_anon_steps', 0) / gib:.2f} GiB before the "
              f"final flush: the process before loading "
              f"{m['rss_anon_before_loading'] / gib:.2f} + the table's budget {m['budget']['total'] / gib:.2f} ("
              + ", ".join(
                  f"{k} {v / gib:.3f}" for k, v in m["budget"].items() if k != "total") + ") + layer parameters "
              f"{m['layer_params_bytes'] / gib:.3f} + a step's working memory {m['step_working_bytes'] / gib:.2f}, "
              f"measured on a small in-memory layer); RssAnon after steps " + ", ".join(
                  f"{k}: {v / gib:.2f}" for k, v in m["rss_anon_after_step"].items()) + " GiB; "
              + (f"memory held (trimmed) grew {m['growth']['bytes_per_row']:.2f} B per row trained between "
                 f"{m['growth']['rows'][0]:,} and "
                 f"{m['growth']['rows'][1]:,} rows (steps {m['growth']['steps'][0]} and {m['growth']['steps'][1]}); "
                 if m.get("growth", {}).get("bytes_per_row") is not None else "") +
              f"VmHWM {m['vmhwm'] / gib:.2f} GiB, which also counts the "
              f"table's and the overlay's file pages mapped by the process (peak RssFile "
              f"{m['peak_rss_file'] / gib:.2f} GiB: page cache, given back under pressure).",
              f"flush() at the end: {fl['seconds']:.2f} s for {fl['rows']:,} overlay rows "
              f"({fl['bytes_written'] / 2**20:,.0f} MiB written); the overlay then holds "
              f"{fl['bytes_on_disk'] / 2**20:,.0f} MiB on disk ({fl['stats']['segments']} segments; "
              f"{fl['stats']['spilled_rows']:,} rows spilled during training).", ""]
    cold = []
    psync_name = "rand read, 4 KiB, psync x 8 threads"
    if tr:
        c, lk, own = tr["passes"]["disk, cold"], tr["lookup_cold"], tr.get("fio_on_table", {})
        cold.append((f"{args.table_gib:.3g} GiB table, cold training steps", c["rows_read"], c["read_seconds"],
                     c["rows_per_s_reading"], c["rows_per_s_of_steps"], own))
        cold.append((f"{args.table_gib:.3g} GiB table, cold lookups only", lk["rows_read"], lk["seconds"],
                     lk["rows_per_s"], lk["rows_per_s"], own))
    if rl:
        c, lk, own = rl["cold"], rl["lookup_cold"], rl.get("fio_on_table", {})
        cold.append((f"real table, first {c['steps']} training steps", c["rows_read"], c["read_seconds"],
                     c["rows_per_s_reading"], c["rows_per_s_of_steps"], own))
        cold.append(("real table, cold lookups only", lk["rows_read"], lk["seconds"], lk["rows_per_s"],
                     lk["rows_per_s"], own))
    if cold:
        psync = jobs.get(psync_name, {}).get("iops")
        L += ["### Cold reads: rows read from the files per second against fio's random 4 KiB reads", "",
              "| pass | rows read | seconds reading | rows/s (reading) | rows/s (whole steps) | fio on the table's "
              "files: qd 1 / qd 32 / psync x 8 IOPS | / fio psync x 8 there | / fio psync x 8 on fio's file |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, n, sec, rate, rate_steps, own in cold:
            there = " / ".join(f"{own[k]['iops']:,.0f}" for k in TABLE_JOBS if k in own)
            vs_own = f"{rate / own[psync_name]['iops']:.2f}" if psync_name in own else ""
            vs = f"{rate / psync:.2f}" if psync else ""
            L.append(f"| {name} | {n:,} | {sec:.2f} | {rate:,.0f} | {rate_steps:,.0f} | {there} | {vs_own} | {vs} |")
        ref = {k: jobs[k]["iops"] for k in jobs if k.startswith("rand read")}
        if ref:
            L += ["", f"fio random 4 KiB reads on its own {fio['file_bytes'] / 2**30:g} GiB file, just written (a "
                  "cache below this machine may hold it), same run: " + ", ".join(
                      f"{k.removeprefix('rand read, 4 KiB, ')} {v:,.0f} IOPS" for k, v in ref.items()) + "."]
        L.append("")
    for key in ("profile_disk", "profile_memory"):
        if tr and key in tr:
            L += [f"### cProfile, {args.profile} warm steps, {key.removeprefix('profile_')} (top by own time)", "",
                  "```", tr[key].strip(), "```", ""]
    return "\n".join(L).rstrip("\n")


# ---- main ------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="train,flush,merge", help=f"comma separated, of {','.join(PARTS)} (--real "
                    "adds real); fio runs whenever train, merge or real does")
    ap.add_argument("--real", action="store_true", help=f"part 4: the real {REAL_ROWS:,} rows, FP8 (47.7 GiB)")
    ap.add_argument("--table-gib", type=float, default=4.0, help="the table of parts 1-3, GiB in --dtype")
    ap.add_argument("--flush-small-gib", type=float, default=0.5, help="part 2's smaller table, GiB")
    ap.add_argument("--flush-rows", default="1000,10000,100000,1000000", help="part 2: rows changed, comma separated")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="the layer's and table's dtype")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (one stream)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--zipf", type=float, default=1.1, help="exponent of the token distribution")
    ap.add_argument("--cold-steps", type=int, default=10)
    ap.add_argument("--warm-steps", type=int, default=20)
    ap.add_argument("--lookup-steps", type=int, default=5, help="cold lookup-only chunks (of batch x length tokens)")
    ap.add_argument("--cache-mib", type=float, default=256.0, help="part 1's row cache (cache_bytes), MiB")
    ap.add_argument("--overlay-mib", type=float, default=1024.0, help="parts 1-2's overlay_bytes, MiB")
    ap.add_argument("--merge-rounds", type=int, default=3, help="part 3: merges timed, each between write rates")
    ap.add_argument("--real-steps", type=int, default=300)
    ap.add_argument("--real-cache-mib", type=float, default=1024.0)
    ap.add_argument("--real-overlay-mib", type=float, default=1024.0)
    ap.add_argument("--real-rows", type=int, default=REAL_ROWS, help=argparse.SUPPRESS)
    ap.add_argument("--file-gib", type=float, default=4.0, help="largest checkpoint file, GiB")
    ap.add_argument("--fio-gib", type=float, default=2.0, help="fio's file, GiB")
    ap.add_argument("--fio-seconds", type=float, default=10.0, help="each fio job's time limit")
    ap.add_argument("--no-fio", action="store_true")
    ap.add_argument("--no-memory", action="store_true", help="skip the table in memory")
    ap.add_argument("--profile", type=int, default=0, help="cProfile this many warm steps (disk and memory)")
    ap.add_argument("--dir", default=str(RESULTS), help="where the checkpoints, overlays and fio's file go")
    ap.add_argument("--keep-file", action="store_true", help="keep the checkpoints (reused by the next run)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--json", default="", help="write the results here as JSON")
    ap.add_argument("--md", default="", help="write the markdown tables here")
    ap.add_argument("--smoke", action="store_true", help="tiny: checks the script runs (every part)")
    ap.add_argument("--child-real", default="", help=argparse.SUPPRESS)
    ap.add_argument("--smoke-config", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child_real:
        args.real_path, args.smoke = args.child_real, args.smoke_config
        print(json.dumps(real_child(args)))
        return 0
    parts = [p.strip() for p in args.parts.split(",") if p.strip()] + (["real"] if args.real else [])
    if args.smoke:
        parts = list(PARTS)
        args.hidden, args.batch, args.length, args.cold_steps, args.warm_steps = 64, 2, 32, 2, 2
        args.table_gib, args.flush_small_gib, args.flush_rows = 60_000 * 320 / 2**30, 20_000 * 320 / 2**30, "100,1000"
        args.cache_mib, args.overlay_mib, args.lookup_steps, args.profile = 1.0, 1.0, 2, 1
        args.merge_rounds = 1
        args.real_rows, args.real_steps, args.real_cache_mib, args.real_overlay_mib = 100_000, 6, 1.0, 0.0625
        args.fio_gib, args.fio_seconds = 1 / 64, 1.0
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {bad}; expected some of {', '.join(PARTS)}")
    args.flush_rows = [int(float(x)) for x in args.flush_rows.split(",") if x.strip()]
    dtype = DTYPES[args.dtype]
    print(NOTE.format(cpus=os.cpu_count(), mem=bdt.memory_bytes() / 2**30, threads=args.threads), flush=True)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "child_real"}, "parts": parts,
                           "machine": {"cpus": os.cpu_count(), "memory_bytes": bdt.memory_bytes()}}
    made: list[Path] = []
    t_start = time.perf_counter()
    try:
        if not args.no_fio and {"train", "merge", "real"} & set(parts):
            res["fio"] = fio_part(args)
        main_cfg = config_for(rows_for(args.table_gib, dtype), args.hidden, args.smoke)
        path = Path(args.dir)                                    # set below where a part needs the checkpoint
        if {"train", "flush", "merge"} & set(parts):
            path, res["write"] = ensure_checkpoint(args, main_cfg, args.dtype)
            made.append(path)
        if "train" in parts or "merge" in parts:
            res["train"] = {}
            train_part(args, main_cfg, path, dtype, res["train"])
            if not args.no_fio:
                res["train"]["fio_on_table"] = fio_on_table(args, res.get("fio", {}),
                                                            sorted(path.glob("*.safetensors")))
            print(f"train part done at {time.perf_counter() - t_start:.0f} s", flush=True)
        if "merge" in parts:
            res["merge"] = merge_part(args, path, Path(res["train"]["overlay_dir"]), dtype)
        if "train" in res:
            shutil.rmtree(res["train"]["overlay_dir"], ignore_errors=True)
        real_path = Path(args.dir)                               # set below where the real part runs
        if "real" in parts:
            real_cfg = config_for(args.real_rows, args.hidden, args.smoke)
            real_path, res["write_real"] = ensure_checkpoint(args, real_cfg, "fp8")
            made.append(real_path)
        if "flush" in parts:
            small_cfg = config_for(rows_for(args.flush_small_gib, dtype), args.hidden, args.smoke)
            small, _ = ensure_checkpoint(args, small_cfg, args.dtype)
            made.append(small)
            tables = [(f"{args.flush_small_gib:.3g} GiB", small, hash_params(small_cfg, 0).num_rows),
                      (f"{args.table_gib:.3g} GiB", path, hash_params(main_cfg, 0).num_rows)]
            if "real" in parts:
                tables.append(("real, FP8", real_path, hash_params(real_cfg, 0).num_rows))
            res["flush"] = flush_part(args, tables, dtype)
        if "real" in parts:
            res["real"] = real_part(args, real_path)
            if not args.no_fio:
                res["real"]["fio_on_table"] = fio_on_table(args, res.get("fio", {}),
                                                           sorted(real_path.glob("*.safetensors")))
    finally:
        for p in [Path(args.dir) / n for n in ("overlay-train", "overlay-flush", "overlay-real", "merged")]:
            shutil.rmtree(p, ignore_errors=True)
        if not args.keep_file:
            for p in made:
                shutil.rmtree(p, ignore_errors=True)
    res["seconds"] = time.perf_counter() - t_start
    md = report(args, res)
    print()
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    if args.md:
        Path(args.md).write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
