"""Shared benchmark plumbing: timing, the device's copy bandwidth, variants, and the CSV.

Every op script measures, in one run and on the same inputs:

* ``triton``: ``ple.fast`` (compiled on CUDA; under TRITON_INTERPRET=1 on a CPU, where
  the numbers only prove the script runs),
* ``reference``: ``ple.reference``,
* ``compiled``: ``torch.compile`` of the reference (skipped with ``--no-compile``,
  reported as missing if compilation fails),

and reports the median time, the bytes the op must move at least, the achieved
GB/s and its fraction of the device's copy bandwidth (a plain ``copy_`` of a large
buffer timed in the same run), and the ratios between variants. Rows are appended
to ``benchmarks/results/results.csv`` with the machine, library versions and git
commit.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():          # before anything imports Triton: run kernels interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

RESULTS = Path(__file__).resolve().parent / "results" / "results.csv"
FIELDS = ["date", "commit", "machine", "device", "torch", "triton", "benchmark", "case", "dtype", "variant",
          "ms", "bytes", "gbps", "copy_gbps", "frac_copy", "vs_reference", "vs_compiled"]


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few repeats: checks the script runs")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 50, smoke 2)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    p.add_argument("--variants", default="triton,reference,compiled",
                   help="comma-separated subset of triton,reference,compiled")
    p.add_argument("--csv", default=str(RESULTS), help="CSV to append rows to ('' for none)")
    p.add_argument("--backward", action="store_true", help="time forward + backward (ops with autograd)")
    return p


def setup(args) -> tuple[torch.device, torch.dtype, int]:
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu" and dtype != torch.float32 and not args.smoke:
        print("note: no CUDA device; the Triton interpreter is slow, use --smoke on a CPU")
    repeats = args.repeats or (2 if args.smoke else 50)
    return device, dtype, repeats


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(fn, device: torch.device, repeats: int, warmup: int = 3, *, wall: bool = False) -> float:
    """Median milliseconds of ``fn()`` after ``warmup`` calls: CUDA events on a GPU, perf_counter on a CPU.
    ``wall``: perf_counter on a GPU too, the device synchronised before and after each call (the time a
    host waits, e.g. across processes)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda" and not wall:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def column_medians(fn, repeats: int, warmup: int = 2) -> list[float]:
    """``fn()`` returns a tuple of times (it times its own parts): the median of each, over ``repeats`` calls
    after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = [fn() for _ in range(repeats)]
    return [statistics.median(col) for col in zip(*times)]


_COPY_GBPS: dict = {}


def copy_bandwidth(device: torch.device, repeats: int, nbytes: int | None = None) -> float:
    """GB/s of a device-to-device ``copy_`` (read + write counted), measured once per process."""
    if device in _COPY_GBPS:
        return _COPY_GBPS[device]
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 24)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device, max(repeats, 3))
    _COPY_GBPS[device] = 2 * nbytes / (ms * 1e-3) / 1e9
    return _COPY_GBPS[device]


def allow_recompiles(limit: int = 64) -> None:
    """Let dynamo keep ``limit`` graphs per function (default 8): each benchmarked shape compiles its own
    (``dynamic=False``), and past the limit dynamo would silently run the function eagerly."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, limit)


def maybe_compile(fn, args):
    """``torch.compile(fn)`` or None when disabled / unavailable."""
    if args.no_compile or "compiled" not in args.variants.split(","):
        return None
    try:
        allow_recompiles()
        return torch.compile(fn, dynamic=False)
    except Exception as e:  # noqa: BLE001 - report, do not abort the benchmark
        print(f"torch.compile unavailable: {type(e).__name__}: {e}")
        return None


def with_backward(args, call, inputs, grads):
    """A zero-arg callable: ``call()`` and, with ``--backward``, the gradients of what it returns (``grads``
    flowing in) with respect to ``inputs``."""
    def f():
        out = call()
        if args.backward:
            torch.autograd.grad(out, inputs, grads)
    return f


def op_variants(args, run, fast_op, ref_op) -> dict:
    """The variants of an op script, for `run_case`: ``run(op)`` (a zero-arg callable) of ``ple.fast``'s op,
    of the reference's, and of `maybe_compile` of the reference (None when that is off)."""
    compiled = maybe_compile(ref_op, args)
    return dict(triton=run(fast_op), reference=run(ref_op), compiled=run(compiled) if compiled else None)


def _env() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = ""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor()})"
    return dict(date=_dt.datetime.now().isoformat(timespec="seconds"), commit=commit,
                machine=platform.node(), device=device, torch=torch.__version__, triton=triton_version)


def run_case(args, benchmark: str, case: str, dtype: torch.dtype, device: torch.device, repeats: int,
             variants: dict, nbytes: int, warmup: int | None = None) -> list[dict]:
    """Time each variant (name -> zero-arg callable, or None to skip), print and record a row each.

    ``warmup`` calls precede the timed ones (default three, one with ``--smoke``)."""
    wanted = args.variants.split(",")
    copy = copy_bandwidth(device, repeats)
    times = {}
    for name, fn in variants.items():
        if fn is None or name not in wanted:
            continue
        try:
            times[name] = bench(fn, device, repeats, warmup=(1 if args.smoke else 3) if warmup is None else warmup)
        except Exception as e:  # noqa: BLE001 - e.g. torch.compile failing at first call
            if os.environ.get("PLE_BENCH_DEBUG"):
                raise
            print(f"  {case:28s} {name:10s} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    rows = []
    env = _env()
    for name, ms in times.items():
        gbps = nbytes / (ms * 1e-3) / 1e9
        row = dict(env, benchmark=benchmark, case=case, dtype=str(dtype).replace("torch.", ""), variant=name,
                   ms=f"{ms:.4f}", bytes=nbytes, gbps=f"{gbps:.2f}", copy_gbps=f"{copy:.1f}",
                   frac_copy=f"{gbps / copy:.3f}",
                   vs_reference=f"{times['reference'] / ms:.2f}" if "reference" in times else "",
                   vs_compiled=f"{times['compiled'] / ms:.2f}" if "compiled" in times else "")
        rows.append(row)
        print(f"  {case:28s} {name:10s} {ms:10.4f} ms {gbps:9.1f} GB/s ({gbps / copy:6.1%} of copy)"
              f"  x{row['vs_reference'] or '-':>6} vs ref  x{row['vs_compiled'] or '-':>6} vs compiled")
    if args.csv:
        append_csv(args.csv, rows, FIELDS)
    return rows


def append_csv(path, rows: list[dict], fields: list[str]) -> None:
    """Append ``rows`` to the CSV at ``path`` (header written when the file is new)."""
    if not rows:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        if new:
            w.writeheader()
        w.writerows(rows)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden-size", type=int, default=2560, help="H (default: the real model's 2560)")
    p.add_argument("--hc-count", type=int, default=4, help="M; C = M * H (default 4, C = 10240)")
    p.add_argument("--embed-dim", type=int, default=2560, help="E (default 2560)")
    p.add_argument("--table-base", type=int, default=1_000_000,
                   help="ngram_vocab_size_base: rows per head (default 1e6, a 5 GB bf16 table; the model's is 2e7)")


TOKENS = ("1,64,256,512,4096,16384", "1,9", "token counts")      # the op scripts' --tokens, for `script`


def script(doc: str, argv, sizes: dict, options=None):
    """The start of an op or layer script: its command line (`parser`'s options, `add_model_args`, ``sizes``
    and what ``options(p)`` adds), then `setup` and `model_config`. ``sizes``: ``{"--flag": (default, smoke,
    help)}``, the value typed as the default is and replaced by ``smoke`` under ``--smoke``.
    Returns (args, device, dtype, repeats, cfg)."""
    p = parser(doc.splitlines()[0])
    add_model_args(p)
    for flag, (default, _, text) in sizes.items():
        p.add_argument(flag, type=type(default), default=default, help=text)
    if options is not None:
        options(p)
    args = p.parse_args(argv)
    device, dtype, repeats = setup(args)
    cfg = model_config(args)
    if args.smoke:
        for flag, (_, smoke, _) in sizes.items():
            setattr(args, flag[2:].replace("-", "_"), smoke)
    return args, device, dtype, repeats, cfg


def model_config(args):
    """The real model's widths (or tiny ones with --smoke), as a PLEConfig."""
    import ple

    if args.smoke:
        return ple.PLEConfig.preset("tiny")
    return ple.PLEConfig.preset("qwen4exp", hidden_size=args.hidden_size, hc_count=args.hc_count,
                                ple_embed_dim=args.embed_dim, ngram_vocab_size_base=args.table_base)


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]
