"""The grouped RMS norms and the signed-sqrt gate (SPEC section 4) as Triton kernels.

Notation per token ``t`` and stream ``m`` (vectors of ``H`` channels): ``k``, ``q`` the
key and hidden-state groups, ``v`` the value row; ``r_k = rsqrt(mean(k^2) + eps)``,
``kh = k r_k``, ``kn = kh (1 + w_k)`` (``qh``, ``qn`` likewise), ``s = sum(kn qn) / sqrt(H)``,
``g = sigmoid(sign(s) sqrt(max(|s|, 1e-6)))``, ``x = g v`` (gated), ``y = norm_conv(x)``.

Kernel design:

* ``_gate_fwd_kernel`` (grid ``(T, M)``): one program per token and stream reads the key
  and hidden groups and the value row once, computes both norms, the score, the gate,
  ``x`` and the conv norm of ``x`` in registers and writes ``gated`` and ``conv_input``.
  ``H`` need not be a power of two: the block is ``next_power_of_2(H)`` wide and masked.
* ``_gate_bwd_kernel`` (grid ``(cdiv(T, TOK), M)``): a program walks ``TOK`` tokens of one
  stream, recomputes the forward from the inputs (nothing but the inputs is saved), and
  writes ``dkey``, ``dhidden``; ``dvalue`` sums over streams, so each program
  ``tl.atomic_add``-s its share into a zeroed float32 ``[T, H]`` buffer. The norm weights'
  gradients are summed over the program's tokens in registers and written as one partial
  row per program (``[3, blocks, C]``), reduced over blocks with ``torch.sum``.

Backward, per ``(t, m)`` with incoming ``dx`` (of gated) and ``dy`` (of conv_input)::

    dw_c += dy xh;  dxh = dy (1 + w_c);  dx += r_x (dxh - xh mean(dxh xh))
    dv += g dx;     dg = sum(dx v);      dz = dg g (1 - g)
    ds = dz / (2 sqrt(max(|s|, 1e-6))) where |s| >= 1e-6, else 0      (torch's clamp_min
         passes the gradient where the input is >= the bound; at s = 0 sign() and abs()
         both give 0, so g = 1/2 and ds = 0 there)
    dkn = ds / sqrt(H) qn;  dw_k += dkn kh;  dkh = dkn (1 + w_k);  dk = r_k (dkh - kh mean(dkh kh))
    (and the same for q)

Numerics: everything is computed in float32 (float64 for float64 inputs, so gradcheck
works), and values are rounded to the input dtype where the reference rounds them (after
each norm, the product ``kn * qn``, the group sum, the division by ``sqrt(H)``, the
clamp, the square root, the sigmoid and ``g * v``), so a bfloat16 run follows the
reference's bfloat16 rounding. Rounding to bfloat16 is ``_numerics.round_bf16`` (bit
arithmetic, round to nearest even, NaN -> the canonical NaN): exact on a GPU and under
the Triton interpreter alike (the interpreter's float32 -> bfloat16 cast truncates).
The backward recomputes the forward in float32 *without* those roundings and rounds only
the final gradients: its gradients are the exact derivative at the given inputs up to
float32 error, which is what a bfloat16 run is judged against (a float64 run). Mirroring
the roundings there made a 1000x-amplified gradient (the conv norm of an all-zero value
row has ``r_x = 1/sqrt(eps)``) land one bfloat16 ulp off.

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
from ._library import register, twin
from ._numerics import acc_dtype, is_fp64, round_bf16

__all__ = ["ple_gate"]

_BWD_PROGRAMS_T = 256   # token blocks of the backward: bounds the weight-gradient partials to [3, 256, C]


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
def _gate_core(k, q, v, wk, wq, H, eps, sqrt_h,
               IS_FP64: tl.constexpr, IS_BF16: tl.constexpr, IS_FP16: tl.constexpr):
    """Forward of one (token, stream) up to the gated value; masked lanes hold zeros."""
    r_k = _rsqrt(tl.sum(k * k, 0) / H + eps, IS_FP64)
    kh = k * r_k
    kn = _round_io(kh * (1.0 + wk), IS_BF16, IS_FP16)
    r_q = _rsqrt(tl.sum(q * q, 0) / H + eps, IS_FP64)
    qh = q * r_q
    qn = _round_io(qh * (1.0 + wq), IS_BF16, IS_FP16)
    s = _round_io(tl.sum(_round_io(kn * qn, IS_BF16, IS_FP16), 0), IS_BF16, IS_FP16)
    s = _round_io(s / sqrt_h, IS_BF16, IS_FP16)
    a = tl.abs(s)
    mag = _round_io(tl.sqrt(_round_io(tl.maximum(a, _gate_clamp(IS_FP64)), IS_BF16, IS_FP16)),
                    IS_BF16, IS_FP16)
    sgn = tl.where(s > 0, 1.0, tl.where(s < 0, -1.0, 0.0))
    z = mag * sgn
    g = _round_io(1.0 / (1.0 + tl.exp(-z)), IS_BF16, IS_FP16)
    x = _round_io(g * v, IS_BF16, IS_FP16)
    return r_k, kh, kn, r_q, qh, qn, a, mag, g, x


@triton.jit
def _stream_setup(wk_ptr, stride_wk_c, wq_ptr, stride_wq_c, wc_ptr, stride_wc_c, H, eps_hi, eps_lo, sqrt_h,
                  IS_FP64: tl.constexpr, BLOCK_H: tl.constexpr):
    """The stream ``m`` of this program: its channels ``c`` (lanes ``h``, live ``hm``), the three
    norm weights of those channels, ``eps`` and ``sqrt(H)`` in the compute dtype."""
    eps, root = _scalars(H, eps_hi, eps_lo, sqrt_h, IS_FP64)
    m = tl.program_id(1).to(tl.int64)
    h = tl.arange(0, BLOCK_H).to(tl.int64)
    hm = h < H
    c = m * H + h                                                  # channel within [0, C)
    wk = _to_acc(tl.load(wk_ptr + c * stride_wk_c, mask=hm, other=0.0), IS_FP64)
    wq = _to_acc(tl.load(wq_ptr + c * stride_wq_c, mask=hm, other=0.0), IS_FP64)
    wc = _to_acc(tl.load(wc_ptr + c * stride_wc_c, mask=hm, other=0.0), IS_FP64)
    return h, hm, c, wk, wq, wc, eps, root


@triton.jit
def _gate_fwd_kernel(
    key_ptr, stride_key_t, stride_key_c, value_ptr, stride_value_t, stride_value_h,
    hid_ptr, stride_hid_t, stride_hid_c,
    wk_ptr, stride_wk_c, wq_ptr, stride_wq_c, wc_ptr, stride_wc_c,
    gated_ptr, stride_gated_t, stride_gated_c, conv_ptr, stride_conv_t, stride_conv_c,
    H, eps_hi, eps_lo, sqrt_h,
    IS_FP64: tl.constexpr, IS_BF16: tl.constexpr, IS_FP16: tl.constexpr, BLOCK_H: tl.constexpr,
):
    h, hm, c, wk, wq, wc, eps, sqrt_h = _stream_setup(wk_ptr, stride_wk_c, wq_ptr, stride_wq_c, wc_ptr, stride_wc_c,
                                                      H, eps_hi, eps_lo, sqrt_h, IS_FP64, BLOCK_H)
    t = tl.program_id(0).to(tl.int64)
    k = _to_acc(tl.load(key_ptr + t * stride_key_t + c * stride_key_c, mask=hm, other=0.0), IS_FP64)
    q = _to_acc(tl.load(hid_ptr + t * stride_hid_t + c * stride_hid_c, mask=hm, other=0.0), IS_FP64)
    v = _to_acc(tl.load(value_ptr + t * stride_value_t + h * stride_value_h, mask=hm, other=0.0), IS_FP64)
    r_k, kh, kn, r_q, qh, qn, a, mag, g, x = _gate_core(k, q, v, wk, wq, H, eps, sqrt_h,
                                                        IS_FP64, IS_BF16, IS_FP16)
    r_x = _rsqrt(tl.sum(x * x, 0) / H + eps, IS_FP64)
    y = _round_io(x * r_x * (1.0 + wc), IS_BF16, IS_FP16)
    tl.store(gated_ptr + t * stride_gated_t + c * stride_gated_c, x, mask=hm)
    tl.store(conv_ptr + t * stride_conv_t + c * stride_conv_c, y, mask=hm)


@triton.jit
def _gate_bwd_kernel(
    key_ptr, stride_key_t, stride_key_c, value_ptr, stride_value_t, stride_value_h,
    hid_ptr, stride_hid_t, stride_hid_c,
    wk_ptr, stride_wk_c, wq_ptr, stride_wq_c, wc_ptr, stride_wc_c,
    dgated_ptr, stride_dgated_t, stride_dgated_c,                         # grad of gated
    dconv_ptr, stride_dconv_t, stride_dconv_c,                            # grad of conv_input
    dk_ptr, dq_ptr,                                                       # [T, C] contiguous, input dtype
    dv_ptr,                                                               # [T, H] contiguous, acc, zeroed
    dw_ptr,                                                               # [3, blocks, C] contiguous, acc
    T, H, C, tok_per_prog, num_blocks, eps_hi, eps_lo, sqrt_h,
    IS_FP64: tl.constexpr, IS_BF16: tl.constexpr, IS_FP16: tl.constexpr, BLOCK_H: tl.constexpr,
):
    h, hm, c, wk, wq, wc, eps, sqrt_h = _stream_setup(wk_ptr, stride_wk_c, wq_ptr, stride_wq_c, wc_ptr, stride_wc_c,
                                                      H, eps_hi, eps_lo, sqrt_h, IS_FP64, BLOCK_H)
    pid_t = tl.program_id(0).to(tl.int64)
    clamp = _gate_clamp(IS_FP64)
    dwk = _to_acc(tl.zeros([BLOCK_H], dtype=tl.float32), IS_FP64)
    dwq = _to_acc(tl.zeros([BLOCK_H], dtype=tl.float32), IS_FP64)
    dwc = _to_acc(tl.zeros([BLOCK_H], dtype=tl.float32), IS_FP64)
    for i in range(tok_per_prog):
        t = pid_t * tok_per_prog + i
        msk = h < tl.where(t < T, H, 0)   # live channels of a live token (hm & (t < T) trips the interpreter)
        k = _to_acc(tl.load(key_ptr + t * stride_key_t + c * stride_key_c, mask=msk, other=0.0), IS_FP64)
        q = _to_acc(tl.load(hid_ptr + t * stride_hid_t + c * stride_hid_c, mask=msk, other=0.0), IS_FP64)
        v = _to_acc(tl.load(value_ptr + t * stride_value_t + h * stride_value_h, mask=msk, other=0.0), IS_FP64)
        # Recompute the forward without the low-precision roundings (see the module docstring).
        r_k, kh, kn, r_q, qh, qn, a, mag, g, x = _gate_core(k, q, v, wk, wq, H, eps, sqrt_h,
                                                            IS_FP64, False, False)
        r_x = _rsqrt(tl.sum(x * x, 0) / H + eps, IS_FP64)
        xh = x * r_x
        dxo = _to_acc(tl.load(dgated_ptr + t * stride_dgated_t + c * stride_dgated_c, mask=msk, other=0.0), IS_FP64)
        dy = _to_acc(tl.load(dconv_ptr + t * stride_dconv_t + c * stride_dconv_c, mask=msk, other=0.0), IS_FP64)
        # conv norm
        dwc += dy * xh
        dxh = dy * (1.0 + wc)
        dx = dxo + r_x * (dxh - xh * (tl.sum(dxh * xh, 0) / H))
        # gated = g * v
        tl.atomic_add(dv_ptr + t * H + h, g * dx, mask=msk, sem="relaxed")
        dg = tl.sum(dx * v, 0)
        dz = dg * g * (1.0 - g)
        ds = tl.where(a >= clamp, dz * 0.5 / mag, 0.0)
        ds0 = ds / sqrt_h
        # score -> both norms
        dkn = ds0 * qn
        dqn = ds0 * kn
        dwk += dkn * kh
        dwq += dqn * qh
        dkh = dkn * (1.0 + wk)
        dqh = dqn * (1.0 + wq)
        dk = r_k * (dkh - kh * (tl.sum(dkh * kh, 0) / H))
        dq = r_q * (dqh - qh * (tl.sum(dqh * qh, 0) / H))
        tl.store(dk_ptr + t * C + c, _round_io(dk, IS_BF16, IS_FP16), mask=msk)
        tl.store(dq_ptr + t * C + c, _round_io(dq, IS_BF16, IS_FP16), mask=msk)
    tl.store(dw_ptr + (0 * num_blocks + pid_t) * C + c, dwk, mask=hm)
    tl.store(dw_ptr + (1 * num_blocks + pid_t) * C + c, dwq, mask=hm)
    tl.store(dw_ptr + (2 * num_blocks + pid_t) * C + c, dwc, mask=hm)


def _eps_parts(eps: float) -> tuple[float, float]:
    """``eps`` as float32 ``hi + lo`` (exact to about 48 bits) for the float64 kernels."""
    hi = float(torch.tensor(eps, dtype=torch.float32))
    lo = float(torch.tensor(eps - hi, dtype=torch.float32))
    return hi, lo


def _launch_args(key, value, hidden_states, wk, wq, wc, eps) -> dict:
    """The arguments both kernels share: inputs, strides, scalars, flags and launch options."""
    H = value.shape[1]
    eps_hi, eps_lo = _eps_parts(eps)
    block_h = triton.next_power_of_2(H)
    dt = key.dtype
    return dict(
        key_ptr=key, stride_key_t=key.stride(0), stride_key_c=key.stride(1),
        value_ptr=value, stride_value_t=value.stride(0), stride_value_h=value.stride(1),
        hid_ptr=hidden_states, stride_hid_t=hidden_states.stride(0), stride_hid_c=hidden_states.stride(1),
        wk_ptr=wk, stride_wk_c=wk.stride(0), wq_ptr=wq, stride_wq_c=wq.stride(0), wc_ptr=wc, stride_wc_c=wc.stride(0),
        H=H, eps_hi=eps_hi, eps_lo=eps_lo, sqrt_h=math.sqrt(H),
        IS_FP64=is_fp64(dt), IS_BF16=dt == torch.bfloat16, IS_FP16=dt == torch.float16, BLOCK_H=block_h,
        num_warps=4 if block_h <= 1024 else (8 if block_h <= 4096 else 16),
    )


def _gate_fwd(key, value, hidden_states, wk, wq, wc, eps):
    T, C = key.shape
    M = C // value.shape[1]
    gated = torch.empty((T, C), dtype=key.dtype, device=key.device)
    conv_input = torch.empty((T, C), dtype=key.dtype, device=key.device)
    if T == 0:
        return gated, conv_input
    _gate_fwd_kernel[(T, M)](
        gated_ptr=gated, stride_gated_t=gated.stride(0), stride_gated_c=gated.stride(1),
        conv_ptr=conv_input, stride_conv_t=conv_input.stride(0), stride_conv_c=conv_input.stride(1),
        **_launch_args(key, value, hidden_states, wk, wq, wc, eps))
    return gated, conv_input


def _gate_bwd(dgated, dconv, key, value, hidden_states, wk, wq, wc, eps):
    """Gradients of key, value, hidden_states and the three norm weights."""
    T, C = key.shape
    H = value.shape[1]
    M = C // H
    dt = key.dtype
    acc = acc_dtype(dt)
    dkey = torch.empty((T, C), dtype=dt, device=key.device)
    dhidden = torch.empty((T, C), dtype=dt, device=key.device)
    dvalue = torch.zeros((T, H), dtype=acc, device=key.device)
    tok_per_prog = triton.cdiv(T, _BWD_PROGRAMS_T) if T else 1
    blocks = triton.cdiv(T, tok_per_prog)
    dw = torch.empty((3, blocks, C), dtype=acc, device=key.device)
    if T == 0:
        dw.zero_()
    else:
        _gate_bwd_kernel[(blocks, M)](
            dgated_ptr=dgated, stride_dgated_t=dgated.stride(0), stride_dgated_c=dgated.stride(1),
            dconv_ptr=dconv, stride_dconv_t=dconv.stride(0), stride_dconv_c=dconv.stride(1),
            dk_ptr=dkey, dq_ptr=dhidden, dv_ptr=dvalue, dw_ptr=dw,
            T=T, C=C, tok_per_prog=tok_per_prog, num_blocks=blocks,
            **_launch_args(key, value, hidden_states, wk, wq, wc, eps))
    dw = dw.sum(1)                                                   # [3, C] over token blocks
    return (dkey, dvalue.to(dt), dhidden, dw[0].to(wk.dtype), dw[1].to(wq.dtype), dw[2].to(wc.dtype))


# ---- registration ----------------------------------------------------------------------------------


def _gate_bwd_impl(dgated: torch.Tensor, dconv: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   hidden_states: torch.Tensor, norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor,
                   norm_conv_weight: torch.Tensor, eps: float) -> list[torch.Tensor]:
    grads = list(_gate_bwd(dgated, dconv, key, value, hidden_states, norm_key_weight, norm_query_weight,
                           norm_conv_weight, eps))
    # The three weight gradients can be views of one reduction buffer; outputs of an op must not alias.
    return grads[:3] + [g.clone() for g in grads[3:]]


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
