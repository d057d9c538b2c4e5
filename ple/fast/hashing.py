"""N-gram ids (SPEC section 3) as one Triton kernel, and the fused hash + table gather.

Kernel design (``_ngram_kernel``; grid ``cdiv(T, BLOCK_T)``, one program per block of tokens):

* **Request of a token.** With ``query_start_loc`` (``IS_VARLEN``) each lane finds its
  request by a binary search over the ``R + 1`` offsets in the kernel: the largest
  ``r`` in ``[0, R)`` with ``query_start_loc[r] <= t``, which skips empty requests.
  The search takes ``ceil(log2 R)`` steps, passed as a runtime loop count, so no host
  loop over tokens and no recompilation per batch size (``T`` and ``R`` are runtime).
* **Window.** ``w[0]`` is the token; for ``k`` in ``1..N-1`` (unrolled, ``N`` is a
  constexpr) the token ``k`` back is read from the chunk when the position in the
  request is ``>= k`` and otherwise from the request's ``ngram_context`` row (column
  ``N - 1 + pos - k``; all EOS without a context, ``HAS_CTX`` false). A running flag
  says whether a step back has already reached an EOS; once it has, the entry is EOS.
* **Hash.** ``mix`` accumulates ``w[k] * m[k]`` by XOR in int64 (the products are below
  ``2**63`` by construction, SPEC section 2), and after step ``k`` the ``P`` heads of order
  ``k + 1`` take ``mix % size[h] + offset[h]``. Multipliers, sizes and offsets are read
  from the ``HashParams`` tensors (so a loaded checkpoint's buffers are what is used).
* **Outputs.** ``WRITE_IDS`` stores the ids ``[T, NH]``; ``GATHER`` copies row ``id`` of the
  table into columns ``[h*D, (h+1)*D)`` of the embedding, in ``BLOCK_D`` chunks. The fused
  ``ngram_embedding`` sets ``GATHER`` (and ``WRITE_IDS`` too when the table needs a
  gradient, so the backward can scatter by id). A gather is a copy, so the fused result
  equals ``embedding_lookup(weight, ngram_ids(...))`` bit for bit.

All address arithmetic is int64; every input is addressed through its strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _checks
from ..reference.hashing import HashParams, check_ngram_args
from .embedding import _as_index, _lookup_bwd

__all__ = ["ngram_ids", "ngram_embedding"]

_BLOCK_T = 64


@triton.jit
def _ngram_kernel(
    ids_ptr, stride_ids,                                   # [T] token ids (any int dtype)
    qsl_ptr,                                               # [R+1] query_start_loc (IS_VARLEN)
    ctx_ptr, stride_ctx_r, stride_ctx_k,                   # [R, N-1] contexts (HAS_CTX)
    mult_ptr, sizes_ptr, offsets_ptr,                      # [N], [NH], [NH] int64
    out_ptr, stride_out_t, stride_out_h,                   # [T, NH] int64 ids (WRITE_IDS)
    w_ptr, stride_w_r, stride_w_d,                         # [rows, D] table (GATHER)
    emb_ptr, stride_emb_t, stride_emb_c,                   # [T, NH*D] embedding (GATHER)
    T, R, D, eos, search_steps,
    N: tl.constexpr, P: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_CTX: tl.constexpr,
    WRITE_IDS: tl.constexpr, GATHER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)   # [BLOCK_T] token index
    live = t < T

    if IS_VARLEN:
        # Largest r in [0, R-1] with query_start_loc[r] <= t (invariant: the answer lies in [lo, hi]).
        lo = tl.zeros([BLOCK_T], dtype=tl.int64)
        hi = tl.zeros([BLOCK_T], dtype=tl.int64) + (R - 1)
        for _ in range(search_steps):
            mid = (lo + hi + 1) // 2
            start_mid = tl.load(qsl_ptr + mid, mask=live, other=0).to(tl.int64)
            go_right = start_mid <= t
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid - 1)
        req = lo
        start = tl.load(qsl_ptr + req, mask=live, other=0).to(tl.int64)
    else:
        req = tl.zeros([BLOCK_T], dtype=tl.int64)
        start = tl.zeros([BLOCK_T], dtype=tl.int64)
    pos = t - start                                                      # position in the request

    tok = tl.load(ids_ptr + t * stride_ids, mask=live, other=0).to(tl.int64)
    mix = tok * tl.load(mult_ptr)
    seen_eos = tok < 0                                                   # all false
    for k in tl.static_range(1, N):
        in_chunk = pos >= k
        from_chunk = tl.load(ids_ptr + (t - k) * stride_ids, mask=live & in_chunk, other=0).to(tl.int64)
        if HAS_CTX:
            col = N - 1 + pos - k
            from_ctx = tl.load(ctx_ptr + req * stride_ctx_r + col * stride_ctx_k,
                               mask=live & (pos < k), other=0).to(tl.int64)
        else:
            from_ctx = tl.zeros([BLOCK_T], dtype=tl.int64) + eos
        back = tl.where(in_chunk, from_chunk, from_ctx)                  # the token k positions back
        w_k = tl.where(seen_eos, tl.zeros([BLOCK_T], dtype=tl.int64) + eos, back)
        seen_eos = seen_eos | (back == eos)
        mix = mix ^ (w_k * tl.load(mult_ptr + k))
        # The P heads of order n = k + 1.
        for j in tl.static_range(P):
            h = (k - 1) * P + j
            row = mix % tl.load(sizes_ptr + h) + tl.load(offsets_ptr + h)   # [BLOCK_T] int64
            if WRITE_IDS:
                tl.store(out_ptr + t * stride_out_t + h * stride_out_h, row, mask=live)
            if GATHER:
                for d0 in range(0, D, BLOCK_D):
                    d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
                    m2 = live[:, None] & (d < D)[None, :]
                    vals = tl.load(w_ptr + row[:, None] * stride_w_r + d[None, :] * stride_w_d, mask=m2)
                    tl.store(emb_ptr + t[:, None] * stride_emb_t + (h * D + d)[None, :] * stride_emb_c,
                             vals, mask=m2)


def _hash_launch(input_ids, params, P, eos_token_id, query_start_loc, ngram_context, R, *,
                 weight=None, write_ids=True):
    """Launch ``_ngram_kernel``; returns ``(ids or None, embedding or None)``."""
    dev = input_ids.device
    T = input_ids.numel()
    N = params.multipliers.numel()
    NH = (N - 1) * P
    ids_in = _as_index(input_ids)
    mult = params.multipliers.to(device=dev, dtype=torch.int64)
    sizes = params.head_sizes.to(device=dev, dtype=torch.int64)
    offsets = params.head_offsets.to(device=dev, dtype=torch.int64)
    out = torch.empty((T, NH), dtype=torch.int64, device=dev) if write_ids else None
    gather = weight is not None
    D = weight.shape[1] if gather else 0
    emb = torch.empty((T, NH * D), dtype=weight.dtype, device=dev) if gather else None
    if T == 0:
        return out, emb
    is_varlen = query_start_loc is not None
    qsl = _as_index(query_start_loc) if is_varlen else ids_in
    has_ctx = ngram_context is not None
    ctx = _as_index(ngram_context) if has_ctx else ids_in
    ids_out = out if write_ids else mult                  # placeholders are never touched
    w = weight if gather else mult
    e = emb if gather else mult
    grid = (triton.cdiv(T, _BLOCK_T),)
    _ngram_kernel[grid](
        ids_in, ids_in.stride(0),
        qsl,
        ctx, ctx.stride(0) if has_ctx else 0, ctx.stride(1) if has_ctx else 0,
        mult, sizes, offsets,
        ids_out, out.stride(0) if write_ids else 0, out.stride(1) if write_ids else 0,
        w, weight.stride(0) if gather else 0, weight.stride(1) if gather else 0,
        e, emb.stride(0) if gather else 0, emb.stride(1) if gather else 0,
        T, R, D, eos_token_id, max(R - 1, 0).bit_length(),
        N=N, P=P, IS_VARLEN=is_varlen, HAS_CTX=has_ctx, WRITE_IDS=write_ids, GATHER=gather,
        BLOCK_T=_BLOCK_T, BLOCK_D=min(triton.next_power_of_2(max(D, 1)), 128),
    )
    return out, emb


def ngram_ids(input_ids: torch.Tensor, params: HashParams, *, heads_per_ngram: int, eos_token_id: int,
              query_start_loc: torch.Tensor | None = None,
              ngram_context: torch.Tensor | None = None) -> torch.Tensor:
    """Table rows of every token's NH hash heads: ``[T, NH]`` int64 (see ``ple.reference.ngram_ids``).

    ``input_ids`` ``[T]`` holds R requests end to end, cut by ``query_start_loc``
    (``[R+1]``, int32 or int64; default one request); ``ngram_context`` ``[R, N-1]``
    (oldest first; default all EOS) holds the tokens before each request.
    """
    R, _ = check_ngram_args(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context)
    ids, _ = _hash_launch(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context, R)
    return ids


class _NGramEmbedding(torch.autograd.Function):
    """Fused hash + gather; the backward scatters into the table by the ids the forward wrote."""

    @staticmethod
    def forward(ctx, weight, input_ids, params, P, eos_token_id, query_start_loc, ngram_context, R):
        ids, emb = _hash_launch(input_ids, params, P, eos_token_id, query_start_loc, ngram_context, R,
                                weight=weight, write_ids=ctx.needs_input_grad[0])
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(ids)
            ctx.num_rows = weight.shape[0]
            ctx.weight_dtype = weight.dtype
        return emb

    @staticmethod
    def backward(ctx, grad_emb):
        (ids,) = ctx.saved_tensors
        grad_weight = _lookup_bwd(grad_emb, ids, ctx.num_rows, ctx.weight_dtype)
        return grad_weight, None, None, None, None, None, None, None


def ngram_embedding(weight: torch.Tensor, input_ids: torch.Tensor, params: HashParams, *,
                    heads_per_ngram: int, eos_token_id: int, query_start_loc: torch.Tensor | None = None,
                    ngram_context: torch.Tensor | None = None) -> torch.Tensor:
    """Hash and gather in one kernel: ``[T, NH * D]`` in ``weight``'s dtype.

    An extra of ``ple.fast`` (no reference twin): equal, bit for bit, to
    ``embedding_lookup(weight, ngram_ids(input_ids, params, ...))``, without writing the
    ``[T, NH]`` ids to memory (they are written only when ``weight`` needs a gradient,
    for the backward's scatter). ``weight`` is the table ``[rows, D]``; every row the
    hash can address, ``head_offsets[-1] + head_sizes[-1]``, must exist.
    """
    R, _ = check_ngram_args(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context)
    _checks.tensor("weight", weight, ndim=2, device=input_ids.device)
    if params.head_sizes.numel():
        needed = int(params.head_offsets[-1]) + int(params.head_sizes[-1])
        if weight.shape[0] < needed:
            raise ValueError(f"weight: the hash addresses rows up to {needed - 1}, so the table needs at "
                             f"least {needed} rows, got {weight.shape[0]}")
    return _NGramEmbedding.apply(weight, input_ids, params, heads_per_ngram, eos_token_id, query_start_loc,
                                 ngram_context, R)
