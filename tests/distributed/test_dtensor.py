"""The table as a DTensor on a DeviceMesh (``ple.distributed.dtensor``), on gloo, W = 2, 3 and 4.

Each world size is spawned once and runs every check (process start-up dominates); each
test reports one check. Every process builds the same float64 layer from one seed and
computes the single-process answer itself.

Covered, for row (``Shard(0)``) and column (``Shard(1)``) sharding: replicated tokens
(forward bit for bit, every gradient, a serving prefill and decode); tokens split across
ranks (data parallel, a rank with no tokens) under FSDP2 for the dense parameters and
under DDP with the table excluded, gradients equal to one process's mean loss; a layer
whose table was never materialised whole (meta), filled from a checkpoint piece by
piece; a checkpoint of another config refused. W = 3 splits 6128 rows 2043/2043/2042 and
D = 4 columns 2/2/0 (a rank with no columns); W = 4 splits both evenly. Quantized tables, a
rank with no rows and every shard's boundary rows: ``test_sharded_table.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _helpers import nonzero_layers, own_requests_served, packed_reference

import ple
from ple.distributed import (
    TableColwise,
    TableRowwise,
    dense_params,
    load_table_piece_,
    parallelize_tables,
    shard_range,
    spawn,
)
from ple.testing import spawned
from ple.testing.spawned import expect

pytestmark = pytest.mark.deep      # deep tier: the DTensor styles, FSDP2 and DDP at W = 2, 3, 4

CONFIG = ple.PLEConfig.preset("tiny")          # C 48, NH 6, D 4, 6128 table rows (PLE index 0)
PLACEMENTS = ("row", "col")


def close(actual, expected, name, tol=1e-12):
    spawned.close(actual, expected, name, tol)


def grads_match(layer, full, placement, W, rank, label=""):
    """Every parameter gradient of ``layer`` (DTensor table, dense parameters plain or FSDP2's DTensors) against
    one process's ``full``: the table's gradient piece for piece, the others whole."""
    for (name, p), (_, q) in zip(layer.named_parameters(), full.named_parameters(), strict=True):
        grad = p.grad
        if name.endswith("ngram_embedding.weight"):
            close(grad.to_local(), local_piece(q.grad, placement, W, rank), f"{placement}: {label}d table piece")
        else:
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            close(grad, q.grad, f"{placement}: {label}d {name}")


def make_layer(seed=0):
    """Every parameter non-zero (norms and conv too), float64, the same in every process."""
    return nonzero_layers(CONFIG, seed=seed)[0]


def batch(seed, B, L=9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG.vocab_size, (B, L), generator=g)
    if B:
        ids[0, 3] = CONFIG.eos_token_id
    hidden = torch.randn(B, L, CONFIG.hc_hidden_size, generator=g, dtype=torch.float64)
    probe = torch.randn(B, L, CONFIG.hc_hidden_size, generator=g, dtype=torch.float64)
    return hidden, ids, probe


def local_piece(full: torch.Tensor, placement: str, W: int, rank: int) -> torch.Tensor:
    dim = 0 if placement == "row" else 1
    a, b = shard_range(full.shape[dim], W, rank)
    return full[a:b] if dim == 0 else full[:, a:b]


def mesh_of(W):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (W,))


# ---- checks run inside the spawned group ---------------------------------------------------------------
def check_replicated_tokens(rank, W, ckpt):
    """Every rank the same tokens: output bit for bit, every gradient, the table's per-rank piece."""
    full = make_layer()
    hidden, ids, probe = batch(1, 3)
    mask = torch.ones_like(ids)
    mask[2, :2] = 0
    h = hidden.clone().requires_grad_(True)
    want = full(h, ids, attention_mask=mask)
    (want * probe).sum().backward()
    mesh = mesh_of(W)
    for placement in PLACEMENTS:
        layer = parallelize_tables(copy.deepcopy(full), mesh, placement)
        layer.zero_grad()
        piece = layer.table.weight.to_local()
        expect(torch.equal(piece, local_piece(full.table.weight.detach(), placement, W, rank)), f"{placement}: piece")
        h2 = hidden.clone().requires_grad_(True)
        got = layer(h2, ids, attention_mask=mask)
        expect(torch.equal(got, want), f"{placement}: output not bit for bit")
        (got * probe).sum().backward()
        close(h2.grad, h.grad, f"{placement}: d hidden")
        grads_match(layer, full, placement, W, rank)


def check_serving_steps(rank, W, ckpt):
    """A prefill and a decode step through a PLECache give the whole-table layer's outputs, bit for bit."""
    from ple.state import Decode, PLECache, Prefill

    full = make_layer()
    mesh = mesh_of(W)
    layers = [full] + [parallelize_tables(copy.deepcopy(full), mesh, p) for p in PLACEMENTS]
    outs = []
    for layer in layers:
        cache = PLECache(CONFIG, num_slots=4, num_layers=1, dtype=torch.float64)
        a, b = cache.allocate(), cache.allocate()
        g = torch.Generator().manual_seed(5)
        steps = [[Prefill(a, [5, 6, 7, 8]), Prefill(b, [9, 2, 11])], [Decode(a, 12), Decode(b, 13)]]
        got = []
        with torch.no_grad():
            for items in steps:
                batch_ = cache.schedule(items)
                h = torch.randn(batch_.num_tokens, CONFIG.hc_hidden_size, generator=g, dtype=torch.float64)
                got.append(layer.step(h, batch_, cache))
        outs.append(got)
    for placement, got in zip(PLACEMENTS, outs[1:], strict=True):
        for k, (x, y) in enumerate(zip(got, outs[0], strict=True)):
            expect(torch.equal(x, y), f"{placement}: serving step {k} not bit for bit")


def _data_parallel(rank, W, wrap):
    """Each rank its own batch (the last rank none); gradients against one process's mean of the ranks' losses."""
    from torch.distributed.tensor import Shard

    full = make_layer()
    sizes = [2 + r % 2 for r in range(W - 1)] + [0]                        # the last rank holds no tokens
    batches = [batch(10 + r, n) for r, n in enumerate(sizes)]
    total = 0
    for hidden, ids, probe in batches:
        total = total + (full(hidden, ids) * probe).sum()
    (total / W).backward()
    mesh = mesh_of(W)
    for placement in PLACEMENTS:
        layer = parallelize_tables(copy.deepcopy(full), mesh, placement, input_layouts=Shard(0))
        layer.zero_grad()
        model = wrap(layer, mesh)
        hidden, ids, probe = batches[rank]
        (model(hidden, ids) * probe).sum().backward()
        grads_match(layer, full, placement, W, rank)


def check_fsdp2_dense_params(rank, W, ckpt):
    from torch.distributed.fsdp import fully_shard

    def wrap(layer, mesh):
        table = layer.table.weight
        fully_shard(layer, mesh=mesh, ignored_params={table})
        expect(all(type(p).__name__ == "DTensor" for p in dense_params(layer)), "FSDP2 shards the dense params")
        return layer

    _data_parallel(rank, W, wrap)


def check_ddp_excludes_the_table(rank, W, ckpt):
    from torch.nn.parallel import DistributedDataParallel as DDP

    _data_parallel(rank, W, lambda layer, mesh: DDP(layer))


def check_ddp_leaves_a_sharded_layers_rows_alone(rank, W, ckpt):
    """DDP around a layer whose table is row-sharded with replicated tokens (uneven rows at W = 3), sharded through
    the process group: its rows are not averaged with other ranks' rows, so gradients equal one process's (the
    dense ones are averaged over equals)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    full = make_layer()
    hidden, ids, probe = batch(1, 2)
    (full(hidden, ids) * probe).sum().backward()
    layer = parallelize_tables(copy.deepcopy(full), None, "row")             # None: the default group
    layer.zero_grad()
    (DDP(layer)(hidden, ids) * probe).sum().backward()
    close(layer.table.weight.grad.to_local(), local_piece(full.table.weight.grad, "row", W, rank), "d table rows")
    close(layer.key_proj.weight.grad, full.key_proj.weight.grad, "d key_proj")


def check_sequence_parallel_on_the_mesh_without_host_syncs(rank, W, ckpt):
    """sp_forward on the DeviceMesh with the table a DTensor (rows, columns): this rank's rows and every gradient
    equal one process's (summed loss, after sync_grads); with list offsets, validate=False and the sync-free ops
    (backend "torch"), forward and backward turn no tensor into a Python value (no host sync)."""
    from ple.distributed import sp_forward, sync_grads
    from ple.distributed.partition import even_bounds
    from ple.testing.conversions import count_host_conversions

    full = make_layer()
    starts = [0, 5, 21, 22, 22, 31]                      # a sequence across every boundary, an empty one
    T = starts[-1]
    one = packed_reference(full, starts, eos_at=19)      # one process: the summed loss's gradients in full
    ids, hidden, probe, ref, h = one["ids"], one["hidden"], one["probe"], one["ref"], one["h"]
    mesh = mesh_of(W)
    bounds = even_bounds(T, W) if W != 3 else [0, 2, 2, T]          # W = 3: a rank with no tokens, one with 2 < S
    lo, hi = bounds[rank], bounds[rank + 1]
    for placement in PLACEMENTS:
        layer = parallelize_tables(copy.deepcopy(full), mesh, placement)
        layer.set_backend("torch")                    # the sync-free ops (ple.reference reads offsets on the host)
        layer.zero_grad()
        hk = hidden[lo:hi].clone().requires_grad_(True)
        with count_host_conversions() as seen:
            out = sp_forward(layer, hk, ids[lo:hi], starts, mesh, bounds=bounds, validate=False)
            (out * probe[lo:hi]).sum().backward()
        expect(seen.count == 0, f"{placement}: {seen.report()}")
        sync_grads(layer, mesh)
        close(out, ref[lo:hi], f"{placement}: sp output")
        close(hk.grad, h.grad[lo:hi], f"{placement}: sp d hidden")
        grads_match(layer, full, placement, W, rank, "sp ")


def check_serving_own_requests_only(rank, W, ckpt):
    """Per-rank tokens: each rank serves its own requests from its own cache (no other rank's), the table a
    DTensor; an idle rank joins the lookup. Outputs and cache states equal the whole-table layer's, bit for bit."""
    from torch.distributed.tensor import Shard

    full = make_layer()
    mesh = mesh_of(W)
    for placement in PLACEMENTS:
        layer = parallelize_tables(copy.deepcopy(full), mesh, placement, input_layouts=Shard(0))
        for k, got, want in own_requests_served(layer, full, rank, W, torch.float64):
            expect(torch.equal(got, want), f"{placement}: cache states" if k is None
                   else f"{placement}: step {k} output not bit for bit")


def check_checkpoint_pieces(rank, W, ckpt):
    """A table never built whole (meta) is filled piece by piece from the checkpoint; another config is refused."""
    full = make_layer()
    mesh = mesh_of(W)
    for placement, style in zip(PLACEMENTS, (TableRowwise, TableColwise), strict=True):
        from torch.distributed.tensor.parallel import parallelize_module

        from ple.table import DenseTable

        layer = ple.PLELayer(CONFIG, 0, dtype=torch.float64,
                             table=DenseTable(full.table.num_rows, full.table.dim, device="meta",
                                              dtype=torch.float64))
        parallelize_module(layer, mesh, {"ple_embedding.ngram_embedding": style()})
        expect(layer.table.weight.to_local().device.type == "cpu", f"{placement}: piece made on the mesh device")
        load_table_piece_(layer, ckpt + "/float", block_bytes=4096)
        expect(torch.equal(layer.table.weight.to_local(), local_piece(full.table.weight.detach(), placement, W,
                                                                        rank)), f"{placement}: piece read")
        try:
            other = ple.PLELayer(CONFIG.replace(seed=99), 0, dtype=torch.float64)
            parallelize_tables(other, mesh, placement)
            load_table_piece_(other, ckpt + "/float")
            expect(False, f"{placement}: a checkpoint of another config was accepted")
        except ValueError as e:
            expect("layer_multipliers" in str(e), f"{placement}: unexpected message {e}")


CHECKS = {f.__name__.removeprefix("check_"): f for f in (
    check_replicated_tokens, check_serving_steps, check_fsdp2_dense_params, check_ddp_excludes_the_table,
    check_ddp_leaves_a_sharded_layers_rows_alone, check_sequence_parallel_on_the_mesh_without_host_syncs,
    check_serving_own_requests_only, check_checkpoint_pieces)}


def run_checks(rank, world_size, names, ckpt):
    return spawned.run_checks(CHECKS, names, rank, world_size, ckpt)


# ---- the parent side -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    from ple import io as pio

    path = tmp_path_factory.mktemp("ckpt")
    pio.save(make_layer(), path / "float", parts=5, max_file_bytes=60_000)
    return str(path)


_RESULTS: dict[int, dict] = {}


def results_for(world_size, checkpoint_dir):
    if world_size not in _RESULTS:
        per_rank = spawn(run_checks, world_size, list(CHECKS), checkpoint_dir, timeout=240.0, pg_timeout=30.0)
        _RESULTS[world_size] = {name: [(r, res[name]) for r, res in enumerate(per_rank) if res[name] is not None]
                                for name in CHECKS}
    return _RESULTS[world_size]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("name", list(CHECKS))
def test_dtensor_table(checkpoint_dir, world_size, name):
    failures = results_for(world_size, checkpoint_dir)[name]
    if failures:
        pytest.fail("\n".join(f"rank {r}:\n{tb}" for r, tb in failures), pytrace=False)


def test_styles_refuse_what_they_cannot_shard():
    with pytest.raises(ValueError, match="input_layouts"):
        TableRowwise(input_layouts="tokens")
    with pytest.raises(ValueError, match="reduce"):
        TableColwise(reduce="max")
    with pytest.raises(ValueError, match="placement"):
        parallelize_tables(make_layer(), None, "diagonal")
