"""The n-gram embedding lookup: gather each token's NH table rows and concatenate them.

Specified in ``docs/spec.md`` (``../../docs/spec.md`` from this file), sections 3 (the embedding of a
token), 7.4 (``embedding_lookup``) and 7.5 (``ngram_embedding``).

``embedding_lookup`` gathers rows by id; ``ngram_embedding`` is the composition
``ngram_ids -> embedding_lookup`` (its call checked once, then the two ops' bodies);
``embedding_lookup_sparse_grad`` wraps any backend's lookup so that the table's gradient is sparse.
``nf4_dequantize_rows`` (not an op of section 7) turns gathered NF4 rows into values, as docs/spec.md
section 13 states it; the table uses it when it runs on this backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import _checks
from ..quant import NF4_LEVELS
from .hashing import HashParams, _ngram_ids

__all__ = ["embedding_lookup", "ngram_embedding", "embedding_lookup_sparse_grad", "nf4_dequantize_rows"]


def embedding_lookup(weight: torch.Tensor, ids: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
    """``weight[ids]`` flattened per token (docs/spec.md section 7.4): head h's row in columns ``[h * D, (h + 1) * D)``.

    Args:
        weight: the table, ``[rows, D]``, any dtype. Autograd reaches it.
        ids: int32 or int64 ``[T, NH]``, table rows (``ngram_ids``), on ``weight``'s device.
        validate: False skips the value check (the range of ``ids``; the metadata checks still run),
            for callers that validated on the host; out-of-range values are then undefined behaviour.

    Returns:
        ``[T, NH * D]`` in ``weight``'s dtype: a copy of the rows (no rounding).

    Raises:
        TypeError: ``weight`` is not a tensor; ``ids`` is not an int32 / int64 tensor.
        ValueError: ``weight`` is not 2-D; ``ids`` is not 2-D, is on another device than ``weight``
            (or on the meta device), or holds a row outside ``[0, rows)``.

    Example::

        >>> embedding_lookup(torch.arange(12.0).reshape(6, 2), torch.tensor([[5, 0]]))
        tensor([[10., 11.,  0.,  1.]])
    """
    (_checks.lookup_call if _checks.validating(validate) else _checks.lookup_meta)(weight, ids)
    return _embedding_lookup(weight, ids)


def _embedding_lookup(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The body of `embedding_lookup`, for a call already checked."""
    (T, NH), D = ids.shape, weight.shape[1]
    return F.embedding(ids.long(), weight).reshape(T, NH * D)


def ngram_embedding(weight: torch.Tensor, input_ids: torch.Tensor, params: HashParams, *, heads_per_ngram: int,
                    eos_token_id: int, query_start_loc: torch.Tensor | None = None,
                    ngram_context: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """Each token's n-gram embedding: ``embedding_lookup(weight, ngram_ids(input_ids, params, ...))``
    (docs/spec.md section 7.5).

    Token t's head h is its row ``ngram_ids(...)[t, h]`` of the table, in columns ``[h * D, (h + 1) * D)``.
    A backend may fuse the two (``ple.fast`` hashes and gathers in one kernel, never writing the
    ids to memory); the result is this one, bit for bit (a gather is a copy).

    Args:
        weight: the table, ``[rows, D]``, on ``input_ids``' device; it must hold every row the hash
            addresses: ``rows >= head_offsets[-1] + head_sizes[-1]``. Autograd reaches it.
        input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context: as in
            ``ngram_ids``.
        validate: False skips the value checks (token id ranges, offsets, the
            table's row count; the metadata checks still run); out-of-range values are then undefined
            behaviour.

    Returns:
        ``[T, NH * D]`` in ``weight``'s dtype.

    Raises:
        TypeError, ValueError: every error of ``ngram_ids``, for the same arguments.
        TypeError: ``weight`` is not a tensor.
        ValueError: ``weight`` is not 2-D, is on another device than ``input_ids``, or has fewer rows than
            the hash addresses (``head_offsets[-1] + head_sizes[-1]``).

    Example::

        >>> params = hash_params(PLEConfig.preset("tiny"), 0)                      # 6128 rows, NH = 6
        >>> ngram_embedding(torch.randn(6128, 4), torch.tensor([5, 7]), params, heads_per_ngram=3,
        ...                 eos_token_id=2).shape
        torch.Size([2, 24])
    """
    check = _checks.ngram_call if _checks.validating(validate) else _checks.ngram_meta
    check(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context, weight=weight)
    # The composition, checked once above (with weight=: also that the table holds every hashed row), so the
    # two ops' bodies run unchecked.
    ids = _ngram_ids(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context)
    return _embedding_lookup(weight, ids)


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


def nf4_dequantize_rows(rows: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Gathered NF4 rows -> their values (docs/spec.md section 13): uint8 ``[T, NH * (D/2 + 4)]`` -> ``[T, NH * D]``.

    The reference statement of the unpacking, step by step: each stored row of ``D/2 + 4``
    bytes holds value ``2i`` in the low nibble of byte ``i`` and value ``2i+1`` in its high
    nibble (a code 0..15 into ``ple.quant.NF4_LEVELS``, float32), its scale as a
    little-endian float16 in bytes ``D/2`` and ``D/2 + 1``, then two zero bytes. A value is
    ``level[code] * float(scale)`` in float32, rounded once to ``dtype``. ``ple.quant.dequantize_rows``
    (the other backends') gives the same bits, vectorised.

    Args:
        rows: uint8 ``[T, NH * (D/2 + 4)]``, NF4 rows as the table stores them (e.g. gathered by
            ``embedding_lookup``).
        dim: D, the values per row (even, at least 2).
        dtype: the output dtype.

    Raises:
        TypeError: ``rows`` is not a uint8 tensor; ``dim`` is not an int.
        ValueError: ``rows`` is not ``[T, NH * (D/2 + 4)]``; ``dim`` is odd or below 2.
    """
    if _checks.int_arg("dim", dim) < 2 or dim % 2:
        raise ValueError(f"dim: expected an even number of values per row, at least 2; got {dim!r}")
    width = dim // 2 + 4                                   # bytes of one stored row
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8:
        what = rows.dtype if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise TypeError(f"rows: expected a uint8 tensor (NF4 rows of D = {dim}), got {what}")
    if rows.dim() != 2 or rows.shape[1] % width:
        raise ValueError(f"rows: expected uint8 [T, NH * {width}] (NF4 rows of D = {dim}), got {tuple(rows.shape)}")
    T = rows.shape[0]
    NH = rows.shape[1] // width
    stored = rows.reshape(T * NH, width).long()            # one stored row per line, bytes as integers
    levels = NF4_LEVELS.to(rows.device)

    # The codes: byte i holds value 2i (low nibble) and value 2i+1 (high nibble).
    values = torch.empty(T * NH, dim, dtype=torch.float32, device=rows.device)
    for i in range(dim // 2):
        byte = stored[:, i]
        values[:, 2 * i] = levels[byte % 16]
        values[:, 2 * i + 1] = levels[byte // 16]

    # The scale: bytes D/2 (low) and D/2 + 1 (high) are a float16's 16 bits, read back as float32.
    bits = stored[:, dim // 2] + 256 * stored[:, dim // 2 + 1]
    signed = torch.where(bits >= 2**15, bits - 2**16, bits)                   # as int16 holds them
    scale = signed.to(torch.int16).view(torch.float16).to(torch.float32)

    # level[code] * scale in float32, then one rounding to the output dtype.
    return (values * scale[:, None]).to(dtype).reshape(T, NH * dim)
