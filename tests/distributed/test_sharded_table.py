"""The one sharded table (``ple.distributed.table``) on gloo, W = 2, 3 and 4: one split rule, quantized tables.

Each world size is spawned once and runs every check; each test reports one check.

* `test_shard_boundary_rows_bit_for_bit`: ids that hit every shard's first and last row (and
  so the rows next to a rank with no rows: 1 row over 2 ranks is 1/0, 4 over 3 is 2/2/0, 5 over
  4 is 2/2/1/0), for float64 (with ``-0.0`` entries), bfloat16, int8 and FP8 tables, rows and
  columns, replicated and per-rank tokens, against the unsharded table bit for bit (and the
  float table's gradient). Random ids almost never hit a shard's boundary rows.
* one split rule: a rank's rows are the same (``ple.io.layout.shard_rows``'s, ``torch.chunk``'s)
  whether the table was sharded from a whole layer, through a process group, built on
  ``meta`` and read from a checkpoint (float, int8: rank k of W reads shard k of a W-shard
  checkpoint and nothing else), or quantized first.
* quantized layers (int8 with per-row scales, FP8 with one scale), rows and columns: pieces,
  forward with replicated and per-rank tokens bit for bit, DDP leaving the table's buffers
  alone, and FP8 / int8 checkpoints read into a table built on ``meta``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _helpers import SpawnedChecks, nonzero_layers

import ple
from ple import reference
from ple.distributed import local_token_rows, parallelize_tables, shard_range
from ple.testing import spawned
from ple.testing.spawned import expect, same_bits

CONFIG = ple.PLEConfig.preset("tiny")          # C 48, NH 6, D 4, 6128 table rows (PLE index 0)
PLACEMENTS = ("row", "col")
EMPTY_RANK_ROWS = {2: 1, 3: 4, 4: 5}           # chunking leaves the last rank no rows


def make_layer(seed=0):
    """Every parameter non-zero (norms and conv too), float64, the same in every process."""
    return nonzero_layers(CONFIG, seed=seed)[0]


def mesh_of(W):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (W,))


def boundary_ids(rows: int, W: int, NH: int = 3) -> torch.Tensor:
    """``[n, NH]`` ids holding every non-empty shard's first and last row, each in every head position."""
    edges = sorted({r for k in range(W) for a, b in [shard_range(rows, W, k)] if b > a for r in (a, b - 1)})
    return torch.tensor([[edges[(i + h) % len(edges)] for h in range(NH)] for i in range(len(edges))])


def tables(rows: int, g) -> list:
    """(name, table, lookup dtype): float64 with -0.0 entries, bfloat16, int8 (row scales), FP8 (one scale)."""
    from ple.table import DenseTable, QuantizedTable

    D = CONFIG.ngram_head_dim
    out = []
    for dtype in (torch.float64, torch.bfloat16):
        t = DenseTable(rows, D, dtype=dtype)
        with torch.no_grad():
            t.weight.copy_(torch.randn(rows, D, generator=g, dtype=torch.float64).to(dtype) + 3)
            t.weight[:, 1] = -0.0                                             # a sum of zeros would lose the sign
        out.append((str(dtype), t, dtype))
    for scheme in ("int8", "fp8"):
        out.append((scheme, QuantizedTable.from_float(torch.randn(rows, D, generator=g) + 3, scheme), torch.bfloat16))
    return out


# ---- checks run inside the spawned group ---------------------------------------------------------------
def check_shard_boundary_rows(rank, W, ckpt):
    from torch.distributed.tensor.parallel import parallelize_module

    from ple.distributed import TableColwise, TableRowwise

    mesh = mesh_of(W)
    g = torch.Generator().manual_seed(3)
    for rows in (EMPTY_RANK_ROWS[W], 11):
        ids = boundary_ids(rows, W)
        mine = ids.roll(rank, 0) if rank < W - 1 or W == 2 else ids[:0]     # W > 2: the last rank has no tokens
        for name, whole, dtype in tables(rows, g):
            want = whole.rows(ids, dtype, ops=reference)
            want_mine = whole.rows(mine, dtype, ops=reference)
            for style in (TableRowwise, TableColwise):
                what = f"{rows} rows, {name}, {style.__name__}"
                t = parallelize_module(copy.deepcopy(whole), mesh, style())
                same_bits(t.rows(ids, dtype, ops=reference), want, f"{what}: replicated tokens")
                same_bits(local_token_rows(t, mine, dtype), want_mine, f"{what}: per-rank tokens")
                if not whole.quantized and dtype == torch.float64:                # the rows' gradient, too
                    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(rows), dtype=dtype)
                    whole.weight.grad = None
                    (whole.rows(ids, dtype, ops=reference) * probe).sum().backward()
                    (t.rows(ids, dtype, ops=reference) * probe).sum().backward()
                    dim = 0 if style is TableRowwise else 1
                    a, b = shard_range(whole.weight.shape[dim], W, rank)
                    piece = whole.weight.grad[a:b] if dim == 0 else whole.weight.grad[:, a:b]
                    same_bits(t.weight.grad.to_local(), piece, f"{what}: gradient")


def check_one_split_rule(rank, W, ckpt):
    """The same rows on a rank whichever entry point sharded the table: the checkpoint layout's split."""
    from torch.distributed.tensor.parallel import parallelize_module

    from ple.distributed import Comm, TableRowwise, load_table_piece_
    from ple.io import read_table_rows, shard_rows
    from ple.io.files import Checkpoint
    from ple.table import DenseTable

    full = make_layer()
    rows = full.table.num_rows
    a, b = shard_rows(rows, W)[rank]
    expect(shard_range(rows, W, rank) == (a, b), "shard_range is the checkpoint layout's split")
    chunks = torch.arange(rows).chunk(W)
    expect((chunks[rank][0].item(), chunks[rank][-1].item() + 1) == (a, b), "torch.chunk's split")
    want = full.table.weight.detach()[a:b]
    for how, group in (("a mesh", mesh_of(W)), ("a Comm", Comm()), ("the default group", None)):
        layer = parallelize_tables(copy.deepcopy(full), group, "row")
        same_bits(layer.table.weight.to_local(), want, f"sharded through {how}")

    read = []
    original = Checkpoint.read

    def spy(self, key, start=None, stop=None):
        if "ngram_embedding" in key:
            read.append((key.rsplit(".", 2)[-2], start, stop))
        return original(self, key, start, stop)

    for kind in ("float", "int8"):
        layer = ple.PLELayer(CONFIG, 0, dtype=torch.float64,
                             table=DenseTable(rows, CONFIG.ngram_head_dim, device="meta", dtype=torch.float64))
        parallelize_module(layer, mesh_of(W), {"ple_embedding.ngram_embedding": TableRowwise()})
        read.clear()
        Checkpoint.read = spy
        try:
            load_table_piece_(layer, f"{ckpt}/{kind}_{W}")
        finally:
            Checkpoint.read = original
        expect(read and set(read) == {(f"shard_{rank}", 0, b - a)},           # the rows, and their scales
               f"{kind}: rank {rank} of {W} reads shard {rank} of {W}, whole, and nothing else: got {read}")
        w, s = read_table_rows(f"{ckpt}/{kind}_{W}", CONFIG, 0)
        same_bits(layer.table.weight.to_local(), w[a:b], f"{kind}: rows read from the checkpoint")
        if kind == "int8":
            expect(layer.table.quantized and layer.table.weight.dtype == torch.int8, "an int8 table now")
            same_bits(layer.table.scale.to_local(), s[a:b], "int8: row scales read from the checkpoint")
            q = copy.deepcopy(full)
            q.ple_embedding.quantize_("int8")
            qs = parallelize_tables(q, mesh_of(W), "row")
            same_bits(qs.table.weight.to_local(), w[a:b], "a quantized whole layer, sharded")


def check_quantized_layers(rank, W, ckpt):
    """int8 / FP8 layers, rows and columns: pieces, forward bit for bit (replicated, per-rank tokens), DDP."""
    from torch.distributed.tensor import Shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = mesh_of(W)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=g)
    hidden = torch.randn(2, 9, CONFIG.hc_hidden_size, generator=g, dtype=torch.float64)
    n = 0 if rank == W - 1 else 1 + rank % 2                                  # the last rank: no tokens
    ids_k = torch.randint(0, CONFIG.vocab_size, (n, 7), generator=torch.Generator().manual_seed(rank))
    hidden_k = torch.randn(n, 7, CONFIG.hc_hidden_size, generator=torch.Generator().manual_seed(rank),
                           dtype=torch.float64)
    for scheme in ("int8", "fp8"):
        full = make_layer()
        full.ple_embedding.quantize_(scheme)
        w, s = full.table.weight, full.table.scale
        with torch.no_grad():
            want, want_k = full(hidden, ids), full(hidden_k, ids_k)
        for placement in PLACEMENTS:
            what = f"{scheme}, {placement}"
            layer = parallelize_tables(copy.deepcopy(full), mesh, placement)
            t = layer.table
            expect(t.weight.dtype == w.dtype and not t.weight.requires_grad, f"{what}: raw dtype, no gradient")
            a, b = shard_range(w.shape[0 if placement == "row" else 1], W, rank)
            same_bits(t.weight.to_local(), w[a:b] if placement == "row" else w[:, a:b], f"{what}: piece")
            same_bits(t.scale.to_local(), s[a:b] if placement == "row" and s.dim() == 2 else s, f"{what}: scale")
            with torch.no_grad():
                same_bits(layer(hidden, ids), want, f"{what}: replicated tokens")
            per_rank = parallelize_tables(copy.deepcopy(full), mesh, placement, input_layouts=Shard(0))
            with torch.no_grad():
                same_bits(per_rank(hidden_k, ids_k), want_k, f"{what}: per-rank tokens")
            h = hidden.clone().requires_grad_(True)                   # DDP: the table's buffers left alone
            full.zero_grad()
            (full(h, ids) ** 2).sum().backward()
            (DDP(layer)(hidden, ids) ** 2).sum().backward()
            spawned.close(layer.key_proj.weight.grad, full.key_proj.weight.grad, f"{what}: DDP d key_proj", 1e-12)


def check_quantized_checkpoints(rank, W, ckpt):
    """A table built on meta, filled from an int8 / FP8 checkpoint, rows and columns: pieces and outputs."""
    from ple.distributed import load_table_piece_
    from ple.io import read_table_rows
    from ple.table import DenseTable, QuantizedTable

    mesh = mesh_of(W)
    full = make_layer()
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=g)
    hidden = torch.randn(2, 9, CONFIG.hc_hidden_size, generator=g, dtype=torch.float64)
    for kind in ("int8_3", "fp8_2"):
        w, s = read_table_rows(f"{ckpt}/{kind}", CONFIG, 0)
        whole = copy.deepcopy(full)
        whole.ple_embedding.ngram_embedding = QuantizedTable(w, s)
        with torch.no_grad():
            want = whole(hidden, ids)
        for placement in PLACEMENTS:
            layer = copy.deepcopy(full)
            layer.ple_embedding.ngram_embedding = DenseTable(w.shape[0], w.shape[1], device="meta")
            parallelize_tables(layer, mesh, placement)
            load_table_piece_(layer, f"{ckpt}/{kind}", block_bytes=5000)
            t = layer.table
            a, b = shard_range(w.shape[0 if placement == "row" else 1], W, rank)
            same_bits(t.weight.to_local(), w[a:b] if placement == "row" else w[:, a:b], f"{kind} {placement}: piece")
            same_bits(t.scale.to_local(), s[a:b] if placement == "row" and s.dim() == 2 else s,
                      f"{kind} {placement}: scale")
            with torch.no_grad():
                same_bits(layer(hidden, ids), want, f"{kind} {placement}: output")


CHECKS = SpawnedChecks(check_shard_boundary_rows, check_one_split_rule, check_quantized_layers,
                       check_quantized_checkpoints, timeout=300.0, pg_timeout=60.0)


# ---- the parent side -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    from ple import io as pio

    path = tmp_path_factory.mktemp("ckpt")
    layer = make_layer()
    for W in (2, 3, 4):                                   # W shards: rank k's rows are shard k
        pio.save(layer, path / f"float_{W}", parts=W)
        pio.save(layer, path / f"int8_{W}", parts=W, table_dtype="int8", ple_only=True)
    pio.save(layer, path / "fp8_2", parts=2, table_dtype="fp8", ple_only=True, max_file_bytes=30_000)
    return str(path)


# One gloo run in the quick tier (W = 3: shards of unequal sizes, where a balanced split would differ from
# the checkpoint's chunk rule); W = 2 and 4 (a rank with no rows) in the deep tier.
WORLD_SIZES = [pytest.param(2, marks=pytest.mark.deep), 3, pytest.param(4, marks=pytest.mark.deep)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shard_boundary_rows_bit_for_bit(checkpoint_dir, world_size):
    CHECKS.report(world_size, "shard_boundary_rows", checkpoint_dir)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", [n for n in CHECKS if n != "shard_boundary_rows"])
def test_sharded_table(checkpoint_dir, world_size, name):
    CHECKS.report(world_size, name, checkpoint_dir)


def test_boundary_ids_hit_every_shard_edge():
    assert boundary_ids(5, 4).unique().tolist() == [0, 1, 2, 3, 4]          # shards [0, 2) [2, 4) [4, 5) []
    assert shard_range(5, 4, 3) == (5, 5)
    assert sorted(boundary_ids(11, 3)[:, 0].tolist()) == [0, 3, 4, 7, 8, 10]
