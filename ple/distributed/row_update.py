"""Row optimizers (``ple.optim``) on a sharded table: each rank updates what it owns and holds its state.

``ple.optim``'s optimizers hand a DTensor table's lookups here (this module registers itself with
``ple.optim.rowwise.register_sharded_training`` when imported): `route_lookups` in the lookup's backward (each
lookup's gradient row goes to the rank(s) that will use it), `sharded_update` at the step. Nothing here is sized
by the table: every collective carries the step's lookups (ids, gradient rows or columns, one float each).

==========  ==============  ===========================================  ========================================
placement   tokens          backward: what a rank keeps                  step
==========  ==============  ===========================================  ========================================
``"row"``   replicated      the lookups of its own rows (no traffic)     the backend's ``table_update`` on its
                                                                         piece and its state
``"row"``   per rank        every lookup's gradient row, sent to the     the same
                            row's owner (one all-to-all, and one of
                            the W counts)
``"col"``   replicated      every lookup and its whole gradient row      its columns of every row looked up
                            (every rank has them; no traffic)
``"col"``   per rank        every rank's ids (all-gather) and its own    the same, with ``mean(g * g)`` from an
                            columns of every gradient row (all-to-all)   all-reduce of per-lookup partial sums
==========  ==============  ===========================================  ========================================

Order: a row's gradient rows are summed in the global lookup order: the backward calls in order and, within one,
rank 0's lookups first, then rank 1's, ..., each rank's in its own lookup order (token-major, head-minor). With
replicated tokens that is the batch's own order; with per-rank tokens it is the order of one process whose batch
is the ranks' batches concatenated in rank order. With ``reduce="mean"`` (per-rank tokens) each gradient row is
divided by W first (the gradient of the ranks' mean loss, as FSDP2 / DDP average the dense gradients).

What equals one process, bit for bit: row sharding, every rule (each row is updated on one rank, by the same op,
from the same gradient rows in the same order); column sharding, ``SparseSGD`` (elementwise), and Adagrad / Adam
with replicated tokens and no weight decay (every rank holds each looked-up row's whole gradient and computes
``mean(g * g)`` as the op does). Otherwise (per-rank tokens, or weight decay, whose term needs the row's other
columns) a rank sums the squares of its own columns of ``g`` and one all-reduce adds the ranks' partial sums:
``mean(g * g)`` is then summed in another order, equal to one process's within float32 rounding.

State (``optimizer.state[weight]``, plain local tensors of this rank): row sharding, the rule's state for the
rank's rows (``[rows_k]``, ``[rows_k, D]``); column sharding, the per-row ``sum`` / ``exp_avg_sq`` of every row
(``[rows]``, the same on every rank) and ``exp_avg`` of the rank's columns (``[rows, D_k]``). Every rank must run
the backward and the step alike (they are collectives, except row sharding's with replicated tokens).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from .._checks import state_shapes
from ..optim.rowwise import register_sharded_training
from ..reference.table_update import rule_constants, sqrt32
from ..table import Table
from .comm import Comm
from .partition import shard_range
from .table import sharded_weight, table_placement

__all__ = ["optimizer_comm", "local_state_shapes", "route_lookups", "sharded_update", "to_row_shard"]

_COMMS: weakref.WeakKeyDictionary[Table, Comm] = weakref.WeakKeyDictionary()


def optimizer_comm(table: Table) -> Comm:
    """The `Comm` that carries the row optimizers' collectives for the sharded ``table`` (one per table, made on
    first use). Its byte counts say what the training steps sent: ``"table_update_counts"`` (the lookups per
    rank), ``"table_update_ids"``, ``"table_update_grads"`` (gradient rows or columns) and ``"table_update_sq"``
    (the partial sums of squares of column sharding)."""
    comm = _COMMS.get(table)
    if comm is None:
        comm = _COMMS[table] = Comm(sharded_weight(table).device_mesh.get_group())
    return comm


def _mesh_place(table: Table) -> tuple[int, int, str, str]:
    """``(world size, rank, placement, tokens)`` of a sharded table."""
    mesh = sharded_weight(table).device_mesh
    return mesh.size(), mesh.get_local_rank(), str(table_placement(table)), getattr(table, "dtensor_tokens",
                                                                                     "replicated")


def local_state_shapes(table: Table, rule: str) -> tuple[tuple[int, ...], ...]:
    """The shapes of this rank's state tensors of ``rule`` for the sharded ``table`` (see the module docstring)."""
    local = sharded_weight(table).to_local()
    if table_placement(table) == "row":
        return state_shapes(rule, local.shape[0], local.shape[1])
    return {"sgd": (), "adagrad": ((table.num_rows,),),
            "adam": ((table.num_rows, local.shape[1]), (table.num_rows,))}[rule]


def to_row_shard(table: Table, local: torch.Tensor) -> torch.Tensor:
    """Rows `shard_range` (rows, W, rank), whole, of a tensor this rank holds laid out as the table's piece (the
    piece itself, or a state tensor of it): what shard k of a checkpoint in W shards holds. Row sharding: ``local``
    as it is. Column sharding: a ``[rows]`` tensor's slice (every rank holds it whole), and a ``[rows, D_k]`` one
    (the piece, ``exp_avg``) turned from columns to rows by an all-to-all (a collective, for saving)."""
    W, rank, placement, _ = _mesh_place(table)
    if placement == "row":
        return local
    if local.dim() == 1:
        a, b = shard_range(table.num_rows, W, rank)
        return local[a:b]
    mesh = sharded_weight(table).device_mesh
    rows, D = table.num_rows, table.dim
    whole = DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=torch.Size((rows, D)), stride=(D, 1))
    return whole.redistribute(mesh, [Shard(0)]).to_local()


# ---- the backward: where each lookup's gradient goes --------------------------------------------------------
def route_lookups(table: Table, ids: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What this rank keeps of one backward call's lookups (ids ``[M]``, gradient rows ``[M, D]``) for the step.

    Row sharding: ``(local row ids, gradient rows)`` of the lookups of this rank's rows, in the global order.
    Column sharding: ``(global row ids, gradient rows)`` of every lookup of every rank, the rows whole (replicated
    tokens) or this rank's columns of them (per-rank tokens). A collective with per-rank tokens.
    """
    W, rank, placement, tokens = _mesh_place(table)
    if tokens == "sharded" and getattr(table, "dtensor_reduce", "mean") == "mean" and W > 1:
        grad = grad / W                                   # the gradient of the ranks' mean loss
    if placement == "row":
        start, stop = shard_range(table.num_rows, W, rank)
        if tokens == "replicated":                        # every rank has every lookup: keep its own rows
            keep = ((ids >= start) & (ids < stop)).nonzero().squeeze(1)
            return ids[keep] - start, grad[keep]
        return _to_owners(table, ids, grad, W, start)
    if tokens == "replicated":
        return ids, grad
    return _columns_to_owners(table, ids, grad, W, rank)


def _to_owners(table: Table, ids: torch.Tensor, grad: torch.Tensor, world_size: int, start: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Row sharding, per-rank tokens: every lookup's gradient row to the row's owner (an all-to-all)."""
    comm = optimizer_comm(table)
    size = shard_range(table.num_rows, world_size, 0)[1]  # rows per rank: rank k owns [k * size, (k + 1) * size)
    owner = ids.long() // size
    order = torch.argsort(owner, stable=True)             # by owner; each owner's lookups in lookup order
    counts = torch.bincount(owner, minlength=world_size)
    ones = [1] * world_size
    got_counts = comm.all_to_all(counts, ones, ones, "table_update_counts")
    send, recv = counts.tolist(), got_counts.tolist()
    got_ids = comm.all_to_all(ids[order], send, recv, "table_update_ids")          # rank 0's first, then 1's ...
    got_grad = comm.all_to_all(grad[order], send, recv, "table_update_grads")
    return got_ids - start, got_grad


def _columns_to_owners(table: Table, ids: torch.Tensor, grad: torch.Tensor, world_size: int, rank: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Column sharding, per-rank tokens: every rank's ids (all-gather) and this rank's columns of every rank's
    gradient rows (an all-to-all: rank j gets columns ``shard_range(D, world_size, j)`` of each row)."""
    comm = optimizer_comm(table)
    M = ids.shape[0]
    counts = comm.all_gather(torch.tensor([M], dtype=torch.int64, device=ids.device),
                             "table_update_counts").reshape(-1).tolist()
    all_ids = comm.all_gather_rows(ids, counts, "table_update_ids")
    cols = [shard_range(table.dim, world_size, r) for r in range(world_size)]
    send = torch.cat([grad[:, a:b].reshape(-1) for a, b in cols])                   # to rank 0, to rank 1, ...
    width = cols[rank][1] - cols[rank][0]
    got = comm.all_to_all(send, [M * (b - a) for a, b in cols], [n * width for n in counts], "table_update_grads")
    return all_ids, got.reshape(sum(counts), width)


# ---- the step -----------------------------------------------------------------------------------------------
def sharded_update(table: Table, ids: torch.Tensor, grad: torch.Tensor, state: tuple[torch.Tensor, ...], op: Any,
                   *, rule: str, lr: float, weight_decay: float, eps: float, betas: tuple[float, float],
                   step: int) -> None:
    """One step on this rank's piece of ``table`` from what `route_lookups` kept (concatenated over the backward
    calls), with this rank's ``state``: row sharding through the backend's ``table_update`` (``op``); column
    sharding as that op's formulas on this rank's columns (see the module docstring)."""
    local = sharded_weight(table).to_local()                 # updated in place: the DTensor's own piece
    if table_placement(table) == "row":
        op(local, ids, grad, state, rule=rule, lr=lr, weight_decay=weight_decay, eps=eps, betas=betas, step=step,
           validate=False)
        return
    _column_update(table, local, ids, grad, state, rule=rule, lr=lr, weight_decay=weight_decay, eps=eps,
                   betas=betas, step=step)


def _column_update(table: Table, w: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor,
                   state: tuple[torch.Tensor, ...], *, rule: str, lr: float, weight_decay: float, eps: float,
                   betas: tuple[float, float], step: int) -> None:
    """``ple.vectorized.table_update``'s formulas, in the same order and rounding, on this rank's columns ``w``
    ``[rows, D_k]`` of the rows ``ids`` (every rank the same ids); ``mean(g * g)`` over the row's D values comes
    from the whole gradient rows, or from the ranks' partial sums (one all-reduce of ``[M]`` floats)."""
    M = ids.shape[0]
    if M == 0:                                               # every rank has the same lookups: none all-reduces
        return
    W, rank, _, _ = _mesh_place(table)
    D = table.dim
    c0, c1 = shard_range(D, W, rank)
    whole = grad.shape[1] == D                               # every lookup's whole gradient row is here
    k = rule_constants(rule, lr, weight_decay, eps, betas, step)
    rows, order = torch.sort(ids.long(), stable=True)       # equal ids in lookup order
    starts = torch.ones(M, dtype=torch.bool, device=w.device)
    starts[1:] = rows[1:] != rows[:-1]
    run = torch.cumsum(starts, 0) - 1
    sums = torch.zeros(M, grad.shape[1], dtype=torch.float32, device=w.device)
    sums.index_add_(0, run, grad[order].float())             # each row's gradient rows, in lookup order
    g_row = sums[run]
    g = g_row[:, c0:c1] if whole else g_row                  # this rank's columns of g
    wr = w[rows].float()
    if weight_decay != 0:
        g = g + k["weight_decay"] * wr
    if rule == "sgd":
        w.index_put_((rows,), (wr - k["lr"] * g).to(w.dtype))
        return
    if whole and weight_decay == 0:
        sq = (g_row * g_row).mean(dim=1)                     # as one process computes it
    else:
        sq = (g * g).sum(dim=1)                              # this rank's columns; the ranks' sum, over D
        sq = optimizer_comm(table).all_reduce(sq, "table_update_sq") / D
    if rule == "adagrad":
        (s,) = state
        s_r = s[rows] + sq
        new = wr - (k["lr"] * g) / (sqrt32(s_r) + k["eps"])[:, None]
        s.index_put_((rows,), s_r)
    else:
        m, v = state
        m_r = k["b1"] * m[rows] + k["one_minus_b1"] * g
        v_r = k["b2"] * v[rows] + k["one_minus_b2"] * sq
        m_hat = m_r / k["correction1"]
        v_hat = v_r / k["correction2"]
        new = wr - (k["lr"] * m_hat) / (sqrt32(v_hat) + k["eps"])[:, None]
        m.index_put_((rows,), m_r)
        v.index_put_((rows,), v_r)
    w.index_put_((rows,), new.to(w.dtype))


register_sharded_training(sys.modules[__name__])
