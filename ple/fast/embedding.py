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
``ple.reference.embedding_lookup_sparse_grad`` (``PLELayer(sparse_table_grad=True)``). The
public, autograd-aware op is ``ple.fast.embedding_lookup`` (``ple.fast.library``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__: list[str] = []   # launchers only; the public op is ple.fast.embedding_lookup (library.py)

_BLOCK_T = 32


def _as_index(t: torch.Tensor) -> torch.Tensor:
    """Integer tensors as int32 or int64 (the dtypes the kernels load); others are widened to int64."""
    return t if t.dtype in (torch.int32, torch.int64) else t.to(torch.int64)


def _block_d(D: int) -> int:
    return min(triton.next_power_of_2(max(D, 1)), 128)


@triton.jit
def _lookup_fwd_kernel(w_ptr, stride_w_r, stride_w_d, ids_ptr, stride_ids_t, stride_ids_h,
                       out_ptr, stride_out_t, stride_out_c, T, D,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    live = t < T
    row = tl.load(ids_ptr + t * stride_ids_t + h * stride_ids_h, mask=live, other=0).to(tl.int64)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        m2 = live[:, None] & (d < D)[None, :]
        vals = tl.load(w_ptr + row[:, None] * stride_w_r + d[None, :] * stride_w_d, mask=m2)
        tl.store(out_ptr + t[:, None] * stride_out_t + (h * D + d)[None, :] * stride_out_c, vals, mask=m2)


@triton.jit
def _lookup_bwd_kernel(g_ptr, stride_g_t, stride_g_c, ids_ptr, stride_ids_t, stride_ids_h,
                       dw_ptr, T, D, IS_FP64: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    live = t < T
    row = tl.load(ids_ptr + t * stride_ids_t + h * stride_ids_h, mask=live, other=0).to(tl.int64)
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
    ids = _as_index(ids)
    grid = (triton.cdiv(T, _BLOCK_T), NH)
    _lookup_fwd_kernel[grid](weight, weight.stride(0), weight.stride(1), ids, ids.stride(0), ids.stride(1),
                             out, out.stride(0), out.stride(1), T, D, BLOCK_T=_BLOCK_T, BLOCK_D=_block_d(D))
    return out


def _lookup_bwd(grad_out: torch.Tensor, ids: torch.Tensor, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Dense ``[num_rows, D]`` gradient of the table from ``grad_out`` ``[T, NH*D]``."""
    T, NH = ids.shape
    D = grad_out.shape[1] // NH if NH else 0
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    dw = torch.zeros((num_rows, D), dtype=acc, device=grad_out.device)
    if T and NH and D:
        ids = _as_index(ids)
        grid = (triton.cdiv(T, _BLOCK_T), NH)
        _lookup_bwd_kernel[grid](grad_out, grad_out.stride(0), grad_out.stride(1), ids, ids.stride(0),
                                 ids.stride(1), dw, T, D, IS_FP64=acc == torch.float64, BLOCK_T=_BLOCK_T,
                                 BLOCK_D=_block_d(D))
    return dw.to(dtype)
