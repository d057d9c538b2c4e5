"""The benchmark scripts run end to end on tiny shapes, so they cannot rot; the GPU report's writer keeps its format."""

from __future__ import annotations

import csv
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
MODULES = ("common", "bench_conv", "bench_gate", "bench_ngram", "bench_step", "bench_layer", "bench_decode_cpu",
           "bench_layer_cpu", "bench_sequence_parallel", "run_all")
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture
def run_all(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    for name in MODULES:
        sys.modules.pop(name, None)
    import run_all

    return run_all


@pytest.mark.deep           # ~25 s; the quick tier runs bench_layer_cpu's smoke (below)
@pytest.mark.interpreter
def test_benchmarks_smoke_and_the_report(run_all, tmp_path):
    """``run_all.py --gpu-report --smoke``: every benchmark on tiny shapes, rows to the CSV, the report written."""
    out = tmp_path / "results.csv"
    assert run_all.main(["--gpu-report", "--smoke", "--out", str(tmp_path), "--dtype", "float32", "--repeats", "1",
                         "--no-compile", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    benchmarks = {r["benchmark"] for r in rows}
    assert {"ngram_ids", "ngram_embedding", "ple_gate", "ple_conv", "dilated_causal_conv",
            "layer_step", "layer_forward_backward", "layer", "layer_step_host", "decode_cpu"} <= benchmarks
    assert any(r["case"].startswith("fwd+bwd") for r in rows if r["benchmark"] == "ple_gate")
    timed = [r for r in rows if r["benchmark"] not in ("layer_step_host", "decode_cpu")]
    for r in timed:
        assert float(r["ms"]) > 0 and float(r["copy_gbps"]) > 0
        assert r["variant"] in {"triton", "reference", "fused", "transformers"}, r["variant"]
    variants = {(r["benchmark"], r["case"]): set() for r in timed}
    for r in timed:
        variants[(r["benchmark"], r["case"])].add(r["variant"])
    assert all({"triton", "reference"} <= v for v in variants.values()), variants

    # the layer benchmark: three modes, the anchor beside ple where transformers is installed
    layer = {r["case"].split()[0]: set() for r in rows if r["benchmark"] == "layer"}
    for r in rows:
        if r["benchmark"] == "layer":
            layer[r["case"].split()[0]].add(r["variant"])
    assert set(layer) == {"forward", "fwd+bwd", "decode"}
    want = {"reference", "triton"} | ({"transformers"} if HAS_TRANSFORMERS else set())
    assert all(v == want for v in layer.values()), layer

    # the report: one table with every row, the CSV beside it, the plot (matplotlib is in the dev extra)
    md = (tmp_path / "gpu_report.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    assert table[0].startswith("| benchmark | case | dtype | variant | ms | MB moved | GB/s | % of peak")
    assert len(table) - 1 == len(rows)
    assert "smoke run" in md and "Compiled correctness tests: **not run**" in md
    report = list(csv.DictReader((tmp_path / "gpu_report.csv").open()))
    assert len(report) == len(rows) and set(report[0]) == set(run_all.REPORT_FIELDS)
    assert (tmp_path / "gpu_report.png").exists() == HAS_MATPLOTLIB
    if HAS_TRANSFORMERS:
        assert all(r["vs_transformers"] for r in report if r["benchmark"] == "layer")


def test_layer_cpu_benchmark_smoke(run_all, tmp_path):
    """``bench_layer_cpu.py --smoke --no-compile``: the torch backend beside transformers (where installed) on
    tiny shapes, one repeat; a row per case and implementation in the CSV."""
    import bench_layer_cpu

    out = tmp_path / "rows.csv"
    rows = bench_layer_cpu.main(["--smoke", "--no-compile", "--repeats", "1", "--csv", str(out)])
    assert rows and {r["benchmark"] for r in rows} == {"layer_cpu"}
    assert {r["case"].split()[0] for r in rows} == {"forward", "fwd+bwd", "decode"}
    assert {r["variant"] for r in rows} == {"torch"} | ({"transformers"} if HAS_TRANSFORMERS else set())
    assert all(float(r["ms"]) > 0 for r in rows)
    assert len(list(csv.DictReader(out.open()))) == len(rows)


@pytest.mark.deep           # ~20 s: every part of the script on tiny tables, fio included where installed
def test_disk_training_benchmark_smoke(tmp_path, monkeypatch):
    """``bench_disk_training.py --smoke``: every part on tiny tables in one run (training from disk against the
    memory table, bit for bit; flush against rows changed; merge; the real part's child process; cold reads
    beside fio where it is installed), the tables printed, the files it made deleted."""
    monkeypatch.syspath_prepend(str(BENCH))
    for name in ("bench_disk_training", "bench_disk_table"):
        sys.modules.pop(name, None)
    import bench_disk_training

    threads = torch.get_num_threads()
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    work = tmp_path / "work"
    try:
        assert bench_disk_training.main(["--smoke", "--dir", str(work), "--json", str(out), "--md", str(md)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    train = report["train"]
    for check in (train["check_after_cold"], train["check_after_warm"]):
        assert check["bitwise_equal"] and check["overlay_rows"] == check["rows_changed_in_memory"] > 0
    assert {"disk, cold", "memory (first steps)", "disk, warm", "memory"} == set(train["passes"])
    assert train["passes"]["disk, cold"]["rows_read"] > 0 and train["lookup_cold"]["rows_read"] > 0
    flushed = {(r["table"], r["rows_changed"], r["overlay_rows_before"]) for r in report["flush"]}
    assert len(flushed) == 9 and all(r["seconds"] > 0 for r in report["flush"])
    assert all(r["bytes_written"] >= r["rows_changed"] * 320 for r in report["flush"] if not r["spilled_rows"])
    if "skipped" not in report["merge"]:
        assert report["merge"]["spot_check_equal"] and report["merge"]["bytes_out"] > 0
    real = report["real"]
    assert real["steps"] == 6 and real["flush"]["stats"]["rows"] > 0 and real["memory"]["peak_rss_anon"] > 0
    text = md.read_text()
    assert "### Training steps" in text and "**equal**" in text and "### flush()" in text
    assert "### Cold reads" in text and "### The real row count" in text
    if shutil.which("fio"):
        assert "rand read, 4 KiB, psync x 8 threads" in report["fio"]["jobs"] and "/ fio psync x 8" in text
    assert not list(work.iterdir())                                      # checkpoints, overlays, fio's file


@pytest.mark.deep           # ~10 s: three child processes
def test_analysis_benchmark_smoke(tmp_path, monkeypatch, capsys):
    """``bench_analysis.py --smoke``: ``ngram_stats`` in fresh processes at 2 and 1 threads and the plain Python
    Counter beside it (the same statistics), the table printed, a row each in the CSV."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_analysis", None)
    import bench_analysis

    out = tmp_path / "rows.csv"
    assert bench_analysis.main(["--smoke", "--csv", str(out)]) == 0
    text = capsys.readouterr().out
    assert "statistics equal to ngram_stats': True" in text and "| ple | 2 | 19,968 |" in text
    rows = list(csv.DictReader(out.open()))
    assert [(r["benchmark"], r["variant"]) for r in rows] == [("ngram_stats", "ple")] * 2 + [("ngram_stats", "counter")]
    assert all(float(r["ms"]) > 0 and int(r["bytes"]) >= 0 and float(r["vs_reference"]) > 0 for r in rows)


def _row(benchmark, case, variant, ms, nbytes, gbps, **kw):
    row = dict(date="2026-12-01T00:00:00", commit="abc1234", machine="m", device="NVIDIA H200", torch="2.13",
               triton="3.6", benchmark=benchmark, case=case, dtype="bfloat16", variant=variant, ms=f"{ms:.4f}",
               bytes=nbytes, gbps=gbps, copy_gbps="4000.0", frac_copy=f"{float(gbps) / 4000:.3f}" if gbps else "",
               vs_reference="", vs_compiled="")
    row.update(kw)
    return row


def test_report_writer_on_fake_rows(run_all, tmp_path, monkeypatch, capsys):
    rows = [_row("ple_gate", "fwd T=4096", "triton", 0.05, 120_000_000, "2400.00", vs_reference="8.00"),
            _row("ple_gate", "fwd T=4096", "reference", 0.40, 120_000_000, "300.00", vs_reference="1.00"),
            _row("layer", "decode R=64", "triton", 0.02, 60_000_000, "3000.00"),
            _row("layer", "decode R=64", "transformers", 0.30, 60_000_000, "200.00"),
            _row("layer_step_host", "decode n=1 T=1", "triton:step", 0.01, 0, "")]
    tests = dict(status="passed", summary="340 passed, 5 skipped", seconds=123.0, command="-m pytest -q")
    log = [("bench_gate", "ran", 10.0, 2), ("bench_sequence_parallel", "skipped: 3 s of the 450 s budget left", 0, 0)]
    paths = run_all.write_report(rows, tmp_path, peak_gbps=4800.0, tests=tests, log=log, seconds=400.0)
    assert set(paths) == {"md", "csv"} | ({"png"} if HAS_MATPLOTLIB else set())

    report = list(csv.DictReader(paths["csv"].open()))
    assert [r["frac_peak"] for r in report] == ["0.5000", "0.0625", "0.6250", "0.0417", ""]
    assert [r["vs_transformers"] for r in report] == ["", "", "15.00", "1.00", ""]

    md = paths["md"].read_text()
    assert "**passed**, 340 passed, 5 skipped (123 s)" in md
    assert "`bench_sequence_parallel` skipped: 3 s of the 450 s budget left" in md
    lines = md.splitlines()
    assert "| ple_gate | fwd T=4096 | bfloat16 | triton | 0.0500 | 120 | 2400.00 | 50.0 | 60.0 | 8.00 | - | - |" \
        in lines
    assert "| layer | decode R=64 | bfloat16 | triton | 0.0200 | 60 | 3000.00 | 62.5 | 75.0 | - | - | 15.00 |" in lines
    assert "| layer_step_host | decode n=1 T=1 | bfloat16 | triton:step | 0.0100 | - | - | - | - | - | - | - |" \
        in lines
    if HAS_MATPLOTLIB:
        assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the plot is drawn from the CSV alone: Triton rows only; none of them, no plot
    assert "png" not in run_all.write_report(rows[1:2], tmp_path / "none")
    # without matplotlib: a note, the table and the CSV all the same
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    capsys.readouterr()
    assert set(run_all.write_report(rows, tmp_path / "no_mpl")) == {"md", "csv"}
    assert "matplotlib is not installed" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_gpu_report_without_a_gpu_says_so(run_all, tmp_path, capsys):
    assert run_all.main(["--gpu-report", "--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_layer_benchmark_without_transformers_skips_it_cleanly(tmp_path):
    """transformers hidden (a ``sys.modules`` entry of None): a printed note, ple's rows, exit status 0."""
    out = tmp_path / "rows.csv"
    code = ("import sys; sys.modules['transformers'] = None; sys.path.insert(0, sys.argv[1]); import bench_layer; "
            "rows = bench_layer.main(['--smoke', '--dtype', 'float32', '--repeats', '1', '--modes', 'forward,decode',"
            " '--variants', 'reference,compiled,transformers,transformers_compiled', '--no-compile',"
            " '--csv', sys.argv[2]]); assert {r['variant'] for r in rows} == {'reference'}, rows")
    done = subprocess.run([sys.executable, "-c", code, str(BENCH), str(out)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "note: transformers is not installed" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    assert {r["case"].split()[0] for r in csv.DictReader(out.open())} == {"forward", "decode"}


def test_table_sharding_report_and_its_collectives(monkeypatch, capsys):
    """docs/distribution.md's per-rank table comes from the script; its collectives are those DTensor issues (gloo)."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("table_sharding_report", None)
    import table_sharding_report as report

    assert report.main(["--world", "8", "--tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "| 8 | row, replicated tokens | 11.9 GiB | 35.0 MiB | 0 B | all_reduce x1; - | 0 |" in out
    assert "| 8 | unsharded (whole table on every rank) | 95.4 GiB |" in out
    page = (BENCH.parent / "docs" / "distribution.md").read_text()
    rows = [line for line in out.splitlines() if line.startswith("|")]
    assert len(rows) == 7 and all(row in page for row in rows), rows   # the page's table is this output
    assert report.main(["--measure"]) == 0
    assert capsys.readouterr().out.count("as claimed") == 4


def test_bench_engram_smoke(monkeypatch, tmp_path):
    """``bench_engram.py --smoke``: every case runs, ple's outputs agree with the demo's (else exit 1), CSV rows."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_engram", None)
    import bench_engram

    out = tmp_path / "engram.csv"
    assert bench_engram.main(["--smoke", "--no-compile", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert {r["variant"] for r in rows} == {"torch", "demo", "gemms"}
    assert {r["case"].split()[0] for r in rows} == {"forward", "fwd+bwd", "decode"}
    assert all(float(r["ms"]) > 0 for r in rows)


def test_bench_prefill_backward_smoke(monkeypatch, tmp_path):
    """``bench_prefill_backward.py --smoke``: both widths, both variants timed, their gradients agree (else exit 1)."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_prefill_backward", None)
    import bench_prefill_backward

    out = tmp_path / "prefill.csv"
    assert bench_prefill_backward.main(["--smoke", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert {r["variant"] for r in rows} == {"blocked", "composition"}
    assert {r["case"].split()[0] for r in rows} == {"engram", "qwen4exp"}
