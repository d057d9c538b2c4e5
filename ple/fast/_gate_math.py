"""The gate's arithmetic (docs/spec.md section 4) as ``@triton.jit`` helpers, one definition for every gating kernel.

``ple.fast.gate`` (one token per program), ``ple.fast.prefill`` (a block of rows per program) and
``ple.fast.prefill_inputs`` call these, so the rounding points of the gate exist once: after each
norm, the product ``kn * qn``, the group sum, the division by ``sqrt(H)``, the clamp, the square
root, the sigmoid, ``g * v`` and the conv norm. Each helper rounds to the storage dtype ``XT`` with
`_numerics.rnd` (``XT`` the accumulation dtype, float32 / float64: no rounding at all, which is how
the gate's backward recomputes the forward). The sums over ``H`` stay in the kernels: their order
(chunked per kernel) is the kernel's own.

The family's norm form is `norm_scale`'s (``UNIT_OFFSET``, a ``tl.constexpr``: the scale ``1 + w`` of the
Qwen4Exp family, or ``w`` itself, ``nn.RMSNorm``'s, of the Engram family, docs/spec.md section 15); the
conv norm's epsilon (``ceps``, the Engram family's 1e-5) is a runtime argument beside the key and query
norms' ``eps``.

`row_scalars` is the prefill kernels' gate of a block of rows (``g`` and the conv norm's ``r_x`` per
row, three loops over ``H`` in chunks of `BLOCK_H`); `conv_norm_chunk` and `conv_rows` give those rows'
gated values and conv inputs, one chunk of ``H`` at a time (`conv_inputs_chunk`: the conv inputs alone).
`BLOCK_H` and `STATE_WARPS` are the prefill kernels' tile across ``H``, shared with ``prefill_inputs`` so its
sums run in the state kernel's order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._numerics import rnd, rsqrt, to_acc, up

__all__ = ["BLOCK_H", "STATE_WARPS", "norm_scale", "gate_clamp", "gate_of", "norm_product", "score_gate", "gated",
           "conv_input", "row_scalars", "conv_norm_chunk", "conv_rows", "conv_inputs_chunk"]

BLOCK_H = 32            # the prefill kernels: channels of H per chunk
STATE_WARPS = 2         # the prefill state kernel's [next_power_of_2(S), BLOCK_H] tiles: 8 channels per thread


@triton.jit
def norm_scale(w, UNIT_OFFSET: tl.constexpr):
    """A norm's scale of its weight ``w`` (in the accumulation dtype): ``1 + w`` where ``UNIT_OFFSET`` (the
    Qwen4Exp family), else ``w`` itself (the Engram family: ``nn.RMSNorm``)."""
    if UNIT_OFFSET:
        a = 1.0 + w
    else:
        a = w
    return a


@triton.jit
def gate_clamp(IS_FP64: tl.constexpr):
    """1e-6 in the compute dtype (a float literal would be float32 even in a float64 kernel)."""
    if IS_FP64:
        c = tl.full([], 1.0, tl.float64) / 1000000.0
    else:
        c = tl.full([], 1e-6, tl.float32)
    return c


@triton.jit
def gate_of(s, XT: tl.constexpr, IS_BF16: tl.constexpr, IS_FP64: tl.constexpr):
    """``(|s|, sqrt(max(|s|, 1e-6)), g)`` of the score ``s``, ``g = sigmoid(sign(s) sqrt(max(|s|, 1e-6)))``,
    rounded to ``XT`` where the reference rounds."""
    a = tl.abs(s)
    mag = rnd(tl.sqrt(rnd(tl.maximum(a, gate_clamp(IS_FP64)), XT, IS_BF16, IS_FP64)), XT, IS_BF16, IS_FP64)
    sgn = tl.where(s > 0, 1.0, tl.where(s < 0, -1.0, 0.0))
    g = rnd(1.0 / (1.0 + tl.exp(-(mag * sgn))), XT, IS_BF16, IS_FP64)
    return a, mag, g


@triton.jit
def norm_product(k, q, r_k, r_q, wk, wq, XT: tl.constexpr, IS_BF16: tl.constexpr, IS_FP64: tl.constexpr,
                 UNIT_OFFSET: tl.constexpr):
    """One term of the score: ``round(kn * qn)``, ``kn = round(k r_k a_k)`` with ``a_k = norm_scale(w_k)``
    (``1 + w_k``, or ``w_k``), ``qn`` likewise (broadcast)."""
    kn = rnd((k * r_k) * norm_scale(wk, UNIT_OFFSET), XT, IS_BF16, IS_FP64)
    qn = rnd((q * r_q) * norm_scale(wq, UNIT_OFFSET), XT, IS_BF16, IS_FP64)
    return rnd(kn * qn, XT, IS_BF16, IS_FP64)


@triton.jit
def score_gate(total, root, XT: tl.constexpr, IS_BF16: tl.constexpr, IS_FP64: tl.constexpr):
    """The gate ``g`` of a summed score ``total``: ``s = round(round(total) / sqrt(H))``, then `gate_of`."""
    s = rnd(total, XT, IS_BF16, IS_FP64)
    s = rnd(s / root, XT, IS_BF16, IS_FP64)
    _, _, g = gate_of(s, XT, IS_BF16, IS_FP64)
    return g


@triton.jit
def gated(g, v, XT: tl.constexpr, IS_BF16: tl.constexpr, IS_FP64: tl.constexpr):
    """The gated value ``x = round(g v)`` (broadcast)."""
    return rnd(g * v, XT, IS_BF16, IS_FP64)


@triton.jit
def conv_input(xr, wc1, XT: tl.constexpr, IS_BF16: tl.constexpr, IS_FP64: tl.constexpr):
    """The conv input ``round(x r_x a_c)`` of the gated value ``x``, from ``xr = x r_x`` and ``wc1 = a_c``, the conv
    norm's scale (`norm_scale`: ``1 + w_c``, or ``w_c``) (broadcast; the caller forms both, so each kernel keeps its
    own order of evaluation, hence its own code)."""
    return rnd(xr * wc1, XT, IS_BF16, IS_FP64)


@triton.jit
def row_scalars(key_ptr, value_ptr, hid_ptr, wk_ptr, wq_ptr, prow, rmask, m, H,
                stride_key_t, stride_key_c, stride_value_t, stride_value_h, stride_hid_t, stride_hid_c,
                stride_wk_c, stride_wq_c, eps, ceps, sqrt_h,
                XT: tl.constexpr, IS_BF16: tl.constexpr, IS_FP64: tl.constexpr,
                BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """Per physical row ``prow`` (where ``rmask``) of stream ``m``: the gate ``g`` and the conv norm's factor
    ``r_x`` (three loops over H: the two norms' sums of squares, the score, the conv norm's sum of squares).
    ``eps`` is the key and query norms' epsilon, ``ceps`` the conv norm's."""
    hh = tl.arange(0, BLOCK_H).to(tl.int64)
    zero = tl.zeros([BLOCK], dtype=tl.float32)
    if IS_FP64:
        zero = zero.to(tl.float64)
    sk = zero
    sq = zero
    for h0 in range(0, H, BLOCK_H):
        h = h0 + hh
        c = m * H + h
        msk = rmask[:, None] & (h < H)[None, :]
        k = up(tl.load(key_ptr + prow[:, None] * stride_key_t + c[None, :] * stride_key_c, mask=msk, other=0.0),
               IS_BF16, IS_FP64)
        q = up(tl.load(hid_ptr + prow[:, None] * stride_hid_t + c[None, :] * stride_hid_c, mask=msk, other=0.0),
               IS_BF16, IS_FP64)
        sk += tl.sum(k * k, 1)
        sq += tl.sum(q * q, 1)
    r_k = rsqrt(sk / H + eps, IS_FP64)
    r_q = rsqrt(sq / H + eps, IS_FP64)
    sd = zero
    for h0 in range(0, H, BLOCK_H):
        h = h0 + hh
        c = m * H + h
        hm = h < H
        msk = rmask[:, None] & hm[None, :]
        k = up(tl.load(key_ptr + prow[:, None] * stride_key_t + c[None, :] * stride_key_c, mask=msk, other=0.0),
               IS_BF16, IS_FP64)
        q = up(tl.load(hid_ptr + prow[:, None] * stride_hid_t + c[None, :] * stride_hid_c, mask=msk, other=0.0),
               IS_BF16, IS_FP64)
        wk = to_acc(tl.load(wk_ptr + c * stride_wk_c, mask=hm, other=0.0), IS_FP64)
        wq = to_acc(tl.load(wq_ptr + c * stride_wq_c, mask=hm, other=0.0), IS_FP64)
        sd += tl.sum(norm_product(k, q, r_k[:, None], r_q[:, None], wk[None, :], wq[None, :], XT, IS_BF16, IS_FP64,
                                  UNIT_OFFSET), 1)
    g = score_gate(sd, sqrt_h, XT, IS_BF16, IS_FP64)
    sx = zero
    for h0 in range(0, H, BLOCK_H):
        h = h0 + hh
        msk = rmask[:, None] & (h < H)[None, :]
        v = up(tl.load(value_ptr + prow[:, None] * stride_value_t + h[None, :] * stride_value_h, mask=msk,
                       other=0.0), IS_BF16, IS_FP64)
        x = gated(g[:, None], v, XT, IS_BF16, IS_FP64)
        sx += tl.sum(x * x, 1)
    r_x = rsqrt(sx / H + ceps, IS_FP64)
    return g, r_x


@triton.jit
def conv_norm_chunk(wc_ptr, stride_wc_c, m, H, h, IS_FP64: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """A chunk ``h`` of stream ``m``'s channels of H: ``(h < H, the channels m * H + h, the conv norm's scale
    there)`` (`norm_scale`: ``1 + w_c``, or ``w_c``)."""
    hm = h < H
    c = m * H + h
    wc1 = norm_scale(to_acc(tl.load(wc_ptr + c * stride_wc_c, mask=hm, other=0.0), IS_FP64), UNIT_OFFSET)
    return hm, c, wc1


@triton.jit
def conv_rows(value_ptr, stride_value_t, stride_value_h, prow, rmask, h, hm, g, r_x, wc1,
              XT: tl.constexpr, IS_BF16: tl.constexpr, IS_FP64: tl.constexpr):
    """``(x, u)``: the gated values and conv inputs (`gated`, `conv_input`; ``[rows, chunk]``) of physical rows
    ``prow`` (where ``rmask``, else 0) with gates ``g`` and conv-norm factors ``r_x``, at the chunk of
    `conv_norm_chunk` (``wc1``, the conv norm's scale)."""
    v = up(tl.load(value_ptr + prow[:, None] * stride_value_t + h[None, :] * stride_value_h,
                   mask=rmask[:, None] & hm[None, :], other=0.0), IS_BF16, IS_FP64)
    x = gated(g[:, None], v, XT, IS_BF16, IS_FP64)
    return x, conv_input(x * r_x[:, None], wc1[None, :], XT, IS_BF16, IS_FP64)


@triton.jit
def conv_inputs_chunk(value_ptr, stride_value_t, stride_value_h, wc_ptr, stride_wc_c, prow, rmask, m, H, h, g, r_x,
                      XT: tl.constexpr, IS_BF16: tl.constexpr, IS_FP64: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """`conv_norm_chunk`, then `conv_rows`: ``(h < H, the channels m * H + h, the conv inputs there)`` of physical
    rows ``prow`` (where ``rmask``) of stream ``m``, for the chunk ``h`` of H (the gated values unkept)."""
    hm, c, wc1 = conv_norm_chunk(wc_ptr, stride_wc_c, m, H, h, IS_FP64, UNIT_OFFSET)
    _, u = conv_rows(value_ptr, stride_value_t, stride_value_h, prow, rmask, h, hm, g, r_x, wc1, XT, IS_BF16, IS_FP64)
    return hm, c, u
