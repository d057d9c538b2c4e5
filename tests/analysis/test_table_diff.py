"""``ple.analysis.table.table_diff``: the rows of ``b - a`` with the largest norms, against a direct dense computation;
quantized and disk tables (an overlay's rows included) read block by block in bounded memory; bad arguments."""

from __future__ import annotations

import copy
import importlib
import math

import pytest
import torch
from analysis._placements import TINY, inputs, placed, table_values

import ple
import ple.io as pio
from ple.analysis.table import TableDiff, table_diff
from ple.io.disk_table.table import DiskTable
from ple.testing.layers import random_layer

analysis_table = importlib.import_module("ple.analysis.table")


def direct(a: torch.Tensor, b: torch.Tensor, top: int) -> TableDiff:
    """The definition on two whole ``[rows, D]`` tables of one float dtype, row by row in Python."""
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    same = a.view(bits) == b.view(bits)
    norms = {}
    for r in (~same).any(dim=1).nonzero().flatten().tolist():
        d = [0.0 if same[r, j] else float(b[r, j].double()) - float(a[r, j].double()) for j in range(a.shape[1])]
        norms[r] = math.sqrt(sum(x * x for x in d))
    # largest first (NaN above every number), ties in ascending row id
    order = sorted(norms, key=lambda r: (not math.isnan(norms[r]), -norms[r] if not math.isnan(norms[r]) else 0, r))
    order = order[:top]
    return TableDiff(torch.tensor(order, dtype=torch.int64), torch.tensor([norms[r] for r in order],
                                                                         dtype=torch.float64), len(norms))


def assert_same_diff(got: TableDiff, want: TableDiff) -> None:
    assert got.changed == want.changed
    assert got.rows.dtype == torch.int64 and got.norms.dtype == torch.float64
    assert got.rows.tolist() == want.rows.tolist()
    torch.testing.assert_close(got.norms, want.norms, rtol=1e-12, atol=0, equal_nan=True)


TIES = [99, 100, 3001, 5000]                                 # one step on each: equal norms, blocks apart


def edited(layer: ple.PLELayer) -> tuple[ple.PLELayer, set[int]]:
    """A copy of a float layer with some rows changed, and those rows: random steps, ties (`TIES`), a NaN, an
    infinity, ``0.0 -> -0.0``, a row with a NaN in both and a finite step; and a NaN put in both (row 11:
    unchanged, so not counted)."""
    out = copy.deepcopy(layer)
    w = out.table.weight
    g = torch.Generator().manual_seed(7)
    special = {11, 17, 23, 29, 31, *TIES}
    rows = [r for r in torch.randperm(w.shape[0], generator=g).tolist() if r not in special][:40]
    with torch.no_grad():
        layer.table.weight[11, 2] = w[11, 2] = float("nan")
        w[rows] += (torch.randn(40, w.shape[1], generator=g) * torch.rand(40, 1, generator=g) * 3 + 0.01).to(w.dtype)
        tie = w[TIES[0]].clone()
        for r in TIES:                                      # one row's values, one step: equal norms
            layer.table.weight[r] = w[r] = tie
            w[r, 1] += 16
        layer.table.weight[17, 0] = 0.0
        w[17, 0] = -0.0
        w[23, 3] = float("nan")
        w[29, 0] = float("inf")
        layer.table.weight[31, 0] = w[31, 0] = float("nan")     # a NaN in both, and another value changed:
        w[31, 3] += 0.5                                          # the norm is that value's step
    return out, {*rows, 17, 23, 29, 31, *TIES}


@pytest.mark.parametrize("block_bytes", [8 * 4 * 37, analysis_table.BLOCK_BYTES])   # 37 rows a block, or one block
def test_equals_the_direct_computation(block_bytes, monkeypatch):
    monkeypatch.setattr(analysis_table, "BLOCK_BYTES", block_bytes)
    a = random_layer(TINY, 0, torch.float32, seed=1)
    b, changed = edited(a)
    wa, wb = a.table.weight.detach(), b.table.weight.detach()
    full = direct(wa, wb, 10**6)
    assert full.changed == len(changed) == 48 and set(full.rows.tolist()) == changed
    assert full.rows[0] == 23 and math.isnan(full.norms[0]) and full.rows[1] == 29 and math.isinf(full.norms[1])
    assert full.rows[-1] == 17 and full.norms[-1] == 0                  # -0.0 differs from 0.0, by nothing
    assert 0 < full.norms[full.rows.tolist().index(31)] < 1            # the NaN both hold does not count
    at = full.rows.tolist().index(TIES[0])
    assert full.rows[at:at + 4].tolist() == TIES and len(set(full.norms[at:at + 4].tolist())) == 1
    for top in (1, 2, 5, 45, 10**6):
        want = direct(wa, wb, top)
        assert_same_diff(table_diff(a, b, top=top), want)
        assert_same_diff(table_diff(a.table, b.table, top=top), want)       # tables, or layers
    same = table_diff(a, copy.deepcopy(a))
    assert same.changed == 0 and same.rows.numel() == 0 and same.norms.numel() == 0


@pytest.mark.parametrize("scheme", ["fp8", "int8", "nf4"])
def test_a_table_against_its_quantization(scheme):
    a = random_layer(TINY, 0, torch.bfloat16, seed=2)
    q = copy.deepcopy(a)
    q.ple_embedding.quantize_(scheme)
    va, vq = table_values(a).float(), table_values(q).float()       # exact in float32, both
    assert_same_diff(table_diff(a, q, top=25), direct(va, vq, 25))
    assert_same_diff(table_diff(q, a, top=25), direct(vq, va, 25))
    assert table_diff(q, copy.deepcopy(q)).changed == 0


@pytest.mark.parametrize("placement", ["disk", "disk-int8", "disk-nf4"])
def test_a_disk_table_is_read_in_blocks_past_its_cache(placement, tmp_path, monkeypatch):
    mem = random_layer(TINY, 0, torch.bfloat16, seed=3)
    disk = placed(mem, placement, tmp_path)
    assert isinstance(disk.table, DiskTable)
    quant = placement.partition("-")[2]
    if quant:
        mem.ple_embedding.quantize_(quant)                          # the disk table's own values, in memory
    reads = []
    real_read = DiskTable._read

    def read(self, ids):
        reads.append(ids.numel())
        return real_read(self, ids)

    monkeypatch.setattr(DiskTable, "_read", read)
    monkeypatch.setattr(analysis_table, "BLOCK_BYTES", 1024)         # 32 rows of D = 4 a block
    disk.table.reset_stats()
    assert table_diff(disk, mem).changed == 0
    assert max(reads) == 32 and sum(reads) == disk.table.num_rows
    other = random_layer(TINY, 0, torch.bfloat16, seed=4)
    want = direct(table_values(disk).float(), table_values(other).float(), 30)
    disk.table.reset_stats()
    assert_same_diff(table_diff(disk, other, top=30), want)
    assert_same_diff(table_diff(mem, other, top=30), want)
    assert disk.table.stats()["gathers"] == 0                      # the row cache is not used (nor filled)


def test_a_disk_table_trained_through_an_overlay(tmp_path):
    src = random_layer(TINY, 0, torch.bfloat16, seed=5)
    pio.save(src, tmp_path / "ckpt")
    base = pio.load_layer(tmp_path / "ckpt", offload="disk")
    overlay = dict(overlay=tmp_path / "overlay", overlay_bytes=50_000)
    with pio.load_layer(tmp_path / "ckpt", offload="disk", **overlay) as trained:
        opt = ple.optim.SparseSGD(trained, lr=0.5)
        h, ids = inputs(0, torch.bfloat16)
        trained(h, ids).float().square().sum().backward()
        opt.step()
        got = table_diff(base, trained, top=10**6)
        looked_up = set(trained.ops.ngram_ids(ids.reshape(-1), trained.ple_embedding.hash_params(),
                                              heads_per_ngram=TINY.heads_per_ngram,
                                              eos_token_id=TINY.eos_token_id,
                                              query_start_loc=torch.tensor([0, 9, 18])).flatten().tolist())
        assert 0 < got.changed <= len(looked_up) and set(got.rows.tolist()) <= looked_up
        assert_same_diff(got, direct(table_values(base).float(), table_values(trained).float(), 10**6))


# ---- errors ------------------------------------------------------------------------------------------------
def test_bad_arguments():
    a = random_layer(TINY, 0, torch.float32, seed=1)
    other = random_layer(TINY, 1, torch.float32, seed=1)               # PLE layer 1: another table size
    assert other.table.num_rows != a.table.num_rows
    with pytest.raises(ValueError, match="^b: .* rows"):
        table_diff(a, other)
    with pytest.raises(ValueError, match="^top: "):
        table_diff(a, a, top=0)
    with pytest.raises(TypeError, match="^top: "):
        table_diff(a, a, top=2.0)
    with pytest.raises(TypeError, match="^a: "):
        table_diff(a.table.weight, a)
    with pytest.raises(TypeError, match="^b: "):
        table_diff(a, "b")
