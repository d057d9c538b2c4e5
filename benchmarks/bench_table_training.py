"""What training the table costs a step: row optimizers (``ple.optim``) against dense ``Adam`` and ``SparseAdam``.

A layer with the real row width (D 160, NH 16; a narrow hidden size, ``--hidden``) and a table of each of
``--rows`` rows, float32 on the CPU, trained on ``--batch`` x ``--length`` tokens a step (drawn uniformly from the
model's vocabulary, so the step's rows are spread over the table). For each table size and each way of training
the table, a fresh process (so its peak resident memory is its own) times, interleaved, steps with the table
frozen (``requires_grad=False``; the other parameters train with Adam) and steps that train it too, and reports:

* ``frozen ms``: the median frozen step; ``overhead ms``: the median extra time of the training step over the
  frozen one (forward, backward, the table's optimizer step and zero_grad all inside);
* ``peak RSS``: the process's peak resident memory (``ru_maxrss``), against the frozen process's.

Ways of training the table (``--modes``): ``adagrad`` (``ple.optim.RowwiseAdagrad``), ``adagrad-fused``
(``fused=True``), ``sgd`` (``SparseSGD``), ``adam`` (``RowwiseAdam``), ``dense-adam`` (``torch.optim.Adam`` on
the table, its dense gradient), ``sparse-adam`` (``PLELayer(sparse_table_grad=True)`` and
``torch.optim.SparseAdam``), and ``grad-only``, a breakdown: the table held by ``RowwiseAdagrad`` but its step
never taken, so the overhead is what any way of training the table pays before its update (the gradient of
the looked-up rows, ``dE = dK Wk + dV Wv``, two GEMMs of the step's tokens by the projections, and the
bookkeeping). A mode whose state would not fit ``--memory-gib`` is skipped and said so. The
targets (the adagrad overhead's growth with the rows, the ratios to ``SparseAdam`` and dense ``Adam``, the
peak memory, the overhead against the frozen step) are checked at the end (``--check`` exits 1 if one is missed).

    python benchmarks/bench_table_training.py                         # 1M, 4M and 16M rows
    python benchmarks/bench_table_training.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MODES = ("adagrad", "adagrad-fused", "sgd", "adam", "dense-adam", "sparse-adam", "grad-only")
D, NH = 160, 16


def config_for(rows: int, hidden: int):
    """A config of the real widths (D 160, NH 16) whose table has about ``rows`` rows."""
    import ple

    base = max(rows // NH, 17)
    return ple.PLEConfig.preset("qwen4exp", hidden_size=hidden, hc_count=1, ngram_vocab_size_base=base,
                                make_ngram_vocab_size_divisible_by=16, split_ngram_parts=1)


def state_bytes(mode: str, rows: int) -> int:
    """The memory a mode adds to the frozen layer: gradient and optimizer state."""
    table = rows * D * 4
    return {"adagrad": rows * 4, "adagrad-fused": rows * 4, "grad-only": rows * 4, "sgd": 0, "adam": rows * (D + 1) * 4,
            "dense-adam": 3 * table, "sparse-adam": 2 * table, "frozen": 0}[mode]


def child(args) -> dict:
    """One process: the layer, interleaved frozen and training steps, the peak memory."""
    import torch

    import ple

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = config_for(args.rows, args.hidden)
    mode = args.mode
    layer = ple.PLELayer(cfg, 0, backend="torch", dtype=torch.float32, sparse_table_grad=mode == "sparse-adam")
    table = layer.table.weight
    dense = torch.optim.Adam(ple.optim.other_parameters(layer), lr=1e-4)
    table_opt: torch.optim.Optimizer | None = None
    if mode in ("adagrad", "adagrad-fused", "grad-only"):
        table_opt = ple.optim.RowwiseAdagrad(layer, lr=1e-2, fused=mode == "adagrad-fused")
    elif mode == "sgd":
        table_opt = ple.optim.SparseSGD(layer, lr=1e-2)
    elif mode == "adam":
        table_opt = ple.optim.RowwiseAdam(layer, lr=1e-3)
    elif mode == "dense-adam":
        table_opt = torch.optim.Adam([table], lr=1e-3)
    elif mode == "sparse-adam":
        table_opt = torch.optim.SparseAdam([table], lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    C = cfg.hc_hidden_size

    def batch():
        return (torch.randn(args.batch, args.length, C, generator=gen),
                torch.randint(0, cfg.vocab_size, (args.batch, args.length), generator=gen))

    def step(train_table: bool) -> float:
        hidden, ids = batch()
        table.requires_grad_(train_table)
        t0 = time.perf_counter()
        loss = layer(hidden, ids).square().mean()
        loss.backward()
        if train_table and table_opt is not None:
            if mode != "grad-only":
                table_opt.step()
            table_opt.zero_grad()
        dense.step()
        dense.zero_grad()
        return (time.perf_counter() - t0) * 1e3

    frozen, trained = [], []
    for i in range(args.warmup + args.steps):
        f = step(False)
        t = step(True) if mode != "frozen" else f
        if i >= args.warmup:
            frozen.append(f)
            trained.append(t)
    overhead = [t - f for f, t in zip(frozen, trained, strict=True)]
    return dict(rows=table.shape[0], mode=mode, frozen_ms=statistics.median(frozen),
                trained_ms=statistics.median(trained), overhead_ms=statistics.median(overhead),
                peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, table_bytes=table.numel() * 4)


def run(args) -> list[dict]:
    results = []
    for rows in args.rows:
        for mode in ("frozen", *args.modes):
            need = rows * D * 4 + state_bytes(mode, rows)
            if need > args.memory_gib * 2**30:
                results.append(dict(rows=rows, mode=mode, skipped=f"needs about {need / 2**30:.1f} GiB"))
                print(f"rows {rows:>12,}  {mode:14s} skipped: needs about {need / 2**30:.1f} GiB", flush=True)
                continue
            cmd = [sys.executable, __file__, "--child", "--mode", mode, "--rows-one", str(rows)] + [
                f"--{k}={getattr(args, k)}" for k in ("hidden", "batch", "length", "steps", "warmup", "threads")]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode:
                raise RuntimeError(f"{mode} at {rows} rows failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(r)
            print(f"rows {r['rows']:>12,}  {mode:14s} frozen {r['frozen_ms']:8.1f} ms  overhead "
                  f"{r['overhead_ms']:8.1f} ms  peak RSS {r['peak_rss'] / 2**30:6.2f} GiB", flush=True)
    return results


def report(results: list[dict]) -> tuple[str, list[str]]:
    """A markdown table and the targets missed."""
    by = {(r["rows"] if "skipped" not in r else r["rows"], r["mode"]): r for r in results}
    lines = ["| rows | table | mode | frozen step | overhead | overhead / frozen | peak RSS | vs frozen RSS |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    frozen_of = {}
    for r in results:
        if r["mode"] == "frozen" and "skipped" not in r:
            frozen_of[r["rows"]] = r
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['rows']:,} | | {r['mode']} | | skipped: {r['skipped']} | | | |")
            continue
        fr = frozen_of.get(r["rows"])
        ratio = f"{r['overhead_ms'] / fr['frozen_ms']:.3f}" if fr and r["mode"] != "frozen" else ""
        rss = f"{r['peak_rss'] / fr['peak_rss']:.2f}x" if fr else ""
        over = f"{r['overhead_ms']:.1f} ms" if r["mode"] != "frozen" else ""
        lines.append(f"| {r['rows']:,} | {r['table_bytes'] / 2**30:.2f} GiB | {r['mode']} | {r['frozen_ms']:.1f} ms | "
                     f"{over} | {ratio} | {r['peak_rss'] / 2**30:.2f} GiB | {rss} |")
    missed = []
    sizes = sorted(frozen_of)
    ada = {n: by.get((n, "adagrad")) for n in sizes}
    if len(sizes) >= 2 and ada[sizes[0]] and ada[sizes[-1]]:
        growth = ada[sizes[-1]]["overhead_ms"] / max(ada[sizes[0]]["overhead_ms"], 1e-9)
        lines.append(f"\nadagrad overhead {sizes[0]:,} -> {sizes[-1]:,} rows: x{growth:.2f} (target <= 1.5)")
        if growth > 1.5:
            missed.append(f"overhead grows x{growth:.2f} from {sizes[0]:,} to {sizes[-1]:,} rows")
    mid = sizes[len(sizes) // 2] if sizes else None
    if mid is not None and ada.get(mid):
        a, fr = ada[mid], frozen_of[mid]
        checks = [("overhead / frozen step", a["overhead_ms"] / fr["frozen_ms"], "<=", 0.3)]
        for other, want in (("sparse-adam", 2.0), ("dense-adam", 50.0)):
            o = by.get((mid, other))
            if o and "skipped" not in o:
                checks.append((f"{other} overhead / adagrad's", o["overhead_ms"] / max(a["overhead_ms"], 1e-9),
                               ">=", want))
        checks.append(("peak RSS / frozen's", a["peak_rss"] / fr["peak_rss"], "<=", 1.1))
        for name, value, op, want in checks:
            ok = value <= want if op == "<=" else value >= want
            lines.append(f"at {mid:,} rows: {name} {value:.3f} (target {op} {want}): {'met' if ok else 'MISSED'}")
            if not ok:
                missed.append(f"at {mid:,} rows: {name} {value:.3f}, target {op} {want}")
    return "\n".join(lines), missed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1000000,4000000,16000000", help="comma-separated table sizes (about)")
    ap.add_argument("--modes", default="adagrad,adagrad-fused,grad-only,dense-adam,sparse-adam",
                    help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (one stream; default 256)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each kind (default 10)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--memory-gib", type=float, default=20.0, help="skip modes needing more (default 20)")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--smoke", action="store_true", help="tiny: checks the script runs")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="adagrad", help=argparse.SUPPRESS)
    ap.add_argument("--rows-one", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.rows = args.rows_one
        print(json.dumps(child(args)))
        return 0
    if args.smoke:
        args.rows, args.batch, args.length, args.steps, args.warmup = "2000", 1, 16, 1, 1
    args.rows = [int(float(x)) for x in args.rows.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; expected a subset of {MODES}")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    results = run(args)
    table, missed = report(results)
    print("\n" + table)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
    return 1 if args.check and missed and not args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
