"""The n-gram embedding lookup as a Triton gather, with a Triton scatter-add backward.

Every kernel works on the ``M = T * NH`` *rows* of the output, flattened: output row
``i = t * NH + h`` is token ``t``'s head ``h``, columns ``[h*D, (h+1)*D)`` of the ``[T, NH * D]``
output, i.e. row ``i`` of the same memory viewed as ``[M, D]``.

Kernel design:

* ``_lookup_fwd_kernel`` (grid ``cdiv(M, BLOCK_T)``): a program reads ``BLOCK_T`` (`_BLOCK_ROWS`)
  consecutive ids at once (contiguous ids: 128-bit loads of int64 pairs) and copies their table
  rows ``BLOCK_D`` (`_BLOCK_D`) columns at a time: each chunk is a ``[BLOCK_T, BLOCK_D]`` gather
  of whole 16-byte pieces when the rows are 16-byte aligned (bf16 ``D = 160``: 320 B rows), stored
  to consecutive output rows. Pure copies, so the result equals ``weight[ids]`` bit for bit.
* ``_lookup_bwd_kernel`` (same grid; the default mode): reads the gradient rows the same way and
  ``tl.atomic_add``-s them into a zeroed float32 (float64 for a float64 table) buffer ``[rows, D]``,
  so repeated ids accumulate; the buffer is cast to the table's dtype on the host. Atomic float
  adds are unordered on a GPU, so the last bits of a row hit many times may vary run to run.
* Deterministic mode (``ple.fast._numerics.deterministic()``, i.e. under
  ``torch.use_deterministic_algorithms(True)``): no float atomics. The flattened ids are sorted
  on the device (``torch.sort(stable=True)``: equal ids keep token order) into ``[M, 2]`` int64
  (id, flat row) pairs (one 128-bit load per position), and
  ``_lookup_bwd_sorted_kernel`` (grid ``(M, cdiv(D, BLOCK_D))``: per sorted position and block of
  `_DET_BLOCK_D` columns) does nothing unless
  its position starts a run of equal ids; the program that starts a run walks it in sorted
  order, `_DET_UNROLL` gradient rows per step (loads in flight together, added one after
  another), summing each row's contributions in token order in float32 (float64), and writes
  the row once, rounded to the table's dtype, into a zeroed ``[rows, D]`` buffer of that dtype.
  The bits depend only on the inputs, not on `_DET_UNROLL` or `_DET_BLOCK_D` nor on the GPU's
  scheduling, and equal the default mode's wherever the sums are exact. No host sync: the grid
  is ``M``, the run lengths are found on the device. **Cost:** a device sort of ``M`` int64 ids
  (its two ``[M]`` int64 outputs and the ``[M, 2]`` pairs: about 32 bytes per (token, head) more
  traffic than the atomics) and ``M`` mostly idle programs; a row hit ``n`` times is summed
  serially by one program (``n / _DET_UNROLL`` dependent steps), so a very hot row (e.g. the
  n-grams of a long EOS padding, one row per head for every padded token) takes time
  proportional to its hits where atomics would spread them. In exchange the dense buffer is in
  the table's dtype (no float32 buffer and no cast pass).

The gradient is dense ``[rows, D]``, like ``F.embedding``'s default; for a sparse one see
``ple.reference.embedding_lookup_sparse_grad`` (``PLELayer(sparse_table_grad=True)``).
Registered as ``torch.ops.ple.embedding_lookup`` (autograd: ``ple.embedding_lookup_backward``);
the public ``embedding_lookup`` checks the metadata, the op checks the ids' range unless
``validate=False`` (then no device-to-host synchronisation: the grid needs only shapes).
Block sizes are module-level names (``_BLOCK_ROWS``, ``_BLOCK_D``, ``_DET_UNROLL``,
``_DET_BLOCK_D``), read at launch time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _checks
from ..reference import embedding as _reference
from ._library import register, twin
from ._numerics import acc_dtype, deterministic, down, is_fp64, pow2_block, sorted_run_start, up

__all__ = ["embedding_lookup"]

_BLOCK_ROWS = 256     # output rows (token, head) per program of the gather / atomic scatter
_BLOCK_D = 32         # columns per chunk of those rows (a [_BLOCK_ROWS, _BLOCK_D] tile)
_DET_UNROLL = 8       # deterministic backward: gradient rows loaded together per step of a run
_DET_BLOCK_D = 256    # deterministic backward: columns per program (at most)


@triton.jit
def _flat_rows(ids_ptr, stride_ids_t, stride_ids_h, M, NH, BLOCK_T: tl.constexpr):
    """This program's flat rows ``i = t * NH + h`` (int64), which exist, and their table rows (int64).

    The id of row ``i`` is at ``(i // NH) * stride_t + (i % NH) * stride_h``; contiguous ids are
    passed as ``NH = 1, stride_t = 1`` (both specialised to the constant 1), so the address is
    ``ids_ptr + i`` and the load is vectorised.
    """
    i = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    live = i < M
    src = (i // NH) * stride_ids_t + (i % NH) * stride_ids_h
    return i, live, tl.load(ids_ptr + src, mask=live, other=0).to(tl.int64)


@triton.jit
def _lookup_fwd_kernel(w_ptr, stride_w_r, stride_w_d, ids_ptr, stride_ids_t, stride_ids_h,
                       out_ptr, M, NH, D,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # out: the [T, NH * D] output, contiguous, i.e. [M, D].
    i, live, row = _flat_rows(ids_ptr, stride_ids_t, stride_ids_h, M, NH, BLOCK_T)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        m2 = live[:, None] & (d < D)[None, :]
        vals = tl.load(w_ptr + row[:, None] * stride_w_r + d[None, :] * stride_w_d, mask=m2)
        tl.store(out_ptr + i[:, None] * D + d[None, :], vals, mask=m2)


@triton.jit
def _lookup_bwd_kernel(g_ptr, ids_ptr, stride_ids_t, stride_ids_h,
                       dw_ptr, M, NH, D, IS_FP64: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # g: the [T, NH * D] output gradient, contiguous ([M, D]); dw: [rows, D] contiguous, zeroed.
    i, live, row = _flat_rows(ids_ptr, stride_ids_t, stride_ids_h, M, NH, BLOCK_T)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        m2 = live[:, None] & (d < D)[None, :]
        g = tl.load(g_ptr + i[:, None] * D + d[None, :], mask=m2, other=0.0)
        if IS_FP64:
            g = g.to(tl.float64)
        else:
            g = g.to(tl.float32)
        tl.atomic_add(dw_ptr + row[:, None] * D + d[None, :], g, mask=m2, sem="relaxed")


@triton.jit
def _lookup_bwd_sorted_kernel(g_ptr, pairs_ptr, dw_ptr, M, D,
                              IS_G_BF16: tl.constexpr, DT: tl.constexpr, IS_DT_BF16: tl.constexpr,
                              IS_FP64: tl.constexpr, UNROLL: tl.constexpr, BLOCK_D: tl.constexpr):
    # pairs: [M, 2] int64 (id, flat row) sorted by id, stable; g: [M, D] contiguous; dw: [rows, D] zeroed.
    p, two, rid, starts = sorted_run_start(pairs_ptr)
    if starts:                                                   # p starts the run of rid
        d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
        dm = d < D
        if IS_FP64:
            acc = tl.zeros([BLOCK_D], dtype=tl.float64)
        else:
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        j = p
        more = p < M
        while more:
            for u in tl.static_range(UNROLL):                    # in sorted (= token) order
                ok = j + u < M
                s, src = tl.split(tl.load(pairs_ptr + 2 * (j + u) + two, mask=tl.where(ok, two < 2, False), other=-1))
                ok = ok & (s == rid)
                g = tl.load(g_ptr + src * D + d, mask=tl.where(ok, dm, False), other=0.0)
                acc += up(g, IS_G_BF16, IS_FP64)                 # +0.0 where masked: acc unchanged
                more = ok
            j += UNROLL
        tl.store(dw_ptr + rid * D + d, down(acc, DT, IS_DT_BF16), mask=dm)


def _ids_args(ids: torch.Tensor) -> dict:
    """Addressing of the ids: contiguous ids as a flat vector (``NH = 1``, unit strides), else by strides."""
    if ids.is_contiguous():
        return dict(stride_ids_t=1, stride_ids_h=1, NH=1)
    return dict(stride_ids_t=ids.stride(0), stride_ids_h=ids.stride(1), NH=ids.shape[1])


def _lookup_fwd(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    T, NH = ids.shape
    D = weight.shape[1]
    out = torch.empty((T, NH * D), dtype=weight.dtype, device=weight.device)
    if out.numel() == 0:
        return out
    M = T * NH
    _lookup_fwd_kernel[(triton.cdiv(M, _BLOCK_ROWS),)](
        w_ptr=weight, stride_w_r=weight.stride(0), stride_w_d=weight.stride(1), ids_ptr=ids, **_ids_args(ids),
        out_ptr=out, M=M, D=D, BLOCK_T=_BLOCK_ROWS, BLOCK_D=pow2_block(D, _BLOCK_D))
    return out


def _lookup_bwd(grad_out: torch.Tensor, ids: torch.Tensor, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Dense ``[num_rows, D]`` gradient of the table from ``grad_out`` ``[T, NH*D]`` (any strides)."""
    T, NH = ids.shape
    D = grad_out.shape[1] // NH if NH else 0
    M = T * NH
    grad_out = grad_out.contiguous()
    if deterministic():
        dw = torch.zeros((num_rows, D), dtype=dtype, device=grad_out.device)
        if M and D:
            sorted_ids, perm = torch.sort(ids.reshape(M).to(torch.int64), stable=True)
            pairs = torch.stack((sorted_ids, perm), dim=1)        # [M, 2]: one 128-bit load per position
            block_d = pow2_block(D, _DET_BLOCK_D)
            _lookup_bwd_sorted_kernel[(M, triton.cdiv(D, block_d))](
                g_ptr=grad_out, pairs_ptr=pairs, dw_ptr=dw, M=M, D=D,
                IS_G_BF16=grad_out.dtype == torch.bfloat16, DT=_tl_dtype(dtype),
                IS_DT_BF16=dtype == torch.bfloat16, IS_FP64=is_fp64(dtype), UNROLL=_DET_UNROLL,
                BLOCK_D=block_d, num_warps=1)
        return dw
    dw = torch.zeros((num_rows, D), dtype=acc_dtype(dtype), device=grad_out.device)
    if M and D:
        _lookup_bwd_kernel[(triton.cdiv(M, _BLOCK_ROWS),)](
            g_ptr=grad_out, ids_ptr=ids, **_ids_args(ids), dw_ptr=dw, M=M, D=D,
            IS_FP64=is_fp64(dtype), BLOCK_T=_BLOCK_ROWS, BLOCK_D=pow2_block(D, _BLOCK_D))
    return dw.to(dtype)


_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64, torch.float16: tl.float16,
              torch.bfloat16: tl.bfloat16}


def _tl_dtype(dtype: torch.dtype):
    return _TL_DTYPES[dtype]


# ---- registration ----------------------------------------------------------------------------------


def _lookup_bwd_impl(grad: torch.Tensor, ids: torch.Tensor, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    return _lookup_bwd(grad, ids, num_rows, dtype)


def _lookup_bwd_fake(grad, ids, num_rows, dtype):
    return grad.new_empty((num_rows, grad.shape[1] // max(ids.shape[1], 1)), dtype=dtype)


lookup_backward_op = register("embedding_lookup_backward", _lookup_bwd_impl, fake=_lookup_bwd_fake)


def _lookup_impl(weight: torch.Tensor, ids: torch.Tensor, validate: bool) -> torch.Tensor:
    if validate:
        _checks.lookup_values(weight, ids)
    return _lookup_fwd(weight, ids)


def _lookup_fake(weight, ids, validate):
    return weight.new_empty((ids.shape[0], ids.shape[1] * weight.shape[1]))


def _lookup_setup(ctx, inputs, output):
    weight, ids, _ = inputs
    ctx.save_for_backward(ids)
    ctx.num_rows, ctx.dtype = weight.shape[0], weight.dtype


def _lookup_backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    return lookup_backward_op(grad.contiguous(), ids, ctx.num_rows, ctx.dtype), None, None


_lookup_op = register("embedding_lookup", _lookup_impl, fake=_lookup_fake, backward=_lookup_backward,
                      setup_context=_lookup_setup)


@twin(_reference.embedding_lookup)
def embedding_lookup(weight: torch.Tensor, ids: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
    """A gather kernel over the ``T * NH`` output rows (copies: ``weight[ids]`` bit for bit). Backward
    (``torch.ops.ple.embedding_lookup_backward``), a dense ``[rows, D]`` gradient: by default ``tl.atomic_add`` into
    a zeroed float32 (float64 for a float64 table) buffer cast to the table's dtype, so the last bits of a row hit
    many times may vary from run to run; under ``torch.use_deterministic_algorithms(True)`` the ids are sorted on
    the device and each row's gradients summed in token order (no atomics: the same bits every run). Registered as
    ``torch.ops.ple.embedding_lookup``: the ids' range is checked inside the op unless ``validate=False`` (then no
    host read: the grid comes from shapes). CPU tensors are refused (``ValueError``) while the kernels are compiled;
    under ``TRITON_INTERPRET=1`` they run on the CPU."""
    _checks.lookup_meta(weight, ids)
    return _lookup_op(weight, ids, _checks.validating(validate))
