"""The two ways a rank gets the conv inputs it does not own, both differentiable.

* `halo_exchange`: point to point; a rank receives only the (at most S) rows
  before its first row that belong to the same request, from the rank(s) that
  own them. Backward sends the halo's gradient back to those ranks, which add it
  to the gradient of the rows they sent.
* `all_gather_rows`: every rank receives every row (the simple baseline, what
  the serving layer this grew from does). Backward is a reduce-scatter: each
  rank gets the sum over ranks of the gradient of its own rows.

Every rank of the group must call these in the same order, forward and
backward alike (run backward on every rank, as data-parallel training does).
"""

from __future__ import annotations

import torch

from .comm import Comm
from .partition import HaloPlan

__all__ = ["halo_exchange", "all_gather_rows"]


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan: HaloPlan, comm: Comm, category: str):
        halo = x.new_empty((plan.num_recv, *x.shape[1:]))
        comm.exchange([(dst, x[lo:hi]) for dst, lo, hi in plan.sends],
                      [(src, halo[o:o + n]) for src, o, n in plan.recvs], category)
        ctx.plan, ctx.comm, ctx.category, ctx.rows = plan, comm, category, x.shape[0]
        return halo

    @staticmethod
    def backward(ctx, grad_halo):
        plan = ctx.plan
        grad_halo = grad_halo.contiguous()
        grad_x = grad_halo.new_zeros((ctx.rows, *grad_halo.shape[1:]))
        back = [grad_halo.new_empty((hi - lo, *grad_halo.shape[1:])) for _, lo, hi in plan.sends]
        ctx.comm.exchange([(src, grad_halo[o:o + n]) for src, o, n in plan.recvs],
                          [(dst, b) for (dst, _, _), b in zip(plan.sends, back, strict=True)],
                          ctx.category + "_grad")
        for (_, lo, hi), b in zip(plan.sends, back, strict=True):   # a row may sit in several halos
            grad_x[lo:hi] += b
        return grad_x, None, None, None


def halo_exchange(x: torch.Tensor, plan: HaloPlan, comm: Comm, category: str = "conv_halo") -> torch.Tensor:
    """This rank's halo rows ``[plan.num_recv, ...]``, received from the ranks that own them.

    ``x`` is this rank's rows (``[T_k, ...]``); ``plan`` comes from `halo_plan`.
    Differentiable in ``x`` (the halo's gradient flows back to its owners).
    """
    return _HaloExchange.apply(x, plan, comm, category)


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts: list[int], comm: Comm, category: str):
        ctx.counts, ctx.comm, ctx.category = counts, comm, category
        return comm.all_gather_rows(x, counts, category)

    @staticmethod
    def backward(ctx, grad_full):
        counts, comm = ctx.counts, ctx.comm
        m = max(counts)
        padded = grad_full.new_zeros((comm.world_size * m, *grad_full.shape[1:]))
        off = 0
        for r, n in enumerate(counts):
            padded[r * m: r * m + n] = grad_full[off:off + n]
            off += n
        grad_x = comm.reduce_scatter(padded, ctx.category + "_grad")[: counts[comm.rank]]
        return grad_x, None, None, None


def all_gather_rows(x: torch.Tensor, counts: list[int], comm: Comm,
                    category: str = "conv_allgather") -> torch.Tensor:
    """Every rank's rows in rank order (``[sum(counts), ...]``); rank r holds ``counts[r]`` of them.

    Differentiable: the gradient of this rank's rows is the sum over ranks of the
    gradient of their copy.
    """
    return _AllGatherRows.apply(x, counts, comm, category)
