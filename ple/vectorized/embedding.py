"""``embedding_lookup`` as one ``F.embedding`` gather, and ``ngram_embedding``, its composition with
``ngram_ids`` (docs/spec.md section 7), checked once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _checks
from .. import reference as _reference
from ..backends import twin
from ..reference.hashing import HashParams
from .hashing import _ngram_ids

__all__ = ["embedding_lookup", "ngram_embedding"]


@twin(_reference.embedding_lookup)
def embedding_lookup(weight: torch.Tensor, ids: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
    """One path: one ``F.embedding`` gather of the ids (as int64), reshaped to ``[T, NH * D]``; its autograd
    is ``F.embedding``'s, a dense ``[rows, D]`` gradient for ``weight``. The checks read the ids on the host
    once (``validate=True``); with ``validate=False`` nothing is read back. Any device and dtype."""
    (_checks.lookup_call if _checks.validating(validate) else _checks.lookup_meta)(weight, ids)
    return _embedding_lookup(weight, ids)


def _embedding_lookup(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The body of `embedding_lookup`, for a call already checked."""
    (T, NH), D = ids.shape, weight.shape[1]
    return F.embedding(ids.long(), weight).reshape(T, NH * D)


@twin(_reference.ngram_embedding)
def ngram_embedding(weight: torch.Tensor, input_ids: torch.Tensor, params: HashParams, *, heads_per_ngram: int,
                    eos_token_id: int, query_start_loc: torch.Tensor | None = None,
                    ngram_context: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """Not fused: the call is checked once (the table's row count included), then the bodies of this
    backend's ``ngram_ids`` and ``embedding_lookup`` run unchecked, so the int64 ids ``[T, NH]`` are made
    in memory and then gathered with ``F.embedding`` (autograd: its dense gradient). As in those ops, with
    ``validate=False`` nothing is read back to the host."""
    # Checked once, the table's row count included (weight=), then the two ops' bodies run unchecked.
    check = _checks.ngram_call if _checks.validating(validate) else _checks.ngram_meta
    check(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context, weight=weight)
    ids = _ngram_ids(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context)
    return _embedding_lookup(weight, ids)
