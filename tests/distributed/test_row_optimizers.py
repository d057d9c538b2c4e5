"""``ple.optim``'s row optimizers on a DTensor-sharded table (``ple.distributed.row_update``), on gloo: W = 2 in the
quick tier, W = 3 and 4 in the deep tier.

Each world size is spawned once and runs every check; each test reports one check. Every process builds the
same tables from one seed and trains one process's twin itself, on the global batch: with replicated tokens
every rank's batch; with per-rank tokens the ranks' batches concatenated in rank order (the gradient rows
divided by W under ``reduce="mean"``, as the ranks' mean loss gives them).

* `check_tables_equal_one_process`: every rule (``SparseSGD``, ``RowwiseAdagrad``, ``RowwiseAdam``), row and
  column placement, replicated and per-rank tokens (a rank with no tokens in a call), float32 and bfloat16
  tables, with and without weight decay, two micro-batches a step and ``fused=True``, ``ple.reference``'s op and
  ``reduce="sum"``, a table of 5 rows (at W = 4 the last rank holds none): each rank's piece and its
  state against one process's, after every step. Row sharding bit for bit; column sharding bit for bit where
  the arithmetic is one process's (SGD; Adagrad / Adam with replicated tokens and no weight decay), within
  float32 (bfloat16: one ulp) rounding elsewhere; rows never looked up bit for bit (and their state zero)
  always. The collectives of the backward and the step are the optimizer's `Comm`'s only (counted by
  ``CommDebugMode``), and their bytes are exactly those the step's lookups make (so none is sized by the table).
* `check_layers_equal_one_process`: a `PLELayer` trained through its forward (``ple.vectorized`` and
  ``ple.reference`` ops), replicated tokens (the rest of the layer trained beside by ``torch.optim.SGD``) and
  per-rank tokens (``reduce="sum"``): the table as one process's, bit for bit (column sharding with per-rank
  tokens: within float32 rounding, Adagrad's ``mean(g * g)`` summed from the ranks' partial sums).
* `check_state_per_rank`: ``state[weight]`` holds this rank's local tensors; ``state_dict`` /
  ``load_state_dict`` per rank; the whole table's state is refused, nothing loaded.
* `check_save_and_resume`: ``save_sharded`` (with the optimizer) after two steps, a fresh layer built on
  ``meta`` filled piece by piece (``load_table_piece_``) and ``ple.io.load_optimizer`` per rank, two more
  steps: the bits of a run never stopped, row and column sharding; the checkpoint loads whole in one process
  (``load_layer``, ``load_optimizer``), and a single process's save loads per rank. SGD (no state); an existing
  checkpoint and a torch optimizer refused by ``save_sharded`` (nothing written), an optimizer over a sharded
  table by ``ple.io.save``.

The quick tier runs each rule with (float32, no weight decay) and (bfloat16, weight decay), and ``fused=True``
with Adam; the deep tier every pair and every rule fused.
"""

from __future__ import annotations

import copy
import os
import tempfile

import _tier
import pytest
import torch

import ple
import ple.optim as O
from ple.distributed import load_table_piece_, optimizer_comm, parallelize_tables, shard_range, shard_table_, spawn
from ple.table import DenseTable
from ple.testing import spawned
from ple.testing.layers import random_layer
from ple.testing.spawned import close, expect, same_bits

CONFIG = ple.PLEConfig.preset("tiny")          # C 48, NH 6, D 4, 6128 table rows (PLE index 0)
ROWS, D, NH = 6128, CONFIG.ngram_head_dim, CONFIG.num_ngram_heads
RULES = {"sgd": (O.SparseSGD, {"lr": 0.05}), "adagrad": (O.RowwiseAdagrad, {"lr": 0.1}),
         "adam": (O.RowwiseAdam, {"lr": 0.02, "betas": (0.8, 0.95)})}
STATE = {"sgd": (), "adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq")}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7}       # float32 rounding; one bfloat16 ulp


def mesh_of(W):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (W,))


def boundary_rows(W, rows=ROWS):
    """Every shard's first and last row and the rows beside them (and the table's ends)."""
    out = {0, rows - 1}
    for k in range(W):
        a, b = shard_range(rows, W, k)
        out |= {r for r in (a - 1, a, b - 1, b) if 0 <= r < rows}
    return sorted(out)


def lookups(W, seed, rows=ROWS):
    """Every rank's ids ``[T_r, NH]`` and output gradients ``[T_r, NH * D]`` (float32) of one backward call: many
    repeats (within a rank and across ranks), every shard boundary, and the last rank with no tokens in odd
    calls."""
    g = torch.Generator().manual_seed(seed)
    edges = torch.tensor(boundary_rows(W, rows))
    hot = torch.randint(0, rows, (5,), generator=g)              # looked up again and again
    out = []
    for r in range(W):
        T = 0 if (r == W - 1 and seed % 2) else int(torch.randint(2, 6, (1,), generator=g))
        pool = torch.cat([edges, hot, torch.randint(0, rows, (20,), generator=g)])
        ids = pool[torch.randint(0, len(pool), (T, NH), generator=g)]
        out.append((ids, torch.randn(T, NH * D, generator=g)))
    return out


def global_batch(per_rank, scale=1.0):
    ids = torch.cat([i for i, _ in per_rank])
    grad = torch.cat([g for _, g in per_rank])
    return ids, (grad / scale if scale != 1.0 else grad)


def piece_of(t, placement, W, rank):
    if placement == "row" or t.dim() == 1:
        if placement == "col":
            return t
        a, b = shard_range(t.shape[0], W, rank)
        return t[a:b]
    c0, c1 = shard_range(t.shape[1], W, rank)
    return t[:, c0:c1]


def _expected_bytes(placement, tokens, per_rank, W, rank, rows, elt=4):
    """What this rank's optimizer `Comm` sends for one backward call (and the step's share, per lookup)."""
    ids, _ = per_rank[rank]
    M = ids.numel()
    if placement == "row":
        if tokens == "replicated":
            return {}
        a, b = shard_range(rows, W, rank)
        away = int(((ids < a) | (ids >= b)).sum())
        return {"table_update_counts": (W - 1) * 8, "table_update_ids": away * 8, "table_update_grads": away * D * elt}
    if tokens == "replicated":
        return {}
    m = max(i.numel() for i, _ in per_rank)
    others = D - (shard_range(D, W, rank)[1] - shard_range(D, W, rank)[0])
    return {"table_update_counts": (W - 1) * 8, "table_update_ids": (W - 1) * m * 8,
            "table_update_grads": M * others * elt}


def _run_case(rank, W, mesh, *, placement, tokens, rule, dtype, wd, fused, ops, reduce="mean", steps=3, rows=ROWS):
    from torch.distributed.tensor.debug import CommDebugMode

    label = f"{placement}/{tokens}/{rule}/{str(dtype)[6:]}/wd={wd}/fused={fused}/rows={rows}"
    cls, hyper = RULES[rule]
    torch.manual_seed(5)
    whole = DenseTable(rows, D, dtype=dtype)
    start = whole.weight.detach().clone()
    table = shard_table_(copy.deepcopy(whole), mesh, placement, tokens=tokens, reduce=reduce)
    opt = cls(table, weight_decay=wd, fused=fused, **hyper)
    ref = cls(whole, weight_decay=wd, fused=fused, **hyper)
    comm = optimizer_comm(table)
    comm.reset()
    want_bytes: dict[str, float] = {}
    touched = torch.zeros(rows, dtype=torch.bool)
    exact = placement == "row" or rule == "sgd" or (tokens == "replicated" and wd == 0)
    scale = W if tokens == "sharded" and reduce == "mean" else 1.0
    for step in range(steps):
        step_lookups = 0
        for call in range(2):
            per_rank = lookups(W, 100 * step + call, rows)
            ids, grad = global_batch(per_rank) if tokens == "replicated" else per_rank[rank]
            all_ids, all_grad = global_batch(per_rank, scale)
            touched[all_ids.reshape(-1)] = True
            step_lookups += all_ids.numel()
            out = table.rows(ids, torch.float32, ops=ops)
            calls_before = sum(comm.calls.values())
            with CommDebugMode() as cdm:
                (out * grad).sum().backward()
            (whole.rows(all_ids, torch.float32, ops=ops) * all_grad).sum().backward()
            expect(cdm.get_total_counts() == sum(comm.calls.values()) - calls_before,
                   f"{label}: a collective in the backward outside the optimizer's Comm: {cdm.get_comm_counts()}")
            for k, v in _expected_bytes(placement, tokens, per_rank, W, rank, rows).items():
                want_bytes[k] = want_bytes.get(k, 0) + v
            if fused and placement == "col" and rule != "sgd" and (tokens == "sharded" or wd):
                want_bytes["table_update_sq"] = want_bytes.get("table_update_sq", 0) + round(
                    2 * (W - 1) / W * all_ids.numel() * 4)
        calls_before = sum(comm.calls.values())
        with CommDebugMode() as cdm:
            opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        expect(cdm.get_total_counts() == sum(comm.calls.values()) - calls_before,
               f"{label}: a collective in the step outside the optimizer's Comm: {cdm.get_comm_counts()}")
        if not fused and placement == "col" and rule != "sgd" and (tokens == "sharded" or wd):
            want_bytes["table_update_sq"] = want_bytes.get("table_update_sq", 0) + round(
                2 * (W - 1) / W * step_lookups * 4)
        piece = table.weight.to_local()
        expected = piece_of(whole.weight.detach(), placement, W, rank)
        if exact:
            same_bits(piece, expected, f"{label}: step {step + 1}: the piece")
        else:
            close(piece.float(), expected.float(), f"{label}: step {step + 1}: the piece", TOL[dtype])
        for name in STATE[rule]:
            mine, theirs = opt.state[table.weight][name], piece_of(ref.state[whole.weight][name], placement, W, rank)
            if exact:
                same_bits(mine, theirs, f"{label}: step {step + 1}: state {name}")
            else:
                close(mine, theirs, f"{label}: step {step + 1}: state {name}", 1e-5)
        expect(opt.state[table.weight]["step"] == ref.state[whole.weight]["step"], f"{label}: step count")
    never = piece_of(~touched, placement, W, rank) if placement == "row" else ~touched
    same_bits(table.weight.to_local()[never], piece_of(start, placement, W, rank)[never],
              f"{label}: rows never looked up")
    for name in STATE[rule]:
        expect(not opt.state[table.weight][name][never].any(), f"{label}: state {name} of rows never looked up")
    sent = {k: v for k, v in comm.bytes_sent.items() if v}
    expect(sent == {k: v for k, v in want_bytes.items() if v},
           f"{label}: bytes sent {dict(sent)}, the lookups make {want_bytes}")
    table_bytes = ROWS * D * whole.weight.element_size()          # the tiny preset's table
    expect(sum(sent.values()) / steps < table_bytes / 10, f"{label}: {sent} in {steps} steps, a table of {table_bytes}")


# ---- checks run inside the spawned group ---------------------------------------------------------------
def check_tables_equal_one_process(rank, W, path, deep):
    from ple import vectorized

    mesh = mesh_of(W)
    f32, bf16 = torch.float32, torch.bfloat16
    # The quick tier: each dtype and each weight decay once, fused=True with Adam; the deep tier: every pair, every
    # rule fused.
    kinds = [(f32, 0.0), (f32, 0.01), (bf16, 0.0), (bf16, 0.01)] if deep else [(f32, 0.0), (bf16, 0.01)]
    for placement in ("row", "col"):
        for tokens in ("replicated", "sharded"):
            for rule in RULES:
                for dtype, wd in kinds:
                    _run_case(rank, W, mesh, placement=placement, tokens=tokens, rule=rule, dtype=dtype, wd=wd,
                              fused=False, ops=vectorized)
                if deep or rule == "adam":
                    _run_case(rank, W, mesh, placement=placement, tokens=tokens, rule=rule, dtype=f32, wd=0.01,
                              fused=True, ops=vectorized, steps=2)
            # ple.reference's op and lookups, reduce="sum"; 5 rows (W = 4: the last rank holds none).
            _run_case(rank, W, mesh, placement=placement, tokens=tokens, rule="adam", dtype=f32, wd=0.0,
                      fused=False, ops=ple.reference, reduce="sum", steps=2)
            _run_case(rank, W, mesh, placement=placement, tokens=tokens, rule="adagrad", dtype=f32, wd=0.01,
                      fused=False, ops=vectorized, steps=2, rows=5)


def _layer_batch(seed, B=2, L=7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG.vocab_size, (B, L), generator=g)
    return torch.randn(B, L, CONFIG.hc_hidden_size, generator=g), ids, torch.randn(B, L, CONFIG.hc_hidden_size,
                                                                                  generator=g)


def check_layers_equal_one_process(rank, W, path, deep):
    from torch.distributed.tensor import Shard

    mesh = mesh_of(W)
    for backend in ("torch", "reference"):
        full = random_layer(CONFIG, 0, torch.float32, seed=3, backend=backend)
        for placement in ("row", "col"):
            for tokens in ("replicated", "sharded"):
                label = f"{backend}/{placement}/{tokens}"
                one = copy.deepcopy(full)
                layer = parallelize_tables(copy.deepcopy(full), mesh, placement,
                                           input_layouts=Shard(0) if tokens == "sharded" else None, reduce="sum")
                opts = [O.RowwiseAdagrad(x, lr=0.1) for x in (layer, one)]
                dense = [torch.optim.SGD(O.other_parameters(x), lr=0.05) for x in (layer, one)]
                for step in range(3):
                    batches = [_layer_batch(100 * step + r) for r in range(W)]
                    if tokens == "replicated":
                        h, ids, probe = batches[step % W]              # every rank the same batch
                        (layer(h, ids) * probe).sum().backward()
                        (one(h, ids) * probe).sum().backward()
                    else:                                              # one process: the ranks' batches in order
                        h, ids, probe = batches[rank]
                        (layer(h, ids) * probe).sum().backward()
                        for h, ids, probe in batches:
                            (one(h, ids) * probe).sum().backward()
                    # The rest of the layer trains beside (replicated tokens: alike on every rank).
                    for o in (*opts, *(dense if tokens == "replicated" else ())):
                        o.step()
                    for o in (*opts, *dense):
                        o.zero_grad()
                    expect(layer.table.weight.grad is None, f"{label}: a table gradient reached .grad")
                    piece, want = layer.table.weight.to_local(), piece_of(one.table.weight.detach(), placement, W, rank)
                    if placement == "row" or tokens == "replicated":
                        same_bits(piece, want, f"{label}: step {step + 1}: the piece")
                    else:                                              # mean(g * g) from the ranks' partial sums
                        close(piece, want, f"{label}: step {step + 1}: the piece", 1e-5)


def check_state_per_rank(rank, W, path, deep):
    mesh = mesh_of(W)
    for placement in ("row", "col"):
        torch.manual_seed(5)
        whole = DenseTable(ROWS, D)
        table = shard_table_(copy.deepcopy(whole), mesh, placement)
        opt = O.RowwiseAdam(table, lr=0.02)
        a, b = shard_range(ROWS, W, rank)
        c0, c1 = shard_range(D, W, rank)
        want = {"exp_avg": (b - a, D) if placement == "row" else (ROWS, c1 - c0),
                "exp_avg_sq": (b - a,) if placement == "row" else (ROWS,)}
        for name, shape in want.items():
            t = opt.state[table.weight][name]
            expect(type(t) is torch.Tensor and tuple(t.shape) == shape, f"{placement}: {name} is {type(t).__name__} "
                   f"{tuple(t.shape)}, this rank's is {shape}")
        per_rank = lookups(W, 7)
        ids, grad = global_batch(per_rank)
        (table.rows(ids, torch.float32, ops=ple.vectorized) * grad).sum().backward()
        opt.step()
        sd = opt.state_dict()
        again = O.RowwiseAdam(shard_table_(copy.deepcopy(whole), mesh, placement), lr=0.02)
        again.load_state_dict(sd)
        for name in want:
            same_bits(again.state[again._tables[0].weight][name], opt.state[table.weight][name],
                      f"{placement}: {name} through state_dict")
        other = O.RowwiseAdam(DenseTable(ROWS, D), lr=0.02).state_dict()        # the whole table's state
        before = {n: t.clone() for n, t in again.state[again._tables[0].weight].items() if torch.is_tensor(t)}
        try:
            again.load_state_dict(other)
            expect(W == 1, f"{placement}: a whole table's state was loaded into a piece's")
        except ValueError as e:
            expect(str(e).startswith("state_dict: "), f"{placement}: unexpected message {e}")
        for n, t in before.items():
            same_bits(again.state[again._tables[0].weight][n], t, f"{placement}: {n} after a refused load")


def _train(layer, opt, dense, W, rank, steps, tokens):
    """Steps of the table's optimizer and, with replicated tokens (alike on every rank), the rest of the layer's."""
    for step in steps:
        batches = [_layer_batch(100 * step + r) for r in range(W)]
        h, ids, probe = batches[rank] if tokens == "sharded" else batches[0]
        (layer(h, ids) * probe).sum().backward()
        for o in (opt, dense) if tokens == "replicated" else (opt,):
            o.step()
        opt.zero_grad()
        dense.zero_grad()


def _fresh(placement, tokens, mesh, source=None):
    from torch.distributed.tensor import Shard

    layer = random_layer(CONFIG, 0, torch.float32, seed=3, backend="torch")
    if source is not None:                                  # the table on meta, filled piece by piece
        layer = ple.PLELayer(CONFIG, 0, table=DenseTable(ROWS, D, device="meta"), backend="torch")
        layer.load_state_dict({k: v for k, v in ple.io.load_layer(source).state_dict().items()
                               if "ngram_embedding" not in k}, strict=False)
    layer = parallelize_tables(layer, mesh, placement, input_layouts=Shard(0) if tokens == "sharded" else None)
    if source is not None:
        load_table_piece_(layer, source)
    opt = O.RowwiseAdam(layer, lr=0.02, weight_decay=0.01)
    dense = torch.optim.SGD(O.other_parameters(layer), lr=0.05)
    return layer, opt, dense


def check_save_and_resume(rank, W, path, deep):
    import torch.distributed as dist

    from ple.distributed import save_sharded

    mesh = mesh_of(W)
    for placement, tokens in (("row", "sharded"), ("col", "replicated"), ("row", "replicated")):
        label = f"{placement}/{tokens}"
        ck = f"{path}/{placement}_{tokens}_{W}"
        unstopped, opt_u, dense_u = _fresh(placement, tokens, mesh)
        _train(unstopped, opt_u, dense_u, W, rank, range(4), tokens)
        first, opt_f, dense_f = _fresh(placement, tokens, mesh)
        _train(first, opt_f, dense_f, W, rank, range(2), tokens)
        save_sharded(first, ck, optimizer=opt_f)
        dense_state = copy.deepcopy(dense_f.state_dict())
        resumed, opt_r, dense_r = _fresh(placement, tokens, mesh, source=ck)
        ple.io.load_optimizer(opt_r, ck)
        dense_r.load_state_dict(dense_state)
        same_bits(resumed.table.weight.to_local(), first.table.weight.to_local(), f"{label}: the piece read back")
        _train(resumed, opt_r, dense_r, W, rank, range(2, 4), tokens)
        same_bits(resumed.table.weight.to_local(), unstopped.table.weight.to_local(), f"{label}: resumed piece")
        for name in STATE["adam"]:
            same_bits(opt_r.state[resumed.table.weight][name], opt_u.state[unstopped.table.weight][name],
                      f"{label}: resumed state {name}")
        # One process reads the sharded save whole; a sharded run reads one process's save.
        whole = ple.io.load_layer(ck)
        same_bits(piece_of(whole.table.weight.detach(), placement, W, rank), first.table.weight.to_local(),
                  f"{label}: the whole table of the sharded save")
        one_opt = O.RowwiseAdam(whole, lr=0.02, weight_decay=0.01)
        ple.io.load_optimizer(one_opt, ck)
        for name in STATE["adam"]:
            same_bits(piece_of(one_opt.state[whole.table.weight][name], placement, W, rank),
                      opt_f.state[first.table.weight][name], f"{label}: whole state {name} of the sharded save")
        if rank == 0:
            ple.io.save(whole, f"{ck}_one", parts=3, optimizer=one_opt)
        dist.barrier()
        again, opt_a, _ = _fresh(placement, tokens, mesh, source=f"{ck}_one")
        ple.io.load_optimizer(opt_a, f"{ck}_one")
        for name in STATE["adam"]:
            same_bits(opt_a.state[again.table.weight][name], opt_f.state[first.table.weight][name],
                      f"{label}: state {name} of one process's save, read per rank")
        expect(opt_a.state[again.table.weight]["step"] == 2, f"{label}: step count")
    # SGD (no state: rank 0 writes the metadata alone); an existing checkpoint refused on every rank.
    layer = parallelize_tables(random_layer(CONFIG, 0, torch.float32, seed=3, backend="torch"), mesh, "row")
    sgd = O.SparseSGD(layer, lr=0.1)
    _train(layer, sgd, torch.optim.SGD(O.other_parameters(layer), lr=0.0), W, rank, range(1), "replicated")
    save_sharded(layer, f"{path}/sgd_{W}", optimizer=sgd)
    try:
        save_sharded(layer, f"{path}/sgd_{W}", optimizer=sgd)
        expect(False, "save_sharded replaced a checkpoint without overwrite=True")
    except ValueError as e:
        expect(str(e).startswith("path: "), f"unexpected message {e}")
    save_sharded(layer, f"{path}/sgd_{W}", optimizer=sgd, overwrite=True)
    try:
        save_sharded(layer, f"{path}/never_{W}", optimizer=torch.optim.SGD(O.other_parameters(layer), lr=0.1))
        expect(False, "save_sharded took a torch optimizer for the table's")
    except TypeError as e:
        expect(str(e).startswith("optimizer: "), f"unexpected message {e}")
    expect(not os.path.exists(f"{path}/never_{W}"), "a refused save_sharded wrote")
    try:
        ple.io.save(layer, f"{path}/whole_{W}_{rank}", optimizer=sgd)
        expect(False, "ple.io.save took an optimizer over a sharded table")
    except ValueError as e:
        expect(str(e).startswith("optimizer: ") and "save_sharded" in str(e), f"unexpected message {e}")
    fresh = O.SparseSGD(parallelize_tables(random_layer(CONFIG, 0, torch.float32, seed=3), mesh, "row"), lr=0.5)
    ple.io.load_optimizer(fresh, f"{path}/sgd_{W}")
    expect(fresh.state[fresh._tables[0].weight]["step"] == 1 and fresh.param_groups[0]["lr"] == 0.1,
           "SGD: the step count and lr read back")


CHECKS = {f.__name__.removeprefix("check_"): f for f in (
    check_tables_equal_one_process, check_layers_equal_one_process, check_state_per_rank, check_save_and_resume)}


def run_checks(rank, world_size, names, path, deep):
    return spawned.run_checks(CHECKS, names, rank, world_size, path, deep)


# ---- the parent side -------------------------------------------------------------------------------------
_RESULTS: dict[int, dict] = {}


def _failures(world_size, name):
    if world_size not in _RESULTS:
        with tempfile.TemporaryDirectory(prefix="ple_rowopt_") as path:
            per_rank = spawn(run_checks, world_size, list(CHECKS), path, _tier.DEEP, timeout=600.0,
                             pg_timeout=120.0)
        _RESULTS[world_size] = {n: [(r, res[n]) for r, res in enumerate(per_rank) if res[n] is not None]
                                for n in CHECKS}
    failures = _RESULTS[world_size][name]
    if failures:
        pytest.fail("\n".join(f"rank {r}:\n{tb}" for r, tb in failures), pytrace=False)


# W = 2 in the quick tier; W = 3 (uneven rows, a rank with no columns: D = 4 is 2/2/0) and W = 4 in the deep tier.
WORLD_SIZES = [2, pytest.param(3, marks=pytest.mark.deep), pytest.param(4, marks=pytest.mark.deep)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", list(CHECKS))
def test_row_optimizers_on_a_sharded_table(world_size, name):
    _failures(world_size, name)


def test_save_sharded_refuses_a_whole_table():
    """A layer whose table is not a DTensor is a ``TypeError`` naming ``layers``, before any collective."""
    from ple.distributed import save_sharded

    with pytest.raises(TypeError, match="^layers: "):
        save_sharded(ple.PLELayer(CONFIG, 0), "unused")
