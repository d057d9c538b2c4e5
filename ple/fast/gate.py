"""The grouped RMS norms and the signed-sqrt gate (SPEC section 4) as Triton kernels.

Notation per token ``t`` and stream ``m`` (vectors of ``H`` channels): ``k``, ``q`` the
key and hidden-state groups, ``v`` the value row; ``r_k = rsqrt(mean(k^2) + eps)``,
``kh = k r_k``, ``kn = kh (1 + w_k)`` (``qh``, ``qn`` likewise), ``s = sum(kn qn) / sqrt(H)``,
``g = sigmoid(sign(s) sqrt(max(|s|, 1e-6)))``, ``x = g v`` (gated), ``y = norm_conv(x)``.

Kernel design (sums over ``H`` run over power-of-two chunks of ``H``, ``_chunk_h``: the widest
power of two dividing ``H`` up to a cap, 512 at ``H = 2560``, so no lane idles; an ``H`` with a
narrow power-of-two factor gets masked chunks of ``min(cap, next_power_of_2(H))``):

* ``_gate_fwd_kernel`` (grid ``(T,)``): one program per token, all ``M`` streams. Per stream,
  two passes over its key and hidden chunks (the sums of squares, then the score; the second
  pass re-reads the stream's 10 KB, meant to hit L1 / L2); then two passes over the value row for all
  streams at once as ``[next_power_of_2(M), chunk]`` tiles (the conv norm's sum of squares,
  then ``gated`` and ``conv_input`` are stored). With those re-reads served by the caches,
  each input element comes from memory once and each output goes once: 87040 B per token
  at the model's widths (the minimum); the norm weights (61 KB, shared by all tokens) come
  from L2.
* Backward, three launches. ``_gate_stats_kernel`` (grid ``(cdiv(T, _STATS_TOKENS),)``,
  chunks of ``H`` outer and the program's tokens inner, so the norm weights load once per
  chunk): for every (token, stream) the six sums over ``H`` the backward needs (below) in one
  pass over ``key``, ``hidden``, both incoming gradients and ``value``, turned into six
  coefficients, stored as ``[T, M, 8]`` float32 (128 B per token).
  ``_gate_bwd_kernel`` (grid ``(cdiv(T, _BWD_BLOCK_T), cdiv(H, chunk))``): a ``[tokens,
  channels of H]`` tile, the streams in turn; element-wise from the inputs and the
  coefficients it writes ``dkey``, ``dhidden`` and ``dvalue`` (the streams' shares added in
  registers in the order 0..M-1, rounded once: no atomics, no float32 ``[T, H]`` buffer), and
  the tile's sums over its tokens of the two products the norm weights' gradients need, one
  partial row pair per tile (``[tiles, 2, C]`` float32). ``_gate_wsum_kernel`` adds the
  partial rows in token order and scales them by ``1 + w`` into the three gradients (rounded
  to each weight's dtype). The inputs are read twice from memory (the stats pass, then the
  tile pass), 2 x 87040 B per token, plus 46080 B of gradients written and 2 x 5120 B of
  partial rows: about 1.67x the op's minimum (138240 B), the price of no atomics and of
  programs small enough for 2 CTAs per SM: the weight gradients need programs that own
  channels over many tokens, the per-(token, stream) sums need all of ``H``, and one token's
  rows (87 KB) with accumulators for all ``C`` channels do not fit on an SM.
* Block sizes are module-level names, read at launch: ``_FWD_CHUNK_H``, ``_STATS_CHUNK_H``,
  ``_STATS_TOKENS``, ``_BWD_BLOCK_T``, ``_BWD_CHUNK_H``, ``_SUM_BLOCK_C`` (the chunk widths are
  caps; token counts powers of two). Nothing in either mode uses atomics, so every result is
  the same from run to run; in the default mode the bits may depend on the block sizes.
* Deterministic mode (``_numerics.deterministic()``, i.e. under
  ``torch.use_deterministic_algorithms(True)``): the bits do not depend on the block sizes.
  Every shape a sum depends on is fixed: the ``H`` chunk of both backward kernels is
  ``_chunk_h(H, _DET_CHUNK_H)`` and of the forward ``_chunk_h(H, _DET_FWD_CHUNK_H)`` (with warps
  derived from those shapes), and the main kernel's tile is ``DETERMINISTIC_CHUNK`` tokens, so
  each partial row is one fixed chunk's sum in one fixed ``[DETERMINISTIC_CHUNK, chunk]`` shape,
  which the second pass adds in token order. ``_STATS_TOKENS`` and ``_SUM_BLOCK_C`` still
  apply (they do not change any sum). Extra cost: none at the default ``_BWD_BLOCK_T`` (16 =
  ``DETERMINISTIC_CHUNK``): the same three launches and bytes; in general the partial rows
  are ``2 x 4 C / DETERMINISTIC_CHUNK`` B per token, written and read once, against
  ``2 x 4 C / _BWD_BLOCK_T``, and the stats kernel takes ``H`` in chunks of 128 instead of 512
  (more, smaller steps; the same bytes).

Backward, per ``(t, m)`` with incoming ``dx`` (of gated) and ``dy`` (of conv_input), in the
exact arithmetic the kernels follow: the sums ``Skk = sum(k^2)``, ``Sqq = sum(q^2)``,
``P = sum(k q (1 + w_k)(1 + w_q))``, ``A = sum(dy (1 + w_c) v)``, ``B = sum(dx v)``,
``V = sum(v^2)``; then ``r_k``, ``r_q``, ``s = r_k r_q P / sqrt(H)``, ``g``,
``r_x = rsqrt(g^2 V / H + eps)``, ``gam = g r_x`` and::

    dg = B + A eps r_x^3                     (= sum(dx_total v); the conv norm's cancellation done exactly)
    dz = dg g (1 - g)
    ds = dz / (2 sqrt(max(|s|, 1e-6))) where |s| >= 1e-6, else 0      (torch's clamp_min
         passes the gradient where the input is >= the bound; at s = 0 sign() and abs()
         both give 0, so g = 1/2 and ds = 0 there)
    alpha = ds r_k r_q / sqrt(H)
    dk = alpha (1 + w_k)(1 + w_q) q - alpha r_k^2 (P / H) k     (dq likewise, k and q swapped)
    dv = sum over m of  g dx + gam (1 + w_c) dy - gam^3 (A / H) v
    dw_k = (1 + w_q) sum over t of alpha k q,  dw_q = (1 + w_k) sum over t of alpha k q,
    dw_c = sum over t of gam dy v

The coefficients stored per (t, m) are ``alpha``, ``alpha r_k^2 P / H``, ``alpha r_q^2 P / H``,
``g``, ``gam`` and ``gam^3 A / H``.

Numerics: everything is computed in float32 (float64 for float64 inputs, so gradcheck
works), and the forward rounds values to the input dtype where the reference rounds them
(after each norm, the product ``kn * qn``, the group sum, the division by ``sqrt(H)``, the
clamp, the square root, the sigmoid and ``g * v``), so a bfloat16 run follows the
reference's bfloat16 rounding (its sums over ``H`` in another order). Rounding to bfloat16 is
``_numerics.round_bf16`` (bit arithmetic, round to nearest even, NaN -> the canonical NaN):
exact on a GPU and under the Triton interpreter alike (the interpreter's float32 -> bfloat16
cast truncates). The backward recomputes the forward in float32 *without* those roundings
and rounds only the final gradients: its gradients are the exact derivative at the given
inputs up to float32 error, which is what a bfloat16 run is judged against (a float64 run).
Mirroring the roundings there made a 1000x-amplified gradient (the conv norm of an all-zero
value row has ``r_x = 1/sqrt(eps)``) land one bfloat16 ulp off.

Registered as ``torch.ops.ple.ple_gate`` (autograd: ``ple.ple_gate_backward``); the public
``ple_gate`` checks the call (``ple._checks.gate_call``; the gate reads no index values).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import _checks
from ..reference import gate as _reference
from . import _numerics
from ._library import register, twin
from ._numerics import acc_dtype, deterministic, is_fp64, round_bf16

__all__ = ["ple_gate"]

# Block sizes (module-level so tests can monkeypatch them; read at launch time).
_FWD_CHUNK_H = 512      # forward: widest power-of-two chunk of H per step (one that divides H when it can)
_STATS_CHUNK_H = 512    # backward stats kernel: chunk of H per step
_STATS_TOKENS = 16      # backward stats kernel: tokens per program, a power of two (norm weights load once per chunk)
_BWD_BLOCK_T = 16       # backward main kernel: tokens per tile, a power of two (one norm-weight partial per tile)
_BWD_CHUNK_H = 128      # backward main kernel: channels of H per tile (at most)
_SUM_BLOCK_C = 1024     # norm-weight second pass: channels per program
_DET_CHUNK_H = 128      # deterministic mode: the H chunk of both backward kernels (fixed, not a tuning knob)
_DET_FWD_CHUNK_H = 512  # deterministic mode: the forward's H chunk (fixed, not a tuning knob)
_MIN_EXACT_CHUNK = 64   # a power-of-two divisor of H narrower than this (and the cap) gives masked chunks


@triton.jit
def _round_io(x, IS_BF16: tl.constexpr, IS_FP16: tl.constexpr):
    """Round float32 ``x`` to the input dtype and back (identity for float32 / float64 inputs)."""
    r = x
    if IS_BF16:
        r = round_bf16(x)
    if IS_FP16:
        r = x.to(tl.float16).to(tl.float32)
    return r


@triton.jit
def _to_acc(x, IS_FP64: tl.constexpr):
    if IS_FP64:
        y = x.to(tl.float64)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _rsqrt(x, IS_FP64: tl.constexpr):
    if IS_FP64:
        y = 1.0 / tl.sqrt(x)          # IEEE sqrt and division in float64
    else:
        y = tl.rsqrt(x)
    return y


@triton.jit
def _gate_clamp(IS_FP64: tl.constexpr):
    """1e-6 in the compute dtype (a float literal would be float32 even in a float64 kernel)."""
    if IS_FP64:
        c = tl.full([], 1.0, tl.float64) / 1000000.0
    else:
        c = tl.full([], 1e-6, tl.float32)
    return c


@triton.jit
def _scalars(H, eps_hi, eps_lo, sqrt_h, IS_FP64: tl.constexpr):
    """``eps`` and ``sqrt(H)`` in the compute dtype.

    Float kernel arguments are float32, so a float64 kernel gets ``eps`` as the sum of two
    float32 halves and computes ``sqrt(H)`` itself; a float32 kernel uses ``eps`` and
    ``sqrt(H)`` rounded to float32, as torch does with a Python scalar.
    """
    if IS_FP64:
        eps = (tl.zeros([], dtype=tl.float64) + eps_hi) + eps_lo
        root = tl.sqrt(tl.zeros([], dtype=tl.float64) + H)
    else:
        eps = eps_hi
        root = sqrt_h
    return eps, root


@triton.jit
def _gate_of(s, IS_FP64: tl.constexpr, IS_BF16: tl.constexpr, IS_FP16: tl.constexpr):
    """``(|s|, sqrt(max(|s|, 1e-6)), g)`` with the reference's roundings (none for float32 / float64)."""
    a = tl.abs(s)
    mag = _round_io(tl.sqrt(_round_io(tl.maximum(a, _gate_clamp(IS_FP64)), IS_BF16, IS_FP16)), IS_BF16, IS_FP16)
    sgn = tl.where(s > 0, 1.0, tl.where(s < 0, -1.0, 0.0))
    g = _round_io(1.0 / (1.0 + tl.exp(-(mag * sgn))), IS_BF16, IS_FP16)
    return a, mag, g


@triton.jit
def _gate_fwd_kernel(
    key_ptr, stride_key_t, stride_key_c, value_ptr, stride_value_t, stride_value_h,
    hid_ptr, stride_hid_t, stride_hid_c,
    wk_ptr, stride_wk_c, wq_ptr, stride_wq_c, wc_ptr, stride_wc_c,
    gated_ptr, stride_gated_t, stride_gated_c, conv_ptr, stride_conv_t, stride_conv_c,
    H, M, eps_hi, eps_lo, sqrt_h,
    IS_FP64: tl.constexpr, IS_BF16: tl.constexpr, IS_FP16: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """One token, all streams: per stream two passes over ``key`` / ``hidden`` (norms, then
    the score), then two passes over ``value`` for all streams at once (conv norm, then the
    stores), ``CHUNK`` channels of ``H`` per step."""
    eps, root = _scalars(H, eps_hi, eps_lo, sqrt_h, IS_FP64)
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, CHUNK)
    rows = tl.arange(0, BLOCK_M)
    key_row = key_ptr + t * stride_key_t
    hid_row = hid_ptr + t * stride_hid_t
    val_row = value_ptr + t * stride_value_t
    g_all = _to_acc(tl.zeros([BLOCK_M], dtype=tl.float32), IS_FP64)
    for m in range(M):
        kk = _to_acc(tl.zeros([CHUNK], dtype=tl.float32), IS_FP64)
        qq = _to_acc(tl.zeros([CHUNK], dtype=tl.float32), IS_FP64)
        for h0 in range(0, H, CHUNK):
            h = h0 + j
            hm = h < H
            c = m * H + h
            k = _to_acc(tl.load(key_row + c * stride_key_c, mask=hm, other=0.0), IS_FP64)
            q = _to_acc(tl.load(hid_row + c * stride_hid_c, mask=hm, other=0.0), IS_FP64)
            kk += k * k
            qq += q * q
        r_k = _rsqrt(tl.sum(kk, 0) / H + eps, IS_FP64)
        r_q = _rsqrt(tl.sum(qq, 0) / H + eps, IS_FP64)
        acc = _to_acc(tl.zeros([CHUNK], dtype=tl.float32), IS_FP64)
        for h0 in range(0, H, CHUNK):         # second pass: the chunks are still in L1 / L2
            h = h0 + j
            hm = h < H
            c = m * H + h
            k = _to_acc(tl.load(key_row + c * stride_key_c, mask=hm, other=0.0), IS_FP64)
            q = _to_acc(tl.load(hid_row + c * stride_hid_c, mask=hm, other=0.0), IS_FP64)
            wk = _to_acc(tl.load(wk_ptr + c * stride_wk_c, mask=hm, other=0.0), IS_FP64)
            wq = _to_acc(tl.load(wq_ptr + c * stride_wq_c, mask=hm, other=0.0), IS_FP64)
            kn = _round_io(k * r_k * (1.0 + wk), IS_BF16, IS_FP16)
            qn = _round_io(q * r_q * (1.0 + wq), IS_BF16, IS_FP16)
            acc += _round_io(kn * qn, IS_BF16, IS_FP16)
        s = _round_io(tl.sum(acc, 0), IS_BF16, IS_FP16)
        s = _round_io(s / root, IS_BF16, IS_FP16)
        _, _, g = _gate_of(s, IS_FP64, IS_BF16, IS_FP16)
        g_all = tl.where(rows == m, g, g_all)
    # conv norm of x = g v, all streams at once: [BLOCK_M, CHUNK] tiles, value read once per pass
    g2 = g_all[:, None]
    live_m = (rows < M)[:, None]
    xx = _to_acc(tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32), IS_FP64)
    for h0 in range(0, H, CHUNK):
        h = h0 + j
        v = _to_acc(tl.load(val_row + h * stride_value_h, mask=h < H, other=0.0), IS_FP64)
        x = _round_io(g2 * v[None, :], IS_BF16, IS_FP16)
        xx += x * x
    r_x = _rsqrt(tl.sum(xx, 1) / H + eps, IS_FP64)[:, None]
    for h0 in range(0, H, CHUNK):
        h = h0 + j
        hm = h < H
        c = rows[:, None] * H + h[None, :]
        msk = live_m & hm[None, :]
        v = _to_acc(tl.load(val_row + h * stride_value_h, mask=hm, other=0.0), IS_FP64)
        wc = _to_acc(tl.load(wc_ptr + c * stride_wc_c, mask=msk, other=0.0), IS_FP64)
        x = _round_io(g2 * v[None, :], IS_BF16, IS_FP16)
        y = _round_io(x * r_x * (1.0 + wc), IS_BF16, IS_FP16)
        tl.store(gated_ptr + t * stride_gated_t + c * stride_gated_c, x, mask=msk)
        tl.store(conv_ptr + t * stride_conv_t + c * stride_conv_c, y, mask=msk)


@triton.jit
def _gate_stats_kernel(
    key_ptr, stride_key_t, stride_key_c, value_ptr, stride_value_t, stride_value_h,
    hid_ptr, stride_hid_t, stride_hid_c,
    wk_ptr, stride_wk_c, wq_ptr, stride_wq_c, wc_ptr, stride_wc_c,
    dgated_ptr, stride_dgated_t, stride_dgated_c,                         # grad of gated
    dconv_ptr, stride_dconv_t, stride_dconv_c,                            # grad of conv_input
    coef_ptr,                                                             # [T, M, 8] contiguous, acc
    T, H, M, eps_hi, eps_lo, sqrt_h,
    IS_FP64: tl.constexpr, TOK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """``TOK`` tokens, all streams: the six sums over ``H`` of each (token, stream) in one pass over
    the inputs (chunks of ``H`` outer, so the norm weights load once per chunk and program), then
    the coefficients of the main kernel (module docstring), stored as one ``[TOK, M, 8]`` tile."""
    eps, root = _scalars(H, eps_hi, eps_lo, sqrt_h, IS_FP64)
    t0 = tl.program_id(0).to(tl.int64) * TOK
    j = tl.arange(0, CHUNK)
    rows = tl.arange(0, BLOCK_M)
    ti = tl.arange(0, TOK)
    live_m = (rows < M)[:, None]
    zero2 = _to_acc(tl.zeros([TOK, BLOCK_M], dtype=tl.float32), IS_FP64)
    s_kk = zero2
    s_qq = zero2
    s_kq = zero2
    s_a = zero2
    s_b = zero2
    s_vv = zero2
    for h0 in range(0, H, CHUNK):
        h = h0 + j
        c = rows[:, None] * H + h[None, :]
        wmsk = live_m & (h < H)[None, :]
        wk = _to_acc(tl.load(wk_ptr + c * stride_wk_c, mask=wmsk, other=0.0), IS_FP64)
        wq = _to_acc(tl.load(wq_ptr + c * stride_wq_c, mask=wmsk, other=0.0), IS_FP64)
        wc1 = 1.0 + _to_acc(tl.load(wc_ptr + c * stride_wc_c, mask=wmsk, other=0.0), IS_FP64)
        wkq = (1.0 + wk) * (1.0 + wq)
        for i in range(TOK):
            t = t0 + i
            hlim = tl.where(t < T, H, 0)        # live channels of a live token
            hm = (h < hlim)[None, :]
            msk = live_m & hm
            k = _to_acc(tl.load(key_ptr + t * stride_key_t + c * stride_key_c, mask=msk, other=0.0), IS_FP64)
            q = _to_acc(tl.load(hid_ptr + t * stride_hid_t + c * stride_hid_c, mask=msk, other=0.0), IS_FP64)
            dxo = _to_acc(tl.load(dgated_ptr + t * stride_dgated_t + c * stride_dgated_c, mask=msk, other=0.0),
                          IS_FP64)
            dy = _to_acc(tl.load(dconv_ptr + t * stride_dconv_t + c * stride_dconv_c, mask=msk, other=0.0),
                         IS_FP64)
            # value broadcast over the streams' rows (L1 serves the repeats; each row sums it alike)
            v = _to_acc(tl.load(value_ptr + t * stride_value_t + (h * stride_value_h)[None, :] + 0 * rows[:, None],
                                mask=hm, other=0.0), IS_FP64)
            sel = (ti == i)[:, None]
            s_kk = tl.where(sel, s_kk + tl.sum(k * k, 1)[None, :], s_kk)
            s_qq = tl.where(sel, s_qq + tl.sum(q * q, 1)[None, :], s_qq)
            s_kq = tl.where(sel, s_kq + tl.sum(k * q * wkq, 1)[None, :], s_kq)
            s_a = tl.where(sel, s_a + tl.sum(dy * wc1 * v, 1)[None, :], s_a)
            s_b = tl.where(sel, s_b + tl.sum(dxo * v, 1)[None, :], s_b)
            s_vv = tl.where(sel, s_vv + tl.sum(v * v, 1)[None, :], s_vv)
    # the forward in float32 without the low-precision roundings (module docstring)
    r_k = _rsqrt(s_kk / H + eps, IS_FP64)
    r_q = _rsqrt(s_qq / H + eps, IS_FP64)
    s = r_k * r_q * s_kq / root
    a, mag, g = _gate_of(s, IS_FP64, False, False)
    r_x = _rsqrt(g * g * s_vv / H + eps, IS_FP64)
    gam = g * r_x
    dg = s_b + s_a * eps * (r_x * r_x * r_x)
    dz = dg * g * (1.0 - g)
    ds = tl.where(a >= _gate_clamp(IS_FP64), dz * 0.5 / mag, 0.0)
    alpha = ds / root * r_k * r_q
    col = tl.arange(0, 8)[None, None, :]
    out = tl.where(col == 0, alpha[:, :, None], 0.0)
    out = tl.where(col == 1, (alpha * (r_k * r_k) * (s_kq / H))[:, :, None], out)
    out = tl.where(col == 2, (alpha * (r_q * r_q) * (s_kq / H))[:, :, None], out)
    out = tl.where(col == 3, g[:, :, None], out)
    out = tl.where(col == 4, gam[:, :, None], out)
    out = tl.where(col == 5, (gam * gam * gam * (s_a / H))[:, :, None], out)
    tok = (t0 + ti)[:, None, None]
    m3 = rows[None, :, None]
    tl.store(coef_ptr + (tok * M + m3) * 8 + col, out, mask=(tok < T) & (m3 < M) & (col < 8))


@triton.jit
def _pick(x, sel, AXIS: tl.constexpr):
    """The entries of ``x`` where ``sel`` holds, one per line along ``AXIS`` (exact: the rest add zeros)."""
    return tl.sum(tl.where(sel, x, 0.0), AXIS)


@triton.jit
def _gate_bwd_kernel(
    key_ptr, stride_key_t, stride_key_c, value_ptr, stride_value_t, stride_value_h,
    hid_ptr, stride_hid_t, stride_hid_c,
    wk_ptr, stride_wk_c, wq_ptr, stride_wq_c, wc_ptr, stride_wc_c,
    dgated_ptr, stride_dgated_t, stride_dgated_c,                         # grad of gated
    dconv_ptr, stride_dconv_t, stride_dconv_c,                            # grad of conv_input
    coef_ptr,                                                             # [T, M, 8] contiguous, acc
    dk_ptr, dq_ptr, dv_ptr,                                               # [T, C], [T, C], [T, H]: input dtype
    part_ptr,                                                             # [tiles, 2, C] contiguous, acc
    T, H, M, C,
    IS_FP64: tl.constexpr, IS_BF16: tl.constexpr, IS_FP16: tl.constexpr,
    TOK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """A ``[TOK, CHUNK]`` tile of tokens x channels of ``H``, all streams in turn: ``dkey``,
    ``dhidden``, ``dvalue`` (the streams summed in order 0..M-1 in registers) and the tile's
    two norm-weight partial rows (its tokens' sums, one ``[2, M, CHUNK]`` store)."""
    pid_t = tl.program_id(0).to(tl.int64)
    ti = tl.arange(0, TOK)
    tok = pid_t * TOK + ti
    h = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    rows = tl.arange(0, BLOCK_M)
    live = tok < T
    hm = h < H
    msk = live[:, None] & hm[None, :]
    tok2 = tok[:, None]
    v = _to_acc(tl.load(value_ptr + tok2 * stride_value_t + (h * stride_value_h)[None, :], mask=msk, other=0.0),
                IS_FP64)
    # every coefficient of the tile's tokens and streams in one load
    col = tl.arange(0, 8)[None, None, :]
    m3 = rows[None, :, None]
    tok3 = tok[:, None, None]
    coef = tl.load(coef_ptr + (tok3 * M + m3) * 8 + col, mask=(tok3 < T) & (m3 < M) & (col < 8), other=0.0)
    col2 = tl.arange(0, 8)[None, :]
    dv = _to_acc(tl.zeros([TOK, CHUNK], dtype=tl.float32), IS_FP64)
    s1 = _to_acc(tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32), IS_FP64)
    s2 = _to_acc(tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32), IS_FP64)
    for m in range(M):
        cm = _pick(coef, m3 == m, 1)                                       # [TOK, 8]
        alpha = _pick(cm, col2 == 0, 1)[:, None]
        beta_k = _pick(cm, col2 == 1, 1)[:, None]
        beta_q = _pick(cm, col2 == 2, 1)[:, None]
        g = _pick(cm, col2 == 3, 1)[:, None]
        gam = _pick(cm, col2 == 4, 1)[:, None]
        delta = _pick(cm, col2 == 5, 1)[:, None]
        c = m * H + h
        wk1 = 1.0 + _to_acc(tl.load(wk_ptr + c * stride_wk_c, mask=hm, other=0.0), IS_FP64)
        wq1 = 1.0 + _to_acc(tl.load(wq_ptr + c * stride_wq_c, mask=hm, other=0.0), IS_FP64)
        wc1 = 1.0 + _to_acc(tl.load(wc_ptr + c * stride_wc_c, mask=hm, other=0.0), IS_FP64)
        wkq = (wk1 * wq1)[None, :]
        c2 = c[None, :]
        k = _to_acc(tl.load(key_ptr + tok2 * stride_key_t + c2 * stride_key_c, mask=msk, other=0.0), IS_FP64)
        q = _to_acc(tl.load(hid_ptr + tok2 * stride_hid_t + c2 * stride_hid_c, mask=msk, other=0.0), IS_FP64)
        dxo = _to_acc(tl.load(dgated_ptr + tok2 * stride_dgated_t + c2 * stride_dgated_c, mask=msk, other=0.0),
                      IS_FP64)
        dy = _to_acc(tl.load(dconv_ptr + tok2 * stride_dconv_t + c2 * stride_dconv_c, mask=msk, other=0.0),
                     IS_FP64)
        dk = alpha * wkq * q - beta_k * k
        dq = alpha * wkq * k - beta_q * q
        tl.store(dk_ptr + tok2 * C + c2, _round_io(dk, IS_BF16, IS_FP16), mask=msk)
        tl.store(dq_ptr + tok2 * C + c2, _round_io(dq, IS_BF16, IS_FP16), mask=msk)
        dv += g * dxo + gam * wc1[None, :] * dy - delta * v
        row = (rows == m)[:, None]
        s1 = tl.where(row, tl.sum(alpha * k * q, 0)[None, :], s1)
        s2 = tl.where(row, tl.sum(gam * dy * v, 0)[None, :], s2)
    tl.store(dv_ptr + tok2 * H + h[None, :], _round_io(dv, IS_BF16, IS_FP16), mask=msk)
    pair = tl.arange(0, 2)[:, None, None]
    hh = h[None, None, :]
    tl.store(part_ptr + (pid_t * 2 + pair) * C + m3 * H + hh, tl.where(pair == 0, s1[None], s2[None]),
             mask=(pair < 2) & (m3 < M) & (hh < H))


@triton.jit
def _store_w(ptr, x, mask, IS_BF16: tl.constexpr, IS_FP16: tl.constexpr):
    """Store ``x`` rounded (nearest even) to the dtype of ``ptr``."""
    if IS_BF16:
        x = round_bf16(x.to(tl.float32))
    if IS_FP16:
        x = x.to(tl.float16)
    tl.store(ptr, x, mask=mask)


@triton.jit
def _gate_wsum_kernel(
    part_ptr, num_tiles, C, wk_ptr, stride_wk_c, wq_ptr, stride_wq_c, dwk_ptr, dwq_ptr, dwc_ptr,
    IS_FP64: tl.constexpr, WK_BF16: tl.constexpr, WK_FP16: tl.constexpr, WQ_BF16: tl.constexpr,
    WQ_FP16: tl.constexpr, WC_BF16: tl.constexpr, WC_FP16: tl.constexpr, BLOCK: tl.constexpr,
):
    """Second pass: the tiles' partial rows added in token order, scaled, rounded to the weights' dtypes."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cm = c < C
    s1 = _to_acc(tl.zeros([BLOCK], dtype=tl.float32), IS_FP64)
    s2 = _to_acc(tl.zeros([BLOCK], dtype=tl.float32), IS_FP64)
    p1 = part_ptr + c                              # [tiles, 2, C]: pointer steps of 2 C (64-bit addresses)
    p2 = part_ptr + C + c
    for _ in range(num_tiles):
        s1 += tl.load(p1, mask=cm, other=0.0)
        s2 += tl.load(p2, mask=cm, other=0.0)
        p1 += 2 * C
        p2 += 2 * C
    wk1 = 1.0 + _to_acc(tl.load(wk_ptr + c * stride_wk_c, mask=cm, other=0.0), IS_FP64)
    wq1 = 1.0 + _to_acc(tl.load(wq_ptr + c * stride_wq_c, mask=cm, other=0.0), IS_FP64)
    _store_w(dwk_ptr + c, wq1 * s1, cm, WK_BF16, WK_FP16)
    _store_w(dwq_ptr + c, wk1 * s1, cm, WQ_BF16, WQ_FP16)
    _store_w(dwc_ptr + c, s2, cm, WC_BF16, WC_FP16)


def _eps_parts(eps: float) -> tuple[float, float]:
    """``eps`` as float32 ``hi + lo`` (exact to about 48 bits) for the float64 kernels."""
    hi = float(torch.tensor(eps, dtype=torch.float32))
    lo = float(torch.tensor(eps - hi, dtype=torch.float32))
    return hi, lo


def _chunk_h(H: int, cap: int) -> int:
    """Channels of ``H`` per step: the largest power of two dividing ``H`` (at most ``cap``), so no lane idles;
    if that is narrower than ``min(cap, _MIN_EXACT_CHUNK)``, ``min(cap, next_power_of_2(H))`` with a masked tail."""
    exact = min(H & -H, cap)
    if exact >= min(cap, _MIN_EXACT_CHUNK):
        return exact
    return min(cap, triton.next_power_of_2(H))


def _warps(elements: int) -> int:
    """Warps for a tile of ``elements``: one per 256 (8 bfloat16, one 128-bit access, per thread and tensor), 1 to 8."""
    return max(1, min(8, elements // 256))


def _input_args(key, value, hidden_states, wk, wq, wc) -> dict:
    """The input pointers and strides all kernels share."""
    return dict(
        key_ptr=key, stride_key_t=key.stride(0), stride_key_c=key.stride(1),
        value_ptr=value, stride_value_t=value.stride(0), stride_value_h=value.stride(1),
        hid_ptr=hidden_states, stride_hid_t=hidden_states.stride(0), stride_hid_c=hidden_states.stride(1),
        wk_ptr=wk, stride_wk_c=wk.stride(0), wq_ptr=wq, stride_wq_c=wq.stride(0), wc_ptr=wc, stride_wc_c=wc.stride(0),
    )


def _dtype_flags(dt: torch.dtype) -> dict:
    return dict(IS_FP64=is_fp64(dt), IS_BF16=dt == torch.bfloat16, IS_FP16=dt == torch.float16)


def _gate_fwd(key, value, hidden_states, wk, wq, wc, eps):
    T, C = key.shape
    H = value.shape[1]
    M = C // H
    gated = torch.empty((T, C), dtype=key.dtype, device=key.device)
    conv_input = torch.empty((T, C), dtype=key.dtype, device=key.device)
    if T == 0:
        return gated, conv_input
    eps_hi, eps_lo = _eps_parts(eps)
    chunk = _chunk_h(H, _DET_FWD_CHUNK_H if deterministic() else _FWD_CHUNK_H)
    _gate_fwd_kernel[(T,)](
        gated_ptr=gated, stride_gated_t=gated.stride(0), stride_gated_c=gated.stride(1),
        conv_ptr=conv_input, stride_conv_t=conv_input.stride(0), stride_conv_c=conv_input.stride(1),
        H=H, M=M, eps_hi=eps_hi, eps_lo=eps_lo, sqrt_h=math.sqrt(H), **_dtype_flags(key.dtype),
        CHUNK=chunk, BLOCK_M=triton.next_power_of_2(M), num_warps=_warps(chunk),
        **_input_args(key, value, hidden_states, wk, wq, wc))
    return gated, conv_input


def _gate_bwd(dgated, dconv, key, value, hidden_states, wk, wq, wc, eps):
    """Gradients of key, value, hidden_states and the three norm weights."""
    T, C = key.shape
    H = value.shape[1]
    M = C // H
    dt = key.dtype
    dev = key.device
    acc = acc_dtype(dt)
    det = deterministic()
    if det:
        tok = _numerics.DETERMINISTIC_CHUNK
        if tok < 1 or tok & (tok - 1):
            raise ValueError(f"DETERMINISTIC_CHUNK must be a power of two, got {tok}")
        stats_chunk = bwd_chunk = _chunk_h(H, _DET_CHUNK_H)
    else:
        tok = _BWD_BLOCK_T
        stats_chunk, bwd_chunk = _chunk_h(H, _STATS_CHUNK_H), _chunk_h(H, _BWD_CHUNK_H)
    block_m = triton.next_power_of_2(M)
    tiles = triton.cdiv(T, tok)
    dkey = torch.empty((T, C), dtype=dt, device=dev)
    dhidden = torch.empty((T, C), dtype=dt, device=dev)
    dvalue = torch.empty((T, H), dtype=dt, device=dev)
    part = torch.empty((tiles, 2, C), dtype=acc, device=dev)
    if T:
        eps_hi, eps_lo = _eps_parts(eps)
        coef = torch.empty((T, M, 8), dtype=acc, device=dev)
        grads = dict(dgated_ptr=dgated, stride_dgated_t=dgated.stride(0), stride_dgated_c=dgated.stride(1),
                     dconv_ptr=dconv, stride_dconv_t=dconv.stride(0), stride_dconv_c=dconv.stride(1),
                     coef_ptr=coef, **_input_args(key, value, hidden_states, wk, wq, wc))
        stats_tok = _STATS_TOKENS
        _gate_stats_kernel[(triton.cdiv(T, stats_tok),)](
            T=T, H=H, M=M, eps_hi=eps_hi, eps_lo=eps_lo, sqrt_h=math.sqrt(H), IS_FP64=is_fp64(dt),
            TOK=stats_tok, CHUNK=stats_chunk, BLOCK_M=block_m, num_warps=_warps(block_m * stats_chunk // 2),
            **grads)
        _gate_bwd_kernel[(tiles, triton.cdiv(H, bwd_chunk))](
            dk_ptr=dkey, dq_ptr=dhidden, dv_ptr=dvalue, part_ptr=part, T=T, H=H, M=M, C=C, **_dtype_flags(dt),
            TOK=tok, CHUNK=bwd_chunk, BLOCK_M=block_m, num_warps=_warps(tok * bwd_chunk), **grads)
    dws = [torch.empty((C,), dtype=w.dtype, device=dev) for w in (wk, wq, wc)]
    flags = {}
    for name, w in zip(("WK", "WQ", "WC"), (wk, wq, wc), strict=True):
        flags[f"{name}_BF16"], flags[f"{name}_FP16"] = w.dtype == torch.bfloat16, w.dtype == torch.float16
    block_c = min(_SUM_BLOCK_C, triton.next_power_of_2(C))
    _gate_wsum_kernel[(triton.cdiv(C, block_c),)](
        part, tiles, C, wk, wk.stride(0), wq, wq.stride(0), dws[0], dws[1], dws[2], IS_FP64=is_fp64(dt), **flags,
        BLOCK=block_c, num_warps=4)
    return (dkey, dvalue, dhidden, *dws)


# ---- registration ----------------------------------------------------------------------------------


def _gate_bwd_impl(dgated: torch.Tensor, dconv: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   hidden_states: torch.Tensor, norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor,
                   norm_conv_weight: torch.Tensor, eps: float) -> list[torch.Tensor]:
    return list(_gate_bwd(dgated, dconv, key, value, hidden_states, norm_key_weight, norm_query_weight,
                          norm_conv_weight, eps))


def _gate_bwd_fake(dgated, dconv, key, value, hidden_states, wk, wq, wc, eps):
    return [torch.empty_like(key, memory_format=torch.contiguous_format),
            torch.empty_like(value, memory_format=torch.contiguous_format),
            torch.empty_like(hidden_states, memory_format=torch.contiguous_format),
            torch.empty_like(wk), torch.empty_like(wq), torch.empty_like(wc)]


_gate_bwd_op = register("ple_gate_backward", _gate_bwd_impl, fake=_gate_bwd_fake)


def _gate_impl(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor, norm_key_weight: torch.Tensor,
               norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _gate_fwd(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps)


def _gate_fake(key, value, hidden_states, wk, wq, wc, eps):
    return (torch.empty_like(key, memory_format=torch.contiguous_format),
            torch.empty_like(key, memory_format=torch.contiguous_format))


def _gate_setup(ctx, inputs, output):
    *tensors, eps = inputs
    ctx.save_for_backward(*tensors)
    ctx.eps = eps


def _gate_backward(ctx, dgated, dconv):
    tensors = ctx.saved_tensors
    dgated = torch.zeros_like(tensors[0]) if dgated is None else dgated
    dconv = torch.zeros_like(tensors[0]) if dconv is None else dconv
    grads = _gate_bwd_op(dgated, dconv, *tensors, ctx.eps)
    return (*grads, None)


_gate_op = register("ple_gate", _gate_impl, fake=_gate_fake, backward=_gate_backward, setup_context=_gate_setup)


@twin(_reference.ple_gate)
def ple_gate(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps):
    _checks.gate_call(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps)
    return _gate_op(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, float(eps))
