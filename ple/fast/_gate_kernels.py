"""The Triton kernels of ``ple.fast.gate`` (the grouped RMS norms and the signed-sqrt gate, docs/spec.md section 4).

Notation per token ``t`` and stream ``m`` (vectors of ``H`` channels): ``k``, ``q`` the
key and hidden-state groups, ``v`` the value row; ``r_k = rsqrt(mean(k^2) + eps)``,
``kh = k r_k``, ``kn = kh a_k`` (``qh``, ``qn`` likewise), ``s = sum(kn qn) / sqrt(H)``,
``g = sigmoid(sign(s) sqrt(max(|s|, 1e-6)))``, ``x = g v`` (gated), ``y = norm_conv(x)``
with ``r_x = rsqrt(mean(x^2) + ceps)``. A norm's scale ``a = norm_scale(w)`` is ``1 + w`` where the
``UNIT_OFFSET`` constexpr is set (the Qwen4Exp family) and ``w`` where it is not (the Engram family,
docs/spec.md section 15); ``ceps``, the conv norm's epsilon, is a runtime argument (``ceps_hi``,
``ceps_lo``), equal to ``eps`` in the Qwen4Exp family. ``da / dw = 1`` either way, so the backward
below holds for both with ``a`` in place of ``1 + w``.

The gate's arithmetic (its rounding points) is ``_gate_math``'s, shared with the prefill kernels;
the launchers, block sizes and deterministic mode are ``ple.fast.gate``'s.

Kernel design (sums over ``H`` run over power-of-two chunks of ``H``, ``CHUNK``: ``gate._chunk_h``):

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
  partial rows in token order and scales them by ``a`` into the three gradients (rounded
  to each weight's dtype). The inputs are read twice from memory (the stats pass, then the
  tile pass), 2 x 87040 B per token, plus 46080 B of gradients written and 2 x 5120 B of
  partial rows: about 1.67x the op's minimum (138240 B), the price of no atomics and of
  programs small enough for 2 CTAs per SM: the weight gradients need programs that own
  channels over many tokens, the per-(token, stream) sums need all of ``H``, and one token's
  rows (87 KB) with accumulators for all ``C`` channels do not fit on an SM.

Backward, per ``(t, m)`` with incoming ``dx`` (of gated) and ``dy`` (of conv_input), in the
exact arithmetic the kernels follow: the sums ``Skk = sum(k^2)``, ``Sqq = sum(q^2)``,
``P = sum(k q a_k a_q)``, ``A = sum(dy a_c v)``, ``B = sum(dx v)``,
``V = sum(v^2)``; then ``r_k``, ``r_q``, ``s = r_k r_q P / sqrt(H)``, ``g``,
``r_x = rsqrt(g^2 V / H + ceps)``, ``gam = g r_x`` and::

    dg = B + A ceps r_x^3                    (= sum(dx_total v); the conv norm's cancellation done exactly)
    dz = dg g (1 - g)
    ds = dz / (2 sqrt(max(|s|, 1e-6))) where |s| >= 1e-6, else 0      (torch's clamp_min
         passes the gradient where the input is >= the bound; at s = 0 sign() and abs()
         both give 0, so g = 1/2 and ds = 0 there)
    alpha = ds r_k r_q / sqrt(H)
    dk = alpha a_k a_q q - alpha r_k^2 (P / H) k     (dq likewise, k and q swapped)
    dv = sum over m of  g dx + gam a_c dy - gam^3 (A / H) v
    dw_k = a_q sum over t of alpha k q,  dw_q = a_k sum over t of alpha k q,
    dw_c = sum over t of gam dy v

The coefficients stored per (t, m) are ``alpha``, ``alpha r_k^2 P / H``, ``alpha r_q^2 P / H``,
``g``, ``gam`` and ``gam^3 A / H``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._gate_math import conv_input, gate_clamp, gate_of, gated, norm_product, norm_scale, score_gate
from ._numerics import round_bf16, round_io, rsqrt, scalars, to_acc

__all__ = ["_gate_fwd_kernel", "_gate_stats_kernel", "_gate_bwd_kernel", "_gate_wsum_kernel"]


@triton.jit
def _gate_fwd_kernel(
    key_ptr, stride_key_t, stride_key_c, value_ptr, stride_value_t, stride_value_h,
    hid_ptr, stride_hid_t, stride_hid_c,
    wk_ptr, stride_wk_c, wq_ptr, stride_wq_c, wc_ptr, stride_wc_c,
    gated_ptr, stride_gated_t, stride_gated_c, conv_ptr, stride_conv_t, stride_conv_c,
    H, M, eps_hi, eps_lo, ceps_hi, ceps_lo, sqrt_h,
    IS_FP64: tl.constexpr, IS_BF16: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
):
    """One token, all streams: per stream two passes over ``key`` / ``hidden`` (norms, then
    the score), then two passes over ``value`` for all streams at once (conv norm, then the
    stores), ``CHUNK`` channels of ``H`` per step."""
    XT = key_ptr.dtype.element_ty
    eps, root = scalars(H, eps_hi, eps_lo, sqrt_h, IS_FP64)
    ceps, _ = scalars(H, ceps_hi, ceps_lo, sqrt_h, IS_FP64)
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, CHUNK)
    rows = tl.arange(0, BLOCK_M)
    key_row = key_ptr + t * stride_key_t
    hid_row = hid_ptr + t * stride_hid_t
    val_row = value_ptr + t * stride_value_t
    g_all = to_acc(tl.zeros([BLOCK_M], dtype=tl.float32), IS_FP64)
    for m in range(M):
        kk = to_acc(tl.zeros([CHUNK], dtype=tl.float32), IS_FP64)
        qq = to_acc(tl.zeros([CHUNK], dtype=tl.float32), IS_FP64)
        for h0 in range(0, H, CHUNK):
            h = h0 + j
            hm = h < H
            c = m * H + h
            k = to_acc(tl.load(key_row + c * stride_key_c, mask=hm, other=0.0), IS_FP64)
            q = to_acc(tl.load(hid_row + c * stride_hid_c, mask=hm, other=0.0), IS_FP64)
            kk += k * k
            qq += q * q
        r_k = rsqrt(tl.sum(kk, 0) / H + eps, IS_FP64)
        r_q = rsqrt(tl.sum(qq, 0) / H + eps, IS_FP64)
        acc = to_acc(tl.zeros([CHUNK], dtype=tl.float32), IS_FP64)
        for h0 in range(0, H, CHUNK):         # second pass: the chunks are still in L1 / L2
            h = h0 + j
            hm = h < H
            c = m * H + h
            k = to_acc(tl.load(key_row + c * stride_key_c, mask=hm, other=0.0), IS_FP64)
            q = to_acc(tl.load(hid_row + c * stride_hid_c, mask=hm, other=0.0), IS_FP64)
            wk = to_acc(tl.load(wk_ptr + c * stride_wk_c, mask=hm, other=0.0), IS_FP64)
            wq = to_acc(tl.load(wq_ptr + c * stride_wq_c, mask=hm, other=0.0), IS_FP64)
            acc += norm_product(k, q, r_k, r_q, wk, wq, XT, IS_BF16, IS_FP64, UNIT_OFFSET)
        g = score_gate(tl.sum(acc, 0), root, XT, IS_BF16, IS_FP64)
        g_all = tl.where(rows == m, g, g_all)
    # conv norm of x = g v, all streams at once: [BLOCK_M, CHUNK] tiles, value read once per pass
    g2 = g_all[:, None]
    live_m = (rows < M)[:, None]
    xx = to_acc(tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32), IS_FP64)
    for h0 in range(0, H, CHUNK):
        h = h0 + j
        v = to_acc(tl.load(val_row + h * stride_value_h, mask=h < H, other=0.0), IS_FP64)
        x = gated(g2, v[None, :], XT, IS_BF16, IS_FP64)
        xx += x * x
    r_x = rsqrt(tl.sum(xx, 1) / H + ceps, IS_FP64)[:, None]
    for h0 in range(0, H, CHUNK):
        h = h0 + j
        hm = h < H
        c = rows[:, None] * H + h[None, :]
        msk = live_m & hm[None, :]
        v = to_acc(tl.load(val_row + h * stride_value_h, mask=hm, other=0.0), IS_FP64)
        wc = to_acc(tl.load(wc_ptr + c * stride_wc_c, mask=msk, other=0.0), IS_FP64)
        x = gated(g2, v[None, :], XT, IS_BF16, IS_FP64)
        y = conv_input(x * r_x, norm_scale(wc, UNIT_OFFSET), XT, IS_BF16, IS_FP64)
        tl.store(gated_ptr + t * stride_gated_t + c * stride_gated_c, x, mask=msk)
        tl.store(conv_ptr + t * stride_conv_t + c * stride_conv_c, y, mask=msk)


@triton.jit
def _bwd_inputs(key_ptr, stride_key_t, stride_key_c, hid_ptr, stride_hid_t, stride_hid_c,
                dgated_ptr, stride_dgated_t, stride_dgated_c, dconv_ptr, stride_dconv_t, stride_dconv_c,
                t, c, mask, IS_FP64: tl.constexpr):
    """``key``, ``hidden`` and the two incoming gradients at tokens ``t`` and channels ``c`` (offsets broadcast
    together) where ``mask``, else 0, in the accumulation dtype: what both backward kernels read per element."""
    k = to_acc(tl.load(key_ptr + t * stride_key_t + c * stride_key_c, mask=mask, other=0.0), IS_FP64)
    q = to_acc(tl.load(hid_ptr + t * stride_hid_t + c * stride_hid_c, mask=mask, other=0.0), IS_FP64)
    dxo = to_acc(tl.load(dgated_ptr + t * stride_dgated_t + c * stride_dgated_c, mask=mask, other=0.0), IS_FP64)
    dy = to_acc(tl.load(dconv_ptr + t * stride_dconv_t + c * stride_dconv_c, mask=mask, other=0.0), IS_FP64)
    return k, q, dxo, dy


@triton.jit
def _gate_stats_kernel(
    key_ptr, stride_key_t, stride_key_c, value_ptr, stride_value_t, stride_value_h,
    hid_ptr, stride_hid_t, stride_hid_c,
    wk_ptr, stride_wk_c, wq_ptr, stride_wq_c, wc_ptr, stride_wc_c,
    dgated_ptr, stride_dgated_t, stride_dgated_c,                         # grad of gated
    dconv_ptr, stride_dconv_t, stride_dconv_c,                            # grad of conv_input
    coef_ptr,                                                             # [T, M, 8] contiguous, acc
    T, H, M, eps_hi, eps_lo, ceps_hi, ceps_lo, sqrt_h,
    IS_FP64: tl.constexpr, TOK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
):
    """``TOK`` tokens, all streams: the six sums over ``H`` of each (token, stream) in one pass over
    the inputs (chunks of ``H`` outer, so the norm weights load once per chunk and program), then
    the coefficients of the main kernel (module docstring), stored as one ``[TOK, M, 8]`` tile."""
    eps, root = scalars(H, eps_hi, eps_lo, sqrt_h, IS_FP64)
    ceps, _ = scalars(H, ceps_hi, ceps_lo, sqrt_h, IS_FP64)
    t0 = tl.program_id(0).to(tl.int64) * TOK
    j = tl.arange(0, CHUNK)
    rows = tl.arange(0, BLOCK_M)
    ti = tl.arange(0, TOK)
    live_m = (rows < M)[:, None]
    zero2 = to_acc(tl.zeros([TOK, BLOCK_M], dtype=tl.float32), IS_FP64)
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
        wk = to_acc(tl.load(wk_ptr + c * stride_wk_c, mask=wmsk, other=0.0), IS_FP64)
        wq = to_acc(tl.load(wq_ptr + c * stride_wq_c, mask=wmsk, other=0.0), IS_FP64)
        wc1 = norm_scale(to_acc(tl.load(wc_ptr + c * stride_wc_c, mask=wmsk, other=0.0), IS_FP64), UNIT_OFFSET)
        wkq = norm_scale(wk, UNIT_OFFSET) * norm_scale(wq, UNIT_OFFSET)
        for i in range(TOK):
            t = t0 + i
            hlim = tl.where(t < T, H, 0)        # live channels of a live token
            hm = (h < hlim)[None, :]
            msk = live_m & hm
            k, q, dxo, dy = _bwd_inputs(key_ptr, stride_key_t, stride_key_c, hid_ptr, stride_hid_t, stride_hid_c,
                                        dgated_ptr, stride_dgated_t, stride_dgated_c,
                                        dconv_ptr, stride_dconv_t, stride_dconv_c, t, c, msk, IS_FP64)
            # value broadcast over the streams' rows (L1 serves the repeats; each row sums it alike)
            v = to_acc(tl.load(value_ptr + t * stride_value_t + (h * stride_value_h)[None, :] + 0 * rows[:, None],
                                mask=hm, other=0.0), IS_FP64)
            sel = (ti == i)[:, None]
            s_kk = tl.where(sel, s_kk + tl.sum(k * k, 1)[None, :], s_kk)
            s_qq = tl.where(sel, s_qq + tl.sum(q * q, 1)[None, :], s_qq)
            s_kq = tl.where(sel, s_kq + tl.sum(k * q * wkq, 1)[None, :], s_kq)
            s_a = tl.where(sel, s_a + tl.sum(dy * wc1 * v, 1)[None, :], s_a)
            s_b = tl.where(sel, s_b + tl.sum(dxo * v, 1)[None, :], s_b)
            s_vv = tl.where(sel, s_vv + tl.sum(v * v, 1)[None, :], s_vv)
    # the forward in float32 without the low-precision roundings (module docstring)
    r_k = rsqrt(s_kk / H + eps, IS_FP64)
    r_q = rsqrt(s_qq / H + eps, IS_FP64)
    s = r_k * r_q * s_kq / root
    a, mag, g = gate_of(s, s.dtype, False, IS_FP64)          # s.dtype: the accumulation dtype, no rounding
    r_x = rsqrt(g * g * s_vv / H + ceps, IS_FP64)
    gam = g * r_x
    dg = s_b + s_a * ceps * (r_x * r_x * r_x)
    dz = dg * g * (1.0 - g)
    ds = tl.where(a >= gate_clamp(IS_FP64), dz * 0.5 / mag, 0.0)
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
    TOK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, UNIT_OFFSET: tl.constexpr,
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
    v = to_acc(tl.load(value_ptr + tok2 * stride_value_t + (h * stride_value_h)[None, :], mask=msk, other=0.0),
                IS_FP64)
    # every coefficient of the tile's tokens and streams in one load
    col = tl.arange(0, 8)[None, None, :]
    m3 = rows[None, :, None]
    tok3 = tok[:, None, None]
    coef = tl.load(coef_ptr + (tok3 * M + m3) * 8 + col, mask=(tok3 < T) & (m3 < M) & (col < 8), other=0.0)
    col2 = tl.arange(0, 8)[None, :]
    dv = to_acc(tl.zeros([TOK, CHUNK], dtype=tl.float32), IS_FP64)
    s1 = to_acc(tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32), IS_FP64)
    s2 = to_acc(tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32), IS_FP64)
    for m in range(M):
        cm = _pick(coef, m3 == m, 1)                                       # [TOK, 8]
        alpha = _pick(cm, col2 == 0, 1)[:, None]
        beta_k = _pick(cm, col2 == 1, 1)[:, None]
        beta_q = _pick(cm, col2 == 2, 1)[:, None]
        g = _pick(cm, col2 == 3, 1)[:, None]
        gam = _pick(cm, col2 == 4, 1)[:, None]
        delta = _pick(cm, col2 == 5, 1)[:, None]
        c = m * H + h
        wk1 = norm_scale(to_acc(tl.load(wk_ptr + c * stride_wk_c, mask=hm, other=0.0), IS_FP64), UNIT_OFFSET)
        wq1 = norm_scale(to_acc(tl.load(wq_ptr + c * stride_wq_c, mask=hm, other=0.0), IS_FP64), UNIT_OFFSET)
        wc1 = norm_scale(to_acc(tl.load(wc_ptr + c * stride_wc_c, mask=hm, other=0.0), IS_FP64), UNIT_OFFSET)
        wkq = (wk1 * wq1)[None, :]
        c2 = c[None, :]
        k, q, dxo, dy = _bwd_inputs(key_ptr, stride_key_t, stride_key_c, hid_ptr, stride_hid_t, stride_hid_c,
                                    dgated_ptr, stride_dgated_t, stride_dgated_c,
                                    dconv_ptr, stride_dconv_t, stride_dconv_c, tok2, c2, msk, IS_FP64)
        dk = alpha * wkq * q - beta_k * k
        dq = alpha * wkq * k - beta_q * q
        tl.store(dk_ptr + tok2 * C + c2, round_io(dk, IS_BF16, IS_FP16), mask=msk)
        tl.store(dq_ptr + tok2 * C + c2, round_io(dq, IS_BF16, IS_FP16), mask=msk)
        dv += g * dxo + gam * wc1[None, :] * dy - delta * v
        row = (rows == m)[:, None]
        s1 = tl.where(row, tl.sum(alpha * k * q, 0)[None, :], s1)
        s2 = tl.where(row, tl.sum(gam * dy * v, 0)[None, :], s2)
    tl.store(dv_ptr + tok2 * H + h[None, :], round_io(dv, IS_BF16, IS_FP16), mask=msk)
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
    UNIT_OFFSET: tl.constexpr,
):
    """Second pass: the tiles' partial rows added in token order, scaled (by the other norm's scale: ``dw_k =
    a_q sum(alpha k q)``), rounded to the weights' dtypes."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cm = c < C
    s1 = to_acc(tl.zeros([BLOCK], dtype=tl.float32), IS_FP64)
    s2 = to_acc(tl.zeros([BLOCK], dtype=tl.float32), IS_FP64)
    p1 = part_ptr + c                              # [tiles, 2, C]: pointer steps of 2 C (64-bit addresses)
    p2 = part_ptr + C + c
    for _ in range(num_tiles):
        s1 += tl.load(p1, mask=cm, other=0.0)
        s2 += tl.load(p2, mask=cm, other=0.0)
        p1 += 2 * C
        p2 += 2 * C
    wk1 = norm_scale(to_acc(tl.load(wk_ptr + c * stride_wk_c, mask=cm, other=0.0), IS_FP64), UNIT_OFFSET)
    wq1 = norm_scale(to_acc(tl.load(wq_ptr + c * stride_wq_c, mask=cm, other=0.0), IS_FP64), UNIT_OFFSET)
    _store_w(dwk_ptr + c, wq1 * s1, cm, WK_BF16, WK_FP16)
    _store_w(dwq_ptr + c, wk1 * s1, cm, WQ_BF16, WQ_FP16)
    _store_w(dwc_ptr + c, s2, cm, WC_BF16, WC_FP16)
