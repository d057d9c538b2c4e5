"""Sequence parallelism for training: a packed batch's tokens split across ranks.

The packed batch (``T`` tokens, sequences cut by ``cu_seqlens``, as
`dilated_causal_conv` takes it) is split by rows: rank ``k`` holds rows
``[bounds[k], bounds[k + 1])`` (default: the balanced split `even_bounds`).
Everything in the layer is row-local except two things that look back:

* the n-gram window needs the N-1 tokens before a rank's first token;
* the conv needs the S = (K-1)*d conv inputs before it.

Both come from the previous rank(s) as a *halo*, point to point, and only for
the sequence that crosses the rank's first row (a rank whose first row starts a
sequence needs none). ``exchange="allgather"`` all-gathers every conv input
instead (the simple baseline). With a sharded table (a DTensor, ``ple.distributed.table``)
the lookup is `local_token_rows` (ids all-gathered, rows reduce-scattered or exchanged).

Gradients: each rank's loss covers its own rows; after ``backward`` on every
rank, `sync_grads` sums the replicated parameters' gradients over the group
(what data parallelism does), and then they equal one process's gradients of the
summed loss. A sharded table's gradient is already complete for its rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import _checks
from .comm import Comm, GroupLike, as_comm
from .exchange import all_gather_rows, halo_exchange
from .partition import check_bounds, even_bounds, fragments, halo_plan
from .table import local_token_rows, sharded_weight

if TYPE_CHECKING:
    from ..layer import PLELayer

__all__ = ["sp_forward", "sp_dilated_causal_conv", "sync_grads", "resolve_comm", "EXCHANGES"]

EXCHANGES = ("halo", "allgather")


def resolve_comm(layer: PLELayer, group: GroupLike) -> Comm:
    """The `Comm` sequence parallelism runs on: ``group`` (a `Comm`, a process group or a 1-D ``DeviceMesh``), or
    without one the sharded table's mesh, or the default group.

    A sharded table must be split over the same ranks, in the same order.
    """
    mesh = sharded_weight(layer.table).device_mesh if layer.table.is_dtensor else None
    if group is None and mesh is not None:
        return as_comm(mesh)
    comm = as_comm(group)
    if mesh is not None:                                            # ranks of both, from the host: no tensor read
        ranks = dist.get_process_group_ranks(comm.group if comm.group is not None else dist.group.WORLD)
        table_ranks = dist.get_process_group_ranks(mesh.get_group())
        if list(ranks) != list(table_ranks):
            raise ValueError(f"group: the table is sharded over ranks {list(table_ranks)}, the sequence is split "
                             f"over ranks {list(ranks)}; use one group for both")
    return comm


def _cumsum(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def local_ngram_ids(layer: PLELayer, input_ids: torch.Tensor, query_start_loc_list: list[int],
                    contexts: torch.Tensor | list[list[int]], *, validate: bool = True) -> torch.Tensor:
    """Hash ids ``[T_k, NH]`` of this rank's request pieces, cut by ``query_start_loc_list`` (their offsets in
    this rank's rows), each with its n-gram context (``contexts``: a ``[pieces, N-1]`` int64 tensor on the
    tokens' device, or nested lists)."""
    cfg = layer.config
    dev = input_ids.device
    if len(query_start_loc_list) == 1:                                # no rows here (the ops want a request)
        return torch.zeros((0, cfg.num_ngram_heads), dtype=torch.int64, device=dev)
    if not isinstance(contexts, torch.Tensor):
        contexts = torch.tensor(contexts, dtype=torch.int64, device=dev).reshape(len(contexts), cfg.context_len)
    return layer.ops.ngram_ids(
        input_ids, layer.ple_embedding.hash_params(), heads_per_ngram=cfg.heads_per_ngram,
        eos_token_id=cfg.eos_token_id, query_start_loc=torch.tensor(query_start_loc_list, device=dev),
        ngram_context=contexts, validate=validate)


def _embed(layer, ids: torch.Tensor, dtype: torch.dtype, counts: list[int], comm: Comm) -> torch.Tensor:
    """Rows of this rank's ids: a sharded table's `local_token_rows` (counts from the split, so no host sync; the
    table's gradient is the sum over ranks, as `sync_grads` sums the others; bytes counted on ``comm``)."""
    if layer.table.is_dtensor:
        return local_token_rows(layer, ids, dtype, counts=counts, reduce="sum", comm=comm)
    return layer.embed(ids, dtype, validate=False)                  # ids of the layer's own hash


def _host_offsets(name: str, values, total: int | None = None) -> list[int]:
    """Offsets given on the host (a list or tuple of ints): validated without touching a device."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError(f"{name}: expected a list of ints or an int tensor, got {values!r}")
    if len(values) < 1:
        raise ValueError(f"{name}: expected at least one offset (0), got {values!r}")
    q = list(values)
    if q[0] != 0 or any(b < a for a, b in zip(q, q[1:])):
        raise ValueError(f"{name}: expected non-decreasing offsets from 0, got {q}")
    if total is not None and q[-1] != total:
        raise ValueError(f"{name}: expected to end at the number of rows {total}, got {q[-1]}")
    return q


def sp_forward(layer: PLELayer, hidden_states: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
               group: GroupLike = None, *, bounds: list[int] | None = None, exchange: str = "halo",
               validate: bool = True) -> torch.Tensor:
    """This rank's rows of ``layer`` over a packed batch split across ranks: ``[T_k, C] -> [T_k, C]``.

    ``hidden_states`` ``[T_k, C]`` and ``input_ids`` ``[T_k]`` are this rank's rows;
    ``cu_seqlens`` (``[R + 1]``, the whole batch's sequence offsets, the same on every
    rank) cuts the ``T = cu_seqlens[-1]`` rows into sequences, each from its start.
    ``bounds`` (``[W + 1]``) is the split (default `even_bounds(T, W)`); a rank may
    hold no rows. The result equals rows ``[bounds[k], bounds[k + 1])`` of ``layer``
    run over each whole sequence in one process. Autograd reaches every parameter,
    ``hidden_states`` and (through the halo) the other ranks' rows.

    ``group``: a process group, a `Comm`, or a 1-D ``DeviceMesh`` (its group; default: a
    sharded table's mesh, else the default group). The layer's table may be whole or sharded
    (a DTensor, rows or columns, float or quantized: ``TableRowwise`` / ``TableColwise``; its
    lookup is then `local_token_rows` with the split's counts).

    Host syncs: none in forward or backward when ``cu_seqlens`` is a Python list (the
    batch's metadata, on the host) and ``validate=False`` (token ids not range-checked; a
    tensor ``cu_seqlens`` costs one device-to-host copy, ``validate=True`` one read of the
    tokens). The n-gram context from the token halo is assembled on the device.
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange: expected one of {EXCHANGES}, got {exchange!r}")
    comm = resolve_comm(layer, group)
    layer._check_hidden(hidden_states, 2)
    dev = hidden_states.device
    if isinstance(cu_seqlens, (list, tuple)):                       # host metadata: no device read at all
        cu_seqlens_list = _host_offsets("cu_seqlens", cu_seqlens)
        total = cu_seqlens_list[-1]
    else:
        _checks.tensor("cu_seqlens", cu_seqlens, ndim=1, kind="int", device=dev)
        host = _checks.host_list(cu_seqlens)                         # one device-to-host copy
        total = host[-1] if host else 0
        cu_seqlens_list = _checks.offsets_arg("cu_seqlens", cu_seqlens, total=total, device=dev,
                                              host={"cu_seqlens": host})
    W, k = comm.world_size, comm.rank
    bounds = even_bounds(total, W) if bounds is None else check_bounds("bounds", bounds, total, W)
    lo, hi = bounds[k], bounds[k + 1]
    Tk = hi - lo
    if hidden_states.shape[0] != Tk:
        raise ValueError(f"hidden_states: rank {k} holds rows [{lo}, {hi}) of the batch, expected {Tk} rows, "
                         f"got {hidden_states.shape[0]}")
    _checks.tensor("input_ids", input_ids, ndim=1, kind="anyint", device=dev, shape=(Tk,))

    cfg = layer.config
    ops = layer.ops
    N1, eos = cfg.context_len, cfg.eos_token_id
    frags = fragments(cu_seqlens_list, lo, hi)
    local_cu_seqlens_list = _cumsum(b - a for _, a, b in frags)            # the pieces' offsets in our rows

    # n-gram context of a sequence continued from an earlier rank: its last N-1 tokens there.
    tok_plan = halo_plan(bounds, cu_seqlens_list, N1, k)
    tok_halo = halo_exchange(input_ids.to(torch.int64), tok_plan, comm, "token_halo")
    ctx = torch.full((len(frags), N1), eos, dtype=torch.int64, device=dev)
    if frags and tok_plan.num_recv:                                  # on the device: no host read of the halo
        ctx[0] = torch.cat([ctx[0], tok_halo])[-N1:]
    ids = local_ngram_ids(layer, input_ids, local_cu_seqlens_list, ctx, validate=validate)
    counts = [bounds[r + 1] - bounds[r] for r in range(W)]
    emb = _embed(layer, ids, hidden_states.dtype, counts, comm)           # [T_k, E]
    gated, conv_input = layer.gate(emb, hidden_states)                   # [T_k, C] each
    y = sp_dilated_causal_conv(conv_input, layer.conv_weights, dilation=cfg.conv_dilation,
                               cu_seqlens=cu_seqlens_list, group=comm, bounds=bounds, exchange=exchange, ops=ops)
    return (gated + y) + hidden_states


def sp_dilated_causal_conv(x: torch.Tensor, weight: torch.Tensor, *, dilation: int,
                           cu_seqlens: torch.Tensor | list[int], group: GroupLike = None,
                           bounds: list[int] | None = None, exchange: str = "halo",
                           ops: Any = None) -> torch.Tensor:
    """`dilated_causal_conv` of a packed batch split across ranks: this rank's ``y`` rows ``[T_k, C]``.

    ``x`` is this rank's rows ``[T_k, C]`` of the packed ``[T, C]`` batch whose
    sequences ``cu_seqlens`` cuts (a list or a tensor, the whole batch's, the same on
    every rank); ``bounds`` is the split (default `even_bounds`). ``exchange="halo"``
    receives at most S = (K-1)*d rows, only for a sequence that crosses this rank's
    first row; ``"allgather"`` gathers every row. Autograd flows back through either
    exchange to the rank that owns each row. ``ops`` is the op module (default: the
    reference).
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange: expected one of {EXCHANGES}, got {exchange!r}")
    if ops is None:
        from .. import reference as ops
    comm = as_comm(group)
    cu_seqlens_list = list(cu_seqlens) if isinstance(cu_seqlens, (list, tuple)) else _checks.host_list(cu_seqlens)
    W, k = comm.world_size, comm.rank
    total = cu_seqlens_list[-1]
    bounds = even_bounds(total, W) if bounds is None else check_bounds("bounds", bounds, total, W)
    lo, hi = bounds[k], bounds[k + 1]
    if x.shape[0] != hi - lo:
        raise ValueError(f"x: rank {k} holds rows [{lo}, {hi}), expected {hi - lo} rows, got {x.shape[0]}")
    dev = x.device
    S = (weight.shape[1] - 1) * dilation
    if exchange == "allgather":
        counts = [bounds[r + 1] - bounds[r] for r in range(W)]
        full = all_gather_rows(x, counts, comm, "conv_allgather")            # [T, C]
        return ops.dilated_causal_conv(full, weight, dilation=dilation,
                                       cu_seqlens=torch.tensor(cu_seqlens_list, device=dev), validate=False)[lo:hi]
    plan = halo_plan(bounds, cu_seqlens_list, S, k)
    halo = halo_exchange(x, plan, comm, "conv_halo")                         # [<= S, C]
    ext = torch.cat([halo, x], dim=0)
    lens = [b - a for _, a, b in fragments(cu_seqlens_list, lo, hi)]
    if not lens:                                                              # no rows here (and no halo)
        return ext
    lens[0] += plan.num_recv                                                  # the halo opens the first piece
    y = ops.dilated_causal_conv(ext, weight, dilation=dilation,                # offsets of our own split
                                cu_seqlens=torch.tensor(_cumsum(lens), device=dev), validate=False)
    return y[plan.num_recv:]


def sync_grads(module: torch.nn.Module, group: GroupLike = None) -> None:
    """Sum every replicated parameter's gradient over the group, in place (after sequence-parallel backward).

    DTensor parameters (sharded tables) are skipped: their gradients are already complete for
    their rows (or columns). A parameter that needs a gradient but got none here (a rank with no
    rows) counts as zero, so every rank makes the same calls.
    """
    comm = as_comm(group)
    sharded = {id(p) for p in module.parameters() if isinstance(p, DTensor)}                  # sharded tables
    for p in module.parameters():
        if id(p) in sharded or not p.requires_grad:
            continue
        g = torch.zeros_like(p) if p.grad is None else p.grad.contiguous()
        comm.all_reduce(g, "grad_sync")
        p.grad = g
