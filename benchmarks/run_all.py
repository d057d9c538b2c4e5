"""Run every benchmark at the real model's widths: ``python benchmarks/run_all.py`` (GPU, < 5 minutes).

``--smoke`` runs each on tiny shapes (the CPU smoke test). Extra arguments go to every script.
Rows are appended to ``benchmarks/results/results.csv``; ``--table`` prints a Markdown table of the
rows this run added.
"""

from __future__ import annotations

import sys
import time

import bench_conv
import bench_gate
import bench_ngram
import bench_step


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    table = "--table" in argv
    argv = [a for a in argv if a != "--table"]
    rows = []
    t0 = time.perf_counter()
    for module in (bench_ngram, bench_gate, bench_conv, bench_step):
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
        lines.append(f"| {r['benchmark']} | {r['case']} | {r['dtype']} | {r['variant']} | {r['ms']} | {r['gbps']} | "
                     f"{float(r['frac_copy']) * 100:.1f} | {r['vs_reference']} | {r['vs_compiled']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
