"""The compiled-kernel report (``benchmarks/codegen.py --check``) at the model's widths: every kernel the public
fast ops launch compiles for sm_90 and meets the report's goals (no spills, >= 90 % of global bytes in 128-bit
instructions, >= 2 CTAs per SM), except the shortfalls ``WAIVERS`` lists with their reason, each still real."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the other tests compile the kernels")
def test_codegen_smoke_subset_meets_the_goals(tmp_path):
    """The quick tier's look at the compiled code: a few kernels (decode and lookup), from the report cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "codegen.py"), "--smoke", "--check", "--json",
                           str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    assert rep["smoke"] and rep["rows"] and all(r["compiled"] and r["stack"] == 0 for r in rep["rows"]), rep["rows"]


@pytest.mark.deep
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the other tests compile the kernels")
def test_codegen_report_meets_the_goals(tmp_path):
    """Capture every launch, compile it for sm_90 (fresh report cache) and check the report."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PLE_CODEGEN_CACHE"] = str(tmp_path / "cache")
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "codegen.py"), "--check", "--json", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, "\n".join(line for line in proc.stdout.splitlines() if "CHECK" in line) or \
        proc.stdout + proc.stderr

    rep = json.loads(out.read_text())
    assert rep["target"] == "cuda sm_90" and not rep["smoke"]
    rows = rep["rows"]
    assert {r["op"] for r in rows} == {"ple_conv", "export", "embedding_lookup", "ngram_ids", "ngram_embedding",
                                       "ngram_embedding_nf4", "table_update", "ple_prefill", "ple_gate",
                                       "dilated_causal_conv"}, rows
    assert all(r["compiled"] for r in rows), [r for r in rows if not r["compiled"]]
    keys = ("regs", "stack", "shared", "num_warps", "ctas_per_sm", "ld128_share", "st128_share", "grid", "tokens",
            "bytes_per_token", "min_bytes_per_token", "local_insts")
    for r in rows:
        assert all(k in r for k in keys), r
        assert 0 < r["regs"] <= 255 and 1 <= r["ctas_per_sm"] <= 32, r
        assert r["bytes_per_token"] > 0 and r["min_bytes_per_token"] > 0, r

    decode = [r for r in rows if r["kernel"] == "_step_fused_kernel"]
    assert sorted(r["grid"][0] for r in decode if "decode" in r["case"]) == [1, 1, 64, 64, 256, 256]  # R, layouts
    assert all(r["grid"][1] == 10 for r in decode)                              # C 10240 over 1024-channel blocks
    for r in decode:
        assert r["constexprs"]["K"] == 4 and r["constexprs"]["MODE"] == (1 if "decode" in r["case"] else 2), r
        if r["case"].endswith(" cl"):            # channels-last state: no local memory, 128-bit state accesses
            assert r["local_insts"] == 0 and r["stack"] == 0, r
            assert r["ld128_share"] > 0 and r["st128_share"] > 0, r
