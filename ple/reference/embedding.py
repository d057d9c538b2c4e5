"""The n-gram embedding lookup: gather each token's NH table rows and concatenate them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _checks

__all__ = ["embedding_lookup", "embedding_lookup_sparse_grad"]


def check_lookup_args(weight, ids):
    _checks.tensor("weight", weight, ndim=2)
    _checks.tensor("ids", ids, ndim=2, kind="anyint", device=weight.device)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]):
        raise ValueError(f"ids: rows must lie in [0, {weight.shape[0]}), got min {int(ids.min())} "
                         f"and max {int(ids.max())}")


def embedding_lookup(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``weight[ids]`` flattened per token: ``[rows, D]`` and ``[T, NH]`` give ``[T, NH * D]``.

    Head h's row occupies columns ``[h * D, (h + 1) * D)``. Autograd reaches ``weight``.
    """
    check_lookup_args(weight, ids)
    T, NH = ids.shape
    return F.embedding(ids.long(), weight).reshape(T, NH * weight.shape[1])


class _SparseGradLookup(torch.autograd.Function):
    """Forward: any lookup op; backward: the table gradient as a sparse COO tensor of the looked-up rows."""

    @staticmethod
    def forward(ctx, weight, ids, lookup):
        ctx.save_for_backward(ids)
        ctx.table_shape = tuple(weight.shape)
        return lookup(weight.detach(), ids)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        T, NH = ids.shape                       # tokens, hash heads
        rows, D = ctx.table_shape
        indices = ids.reshape(1, T * NH).to(torch.int64)
        values = grad.reshape(T * NH, D)        # head h of token t is columns [h * D, (h + 1) * D)
        return torch.sparse_coo_tensor(indices, values, (rows, D)), None, None


def embedding_lookup_sparse_grad(weight: torch.Tensor, ids: torch.Tensor, lookup=embedding_lookup) -> torch.Tensor:
    """``lookup(weight, ids)`` whose table gradient is sparse: only the T * NH rows looked up.

    For very large tables (the real model's has 320M rows): the dense gradient would be as
    large as the table. The gradient is an uncoalesced ``torch.sparse_coo_tensor`` (repeated
    rows are summed when it is coalesced, e.g. by ``torch.optim.SparseAdam``); its dense
    value equals the dense gradient. ``lookup`` is the backend's ``embedding_lookup``.
    """
    check_lookup_args(weight, ids)
    return _SparseGradLookup.apply(weight, ids, lookup)
