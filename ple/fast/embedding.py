"""The n-gram embedding lookup as a Triton gather, with a Triton scatter-add backward.

Kernel design:

* ``_lookup_fwd_kernel`` (grid ``(cdiv(T, BLOCK_T), NH)``): a program takes ``BLOCK_T``
  tokens and one head, reads their row ids and copies the rows ``[BLOCK_T, BLOCK_D]`` at a
  time into columns ``[h*D, (h+1)*D)`` of the output. Pure copies, so the result equals
  ``weight[ids]`` bit for bit in any dtype.
* ``_lookup_bwd_kernel`` (same grid): reads the gradient tiles and ``tl.atomic_add``-s them
  into a zeroed float32 (float64 for a float64 table) buffer ``[rows, D]``, so repeated
  ids accumulate; the buffer is cast to the table's dtype on the host. Atomic float adds
  are unordered on a GPU, so the last bits of a row hit many times may vary run to run.

The gradient is dense ``[rows, D]``, like ``F.embedding``'s default; for a sparse one see
``ple.reference.embedding_lookup_sparse_grad`` (``PLELayer(sparse_table_grad=True)``).
Registered as ``torch.ops.ple.embedding_lookup`` (autograd: ``ple.embedding_lookup_backward``);
the public ``embedding_lookup`` checks the metadata, the op checks the ids' range unless
``validate=False`` (then no device-to-host synchronisation: the grid needs only shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _checks
from ..reference import embedding as _reference
from ._library import register, twin
from ._numerics import acc_dtype, is_fp64, pow2_block

__all__ = ["embedding_lookup"]

_BLOCK_T = 32
_MAX_BLOCK_D = 128


@triton.jit
def _token_rows(ids_ptr, stride_ids_t, stride_ids_h, T, BLOCK_T: tl.constexpr):
    """This program's tokens ``t``, its head ``h``, which tokens exist, and their table rows (int64)."""
    h = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    live = t < T
    return t, h, live, tl.load(ids_ptr + t * stride_ids_t + h * stride_ids_h, mask=live, other=0).to(tl.int64)


@triton.jit
def _lookup_fwd_kernel(w_ptr, stride_w_r, stride_w_d, ids_ptr, stride_ids_t, stride_ids_h,
                       out_ptr, stride_out_t, stride_out_c, T, D,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t, h, live, row = _token_rows(ids_ptr, stride_ids_t, stride_ids_h, T, BLOCK_T)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        m2 = live[:, None] & (d < D)[None, :]
        vals = tl.load(w_ptr + row[:, None] * stride_w_r + d[None, :] * stride_w_d, mask=m2)
        tl.store(out_ptr + t[:, None] * stride_out_t + (h * D + d)[None, :] * stride_out_c, vals, mask=m2)


@triton.jit
def _lookup_bwd_kernel(g_ptr, stride_g_t, stride_g_c, ids_ptr, stride_ids_t, stride_ids_h,
                       dw_ptr, T, D, IS_FP64: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t, h, live, row = _token_rows(ids_ptr, stride_ids_t, stride_ids_h, T, BLOCK_T)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        m2 = live[:, None] & (d < D)[None, :]
        g = tl.load(g_ptr + t[:, None] * stride_g_t + (h * D + d)[None, :] * stride_g_c, mask=m2, other=0.0)
        if IS_FP64:
            g = g.to(tl.float64)
        else:
            g = g.to(tl.float32)
        tl.atomic_add(dw_ptr + row[:, None] * D + d[None, :], g, mask=m2, sem="relaxed")   # dw: [rows, D]


def _lookup_fwd(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    T, NH = ids.shape
    D = weight.shape[1]
    out = torch.empty((T, NH * D), dtype=weight.dtype, device=weight.device)
    if out.numel() == 0:
        return out
    _lookup_fwd_kernel[(triton.cdiv(T, _BLOCK_T), NH)](
        w_ptr=weight, stride_w_r=weight.stride(0), stride_w_d=weight.stride(1),
        ids_ptr=ids, stride_ids_t=ids.stride(0), stride_ids_h=ids.stride(1),
        out_ptr=out, stride_out_t=out.stride(0), stride_out_c=out.stride(1), T=T, D=D,
        BLOCK_T=_BLOCK_T, BLOCK_D=pow2_block(D, _MAX_BLOCK_D))
    return out


def _lookup_bwd(grad_out: torch.Tensor, ids: torch.Tensor, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Dense ``[num_rows, D]`` gradient of the table from ``grad_out`` ``[T, NH*D]``."""
    T, NH = ids.shape
    D = grad_out.shape[1] // NH if NH else 0
    dw = torch.zeros((num_rows, D), dtype=acc_dtype(dtype), device=grad_out.device)
    if T and NH and D:
        _lookup_bwd_kernel[(triton.cdiv(T, _BLOCK_T), NH)](
            g_ptr=grad_out, stride_g_t=grad_out.stride(0), stride_g_c=grad_out.stride(1),
            ids_ptr=ids, stride_ids_t=ids.stride(0), stride_ids_h=ids.stride(1), dw_ptr=dw, T=T, D=D,
            IS_FP64=is_fp64(dtype), BLOCK_T=_BLOCK_T, BLOCK_D=pow2_block(D, _MAX_BLOCK_D))
    return dw.to(dtype)


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
def embedding_lookup(weight, ids, *, validate=True):
    _checks.lookup_meta(weight, ids)
    return _lookup_op(weight, ids, bool(validate))
