"""The Engram family's table sharded (``ple.distributed``) on gloo: W = 2 (quick tier) and W = 3 (deep tier).

Each world size is spawned once and runs every check; each test reports one check. Every process builds the same
float64 Engram layer (biases, norms around one, a token map) from one seed and computes the one-process answer.

* `check_forward`: rows and columns (``parallelize_tables``), replicated tokens (forward bit for bit, the table's
  gradient piece and the biases' gradients) and per-rank tokens (the last rank with none); an int8 table by rows.
* `check_checkpoints`: ``save_sharded`` of an Engram layer writes the family's prefix ``layers.{i}.engram.``, the
  projection biases and the family in ``config.json``; one process's ``load_layer`` of it is the layer, bit for
  bit; a layer built on ``meta`` and sharded reads its piece of a ``ple.io.save`` checkpoint in W shards
  (``load_table_piece_``) and gives the layer's output.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _helpers import SpawnedChecks

import ple
from ple.distributed import parallelize_tables, shard_range
from ple.testing import spawned
from ple.testing.layers import random_layer
from ple.testing.spawned import expect, same_bits

CONFIG = ple.PLEConfig.engram(vocab_size=50, hidden_size=6, hc_count=2, engram_vocab_size=[23, 31],
                              max_ngram_size=3, n_embed_per_ngram=8, n_head_per_ngram=2, layer_ids=[0, 3], pad_id=2,
                              seed=5, kernel_size=3, token_map=[(7 * t) % 17 for t in range(50)])
C = CONFIG.hc_hidden_size
PLACEMENTS = ("row", "col")


def make_layer(index: int = 1) -> ple.PLELayer:
    return random_layer(CONFIG, index, torch.float64, seed=11 + index)


def mesh_of(W):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (W,))


def inputs(seed: int, B: int = 2, L: int = 9):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, L, C, generator=g, dtype=torch.float64),
            torch.randint(0, CONFIG.vocab_size, (B, L), generator=g))


# ---- checks run inside the spawned group ---------------------------------------------------------------
def check_forward(rank, W, ckpt):
    from torch.distributed.tensor import Shard

    mesh = mesh_of(W)
    full = make_layer()
    hidden, ids = inputs(3)
    n = 0 if rank == W - 1 else 1 + rank % 2                                  # the last rank: no tokens
    hidden_k, ids_k = inputs(100 + rank, B=n, L=7)
    probe = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    full.zero_grad()
    want = full(hidden, ids)
    (want * probe).sum().backward()
    with torch.no_grad():
        want_k = full(hidden_k, ids_k)
    for placement in PLACEMENTS:
        layer = parallelize_tables(copy.deepcopy(full), mesh, placement)
        layer.zero_grad()
        out = layer(hidden, ids)
        same_bits(out, want.detach(), f"{placement}: replicated tokens")
        (out * probe).sum().backward()
        a, b = shard_range(full.table.num_rows if placement == "row" else full.table.dim, W, rank)
        g = full.table.weight.grad
        spawned.close(layer.table.weight.grad.to_local(), g[a:b] if placement == "row" else g[:, a:b],
                      f"{placement}: d table piece", 1e-12)
        for name in ("key_proj", "value_proj"):
            spawned.close(getattr(layer, name).bias.grad, getattr(full, name).bias.grad, f"{placement}: d {name}.bias",
                          1e-12)
        per_rank = parallelize_tables(copy.deepcopy(full), mesh, placement, input_layouts=Shard(0))
        with torch.no_grad():
            same_bits(per_rank(hidden_k, ids_k), want_k, f"{placement}: per-rank tokens")
    q = copy.deepcopy(full)
    q.ple_embedding.quantize_("int8")
    with torch.no_grad():
        same_bits(parallelize_tables(copy.deepcopy(q), mesh, "row")(hidden, ids), q(hidden, ids), "int8, row")


def check_checkpoints(rank, W, ckpt):
    import torch.distributed as dist

    from ple.distributed import load_table_piece_, save_sharded
    from ple.io import Checkpoint, load_layer
    from ple.table import DenseTable

    mesh = mesh_of(W)
    full = make_layer()
    hidden, ids = inputs(4)
    with torch.no_grad():
        want = full(hidden, ids)
    path = f"{ckpt}/sharded_{W}"
    save_sharded(parallelize_tables(copy.deepcopy(full), mesh, "row"), path)
    keys = set(Checkpoint.open(path).keys())
    expect({f"layers.3.engram.ple_embedding.ngram_embedding.shard_{k}.weight" for k in range(W)} <= keys,
           f"the family's prefix and W shards: {sorted(keys)[:6]}")
    expect({"layers.3.engram.key_proj.bias", "layers.3.engram.value_proj.bias"} <= keys, "the biases saved")
    with open(f"{path}/config.json", encoding="utf-8") as fh:
        config = json.load(fh)
    expect(config["family"] == "engram" and config["ple_only"] and ple.PLEConfig.from_dict(config) == CONFIG,
           "config.json keeps the family, marked for ple only")
    whole = load_layer(path, ple_layer_index=1)
    for (name, p), (_, q) in zip(whole.state_dict().items(), full.state_dict().items(), strict=True):
        same_bits(p, q, f"load_layer of the sharded save: {name}")
    same_bits(whole.ple_embedding.token_map, full.ple_embedding.token_map, "token map")
    dist.barrier()

    for placement in PLACEMENTS:                                     # a layer never whole, filled piece by piece
        layer = ple.PLELayer(CONFIG, 1, dtype=torch.float64,
                             table=DenseTable(full.table.num_rows, full.table.dim, device="meta", dtype=torch.float64))
        with torch.no_grad():
            for (_, p), (_, q) in zip(layer.named_parameters(), full.named_parameters(), strict=True):
                if p.device.type != "meta":
                    p.copy_(q)
        parallelize_tables(layer, mesh, placement)
        load_table_piece_(layer, f"{ckpt}/saved_{W}", block_bytes=200)
        with torch.no_grad():
            same_bits(layer(hidden, ids), want, f"{placement}: read piece by piece from ple.io.save's checkpoint")


CHECKS = SpawnedChecks(check_forward, check_checkpoints, timeout=300.0, pg_timeout=60.0)


# ---- the parent side -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    from ple import io as pio

    path = tmp_path_factory.mktemp("engram_ckpt")
    layer = make_layer()
    for W in (2, 3):                                      # W shards: rank k's rows are shard k
        pio.save(layer, path / f"saved_{W}", parts=W)
    return str(path)


# One gloo run in the quick tier (W = 2: the last rank with no tokens); W = 3 (a table of unequal shards, D = 4
# columns split 2/1/1) in the deep tier.
WORLD_SIZES = [2, pytest.param(3, marks=pytest.mark.deep)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", list(CHECKS))
def test_engram_sharded(checkpoint_dir, world_size, name):
    CHECKS.report(world_size, name, checkpoint_dir)
