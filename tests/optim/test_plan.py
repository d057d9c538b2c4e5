"""``ple.optim.plan`` and ``python -m ple plan``: the bytes per rank of training the real model's table."""

from __future__ import annotations

import json

import pytest

from ple.__main__ import main
from ple.optim import plan
from ple.optim.plan import parse_bytes

REAL_ROWS, D, NH = 320_001_536, 160, 16


@pytest.mark.parametrize("rule, state_row", [("sgd", 0), ("adagrad", 4), ("adam", 4 * D + 4)])
@pytest.mark.parametrize("W", [1, 8, 16, 64])
def test_the_counts_of_the_real_table(rule, state_row, W):
    p = plan("qwen4exp", "bfloat16", rule, W, tokens=2048)
    per_rank = -(-REAL_ROWS // W)
    M = 2048 * NH
    assert (p.rows, p.dim, p.rows_per_rank, p.lookups) == (REAL_ROWS, D, per_rank, M)
    assert p.table_bytes == per_rank * D * 2
    assert p.state_bytes == per_rank * state_row
    assert p.dense_adam_state_bytes == per_rank * D * 8
    assert p.rows_sent_bytes == p.grads_received_bytes == M * D * 2
    assert p.update_bytes == 2 * M * (D * 2 + state_row)
    assert p.working_bytes == M * (8 + D * 2) + 4 * M * D * 4
    assert plan("qwen4exp", "bfloat16", rule, W, fused=True).working_bytes == 4 * M * D * 4
    assert p.fits is None and p.total_bytes == p.table_bytes + p.state_bytes + p.working_bytes


def test_fits_and_the_command_line(capsys):
    assert plan("qwen4exp", "bfloat16", "adagrad", 1, device_memory="141GB").fits is True     # 95.7 GiB
    assert plan("qwen4exp", "bfloat16", "adam", 1, device_memory="141GB").fits is False      # + 191 GiB
    assert plan("qwen4exp", "float32", "adam", 8, device_memory=80 * 2**30).fits is True
    assert main(["plan", "--rule", "adagrad", "adam", "--world-size", "1", "--device-memory", "141GB"]) == 1
    out = capsys.readouterr().out
    assert "rule adagrad, 1 rank(s)" in out and "fits 131.32 GiB per device: no" in out
    assert main(["plan", "--world-size", "8", "16", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["world_size"] for r in rows] == [8, 16] and rows[0]["fits"] is None
    assert main(["plan", "--config", "tiny", "--device-memory", "lots"]) == 2
    assert "device_memory: expected a size" in capsys.readouterr().err


def test_bad_arguments():
    with pytest.raises(ValueError, match="^table_dtype: a trained table is float"):
        plan("qwen4exp", "fp8")
    with pytest.raises(ValueError, match="^rule: "):
        plan("qwen4exp", rule="lion")
    with pytest.raises(ValueError, match="^world_size: "):
        plan("qwen4exp", world_size=0)
    with pytest.raises(TypeError, match="^config: "):
        plan(3)
    assert parse_bytes("141GB") == 141 * 10**9 and parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1e9") == 10**9
