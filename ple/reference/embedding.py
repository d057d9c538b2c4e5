"""The n-gram embedding lookup: gather each token's NH table rows and concatenate them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _checks

__all__ = ["embedding_lookup"]


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
