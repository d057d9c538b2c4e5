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
instead (the simple baseline). With a `ShardedPLELayer` the table lookup is the
sequence-parallel one (ids all-gathered, embeddings reduce-scattered).

Gradients: each rank's loss covers its own rows; after ``backward`` on every
rank, `sync_grads` sums the replicated parameters' gradients over the group
(what data parallelism does), and then they equal one process's gradients of the
summed loss. A sharded table's gradient is already complete for its rows.
"""

from __future__ import annotations

import torch

from .. import _checks
from .comm import Comm, as_comm
from .exchange import all_gather_rows, halo_exchange
from .partition import check_bounds, even_bounds, fragments, halo_plan
from .table import ShardedPLELayer, ShardedTable

__all__ = ["sp_forward", "sp_dilated_causal_conv", "sync_grads", "resolve_comm", "EXCHANGES"]

EXCHANGES = ("halo", "allgather")


def resolve_comm(layer, group) -> Comm:
    """The `Comm` sequence parallelism runs on: ``group`` (a `Comm` or a process group) or the default group.

    A `ShardedPLELayer`'s table must live on the same process group.
    """
    if group is None and isinstance(layer, ShardedPLELayer):
        return layer.comm
    comm = as_comm(group)
    if isinstance(layer, ShardedPLELayer) and comm.group is not layer.comm.group:
        raise ValueError("group: a sharded layer's table must be split over the sequence-parallel group")
    return comm


def _cumsum(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def local_ngram_ids(layer, input_ids: torch.Tensor, local_starts: list[int], contexts: list[list[int]]):
    """Hash ids ``[T_k, NH]`` of request pieces cut by ``local_starts``, each with its n-gram context."""
    cfg = layer.config
    dev = input_ids.device
    if len(local_starts) == 1:                                  # no rows here (the ops want a request)
        return torch.zeros((0, cfg.num_ngram_heads), dtype=torch.int64, device=dev)
    return layer.ops.ngram_ids(
        input_ids, layer.ple_embedding.hash_params(), heads_per_ngram=cfg.heads_per_ngram,
        eos_token_id=cfg.eos_token_id, query_start_loc=torch.tensor(local_starts, device=dev),
        ngram_context=torch.tensor(contexts, dtype=torch.int64, device=dev).reshape(len(contexts),
                                                                                  cfg.context_len))


def _embed(layer, ids: torch.Tensor, dtype: torch.dtype, counts: list[int]) -> torch.Tensor:
    if isinstance(layer, ShardedPLELayer):
        return layer.embed_sequence_parallel(ids, dtype, counts)
    return layer.embed(ids, dtype)


def sp_forward(layer, hidden_states: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
               group=None, *, bounds: list[int] | None = None, exchange: str = "halo") -> torch.Tensor:
    """This rank's rows of ``layer`` over a packed batch split across ranks: ``[T_k, C] -> [T_k, C]``.

    ``hidden_states`` ``[T_k, C]`` and ``input_ids`` ``[T_k]`` are this rank's rows;
    ``cu_seqlens`` (``[R + 1]``, the whole batch's sequence offsets, the same on every
    rank) cuts the ``T = cu_seqlens[-1]`` rows into sequences, each from its start.
    ``bounds`` (``[W + 1]``) is the split (default `even_bounds(T, W)`); a rank may
    hold no rows. The result equals rows ``[bounds[k], bounds[k + 1])`` of ``layer``
    run over each whole sequence in one process. Autograd reaches every parameter,
    ``hidden_states`` and (through the halo) the other ranks' rows.
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange: expected one of {EXCHANGES}, got {exchange!r}")
    comm = resolve_comm(layer, group)
    layer._check_hidden(hidden_states, 2)
    dev = hidden_states.device
    _checks.tensor("cu_seqlens", cu_seqlens, ndim=1, kind="int", device=dev)
    host = _checks.host_list(cu_seqlens)
    total = host[-1] if host else 0
    starts = _checks.offsets_arg("cu_seqlens", cu_seqlens, total=total, device=dev)
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
    frags = fragments(starts, lo, hi)
    local_starts = _cumsum(b - a for _, a, b in frags)

    # n-gram context of a sequence continued from an earlier rank: its last N-1 tokens there.
    tok_plan = halo_plan(bounds, starts, N1, k)
    tok_halo = halo_exchange(input_ids.to(torch.int64), tok_plan, comm, "token_halo")
    ctx = [[eos] * N1 for _ in frags]
    if frags and tok_plan.num_recv:
        ctx[0] = ([eos] * N1 + tok_halo.tolist())[-N1:]
    ids = local_ngram_ids(layer, input_ids, local_starts, ctx)
    counts = [bounds[r + 1] - bounds[r] for r in range(W)]
    emb = _embed(layer, ids, hidden_states.dtype, counts)                 # [T_k, E]
    gated, conv_input = layer.gate(emb, hidden_states)                   # [T_k, C] each
    y = sp_dilated_causal_conv(conv_input, layer.conv_weights, dilation=cfg.conv_dilation, cu_seqlens=starts,
                               group=comm, bounds=bounds, exchange=exchange, ops=ops)
    return (gated + y) + hidden_states


def sp_dilated_causal_conv(x: torch.Tensor, weight: torch.Tensor, *, dilation: int, cu_seqlens, group=None,
                           bounds: list[int] | None = None, exchange: str = "halo", ops=None) -> torch.Tensor:
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
    starts = list(cu_seqlens) if isinstance(cu_seqlens, (list, tuple)) else _checks.host_list(cu_seqlens)
    W, k = comm.world_size, comm.rank
    bounds = even_bounds(starts[-1], W) if bounds is None else check_bounds("bounds", bounds, starts[-1], W)
    lo, hi = bounds[k], bounds[k + 1]
    if x.shape[0] != hi - lo:
        raise ValueError(f"x: rank {k} holds rows [{lo}, {hi}), expected {hi - lo} rows, got {x.shape[0]}")
    dev = x.device
    S = (weight.shape[1] - 1) * dilation
    if exchange == "allgather":
        counts = [bounds[r + 1] - bounds[r] for r in range(W)]
        full = all_gather_rows(x, counts, comm, "conv_allgather")            # [T, C]
        return ops.dilated_causal_conv(full, weight, dilation=dilation,
                                       cu_seqlens=torch.tensor(starts, device=dev))[lo:hi]
    plan = halo_plan(bounds, starts, S, k)
    halo = halo_exchange(x, plan, comm, "conv_halo")                         # [<= S, C]
    ext = torch.cat([halo, x], dim=0)
    lens = [b - a for _, a, b in fragments(starts, lo, hi)]
    if not lens:                                                              # no rows here (and no halo)
        return ext
    lens[0] += plan.num_recv                                                  # the halo opens the first piece
    y = ops.dilated_causal_conv(ext, weight, dilation=dilation,
                                cu_seqlens=torch.tensor(_cumsum(lens), device=dev))
    return y[plan.num_recv:]


def sync_grads(module: torch.nn.Module, group=None) -> None:
    """Sum every replicated parameter's gradient over the group, in place (after sequence-parallel backward).

    Tables of `ShardedTable` modules are skipped: their gradients are already
    complete for their rows. A parameter that needs a gradient but got none here
    (a rank with no rows) counts as zero, so every rank makes the same calls.
    """
    comm = as_comm(group)
    sharded = {id(m.weight) for m in module.modules() if isinstance(m, ShardedTable)}
    for p in module.parameters():
        if id(p) in sharded or not p.requires_grad:
            continue
        g = torch.zeros_like(p) if p.grad is None else p.grad.contiguous()
        comm.all_reduce(g, "grad_sync")
        p.grad = g
