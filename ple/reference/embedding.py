"""The n-gram embedding lookup (SPEC section 3): gather each token's NH table rows and concatenate them.

``embedding_lookup`` gathers rows by id; ``ngram_embedding`` is the composition
``ngram_ids -> embedding_lookup``; ``embedding_lookup_sparse_grad`` wraps any backend's lookup
so that the table's gradient is sparse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import _checks
from .hashing import HashParams, ngram_ids

__all__ = ["embedding_lookup", "ngram_embedding", "embedding_lookup_sparse_grad"]


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


def ngram_embedding(weight: torch.Tensor, input_ids: torch.Tensor, params: HashParams, *, heads_per_ngram: int,
                    eos_token_id: int, query_start_loc: torch.Tensor | None = None,
                    ngram_context: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """Each token's n-gram embedding, ``[T, NH * D]``: ``embedding_lookup(weight, ngram_ids(input_ids, params, ...))``.

    Arguments as in ``ngram_ids``; ``weight`` is the table ``[rows, D]`` and must hold every row
    the hash addresses (``head_offsets[-1] + head_sizes[-1]`` rows, else ``ValueError``). Token t's
    head h is its row ``ngram_ids(...)[t, h]`` of the table, in columns ``[h * D, (h + 1) * D)``.
    Autograd reaches ``weight``. A backend may fuse the two (``ple.fast`` hashes and gathers in
    one kernel, never writing the ids to memory); the result is this one, bit for bit (a gather
    is a copy).

    ``validate=False`` skips the value checks (token id ranges, offsets, the table's row count);
    out-of-range values are then undefined behaviour.
    """
    (_checks.ngram_call if validate else _checks.ngram_meta)(input_ids, params, heads_per_ngram, eos_token_id,
                                                             query_start_loc, ngram_context, weight=weight)
    # The composition; the check above covers both (with weight=, that the table holds every hashed row).
    ids = ngram_ids(input_ids, params, heads_per_ngram=heads_per_ngram, eos_token_id=eos_token_id,
                    query_start_loc=query_start_loc, ngram_context=ngram_context, validate=False)
    return embedding_lookup(weight, ids, validate=False)


class _SparseGradLookup(torch.autograd.Function):
    """Forward: any lookup op; backward: the table gradient as a sparse COO tensor of the looked-up rows."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, ids: torch.Tensor,
                lookup: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        detached = weight.detach() if isinstance(weight, torch.Tensor) else weight
        out = lookup(detached, ids)                 # validates the call
        ctx.save_for_backward(ids)
        ctx.table_shape = tuple(weight.shape)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (ids,) = ctx.saved_tensors
        T, NH = ids.shape                       # tokens, hash heads
        rows, D = ctx.table_shape
        indices = ids.reshape(1, T * NH).to(torch.int64)
        values = grad.reshape(T * NH, D)        # head h of token t is columns [h * D, (h + 1) * D)
        return torch.sparse_coo_tensor(indices, values, (rows, D)), None, None


def embedding_lookup_sparse_grad(weight: torch.Tensor, ids: torch.Tensor,
                                 lookup: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = embedding_lookup
                                 ) -> torch.Tensor:
    """``lookup(weight, ids)`` whose table gradient is sparse: only the T * NH rows looked up.

    For very large tables (the real model's has 320M rows): the dense gradient would be as
    large as the table. The gradient is an uncoalesced ``torch.sparse_coo_tensor`` (repeated
    rows are summed when it is coalesced, e.g. by ``torch.optim.SparseAdam``); its dense
    value equals the dense gradient. ``lookup`` is the backend's ``embedding_lookup``.
    """
    return _SparseGradLookup.apply(weight, ids, lookup)    # ``lookup`` validates the call
