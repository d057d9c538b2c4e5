"""Run every benchmark at the real model's widths: ``python benchmarks/run_all.py`` (GPU).

    python benchmarks/run_all.py                       # op and layer benchmarks; rows to results/results.csv
    python benchmarks/run_all.py --smoke               # tiny shapes (the CPU smoke test)
    python benchmarks/run_all.py --table               # ... and print a Markdown table of this run's rows
    python benchmarks/run_all.py --gpu-report          # the GPU report (H200, budgeted to 8 minutes)
    python benchmarks/run_all.py --gpu-report --smoke --no-compile --dtype float32   # its CPU format check

Extra arguments go to every benchmark script.

``--gpu-report`` first runs the correctness tests that compile the Triton kernels (pytest ``-m
"interpreter or gpu"``: on a GPU the ``interpreter`` tests run the kernels compiled, and the ``gpu``
tests need CUDA), then every benchmark (``bench_gate``, ``bench_conv``, ``bench_ngram``,
``bench_step`` forward and backward, ``bench_layer``, ``bench_step --host``, ``bench_decode_cpu``,
``bench_sequence_parallel``) at the real widths, within one wall-clock budget (``--budget``,
default 450 s; the tests get at most ``--tests-budget``, default 150 s; a benchmark not started
with 20 s left is listed as skipped). Inductor compiles a graph per shape, so ``torch.compile``
variants are timed in ``bench_layer`` only, unless ``--compile-ops``. It writes to ``--out``
(default ``benchmarks/results``):

* ``gpu_report.md``: the tests' outcome, what ran, and one table: per op, case and variant the
  time, the bytes the op must move, the achieved bandwidth, its fraction of the HBM peak
  (``--peak-gbps``, default 4800: the H200's 4.8 TB/s) and of the copy bandwidth measured in the
  same run, and the ratios to the reference, to ``torch.compile`` of it and to transformers;
* ``gpu_report.csv``: the same rows (``REPORT_FIELDS``);
* ``gpu_report.png``: the bandwidth fraction of every Triton row, drawn from the CSV (skipped with
  a note where matplotlib is not installed);
* ``gpu_report_tests.log``: pytest's output.

The exit status is 0 when the tests passed (or were not run), 1 when they failed or ran out of
time; the report is written either way. Without a CUDA device ``--gpu-report`` says so and exits
with status 2, writing nothing; with ``--smoke`` it runs
on any machine, skips the tests and the sequence-parallel benchmark, runs the rest at tiny
sizes and writes the same files (the numbers then only show that the format is right).
"""

from __future__ import annotations

import argparse
import csv
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import bench_conv
import bench_gate
import bench_layer
import bench_ngram
import bench_step
import common
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
H200_PEAK_GBPS = 4800.0
REPORT_FIELDS = common.FIELDS + ["frac_peak", "vs_transformers"]
TEST_MARKS = "interpreter or gpu"
TEST_PATHS = ["tests"]
TEST_IGNORE = ["tests/test_notebooks.py", "tests/test_benchmarks.py", "tests/test_examples.py"]
MIN_LEFT_S = 20.0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--gpu-report" in argv:
        return gpu_report([a for a in argv if a != "--gpu-report"])
    table = "--table" in argv
    argv = [a for a in argv if a != "--table"]
    rows = []
    t0 = time.perf_counter()
    for module in (bench_ngram, bench_gate, bench_conv, bench_step, bench_layer):
        print(f"== {module.__name__}")
        rows += module.main(argv)
        if module in (bench_gate, bench_conv, bench_step):           # training: forward + backward
            rows += module.main(argv + ["--backward"])
    print(f"all benchmarks: {time.perf_counter() - t0:.0f} s, {len(rows)} rows")
    if table:
        print(markdown(rows))
    return 0


def markdown(rows) -> str:
    lines = ["| benchmark | case | dtype | variant | ms | GB/s | % of copy | x vs reference | x vs compiled |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        frac = f"{float(r['frac_copy']) * 100:.1f}" if r["frac_copy"] else "-"
        lines.append(f"| {r['benchmark']} | {r['case']} | {r['dtype']} | {r['variant']} | {r['ms']} | "
                     f"{r['gbps'] or '-'} | {frac} | {r['vs_reference']} | {r['vs_compiled']} |")
    return "\n".join(lines)


# ---- the GPU report ------------------------------------------------------------------------------
def report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="run_all.py --gpu-report", description="the GPU report (see the module doc)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, no tests: checks the report's format")
    p.add_argument("--out", default=str(HERE / "results"), help="folder for gpu_report.{md,csv,png}")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for tests and benchmarks together")
    p.add_argument("--tests-budget", type=float, default=150.0, help="seconds the tests may take at most")
    p.add_argument("--no-tests", action="store_true", help="skip the compiled correctness tests")
    p.add_argument("--peak-gbps", type=float, default=H200_PEAK_GBPS, help="the HBM peak the fractions are of")
    p.add_argument("--compile-ops", action="store_true",
                   help="time torch.compile of the reference in the op benchmarks too (minutes more)")
    return p


def units(smoke: bool, compile_ops: bool = False) -> list[tuple[str, object, list[str]]]:
    """``(label, module, its arguments)`` of every benchmark, in the order they run (the budget may cut the tail):
    the op benchmarks first (the bandwidth table), then the layer against transformers, then the CPU and
    sequence-parallel ones. Inductor compiles one graph per shape, which costs far more than the timing, so
    on a GPU only the layer benchmark times ``torch.compile`` variants unless ``compile_ops``, and the
    shape lists are the telling ones."""
    import bench_decode_cpu
    import bench_sequence_parallel

    if smoke:
        sizes: dict = {}
        no_compile: list[str] = []
    else:
        sizes = {bench_layer: ["--seqs", "4x4096", "--decode", "1,64,256"],
                 bench_gate: ["--tokens", "1,64,256,4096,16384"],
                 bench_conv: ["--prefill", "4096,16384", "--decode", "1,64,256", "--spec-batch", "64,256"],
                 bench_ngram: ["--tokens", "1,64,256,4096,16384"],
                 bench_step: ["--prefill", "4096,16384", "--decode", "1,64,256", "--spec-batch", "64,256"]}
        no_compile = [] if compile_ops else ["--no-compile"]
    plan = [("bench_gate", bench_gate, sizes.get(bench_gate, []) + no_compile),
            ("bench_gate --backward", bench_gate, sizes.get(bench_gate, []) + no_compile + ["--backward"]),
            ("bench_conv", bench_conv, sizes.get(bench_conv, []) + no_compile),
            ("bench_conv --backward", bench_conv, sizes.get(bench_conv, []) + no_compile + ["--backward"]),
            ("bench_ngram", bench_ngram, sizes.get(bench_ngram, []) + no_compile),
            ("bench_step", bench_step, sizes.get(bench_step, [])),
            ("bench_step --backward", bench_step, sizes.get(bench_step, []) + ["--backward"]),
            ("bench_layer", bench_layer, sizes.get(bench_layer, [])),
            ("bench_step --host", bench_step, sizes.get(bench_step, []) + ["--host"]),
            ("bench_decode_cpu", bench_decode_cpu,
             [] if smoke else ["--dtype", "bfloat16", "--threads", str(bench_decode_cpu.DEFAULT_THREADS),
                               "--budget", "3"])]
    if not smoke:                       # spawns gloo processes (CPU); its rows go to its own CSV
        plan.append(("bench_sequence_parallel", bench_sequence_parallel, ["--world-sizes", "2,4"]))
    return plan


def run_tests(budget_s: float, log_path: Path) -> dict:
    """pytest on the tests that compile the kernels: ``{"status", "summary", "seconds"}`` (output to ``log_path``)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", TEST_MARKS, *TEST_PATHS,
           *(f"--ignore={p}" for p in TEST_IGNORE)]
    command = "python " + shlex.join(cmd[1:])
    print(f"== tests: {command} (at most {budget_s:.0f} s)")
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, budget_s), check=False)
        output, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        output, rc = output + f"\n(timed out after {budget_s:.0f} s)\n", None
    seconds = time.perf_counter() - t0
    log_path.write_text(output)
    summary = test_summary(output)
    status = "timed out" if rc is None else ("passed" if rc == 0 else f"failed (exit status {rc})")
    print(f"   tests {status}: {summary} ({seconds:.0f} s)")
    return dict(status=status, summary=summary, seconds=seconds, command=command)


def test_summary(output: str) -> str:
    """pytest's closing counts (``12 passed, 3 skipped``), or what came before a timeout."""
    counts = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", output)
    if not counts:
        return "no summary"
    last: dict = {}
    for n, what in counts:                      # the summary line is the last mention of each
        last[what] = n
    return ", ".join(f"{n} {what}" for what, n in last.items())


def gpu_report(argv) -> int:
    args, rest = report_parser().parse_known_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("run_all.py --gpu-report: no CUDA device here, so there is nothing to report (the Triton kernels "
              "would run interpreted). Run it on a GPU machine, or add --smoke to check the report's format on "
              "this one.", file=sys.stderr)
        return 2
    start = time.perf_counter()
    deadline = start + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench_argv = (["--smoke"] if args.smoke else ["--repeats", "20"]) + rest
    if args.smoke or args.no_tests:
        tests = dict(status="not run", summary="--smoke" if args.smoke else "--no-tests", seconds=0.0, command="")
    else:
        tests = run_tests(min(args.tests_budget, args.budget - MIN_LEFT_S), out / "gpu_report_tests.log")
    rows, log = [], []
    for label, module, extra in units(args.smoke, args.compile_ops):
        left = deadline - time.perf_counter()
        if left < MIN_LEFT_S:
            log.append((label, f"skipped: {left:.0f} s of the {args.budget:.0f} s budget left", 0.0, 0))
            continue
        print(f"== {label}")
        t0 = time.perf_counter()
        own_parser = module.__name__ == "bench_sequence_parallel"      # takes none of the shared options
        unit_argv = extra if own_parser else bench_argv + extra
        try:
            got = module.main(unit_argv) or []
            status = "ran"
        except (Exception, SystemExit) as e:  # noqa: BLE001 - one benchmark failing must not lose the others
            got, status = [], f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            print(f"   {status}")
        if own_parser:
            status += f" (its rows: {bench_sequence_parallel_csv(unit_argv)})"
            got = []
        log.append((label, status, time.perf_counter() - t0, len(got)))
        rows += got
    total = time.perf_counter() - start
    paths = write_report(rows, out, peak_gbps=args.peak_gbps, tests=tests, log=log, seconds=total,
                         smoke=args.smoke)
    print(f"gpu report: {total:.0f} s; " + ", ".join(str(p) for p in paths.values()))
    return 0 if tests["status"] in ("passed", "not run") else 1


def bench_sequence_parallel_csv(argv) -> str:
    import bench_sequence_parallel

    return bench_sequence_parallel.parse(argv).csv or "none"


def report_rows(rows, peak_gbps: float) -> list[dict]:
    """``rows`` with ``frac_peak`` (GB/s over ``peak_gbps``) and ``vs_transformers`` (transformers' ms over this
    row's, for rows of a case that has a ``transformers`` row) added."""
    tf_ms = {(r["benchmark"], r["case"], r["dtype"]): float(r["ms"]) for r in rows if r["variant"] == "transformers"}
    out = []
    for r in rows:
        r = {k: r.get(k, "") for k in common.FIELDS}
        r["frac_peak"] = f"{float(r['gbps']) / peak_gbps:.4f}" if r["gbps"] else ""
        tf = tf_ms.get((r["benchmark"], r["case"], r["dtype"]))
        r["vs_transformers"] = f"{tf / float(r['ms']):.2f}" if tf is not None else ""
        out.append(r)
    return out


def _pct(frac: str) -> str:
    return f"{float(frac) * 100:.1f}" if frac else "-"


def report_markdown(rows, *, peak_gbps: float, tests: dict, log, seconds: float, smoke: bool) -> str:
    """The report: a header (machine, tests, what ran) and one table of ``report_rows(rows)``."""
    env = common._env()
    lines = [f"# GPU report{' (smoke run: tiny shapes, the numbers mean nothing)' if smoke else ''}", "",
             f"**{env['device']}**, commit `{env['commit']}`, {env['date']}, torch {env['torch']}, "
             f"triton {env['triton']}; {seconds:.0f} s in all.", "",
             (f"Compiled correctness tests (`{tests['command']}`): **{tests['status']}**, "
              f"{tests['summary']} ({tests['seconds']:.0f} s)." if tests.get("command") else
              f"Compiled correctness tests: **{tests['status']}** ({tests['summary']})."), "",
             "Benchmarks: " + "; ".join(f"`{label}` {status} ({s:.0f} s, {n} rows)" for label, status, s, n in log)
             + ".", "",
             f"Bytes: the least the op must move. % of peak: achieved GB/s over {peak_gbps:.0f} GB/s (HBM peak); "
             "% of copy: over a device-to-device copy timed in the same run. x vs ...: how many times faster "
             "than that variant on the same case (above 1: faster).", "",
             "| benchmark | case | dtype | variant | ms | MB moved | GB/s | % of peak | % of copy "
             "| x vs reference | x vs compiled | x vs transformers |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mb = f"{int(r['bytes']) / 1e6:.4g}" if r["bytes"] not in ("", "0", 0) else "-"
        lines.append(f"| {r['benchmark']} | {r['case']} | {r['dtype']} | {r['variant']} | {r['ms']} | {mb} "
                     f"| {r['gbps'] or '-'} | {_pct(r['frac_peak'])} | {_pct(r['frac_copy'])} "
                     f"| {r['vs_reference'] or '-'} | {r['vs_compiled'] or '-'} | {r['vs_transformers'] or '-'} |")
    return "\n".join(lines) + "\n"


def plot_report(csv_path: Path, png_path: Path, peak_gbps: float) -> str | None:
    """A bar per Triton row of the report's CSV: its fraction of the HBM peak. None (a note printed) without
    matplotlib or without such rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; gpu_report.png skipped (pip install matplotlib)")
        return None
    with csv_path.open() as fh:
        rows = [r for r in csv.DictReader(fh) if r["variant"] == "triton" and r["frac_peak"]]
    if not rows:
        print("note: no Triton rows with a bandwidth; gpu_report.png skipped")
        return None
    labels = [f"{r['benchmark']} {r['case']} {r['dtype']}" for r in rows]
    fracs = [float(r["frac_peak"]) * 100 for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) + 1.5))
    ax.barh(labels, fracs, color="C0")
    ax.axvline(80, color="C3", ls="--", lw=1, label="goal: 80 % of the peak")
    ax.set(xlabel=f"% of the HBM peak ({peak_gbps:.0f} GB/s)", xlim=(0, max(100.0, max(fracs) * 1.05)),
           title=f"Triton kernels: achieved bandwidth ({rows[0]['device']})")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return str(png_path)


def write_report(rows, out: Path, *, peak_gbps: float = H200_PEAK_GBPS, tests: dict | None = None, log=(),
                 seconds: float = 0.0, smoke: bool = False) -> dict:
    """Write ``gpu_report.md``, ``gpu_report.csv`` (overwritten) and ``gpu_report.png`` under ``out``;
    returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tests = tests or dict(status="not run", summary="-", seconds=0.0, command="")
    full = report_rows(rows, peak_gbps)
    paths = {"md": out / "gpu_report.md", "csv": out / "gpu_report.csv"}
    with paths["csv"].open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=REPORT_FIELDS)
        w.writeheader()
        w.writerows(full)
    paths["md"].write_text(report_markdown(full, peak_gbps=peak_gbps, tests=tests, log=log, seconds=seconds,
                                           smoke=smoke))
    png = plot_report(paths["csv"], out / "gpu_report.png", peak_gbps)
    if png:
        paths["png"] = Path(png)
    return paths


if __name__ == "__main__":
    sys.exit(main())
