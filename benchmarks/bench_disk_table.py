"""The table served from disk (``load_layer(..., offload="disk")``) against the table in memory.

Writes a one-layer checkpoint at the real model's widths (D = 160, NH = 16; H = 2560, M = 4) with
a table of ``--rows`` rows (``--real``: the model's 320,001,536) in ``--table-dtype`` (``fp8``, the
default, ``bfloat16`` or ``nf4``: 160, 320 or 84 bytes a row), sharded as the model's is (128 shards)
over files of at most ``--file-gib``, with the write speed measured; then serves token streams drawn
like text (token ids Zipfian, exponent ``--zipf``) from it:

* ``decode``: steps of ``--batch`` requests of one token each (``--batch * 16`` rows a step);
* ``prefill``: chunks of ``--chunk`` tokens of one request.

Each mode is timed on the table's lookup (``table.rows``, the n-gram ids hashed beforehand: the
part that differs between the two tables; on the ops of the ``"torch"`` backend the layers are loaded
with, ``ple.vectorized``, so NF4 rows are unpacked by ``ple.quant.dequantize_rows``, not by the
reference's step-by-step ``nf4_dequantize_rows``; FP8 and bfloat16 gathers are the same on both) and
reported as tokens/s:

* ``memory``: the table read into memory (``load_layer(path)``), when it fits (``--no-memory``
  skips it; it is skipped anyway when the table is more than 60 % of the machine's memory);
* ``disk, cold``: the first stream after the files' pages were dropped from the page cache
  (``DiskTable.drop_page_cache``: ``posix_fadvise(DONTNEED)``, allowed without privileges; the
  kernel may keep some) and the row cache emptied;
* ``disk, warm``: then a new stream of the same distribution (new tokens: its hot n-grams are in
  the row cache, its tail is not) with the whole file read into the page cache first, when it
  fits the machine (60 % of its memory): misses are copies from the page cache;
* ``disk, after cold``: where the file does not fit, the new stream right after the cold one:
  the page cache holds what the machine can of what was read, the state of a server that has
  run for a while;
* ``disk, again``: that stream once more: its rows are in the row cache as far as it holds them,
  the rest in pages this process has mapped already (the floor of the disk table's overhead).
  ``memory`` and ``disk, again`` are timed step by step, interleaved, the fastest of 3 runs of each
  step (this machine's two cores are shared); ``cold`` and ``warm`` happen once and are timed once.

A row's first read from a page that is in the page cache but not yet mapped by the process is a
minor page fault (about 2.5 us on this virtual machine), so ``warm`` is slower than ``again``.

With the row cache's hit rate (`DiskTable.stats`), the hit rate an exact LRU cache of the same
capacity would have had on the same lookups, and the bytes read per token. The disk table's rows
are compared with the memory table's bit for bit on 40 steps of each stream when both are loaded;
at any size, a sample of rows is compared with a plain read of the file (``os.pread``). The
memory table is loaded after the disk passes (so the anonymous memory the disk layer adds,
RssAnon, is measured alone). ``--layer`` also times whole
``layer.step`` calls on the ``"torch"`` backend (projections, gate, conv; rows prefetched with
``start_prefetch`` just before each step, so nothing overlaps them here; 10 decode and 3 prefill
steps), where the lookup is a small part of a CPU step.

``--table-dtypes bfloat16,fp8,nf4`` measures several table dtypes side by side in one run: one checkpoint
each, the same token streams for all; each table's cold, warm (or after cold) and again passes one table after
the other (its files' pages dropped before each cold pass), then ``memory`` and ``disk, again`` of every table
timed step by step, interleaved across all of them (the in-memory tables loaded together where they fit 60 %
of the machine's memory); a table per dtype as above, then tokens/s side by side with the ratios of NF4
(else the last dtype listed) to the others, and the bytes read from the files per token.

    python benchmarks/bench_disk_table.py --rows 26_843_520              # a 4 GiB FP8 table
    python benchmarks/bench_disk_table.py --rows 6_710_880 --table-dtypes bfloat16,fp8,nf4
    python benchmarks/bench_disk_table.py --real --no-memory --keep-file # 48 GiB on disk
    python benchmarks/bench_disk_table.py --smoke
    python benchmarks/bench_disk_table.py --rows 13_421_760 --cold-reads 4096   # 2 GiB FP8: cold reads vs fio

``--cold-reads ROWS`` measures only the cold reads: per table, ``--cold-rounds`` rounds of fio's random 4 KiB
reads at queue depth 32 on the table's own files (5 s, direct I/O where allowed), then 6 gathers of ROWS distinct
random rows, the files' pages dropped before each (no row cache); rows/s against fio's IOPS, and the growth of
the process's mapped file pages (RssFile) over the gathers.

The checkpoint goes to ``--dir`` (default ``$TMPDIR/ple_bench_disk_table``; the cold numbers are
those of that disk) and is deleted at the
end unless ``--keep-file``; an existing one of the same shape and dtype is reused.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import ple.io as pio
from ple import PLEConfig, reference, vectorized
from ple.io.disk_table.table import DiskTable
from ple.io.files import Entry, write_files
from ple.io.layout import SHARD, TABLE_SCALE, shard_rows
from ple.io.load import CONFIG_METADATA_KEY
from ple.io.save import tensor_entry
from ple.layer import PLELayer
from ple.quant import SCHEMES, fp8_scale, nf4_pack
from ple.reference.hashing import hash_params
from ple.state import Decode, PLECache, Prefill
from ple.table import QuantizedTable

REAL_ROWS = 320_001_536
RESULTS = Path(tempfile.gettempdir()) / "ple_bench_disk_table"
TABLE_DTYPES = {"fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16, "nf4": torch.uint8}   # NF4: packed rows


def config_for_rows(rows: int, smoke: bool) -> PLEConfig:
    """The real model's config with ``ngram_vocab_size_base`` set for about ``rows`` rows (exact at the real
    count); the smoke run shrinks the widths too."""
    real = PLEConfig.preset("qwen4exp")
    if rows == REAL_ROWS:
        return real
    base = max(rows // real.num_ngram_heads, 8)
    kw = dict(hidden_size=64, hc_count=1, vocab_size=5000, eos_token_id=0) if smoke else {}
    return PLEConfig(**{**real.to_dict(), "ngram_vocab_size_base": base, **kw})


def _kib_field(path: str, name: str) -> int:
    """Bytes of the ``name:`` line (in kB) of a /proc file; 0 where there is none."""
    with open(path) as fh:
        for line in fh:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_anon() -> int:
    """This process's anonymous resident memory (its own; the page cache of mapped files is not in it)."""
    return _kib_field("/proc/self/status", "RssAnon")


def memory_bytes() -> int:
    return _kib_field("/proc/meminfo", "MemTotal")


# ---- the checkpoint ------------------------------------------------------------------------------------------
def stored_width(table_dtype: str, dim: int) -> int:
    """Stored elements of a row of ``dim`` values: ``dim``, or for NF4 the packed row's ``dim/2 + 4`` bytes."""
    return SCHEMES["nf4"].weight_width(dim) if table_dtype == "nf4" else dim


def row_nbytes(table_dtype: str, dim: int) -> int:
    """Bytes of a stored row (D = 160: bfloat16 320, FP8 160, NF4 84)."""
    return stored_width(table_dtype, dim) * TABLE_DTYPES[table_dtype].itemsize


def random_block(rows: int, dim: int, table_dtype: str, gen: torch.Generator) -> torch.Tensor:
    """``rows`` random stored rows (FP8: every bit pattern but NaN; bfloat16: normal(0, 1); NF4: random codes and
    a random float16 scale in [0.05, 0.55) a row, packed)."""
    if table_dtype == "fp8":
        b = torch.randint(0, 256, (rows * dim,), dtype=torch.uint8, generator=gen)
        b[(b & 0x7F) == 0x7F] ^= 1                                         # 0x7F / 0xFF are NaN
        return b.view(torch.float8_e4m3fn).view(rows, dim)
    if table_dtype == "nf4":
        codes = torch.randint(0, 16, (rows, dim), dtype=torch.uint8, generator=gen)
        return nf4_pack(codes, (0.05 + 0.5 * torch.rand(rows, generator=gen)).to(torch.float16))
    return torch.randn(rows * dim, generator=gen).to(torch.bfloat16).view(rows, dim)


def write_checkpoint(path: Path, cfg: PLEConfig, table_dtype: str, file_gib: float) -> tuple[float, int]:
    """A one-layer checkpoint with a ``table_dtype`` table: random table shards (one random block, repeated:
    writing is the cost measured), random small tensors. Returns (seconds, bytes)."""
    p = hash_params(cfg, 0)
    D = cfg.ngram_head_dim
    dtype, width = TABLE_DTYPES[table_dtype], stored_width(table_dtype, D)
    # The small tensors of a random layer (its table on the meta device: written below, block by block).
    small = PLELayer(cfg, 0, dtype=torch.bfloat16, table=QuantizedTable.empty(p.num_rows, D, "fp8", device="meta"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in small.named_parameters():
            t.copy_((torch.randn(t.shape, generator=gen) * (t.shape[-1] ** -0.5 if "proj" in name else 0.3)
                     ).to(t.dtype))
    rows_per_block = (64 << 20) // row_nbytes(table_dtype, D)
    block = random_block(rows_per_block, D, table_dtype, gen)

    def produce(a: int, b: int):
        for lo in range(a, b, rows_per_block):
            yield block[: min(rows_per_block, b - lo)]

    prefix = "model.language_model.layers.1.ple."
    entries = []
    for k, (a, b) in enumerate(shard_rows(p.num_rows, cfg.split_ngram_parts)):
        entries.append(Entry(prefix + SHARD.format(k=k), dtype, (b - a, width),
                             lambda a=a, b=b: produce(a, b)))
    if table_dtype == "fp8":
        entries.append(tensor_entry(prefix + TABLE_SCALE, fp8_scale(4.0)))
    e = small.ple_embedding
    for key, t in (("ple_embedding.layer_multipliers", e.layer_multipliers),
                   ("ple_embedding.ngram_heads_vocab_sizes", e.ngram_heads_vocab_sizes),
                   ("ple_embedding.ngram_heads_offsets", e.ngram_heads_offsets),
                   ("key_proj.weight", small.key_proj.weight), ("value_proj.weight", small.value_proj.weight),
                   ("norm_key.weight", small.norm_key.weight), ("norm_query.weight", small.norm_query.weight),
                   ("norm_conv.weight", small.norm_conv.weight), ("conv1d.weight", small.conv1d.weight)):
        entries.append(tensor_entry(prefix + key, t))
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    files = write_files(path, entries, max_file_bytes=int(file_gib * 2**30),
                        metadata={CONFIG_METADATA_KEY: json.dumps(cfg.to_dict()), "ple.only": "benchmark"})
    for f in files:                                                        # on the disk, not in the page cache
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
    return time.perf_counter() - t0, sum(f.stat().st_size for f in files)


# ---- streams ----------------------------------------------------------------------------------------------------
def zipf_tokens(cfg: PLEConfig, n: int, s: float, gen: torch.Generator) -> torch.Tensor:
    """``n`` token ids, rank r drawn with probability ~ 1 / r**s over a random permutation of the vocabulary."""
    weights = 1.0 / torch.arange(1, cfg.vocab_size + 1, dtype=torch.float64) ** s
    ranks = torch.multinomial(weights, n, replacement=True, generator=gen)
    return torch.randperm(cfg.vocab_size, generator=gen)[ranks]


def stream(cfg: PLEConfig, mode: str, steps: int, batch: int, chunk: int, s: float, seed: int) -> list[torch.Tensor]:
    """Hashed ids ``[T, NH]`` of each step: decode, ``batch`` requests one token at a time; prefill, chunks of
    ``chunk`` tokens of successive requests."""
    gen = torch.Generator().manual_seed(seed)
    params = hash_params(cfg, 0)

    def ids_of(tokens: torch.Tensor) -> torch.Tensor:
        return reference.ngram_ids(tokens, params, heads_per_ngram=cfg.heads_per_ngram,
                                   eos_token_id=cfg.eos_token_id)

    if mode == "decode":
        per_request = [ids_of(zipf_tokens(cfg, steps, s, gen)) for _ in range(batch)]      # [steps, NH] each
        return [torch.stack([r[t] for r in per_request]) for t in range(steps)]
    return [ids_of(zipf_tokens(cfg, chunk, s, gen)) for _ in range(steps)]


def time_lookups(table, steps: list[torch.Tensor]) -> float:
    """Seconds to look up every step's rows, one step after the other."""
    total = 0.0
    for ids in steps:
        t0 = time.perf_counter()
        table.rows(ids, torch.bfloat16, ops=vectorized, validate=False)
        total += time.perf_counter() - t0
    return total


def min_times(tables: list, steps: list[torch.Tensor], repeats: int = 3) -> list[list[float]]:
    """For each table, the fastest of ``repeats`` lookups of each step (the tables interleaved step by step)."""
    best = [[float("inf")] * len(steps) for _ in tables]
    for _ in range(repeats):
        for i, ids in enumerate(steps):
            for k, table in enumerate(tables):
                t0 = time.perf_counter()
                table.rows(ids, torch.bfloat16, ops=vectorized, validate=False)
                best[k][i] = min(best[k][i], time.perf_counter() - t0)
    return best


def read_through(table: DiskTable) -> None:
    """Read the table's files once, sequentially, so their pages are in the page cache."""
    buf = bytearray(64 << 20)
    for f in table.files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def spot_check(table: DiskTable, n: int, gen: torch.Generator) -> None:
    """``n`` random rows of the disk table against a plain read (``os.pread``) of the file's bytes."""
    ids = torch.randint(0, table.num_rows, (n, 1), generator=gen)
    rows = table.gather(ids)[0].view(torch.uint8).view(n, -1)
    for i, r in enumerate(ids.view(-1).tolist()):
        piece = next(p for p in table._pieces if p.start <= r < p.stop)
        nbytes = rows.shape[1]
        data = os.pread(piece.file.fd, nbytes, piece.offset + (r - piece.start) * nbytes)
        if bytes(rows[i].tolist()) != data:
            raise AssertionError(f"row {r}: the disk table's bytes differ from the file's")


def time_layer(layer: PLELayer, mode: str, cfg: PLEConfig, steps: int, batch: int, chunk: int, s: float,
               seed: int) -> float:
    """Tokens/s of ``layer.step`` (rows prefetched first), on a stream like `stream`'s."""
    gen = torch.Generator().manual_seed(seed)
    n = batch if mode == "decode" else 1
    cache = PLECache(cfg, n + 1, dtype=torch.bfloat16)
    slots = [cache.allocate() for _ in range(n)]
    step_items = []
    if mode == "decode":
        step_items.append([Prefill(sl, zipf_tokens(cfg, 4, s, gen).tolist()) for sl in slots])
        toks = zipf_tokens(cfg, steps * n, s, gen).view(steps, n).tolist()
        step_items += [[Decode(sl, t) for sl, t in zip(slots, row, strict=True)] for row in toks]
    else:
        step_items += [[Prefill(slots[0], zipf_tokens(cfg, chunk, s, gen).tolist())] for _ in range(steps + 1)]
    total, tokens = 0.0, 0
    for i, items in enumerate(step_items):
        batch_ = cache.schedule(items)
        h = torch.randn(batch_.num_tokens, cfg.hc_hidden_size, generator=gen).to(torch.bfloat16)
        t0 = time.perf_counter()
        layer.start_prefetch(batch_.input_ids, batch_.query_start_loc, batch_.ngram_context)
        with torch.no_grad():
            layer.step(h, batch_, cache)
        if i:                                                              # the first step warms up
            total += time.perf_counter() - t0
            tokens += batch_.num_tokens
    return tokens / total


def cold_reads(args, paths: dict[str, Path], served: dict[str, dict]) -> str:
    """``--cold-reads``: per table, rounds of fio (random 4 KiB reads, queue depth 32, direct I/O where the file
    system allows, else buffered with the pages dropped first) then 6 cold gathers of distinct random rows per
    read path (the files' pages dropped before each, no row cache; the paths interleaved gather by gather:
    ``ring``, the ``io_uring`` where the kernel allows it, and ``threads``, the reader threads, ``PLE_READS``);
    rows/s over the gathers' time against fio's IOPS, both summed over the rounds, the process's CPU time per
    row read (all its threads, the kernel's work for it included: the load-independent cost), and how much the
    gathers grew the process's mapped file pages (RssFile). The load average is printed with each round (a shared
    machine)."""
    from bench_disk_training import _fio, drop_files  # here: it imports this module

    from ple.io.disk_table import _uring

    modes = ["ring", "threads"] if _uring.available() else ["threads"]
    if not _uring.available():
        print(f"no io_uring here ({_uring.why_not()}): the reader threads only")
    lines = ["| table | round | load avg | fio qd 32 IOPS | "
             + " | ".join(f"{m} rows/s | / fio | CPU us/row" for m in modes)
             + " | RssFile growth |", "|---|---|---:|---:|" + "---:|---:|---:|" * len(modes) + "---:|"]
    gen = torch.Generator().manual_seed(3)
    before = os.environ.get("PLE_READS")
    for name, path in paths.items():
        table = pio.load_layer(path, offload="disk", cache_bytes=0, backend="torch").table
        assert isinstance(table, DiskTable)
        files = [Path(f) for f in table.files]
        rec = served[name]["cold_reads"] = {"rows": args.cold_reads, "rounds": [], "modes": modes}
        try:
            for r in range(args.cold_rounds):
                job = dict(rw="randread", bs="4k", iodepth=32, time_based=1, readonly=True)
                for direct, engine in ((1, "io_uring"), (1, "libaio"), (0, "io_uring")):
                    try:
                        drop_files(files)
                        iops = _fio(":".join(map(str, files)), None, 5, direct, engine, job)["iops"]
                        break
                    except RuntimeError:
                        continue
                seconds, rss = dict.fromkeys(modes, 0.0), _kib_field("/proc/self/status", "RssFile")
                cpu = dict.fromkeys(modes, 0.0)
                for _ in range(6):
                    for mode in modes:
                        os.environ["PLE_READS"] = mode
                        ids = torch.randperm(table.num_rows, generator=gen)[: args.cold_reads].view(-1, 1)
                        table.drop_page_cache()
                        t0, c0 = time.perf_counter(), time.process_time()
                        table.gather(ids)
                        seconds[mode] += time.perf_counter() - t0
                        cpu[mode] += time.process_time() - c0
                rates = {m: 6 * args.cold_reads / seconds[m] for m in modes}
                cpu_us = {m: cpu[m] / (6 * args.cold_reads) * 1e6 for m in modes}
                growth = _kib_field("/proc/self/status", "RssFile") - rss
                load = os.getloadavg()[0]
                rec["rounds"].append({"fio_iops": iops, "fio": f"direct={direct} {engine}", "load_avg": load,
                                      "rows_per_s": rates[modes[0]], "rows_per_s_by_mode": rates,
                                      "cpu_us_per_row_by_mode": cpu_us,
                                      "rss_file_growth": growth})
                lines.append(f"| {name} | {r + 1} | {load:.1f} | {iops:,.0f} | "
                             + " | ".join(f"{rates[m]:,.0f} | {rates[m] / iops:.2f} | {cpu_us[m]:.1f}" for m in modes)
                             + f" | {growth / 2**20:.1f} MiB |")
                print(lines[-1], flush=True)
        finally:
            if before is None:
                os.environ.pop("PLE_READS", None)
            else:
                os.environ["PLE_READS"] = before
        fio_sum = sum(x["fio_iops"] for x in rec["rounds"])
        ratios = {m: sum(x["rows_per_s_by_mode"][m] for x in rec["rounds"]) / fio_sum for m in modes}
        rec["ratio"], rec["ratio_by_mode"] = ratios[modes[0]], ratios
        lines.append(f"| {name} | all | | | " + " | ".join(f"| {ratios[m]:.2f} |" for m in modes) + " |")
        table.close()
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=26_843_520, help="table rows (default: a 4 GiB FP8 table)")
    ap.add_argument("--real", action="store_true", help=f"the real model's {REAL_ROWS:,} rows")
    ap.add_argument("--table-dtype", default="fp8", choices=list(TABLE_DTYPES))
    ap.add_argument("--table-dtypes", default="",
                    help="several table dtypes, comma separated (e.g. bfloat16,fp8,nf4), measured side by side in "
                         "one run (instead of --table-dtype)")
    ap.add_argument("--cache-mib", type=float, default=256.0, help="the row cache (cache_bytes), MiB")
    ap.add_argument("--batch", type=int, default=64, help="decode: requests a step (one token each)")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill: tokens a step")
    ap.add_argument("--decode-steps", type=int, default=200)
    ap.add_argument("--prefill-steps", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.1, help="exponent of the token distribution")
    ap.add_argument("--file-gib", type=float, default=4.0, help="largest checkpoint file, GiB")
    ap.add_argument("--dir", default=str(RESULTS), help="where the checkpoint is written")
    ap.add_argument("--keep-file", action="store_true", help="keep the checkpoint (reused by the next run)")
    ap.add_argument("--no-memory", action="store_true", help="skip the table in memory")
    ap.add_argument("--layer", action="store_true", help="also time layer.step (real widths: slow on a CPU)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: this shared 2-core machine)")
    ap.add_argument("--json", default="", help="write the results here as JSON")
    ap.add_argument("--smoke", action="store_true", help="tiny: checks the script runs")
    ap.add_argument("--cold-reads", type=int, default=0, metavar="ROWS",
                    help="instead of the streams: cold gathers of ROWS distinct random rows (pages dropped before "
                         "each) against fio's random 4 KiB reads at queue depth 32 on the same files")
    ap.add_argument("--cold-rounds", type=int, default=3, help="--cold-reads: rounds (fio, then 6 gathers, each)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.table_dtypes.split(",")] if args.table_dtypes else [args.table_dtype]
    unknown = [n for n in names if n not in TABLE_DTYPES]
    if unknown or len(set(names)) != len(names):
        ap.error(f"--table-dtypes: expected distinct names among {', '.join(TABLE_DTYPES)}, comma separated; "
                 f"got {args.table_dtypes!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.rows, args.decode_steps, args.prefill_steps, args.batch, args.chunk = 60_000, 6, 2, 4, 64
        args.cache_mib = 1.0
    rows = REAL_ROWS if args.real else args.rows
    cfg = config_for_rows(rows, args.smoke)
    rows = hash_params(cfg, 0).num_rows
    D = cfg.ngram_head_dim
    served = {n: {"table_dtype": n, "table_gib": rows * row_nbytes(n, D) / 2**30} for n in names}   # per dtype
    paths = {n: Path(args.dir) / f"{n}-{rows}" for n in names}
    gib = " / ".join(f"{served[n]['table_gib']:.2f}" for n in names)
    print(f"table: {rows:,} rows x {D} {' / '.join(names)}, {gib} GiB; "
          f"machine memory {memory_bytes() / 2**30:.1f} GiB; {torch.get_num_threads()} torch threads")

    out: dict = {"rows": rows, "table_dtype": names[0], "cache_mib": args.cache_mib, "batch": args.batch,
                 "chunk": args.chunk, "zipf": args.zipf}
    if len(names) > 1:
        out["table_dtype"], out["table_dtypes"], out["schemes"] = None, names, served
    try:
        for n, path in paths.items():
            marker = path / "complete.json"
            if marker.exists():
                print(f"reusing {path}")
                served[n]["write"] = json.loads(marker.read_text())
                continue
            free = shutil.disk_usage(Path(args.dir).parent if not Path(args.dir).exists() else args.dir).free
            table_bytes = rows * row_nbytes(n, D)
            if table_bytes * 1.05 > free:
                print(f"error: {table_bytes / 2**30:.1f} GiB do not fit the {free / 2**30:.1f} GiB free at {args.dir}")
                return 2
            seconds, nbytes = write_checkpoint(path, cfg, n, args.file_gib)
            served[n]["write"] = {"seconds": seconds, "bytes": nbytes, "mb_per_s": nbytes / seconds / 1e6}
            marker.write_text(json.dumps(served[n]["write"]))
            print(f"wrote {nbytes / 2**30:.2f} GiB{'' if len(names) == 1 else ' of ' + n} in {seconds:.0f} s "
                  f"({nbytes / seconds / 1e6:.0f} MB/s)")
        results = cold_reads(args, paths, served) if args.cold_reads else run(args, cfg, paths, rows, served)
    finally:
        if not args.keep_file:
            for path in paths.values():
                shutil.rmtree(path, ignore_errors=True)
    if len(names) == 1:
        out.update(served[names[0]])
    print()
    print(results)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


@dataclasses.dataclass
class Served:
    """One table dtype of the run: its layer served from disk, its sizes, its results and its JSON record."""

    name: str
    path: Path                             # its checkpoint
    disk: PLELayer
    row_bytes: int
    table_bytes: int
    second: str                            # "warm" where the file fits the machine, else "after cold"
    results: dict[str, dict[str, dict]]    # mode -> "memory" / "disk, cold" / ... -> numbers
    out: dict

    @property
    def table(self) -> DiskTable:
        table = self.disk.table
        assert isinstance(table, DiskTable)
        return table


def run(args, cfg: PLEConfig, paths: dict[str, Path], rows: int, served_out: dict[str, dict]) -> str:
    """Every table dtype's disk passes, one dtype after the other, then memory and "again" of all interleaved;
    returns the tables of results (markdown)."""
    streams = {mode: (stream(cfg, mode, steps, args.batch, args.chunk, args.zipf, seed=11),
                      stream(cfg, mode, steps, args.batch, args.chunk, args.zipf, seed=12))
               for mode, steps in (("decode", args.decode_steps), ("prefill", args.prefill_steps))}
    served = [disk_passes(args, cfg, name, path, rows, streams, served_out[name]) for name, path in paths.items()]
    memory_passes(args, cfg, served, streams)
    lines: list[str] = []
    for s in served:
        if len(served) > 1:
            lines += [f"{s.name} ({s.row_bytes} B a row, {s.table_bytes / 2**30:.2f} GiB):", ""]
        lines += scheme_lines(args, s, streams) + [""]
    if len(served) > 1:
        lines += comparison_lines(served, streams, cfg.num_ngram_heads)
    return "\n".join(lines).rstrip("\n")


def disk_passes(args, cfg: PLEConfig, name: str, path: Path, rows: int, streams: dict, out: dict) -> Served:
    """Load the ``name`` checkpoint with its table on disk; time each stream cold, then warm (or after cold),
    then again (once more, the fastest of 3 runs of each step)."""
    row_bytes = row_nbytes(name, cfg.ngram_head_dim)
    table_bytes = rows * row_bytes
    second = "warm" if table_bytes < 0.6 * memory_bytes() else "after cold"
    before = rss_anon()
    t0 = time.perf_counter()
    disk = pio.load_layer(path, offload="disk", cache_bytes=int(args.cache_mib * 2**20), backend="torch")
    out["disk_load_s"] = time.perf_counter() - t0
    table = disk.table
    assert isinstance(table, DiskTable)
    spot_check(table, 200, torch.Generator().manual_seed(1))
    print(f"disk table mapped in {out['disk_load_s']:.2f} s: {table}")
    results: dict[str, dict[str, dict]] = {mode: {} for mode in streams}
    for mode, (a, b) in streams.items():
        table.clear_cache()
        table.drop_page_cache()
        for step, steps_ in (("cold", a), (second, b), ("again", b)):
            if step == "warm":
                read_through(table)                                        # the whole file in the page cache
            table.reset_stats()
            # cold and warm happen once; "again" is repeatable: the fastest of 3 runs of each step
            sec = time_lookups(table, steps_) if step != "again" else sum(min_times([table], steps_)[0])
            st = table.stats()
            n = sum(ids.shape[0] for ids in steps_)
            results[mode][f"disk, {step}"] = {"tokens_per_s": n / sec, "ms_per_step": sec / len(steps_) * 1e3,
                                              "hit_rate": st["hit_rate"], "bytes_per_token": st["bytes_read"] / n,
                                              "stats": st}
    out["disk_rss_anon_mib"] = (rss_anon() - before) / 2**20            # lookups only, no memory table yet
    if args.layer:
        for mode in streams:
            results[mode][f"disk, {second}"]["layer_tokens_per_s"] = time_layer(
                disk, mode, cfg, LAYER_STEPS[mode](args), args.batch, args.chunk, args.zipf, 13)
    return Served(name, path, disk, row_bytes, table_bytes, second, results, out)


LAYER_STEPS = {"decode": lambda args: min(args.decode_steps, 10), "prefill": lambda args: min(args.prefill_steps, 3)}


def memory_passes(args, cfg: PLEConfig, served: list[Served], streams: dict) -> None:
    """Load the in-memory tables that fit (together, 60 % of the machine's memory; in the order given), then time
    ``memory`` and ``disk, again`` of every dtype on the same steps, interleaved step by step (this machine is
    shared): the fastest of 3 runs each. With one dtype and no memory table, the disk pass's "again" stands."""
    mem: dict[str, PLELayer] = {}
    room = 0.6 * memory_bytes()
    for s in served if not args.no_memory else ():
        if s.table_bytes >= room:
            print("the memory table does not fit this machine: skipped" if len(served) == 1 else
                  f"the {s.name} memory table does not fit this machine beside the others: skipped")
            continue
        room -= s.table_bytes
        t0 = time.perf_counter()
        mem[s.name] = pio.load_layer(s.path, backend="torch")
        s.out["memory_load_s"] = time.perf_counter() - t0
        print(f"memory table{'' if len(served) == 1 else ' ' + s.name} loaded in {s.out['memory_load_s']:.1f} s")
    if not mem and len(served) == 1:
        return
    timed = [(s, "memory", mem[s.name].table) for s in served if s.name in mem]
    timed += [(s, "disk, again", s.table) for s in served]
    for mode, (a, b) in streams.items():
        for layer in mem.values():
            time_lookups(layer.table, a)                                   # warm-up
        times = min_times([t for _, _, t in timed], b)
        n = sum(ids.shape[0] for ids in b)
        for (s, step, _), t in zip(timed, times, strict=True):
            r = s.results[mode].setdefault(step, {})
            r["tokens_per_s"], r["ms_per_step"] = n / sum(t), sum(t) / len(b) * 1e3
        for s in served:
            if s.name not in mem:
                continue
            for ids in a[:20] + b[:20]:                                    # the same rows, bit for bit
                got = s.table.rows(ids, torch.bfloat16, ops=vectorized, validate=False)
                want = mem[s.name].table.rows(ids, torch.bfloat16, ops=vectorized, validate=False)
                if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    raise AssertionError(f"the {s.name} disk table's rows differ from the memory table's")
            if args.layer:
                s.results[mode]["memory"]["layer_tokens_per_s"] = time_layer(
                    mem[s.name], mode, cfg, LAYER_STEPS[mode](args), args.batch, args.chunk, args.zipf, 13)
    mem.clear()


def scheme_lines(args, s: Served, streams: dict) -> list[str]:
    """One dtype's table: each mode and step, with the hit rates and the bytes read per token."""
    lines = ["| mode | table | lookup tokens/s | lookup ms/step | layer.step tokens/s | row-cache hit rate | "
             "exact-LRU hit rate | read from files / token |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    capacity = s.table.cache.capacity if s.table.cache is not None else 0
    for mode, (a, b) in streams.items():
        lru_rate = exact_lru_hit_rate(a, b, capacity)                       # over b after a, as the cache's
        res = s.results[mode]
        res["exact_lru_hit_rate"] = lru_rate
        order = ["memory", "disk, cold", f"disk, {s.second}", "disk, again"]
        for name in [k for k in order if k in res]:
            r = res[name]
            hit = f"{r['hit_rate']:.3f}" if "hit_rate" in r else ""
            lru = f"{lru_rate:.3f}" if name == f"disk, {s.second}" else ""
            read = f"{r['bytes_per_token'] / 1024:.2f} KiB" if "bytes_per_token" in r else ""
            layer = f"{r['layer_tokens_per_s']:,.0f}" if "layer_tokens_per_s" in r else ""
            lines.append(f"| {mode} | {name} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.2f} | {layer} | {hit} | "
                         f"{lru} | {read} |")
    s.out["modes"] = s.results
    lines.append("")
    small = sum(t.nbytes for t in s.disk.parameters())
    lines.append(f"Anonymous memory (RssAnon) the disk layer added, loaded and looked up from: "
                 f"{s.out['disk_rss_anon_mib']:.0f} MiB (its row cache {args.cache_mib:.0f} MiB, its projections, "
                 f"norms and conv {small / 2**20:.0f} MiB); the table: {s.table_bytes / 2**30:.2f} GiB.")
    return lines


def comparison_lines(served: list[Served], streams: dict, heads: int) -> list[str]:
    """Lookup tokens/s of every dtype side by side, the ratios of NF4 (else the last dtype) to the others, and the
    bytes read from the files per token; recorded in each dtype's JSON under ``"ratios"``."""
    ref = next((s for s in served if s.name == "nf4"), served[-1])
    others = [s for s in served if s is not ref]
    lines = ["| mode | table | " + " | ".join(f"{s.name} tokens/s" for s in served) + " | "
             + " | ".join(f"{ref.name} / {o.name}" for o in others) + " | "
             + " | ".join(f"{s.name} read / token" for s in served) + " |",
             "|---|---|" + "---:|" * (2 * len(served) + len(others))]
    mixed = len({s.second for s in served}) > 1
    for mode in streams:
        for step in ("memory", "disk, cold", "second", "disk, again"):
            keys = {s.name: f"disk, {s.second}" if step == "second" else step for s in served}
            got: dict[str, dict] = {s.name: s.results[mode].get(keys[s.name]) or {} for s in served}
            if not any(got.values()):
                continue
            label = keys[served[0].name] if not mixed or step != "second" else "disk, warm or after cold (*)"
            star = {s.name: " *" if mixed and step == "second" and s.second != "warm" else "" for s in served}
            speed = [f"{got[s.name]['tokens_per_s']:,.0f}{star[s.name]}" if got[s.name] else "" for s in served]
            ratios = []
            for o in others:
                x, y = got[ref.name], got[o.name]
                if x and y:
                    x.setdefault("ratios", {})[o.name] = x["tokens_per_s"] / y["tokens_per_s"]
                ratios.append(f"{x['ratios'][o.name]:.2f}" if x and y else "")
            read = [f"{got[s.name]['bytes_per_token']:,.0f} B" if "bytes_per_token" in got[s.name] else ""
                    for s in served]
            lines.append(f"| {mode} | {label} | " + " | ".join(speed + ratios + read) + " |")
    lines.append("")
    lines.append(f"A token looks up {heads} rows, read from the files where the row cache misses: " + ", ".join(
        f"{s.name} {s.row_bytes} B a row ({heads * s.row_bytes:,} B a token)" for s in served) + "."
        + (" (*) after cold: that file does not fit the machine." if mixed else ""))
    return lines


def exact_lru_hit_rate(a: list[torch.Tensor], b: list[torch.Tensor], capacity: int) -> float:
    """Hits / distinct rows of a step over the steps ``b`` of an exact LRU cache of ``capacity`` rows that saw
    ``a`` first (as the disk table's warm pass follows its cold one)."""
    if not capacity:
        return 0.0
    lru: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = total = 0
    for i, ids in enumerate(a + b):
        for r in ids.unique().tolist():
            counted = i >= len(a)
            total += counted
            if r in lru:
                hits += counted
                lru.move_to_end(r)
            else:
                lru[r] = None
                if len(lru) > capacity:
                    lru.popitem(last=False)
    return hits / total if total else 0.0


if __name__ == "__main__":
    sys.exit(main())
