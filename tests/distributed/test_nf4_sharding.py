"""NF4 tables sharded by rows (``ple.distributed.table``) on gloo: W = 2 (quick tier) and W = 3 (deep tier).

Each world size is spawned once and runs every check; each test reports one check. An NF4 table's
rows are packed (``D/2 + 4`` bytes: codes and a float16 scale), so a rank holds whole packed rows,
the lookup moves packed rows (a byte-wise sum where exactly one rank holds each row's bytes) and
unpacks them after the collective. Every comparison is bit for bit against the unsharded NF4 table
or layer.

* `check_rows_bit_for_bit`: hand-made NF4 rows (random codes; float16 scales of either sign, zeros,
  subnormals, the largest) at every shard's first and last row and at random, through the reference
  unpacker and the vectorised one, float32 and bfloat16 out, replicated and per-rank tokens (a rank
  with none); each rank's piece is its ``shard_range`` of the packed rows; packed rows are what
  cross the wire (``Comm``'s count); ``placement="col"`` is refused.
* `check_layers`: an NF4 layer (float32, bfloat16) row-sharded with ``parallelize_tables``: output
  with replicated tokens, and with per-rank tokens (``reduce`` mean and sum, the last rank with no
  tokens); column sharding refused, the layer left whole.
* `check_idle_rank_joins`: serving each rank's own requests (``PLECache``), the last rank idle in a
  step and joining the lookup with ``join_table_lookup``; outputs and cache states.
* `check_checkpoints`: NF4 checkpoints (``ple.io.save(..., table_dtype="nf4", ple_only=True)``) in W
  shards and in 5 small files, read piece by piece (``load_table_piece_``) into a float table built
  on ``meta`` (it becomes an NF4 table) and into an NF4 table built on ``meta`` (zero pieces first);
  rank k of W reads shard k only; the layer's output equals ``ple.io.load_layer``'s; a
  column-sharded layer refuses the checkpoint and keeps its table.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _helpers import SpawnedChecks, own_requests_served

import ple
from ple.distributed import shard_range, shard_table_
from ple.testing.layers import random_layer
from ple.testing.spawned import expect, same_bits

CONFIG = ple.PLEConfig.preset("tiny")          # C 48, NH 6, D 4 (NF4 rows of 6 bytes), 6128 table rows
D = CONFIG.ngram_head_dim
WIDTH = D // 2 + 4
BACKENDS = ("reference", "torch")              # ple.reference's readable unpacker; ple.quant's vectorised one
OUT_DTYPES = (torch.float32, torch.bfloat16)
EMPTY_RANK_ROWS = {2: 1, 3: 4}                 # chunking leaves the last rank no rows


def nf4_layer(dtype=torch.float32, backend="reference", seed=11):
    """A tiny layer whose table is NF4, the same in every process."""
    layer = random_layer(CONFIG, 0, dtype, seed=seed, backend=backend)
    layer.ple_embedding.quantize_("nf4")
    return layer


def crafted_table(rows: int, g: torch.Generator):
    """An NF4 table of ``rows`` hand-made rows: random codes and scales of every kind (sign bits included)."""
    from ple.quant import nf4_pack
    from ple.table import QuantizedTable

    codes = torch.randint(0, 16, (rows, D), generator=g, dtype=torch.uint8)
    special = torch.tensor([-0.0, 0.0, 6e-8, -6e-8, 65504.0, -65504.0, 1.0, -0.5], dtype=torch.float16)
    drawn = torch.randn(rows, generator=g).to(torch.float16)
    scale = torch.where(torch.arange(rows) % 3 == 0, special[torch.arange(rows) % len(special)], drawn)
    return QuantizedTable(nf4_pack(codes, scale))


def mesh_of(W):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (W,))


def boundary_ids(rows: int, W: int, NH: int = 3) -> torch.Tensor:
    """``[n, NH]`` ids holding every non-empty shard's first and last row, each in every head position."""
    edges = sorted({r for k in range(W) for a, b in [shard_range(rows, W, k)] if b > a for r in (a, b - 1)})
    return torch.tensor([[edges[(i + h) % len(edges)] for h in range(NH)] for i in range(len(edges))])


def refused(fn, start: str) -> str | None:
    """None if ``fn()`` raises a ``ValueError`` whose message starts with ``start``, else what happened."""
    try:
        fn()
    except ValueError as e:
        return None if str(e).startswith(start) else f"ValueError {e}"
    return "no error"


# ---- checks run inside the spawned group ---------------------------------------------------------------
def check_rows_bit_for_bit(rank, W, ckpt):
    from ple.backends import backend_module
    from ple.distributed import Comm, local_token_rows

    mesh = mesh_of(W)
    g = torch.Generator().manual_seed(3)
    for rows in (EMPTY_RANK_ROWS[W], 11, 300):
        whole = crafted_table(rows, g)
        ids = torch.cat([boundary_ids(rows, W), torch.randint(0, rows, (5, 3), generator=g)])
        mine = ids.roll(rank, 0)[: 2 + rank] if rank < W - 1 else ids[:0]     # the last rank: no tokens
        t = shard_table_(copy.deepcopy(whole), mesh, "row")
        a, b = shard_range(rows, W, rank)
        piece = t.weight.to_local()
        same_bits(piece, whole.weight[a:b], f"{rows} rows: rank {rank}'s piece is rows [{a}, {b})")
        expect(t.dim == D and t.num_rows == rows and t._packed, f"{rows} rows: dim {t.dim}, rows {t.num_rows}")
        per_rank = shard_table_(copy.deepcopy(whole), mesh, "row", tokens="sharded")
        for backend in BACKENDS:
            ops = backend_module(backend)
            for dtype in OUT_DTYPES:
                what = f"{rows} rows, {backend}, {dtype}"
                want = whole.rows(ids, dtype, ops=ops)
                same_bits(t.rows(ids, dtype, ops=ops), want, f"{what}: replicated tokens")
                want_mine = whole.rows(mine, dtype, ops=ops)
                same_bits(local_token_rows(t, mine, dtype, ops=ops), want_mine, f"{what}: per-rank tokens")
                same_bits(per_rank.rows(mine, dtype, ops=ops), want_mine, f"{what}: tokens='sharded'")
        comm = Comm()                                   # packed rows cross the wire: D/2 + 4 bytes a row
        local_token_rows(t, mine, torch.float32, counts=[2 + k if k < W - 1 else 0 for k in range(W)], comm=comm)
        m, NH = W, ids.shape[1]                         # ids padded to the largest count: 2 + (W - 2)
        sent = comm.bytes_sent["table_rows"]
        expect(sent == (W - 1) * m * NH * WIDTH, f"{rows} rows: {sent} bytes of rows sent, expected packed rows")
    for placement in ("col", "diagonal"):
        bad = refused(lambda p=placement: shard_table_(crafted_table(4, g), mesh, p), "placement: ")
        expect(bad is None, f"placement={placement!r}: expected a ValueError naming placement, got {bad}")
    msg = ""
    try:
        shard_table_(crafted_table(4, g), mesh, "col")
    except ValueError as e:
        msg = str(e)
    expect("NF4" in msg and "placement='row'" in msg, f"col: the message should say to shard by rows: {msg!r}")


def check_layers(rank, W, ckpt):
    from torch.distributed.tensor import Shard

    from ple.distributed import parallelize_tables

    mesh = mesh_of(W)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=g)
    n = 0 if rank == W - 1 else 1 + rank % 2                                  # the last rank: no tokens
    ids_k = torch.randint(0, CONFIG.vocab_size, (n, 7), generator=torch.Generator().manual_seed(rank))
    for dtype in OUT_DTYPES:
        for backend in BACKENDS:
            what = f"{dtype}, {backend}"
            full = nf4_layer(dtype, backend)
            hidden = torch.randn(2, 9, CONFIG.hc_hidden_size, generator=g).to(dtype)
            hidden_k = torch.randn(n, 7, CONFIG.hc_hidden_size, generator=torch.Generator().manual_seed(rank)
                                   ).to(dtype)
            with torch.no_grad():
                want, want_k = full(hidden, ids), full(hidden_k, ids_k)
                layer = parallelize_tables(copy.deepcopy(full), mesh, "row")
                expect(layer.table.is_dtensor and layer.table.weight.dtype == torch.uint8, f"{what}: a DTensor")
                same_bits(layer(hidden, ids), want, f"{what}: replicated tokens")
                for reduce in ("mean", "sum"):
                    per_rank = parallelize_tables(copy.deepcopy(full), mesh, "row", input_layouts=Shard(0),
                                                  reduce=reduce)
                    same_bits(per_rank(hidden_k, ids_k), want_k, f"{what}: per-rank tokens, reduce={reduce}")
            kept = copy.deepcopy(full)
            bad = refused(lambda k=kept: parallelize_tables(k, mesh, "col"), "placement: ")
            expect(bad is None, f"{what}: column sharding: expected a ValueError naming placement, got {bad}")
            expect(not kept.table.is_dtensor and torch.equal(kept.table.weight, full.table.weight),
                   f"{what}: a refused layer keeps its whole table")


def check_idle_rank_joins(rank, W, ckpt):
    """Each rank serves its own requests from its own cache; the last rank idles in step 1 and joins the lookup."""
    from torch.distributed.tensor import Shard

    from ple.distributed import parallelize_tables

    full = nf4_layer(torch.float32)
    layer = parallelize_tables(copy.deepcopy(full), mesh_of(W), "row", input_layouts=Shard(0))
    for k, got, want in own_requests_served(layer, full, rank, W, torch.float32):
        same_bits(got, want, "cache states" if k is None else f"step {k}: output")


def check_checkpoints(rank, W, ckpt):
    """NF4 checkpoints read piece by piece into a table built on meta (float or NF4); the layer's output."""
    from ple.distributed import load_table_piece_, parallelize_tables
    from ple.io import load_layer, read_table_rows
    from ple.io.files import Checkpoint
    from ple.table import DenseTable, QuantizedTable

    mesh = mesh_of(W)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=g)
    hidden = torch.randn(2, 9, CONFIG.hc_hidden_size, generator=g)
    read: list = []
    original = Checkpoint.read

    def spy(self, key, start=None, stop=None):
        if "ngram_embedding" in key:
            read.append((key.rsplit(".", 2)[-2], start, stop))
        return original(self, key, start, stop)

    for kind in (f"nf4_{W}", "nf4_small_files"):
        path = f"{ckpt}/{kind}"
        whole = load_layer(path)
        w, s = read_table_rows(path, CONFIG, 0)
        expect(w.dtype == torch.uint8 and s is None and whole.table._packed, f"{kind}: an NF4 checkpoint")
        with torch.no_grad():
            want = whole(hidden, ids)
        a, b = shard_range(w.shape[0], W, rank)
        for start in ("float", "nf4"):
            what = f"{kind}, a {start} table on meta"
            layer = copy.deepcopy(whole)
            layer.ple_embedding.ngram_embedding = (
                DenseTable(w.shape[0], D, device="meta") if start == "float"
                else QuantizedTable.empty(w.shape[0], D, "nf4", device="meta"))
            parallelize_tables(layer, mesh, "row")
            before = layer.table
            if start == "nf4":
                piece = before.weight.to_local()
                expect(piece.dtype == torch.uint8 and piece.shape == (b - a, WIDTH) and not piece.any(),
                       f"{what}: rank {rank}'s piece made as zeros [{b - a}, {WIDTH}], got {piece.shape}")
            read.clear()
            Checkpoint.read = spy
            try:
                load_table_piece_(layer, path)
            finally:
                Checkpoint.read = original
            t = layer.table
            expect(t._packed and t.is_dtensor and t.scale is None, f"{what}: an NF4 DTensor table now")
            expect((t is before) == (start == "nf4"), f"{what}: the table is replaced exactly when not NF4")
            same_bits(t.weight.to_local(), w[a:b], f"{what}: rank {rank}'s packed rows")
            if kind == f"nf4_{W}":
                expect(set(read) == {(f"shard_{rank}", 0, b - a)},
                       f"{what}: rank {rank} of {W} reads shard {rank}, whole, and nothing else: got {read}")
            with torch.no_grad():
                same_bits(layer(hidden, ids), want, f"{what}: output")
        layer = copy.deepcopy(whole)
        layer.ple_embedding.ngram_embedding = DenseTable(w.shape[0], D, device="meta")
        parallelize_tables(layer, mesh, "col")
        before = layer.table
        bad = refused(lambda la=layer, p=path: load_table_piece_(la, p), "placement: ")
        expect(bad is None, f"{kind}: a column-sharded layer: expected a ValueError naming placement, got {bad}")
        expect(layer.table is before, f"{kind}: a refused checkpoint leaves the layer's table")


CHECKS = SpawnedChecks(check_rows_bit_for_bit, check_layers, check_idle_rank_joins, check_checkpoints,
                       timeout=300.0, pg_timeout=60.0)


# ---- the parent side -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    from ple import io as pio

    path = tmp_path_factory.mktemp("nf4_ckpt")
    layer = random_layer(CONFIG, 0, torch.float32, seed=5)
    for W in (2, 3):                                      # W shards: rank k's rows are shard k
        pio.save(layer, path / f"nf4_{W}", parts=W, table_dtype="nf4", ple_only=True)
    pio.save(layer, path / "nf4_small_files", parts=5, table_dtype="nf4", ple_only=True, max_file_bytes=12_000)
    return str(path)


# One gloo run in the quick tier (W = 2: the last rank with no rows in the smallest table, and no tokens); W = 3
# (shards of unequal sizes) in the deep tier.
WORLD_SIZES = [2, pytest.param(3, marks=pytest.mark.deep)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", list(CHECKS))
def test_nf4_sharded(checkpoint_dir, world_size, name):
    CHECKS.report(world_size, name, checkpoint_dir)


def test_column_sharding_refused_before_the_mesh():
    """``placement="col"`` of an NF4 table is a ``ValueError`` naming ``placement``, before any mesh is needed."""
    table = nf4_layer().table
    with pytest.raises(ValueError, match=r"^placement: an NF4 table's rows are packed .*placement='row'"):
        shard_table_(table, None, "col")
    assert not table.is_dtensor
