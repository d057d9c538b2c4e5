"""Triton kernels for the dilated causal convolution over whole sequences, for training (SPEC section 5).

Same name, signature and numbers as ``ple.reference.training_conv.dilated_causal_conv``.

Three kernels, all tiled ``(time tiles, channel blocks)``: dense ``[B, L, C]`` tiles are
computed from the program id; packed ``[T, C]`` with ``cu_seqlens`` launches
``T // BLOCK_T + B`` programs (an upper bound from shapes, ``_numerics.tile_grid``) and each
finds its (sequence, first position) by a binary search over ``cu_seqlens`` on the device
(``_numerics.tile_of``, read through its stride); a program past its sequence's rows does
nothing. No host values: the backward reads none either. Forward writes ``y``. Backward recomputes the
pre-activation (only ``x`` and ``weight`` are saved), writes ``g' = dy * silu'(preact)``
rounded to ``x``'s dtype (as the reference's autograd rounds it) and adds each tile's
``sum_t g'_t * x_{t - lag_j}`` as one row of a float32 (float64 for float64 inputs)
``[time programs, C, K]`` buffer, which the launcher sums over programs (no atomics: the
weight gradient does not depend on the order programs finish; the buffer is
``grid[0] * C * K`` accumulators, 84 MB at B 4 x L 4096 x C 10240); a second kernel computes
``dx_t = sum_j w_j g'_{t + lag_j}`` inside each sequence.

Numerics as in ``conv`` (``_numerics``). Recompilation: K, the dilation, the block sizes,
the dtypes and the flags are compile-time constants; the length arguments are
``do_not_specialize``. The strides, batch strides included, are specialised as Triton does
(``== 1``, divisible by 16): that is what lets the compiler prove the rows 16-byte aligned
and issue 128-bit accesses (``benchmarks/codegen.py``: 97-99 % of the dense kernels' load
bytes, and no spill in the dW kernel), at the cost of one compile per such stride class.

Registered as ``torch.ops.ple.dilated_causal_conv`` (autograd:
``ple.dilated_causal_conv_backward``): the public function checks the metadata
(``ple._checks.dense_conv_meta``), the op the values of ``cu_seqlens`` at run time unless
``validate=False`` (then no device-to-host synchronisation at all, forward or backward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _checks
from ..reference import training_conv as _reference
from ._library import register, twin
from ._numerics import TIME_BLOCK, acc_dtype, block_c, down, is_fp64, rnd, search_steps, silu, tile_grid, tile_of, up

__all__ = ["dilated_causal_conv"]


@triton.jit
def _tile(cu_ptr, stride_cu_r, L, tiles_per_seq, C, IS_VARLEN: tl.constexpr, BLOCK_T: tl.constexpr,
          BLOCK_C: tl.constexpr):
    """This program's tile: (first row of its sequence, batch index, positions, channels, their masks).

    Packed (``IS_VARLEN``): ``L`` is the number of sequences and ``tiles_per_seq`` the search steps.
    """
    pid64 = tl.program_id(0).to(tl.int64)
    if IS_VARLEN:
        seq, t0 = tile_of(pid64, cu_ptr, stride_cu_r, L, tiles_per_seq, BLOCK_T)
        lo = tl.load(cu_ptr + seq * stride_cu_r).to(tl.int64)
        n = tl.load(cu_ptr + (seq + 1) * stride_cu_r).to(tl.int64) - lo
        b = pid64 * 0
    else:
        b = pid64 // tiles_per_seq
        t0 = (pid64 - b * tiles_per_seq) * BLOCK_T
        lo = pid64 * 0
        n = pid64 * 0 + L
    p = t0 + tl.arange(0, BLOCK_T)
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    return lo, b, n, p, c, p < n, c < C


@triton.jit
def _preact(x_ptr, w_ptr, xb, p, pmask, c, cmask, stride_x_t, stride_x_c, stride_w_c, stride_w_k,
            K: tl.constexpr, DILATION: tl.constexpr, IS_X_BF16: tl.constexpr, IS_W_BF16: tl.constexpr,
            IS_FP64: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """The conv sum of the tile, rounded to x's dtype (in the accumulation dtype)."""
    XT = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if IS_FP64:
        acc = acc.to(tl.float64)
    for j in tl.static_range(K):
        lag = (K - 1 - j) * DILATION
        src = p - lag
        m = (pmask & (src >= 0))[:, None] & cmask[None, :]
        xv = up(tl.load(x_ptr + xb + src[:, None] * stride_x_t + c[None, :] * stride_x_c, mask=m, other=0.0),
                IS_X_BF16, IS_FP64)
        wj = up(tl.load(w_ptr + c * stride_w_c + j * stride_w_k, mask=cmask, other=0.0), IS_W_BF16, IS_FP64)
        acc = acc + wj[None, :] * xv
    return rnd(acc, XT, IS_X_BF16, IS_FP64)


@triton.jit(do_not_specialize=["L", "tiles_per_seq"])
def _dcc_fwd_kernel(
    x_ptr, w_ptr, y_ptr, cu_ptr,
    L, tiles_per_seq, C, stride_cu_r,
    stride_x_b, stride_x_t, stride_x_c, stride_y_b, stride_y_t, stride_y_c, stride_w_c, stride_w_k,
    K: tl.constexpr, DILATION: tl.constexpr, IS_VARLEN: tl.constexpr,
    IS_X_BF16: tl.constexpr, IS_W_BF16: tl.constexpr, IS_FP64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``y = silu(conv(x))`` for one (time tile, channel block) of one sequence."""
    XT = x_ptr.dtype.element_ty
    lo, b, n, p, c, pmask, cmask = _tile(cu_ptr, stride_cu_r, L, tiles_per_seq, C, IS_VARLEN, BLOCK_T, BLOCK_C)
    a = _preact(x_ptr, w_ptr, b * stride_x_b + lo * stride_x_t, p, pmask, c, cmask, stride_x_t, stride_x_c,
                stride_w_c, stride_w_k, K, DILATION, IS_X_BF16, IS_W_BF16, IS_FP64, BLOCK_T, BLOCK_C)
    y = down(silu(a), XT, IS_X_BF16)
    yb = b * stride_y_b + lo * stride_y_t
    tl.store(y_ptr + yb + p[:, None] * stride_y_t + c[None, :] * stride_y_c, y,
             mask=pmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["L", "tiles_per_seq"])
def _dcc_bwd_gw_kernel(
    x_ptr, w_ptr, dy_ptr, g_ptr, dw_ptr, cu_ptr,
    L, tiles_per_seq, C, stride_cu_r,
    stride_x_b, stride_x_t, stride_x_c, stride_dy_b, stride_dy_t, stride_dy_c,
    stride_g_b, stride_g_t, stride_g_c, stride_w_c, stride_w_k,
    K: tl.constexpr, DILATION: tl.constexpr, IS_VARLEN: tl.constexpr,
    IS_X_BF16: tl.constexpr, IS_W_BF16: tl.constexpr, IS_FP64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``g' = dy * silu'(preact)`` (rounded to x's dtype) and this tile's ``sum_t g'_t x_{t-lag_j}`` per
    channel and tap (reduced over tiles by the launcher: no atomics)."""
    XT = x_ptr.dtype.element_ty
    lo, b, n, p, c, pmask, cmask = _tile(cu_ptr, stride_cu_r, L, tiles_per_seq, C, IS_VARLEN, BLOCK_T, BLOCK_C)
    m = pmask[:, None] & cmask[None, :]
    xb = b * stride_x_b + lo * stride_x_t
    a = _preact(x_ptr, w_ptr, xb, p, pmask, c, cmask, stride_x_t, stride_x_c, stride_w_c, stride_w_k,
                K, DILATION, IS_X_BF16, IS_W_BF16, IS_FP64, BLOCK_T, BLOCK_C)
    dy_rows = dy_ptr + b * stride_dy_b + lo * stride_dy_t
    dy = up(tl.load(dy_rows + p[:, None] * stride_dy_t + c[None, :] * stride_dy_c, mask=m, other=0.0),
            IS_X_BF16, IS_FP64)
    s = tl.sigmoid(a)
    g = rnd(dy * s * (1.0 + a * (1.0 - s)), XT, IS_X_BF16, IS_FP64)   # torch's silu_backward, then rounded
    g = tl.where(m, g, 0.0)
    g_rows = g_ptr + b * stride_g_b + lo * stride_g_t
    tl.store(g_rows + p[:, None] * stride_g_t + c[None, :] * stride_g_c, down(g, XT, IS_X_BF16), mask=m)
    for j in tl.static_range(K):
        lag = (K - 1 - j) * DILATION
        src = p - lag
        ms = (pmask & (src >= 0))[:, None] & cmask[None, :]
        xv = up(tl.load(x_ptr + xb + src[:, None] * stride_x_t + c[None, :] * stride_x_c, mask=ms, other=0.0),
                IS_X_BF16, IS_FP64)
        # This tile's partial sum: dw_ptr is [programs along time, C, K]; every program writes its row.
        tl.store(dw_ptr + tl.program_id(0).to(tl.int64) * (C * K) + c * K + j, tl.sum(g * xv, axis=0), mask=cmask)


@triton.jit(do_not_specialize=["L", "tiles_per_seq"])
def _dcc_bwd_dx_kernel(
    g_ptr, w_ptr, dx_ptr, cu_ptr,
    L, tiles_per_seq, C, stride_cu_r,
    stride_g_b, stride_g_t, stride_g_c, stride_dx_b, stride_dx_t, stride_dx_c, stride_w_c, stride_w_k,
    K: tl.constexpr, DILATION: tl.constexpr, IS_VARLEN: tl.constexpr,
    IS_X_BF16: tl.constexpr, IS_W_BF16: tl.constexpr, IS_FP64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``dx_t = sum_j w_j g'_{t + lag_j}`` over the taps that stay inside the sequence."""
    XT = dx_ptr.dtype.element_ty
    lo, b, n, p, c, pmask, cmask = _tile(cu_ptr, stride_cu_r, L, tiles_per_seq, C, IS_VARLEN, BLOCK_T, BLOCK_C)
    gb = b * stride_g_b + lo * stride_g_t
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if IS_FP64:
        acc = acc.to(tl.float64)
    for j in tl.static_range(K):
        lag = (K - 1 - j) * DILATION
        dst = p + lag
        m = (pmask & (dst < n))[:, None] & cmask[None, :]
        gv = up(tl.load(g_ptr + gb + dst[:, None] * stride_g_t + c[None, :] * stride_g_c, mask=m, other=0.0),
                IS_X_BF16, IS_FP64)
        wj = up(tl.load(w_ptr + c * stride_w_c + j * stride_w_k, mask=cmask, other=0.0), IS_W_BF16, IS_FP64)
        acc = acc + wj[None, :] * gv
    tl.store(dx_ptr + b * stride_dx_b + lo * stride_dx_t + p[:, None] * stride_dx_t + c[None, :] * stride_dx_c,
             down(acc, XT, IS_X_BF16), mask=pmask[:, None] & cmask[None, :])


# ---- launchers -------------------------------------------------------------------------------------


def _strides(name: str, t: torch.Tensor) -> dict:
    """``stride_<name>_{b,t,c}`` of a ``[B, L, C]`` or ``[T, C]`` tensor (batch stride 0 for 2-D)."""
    b, s_t, s_c = (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 3 else (0, t.stride(0), t.stride(1))
    return {f"stride_{name}_b": b, f"stride_{name}_t": s_t, f"stride_{name}_c": s_c}


def _launch(x: torch.Tensor, weight: torch.Tensor, dilation: int, cu_seqlens):
    """(grid, the arguments every training kernel takes), or (None, None) for an empty grid; shapes only."""
    C, K = weight.shape
    bc = block_c(C)
    if cu_seqlens is not None:                                  # packed: tiles found on the device
        B = cu_seqlens.numel() - 1
        grid, L, per_seq = (tile_grid(x.shape[0], B, TIME_BLOCK), triton.cdiv(C, bc)), B, search_steps(B)
        if B == 0:
            grid = (0, 0)
    else:
        B, L = (x.shape[0], x.shape[1]) if x.dim() == 3 else (1, x.shape[0])
        per_seq = triton.cdiv(L, TIME_BLOCK)
        grid = (B * per_seq, triton.cdiv(C, bc))
    if grid[0] == 0 or grid[1] == 0:
        return None, None
    cu = cu_seqlens if cu_seqlens is not None else x.view(-1)   # placeholder: never read
    return grid, dict(
        w_ptr=weight, cu_ptr=cu, L=L, tiles_per_seq=per_seq, C=C, stride_cu_r=cu.stride(0),
        stride_w_c=weight.stride(0), stride_w_k=weight.stride(1), K=K, DILATION=dilation,
        IS_VARLEN=cu_seqlens is not None, IS_X_BF16=x.dtype == torch.bfloat16,
        IS_W_BF16=weight.dtype == torch.bfloat16, IS_FP64=is_fp64(x.dtype), BLOCK_T=TIME_BLOCK, BLOCK_C=bc)


def _fwd(x, weight, dilation, cu_seqlens):
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid, common = _launch(x, weight, dilation, cu_seqlens)
    if grid is not None:
        _dcc_fwd_kernel[grid](x_ptr=x, y_ptr=y, **_strides("x", x), **_strides("y", y), **common)
    return y


def _bwd(dy, x, weight, dilation, cu_seqlens):
    """``(dx, dweight)``."""
    acc = acc_dtype(x.dtype)
    grid, common = _launch(x, weight, dilation, cu_seqlens)
    if grid is None:
        return (torch.zeros(x.shape, dtype=x.dtype, device=x.device),
                torch.zeros(weight.shape, dtype=acc, device=x.device).to(weight.dtype))
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    g = torch.empty(x.shape, dtype=x.dtype, device=x.device)      # g' = dy * silu'(preact)
    partial = torch.empty((grid[0],) + tuple(weight.shape), dtype=acc, device=x.device)   # per time tile
    _dcc_bwd_gw_kernel[grid](x_ptr=x, dy_ptr=dy, g_ptr=g, dw_ptr=partial, **_strides("x", x),
                             **_strides("dy", dy), **_strides("g", g), **common)
    _dcc_bwd_dx_kernel[grid](g_ptr=g, dx_ptr=dx, **_strides("g", g), **_strides("dx", dx), **common)
    return dx, partial.sum(0).to(weight.dtype)       # the tiles' partial sums, reduced in a fixed order


# ---- registration ----------------------------------------------------------------------------------


def _bwd_impl(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, dilation: int,
              cu_seqlens: torch.Tensor | None) -> list[torch.Tensor]:
    # The forward validated cu_seqlens (or was told not to); the tiles are found on the device.
    return list(_bwd(dy.contiguous(), x, weight, dilation, cu_seqlens))


def _bwd_fake(dy, x, weight, dilation, cu_seqlens):
    return [torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)]


_bwd_op = register("dilated_causal_conv_backward", _bwd_impl, fake=_bwd_fake)


def _fwd_impl(x: torch.Tensor, weight: torch.Tensor, dilation: int, cu_seqlens: torch.Tensor | None,
              validate: bool) -> torch.Tensor:
    if validate:
        _checks.dense_conv_values(x, weight, dilation, cu_seqlens)
    return _fwd(x, weight, dilation, cu_seqlens)


def _fwd_fake(x, weight, dilation, cu_seqlens, validate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    x, weight, dilation, cu_seqlens, _ = inputs
    ctx.save_for_backward(x, weight, cu_seqlens)
    ctx.dilation = dilation


def _backward(ctx, dy):
    x, weight, cu_seqlens = ctx.saved_tensors
    dx, dw = _bwd_op(dy, x, weight, ctx.dilation, cu_seqlens)
    return dx, dw, None, None, None


_op = register("dilated_causal_conv", _fwd_impl, fake=_fwd_fake, backward=_backward, setup_context=_setup)


@twin(_reference.dilated_causal_conv)
def dilated_causal_conv(x, weight, *, dilation, cu_seqlens=None, validate=True):
    _checks.dense_conv_meta(x, weight, dilation, cu_seqlens)
    return _op(x, weight, dilation, cu_seqlens, bool(validate))
