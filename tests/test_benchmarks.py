"""The benchmark scripts run end to end on tiny shapes, so they cannot rot."""

from __future__ import annotations

import csv
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.interpreter
def test_benchmarks_smoke(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    for name in ("common", "bench_conv", "bench_gate", "bench_ngram", "bench_step", "run_all"):
        sys.modules.pop(name, None)
    import run_all

    out = tmp_path / "results.csv"
    assert run_all.main(["--smoke", "--dtype", "float32", "--repeats", "1", "--no-compile",
                         "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    benchmarks = {r["benchmark"] for r in rows}
    assert {"ngram_ids", "ngram_embedding", "ple_gate", "ple_conv", "dilated_causal_conv",
            "layer_step", "layer_forward_backward"} <= benchmarks
    assert any(r["case"].startswith("fwd+bwd") for r in rows if r["benchmark"] == "ple_gate")
    for r in rows:
        assert float(r["ms"]) > 0 and float(r["copy_gbps"]) > 0
        assert r["variant"] in {"triton", "reference", "fused"}
    variants = {(r["benchmark"], r["case"]): set() for r in rows}
    for r in rows:
        variants[(r["benchmark"], r["case"])].add(r["variant"])
    assert all({"triton", "reference"} <= v for v in variants.values()), variants
