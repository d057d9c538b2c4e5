"""The n-gram embedding lookup: gather each token's NH table rows and concatenate them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _checks

__all__ = ["embedding_lookup", "embedding_lookup_sparse_grad"]


def embedding_lookup(weight: torch.Tensor, ids: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
    """``weight[ids]`` flattened per token: ``[rows, D]`` and ``[T, NH]`` give ``[T, NH * D]``.

    Head h's row occupies columns ``[h * D, (h + 1) * D)``. Autograd reaches ``weight``.

    ``validate=False`` skips the value checks (the range of ``ids``); for callers that
    validated on the host, e.g. ``PLECache.schedule``; out-of-range values are
    then undefined behaviour.
    """
    (_checks.lookup_call if validate else _checks.lookup_meta)(weight, ids)
    (T, NH), D = ids.shape, weight.shape[1]
    return F.embedding(ids.long(), weight).reshape(T, NH * D)


class _SparseGradLookup(torch.autograd.Function):
    """Forward: any lookup op; backward: the table gradient as a sparse COO tensor of the looked-up rows."""

    @staticmethod
    def forward(ctx, weight, ids, lookup):
        detached = weight.detach() if isinstance(weight, torch.Tensor) else weight
        out = lookup(detached, ids)                 # validates the call
        ctx.save_for_backward(ids)
        ctx.table_shape = tuple(weight.shape)
        return out

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
    return _SparseGradLookup.apply(weight, ids, lookup)    # ``lookup`` validates the call
