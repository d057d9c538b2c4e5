"""The grouped RMS norms and the signed-sqrt gate (docs/spec.md section 4) as Triton kernels.

Notation per token ``t`` and stream ``m`` (vectors of ``H`` channels): ``k``, ``q`` the
key and hidden-state groups, ``v`` the value row; ``r_k = rsqrt(mean(k^2) + eps)``,
``kh = k r_k``, ``kn = kh (1 + w_k)`` (``qh``, ``qn`` likewise), ``s = sum(kn qn) / sqrt(H)``,
``g = sigmoid(sign(s) sqrt(max(|s|, 1e-6)))``, ``x = g v`` (gated), ``y = norm_conv(x)`` (its
epsilon ``conv_eps``). With ``unit_offset=False`` (the Engram family, docs/spec.md section 15) every
norm scales by ``w`` instead of ``1 + w``: the kernels' ``UNIT_OFFSET`` constexpr (``_gate_math.norm_scale``),
so each family compiles its own kernels; the conv eps is a runtime argument.

Kernels (``ple.fast._gate_kernels``, where their design, memory traffic and the backward's arithmetic
are written down): the forward ``_gate_fwd_kernel`` is one program per token, all ``M`` streams, and
moves the op's minimum bytes; the backward is three launches, ``_gate_stats_kernel`` (six sums over
``H`` per token and stream, turned into coefficients), ``_gate_bwd_kernel`` (``dkey``, ``dhidden``,
``dvalue`` and per-tile partial sums of the norm weights' gradients, no atomics) and
``_gate_wsum_kernel`` (those partial rows added in token order). Sums over ``H`` run over
power-of-two chunks of ``H`` (``_chunk_h``: the widest power of two dividing ``H`` up to a cap, 512
at ``H = 2560``, so no lane idles; an ``H`` with a narrow power-of-two factor gets masked chunks of
``min(cap, next_power_of_2(H))``). Here: the launchers, their block sizes and deterministic mode.

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

Numerics: everything is computed in float32 (float64 for float64 inputs, so gradcheck
works), and the forward rounds values to the input dtype where the reference rounds them
(after each norm, the product ``kn * qn``, the group sum, the division by ``sqrt(H)``, the
clamp, the square root, the sigmoid and ``g * v``: ``_gate_math``), so a bfloat16 run follows the
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

from .. import _checks
from ..reference import gate as _reference
from . import _numerics
from ._gate_kernels import _gate_bwd_kernel, _gate_fwd_kernel, _gate_stats_kernel, _gate_wsum_kernel
from ._library import register, twin
from ._numerics import acc_dtype, deterministic, eps_parts, is_fp64

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


def _gate_dtype_flags(dt: torch.dtype) -> dict:
    """The dtype flags of the gate kernels (the conv kernels have their own, ``ple.fast.conv._conv_dtype_flags``)."""
    return dict(IS_FP64=is_fp64(dt), IS_BF16=dt == torch.bfloat16, IS_FP16=dt == torch.float16)


def _family_args(eps, conv_eps, unit_offset) -> dict:
    """The family's kernel arguments: the conv norm's epsilon as float32 halves (``conv_eps`` None: ``eps``) and
    ``UNIT_OFFSET``."""
    ceps_hi, ceps_lo = eps_parts(eps if conv_eps is None else conv_eps)
    return dict(ceps_hi=ceps_hi, ceps_lo=ceps_lo, UNIT_OFFSET=bool(unit_offset))


def _gate_fwd(key, value, hidden_states, wk, wq, wc, eps, conv_eps=None, unit_offset=True):
    T, C = key.shape
    H = value.shape[1]
    M = C // H
    gated = torch.empty((T, C), dtype=key.dtype, device=key.device)
    conv_input = torch.empty((T, C), dtype=key.dtype, device=key.device)
    if T == 0:
        return gated, conv_input
    eps_hi, eps_lo = eps_parts(eps)
    chunk = _chunk_h(H, _DET_FWD_CHUNK_H if deterministic() else _FWD_CHUNK_H)
    _gate_fwd_kernel[(T,)](
        gated_ptr=gated, stride_gated_t=gated.stride(0), stride_gated_c=gated.stride(1),
        conv_ptr=conv_input, stride_conv_t=conv_input.stride(0), stride_conv_c=conv_input.stride(1),
        H=H, M=M, eps_hi=eps_hi, eps_lo=eps_lo, sqrt_h=math.sqrt(H), IS_FP64=is_fp64(key.dtype),
        IS_BF16=key.dtype == torch.bfloat16, CHUNK=chunk, BLOCK_M=triton.next_power_of_2(M), num_warps=_warps(chunk),
        **_family_args(eps, conv_eps, unit_offset), **_input_args(key, value, hidden_states, wk, wq, wc))
    return gated, conv_input


def _gate_bwd(dgated, dconv, key, value, hidden_states, wk, wq, wc, eps, conv_eps=None, unit_offset=True):
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
        eps_hi, eps_lo = eps_parts(eps)
        coef = torch.empty((T, M, 8), dtype=acc, device=dev)
        grads = dict(dgated_ptr=dgated, stride_dgated_t=dgated.stride(0), stride_dgated_c=dgated.stride(1),
                     dconv_ptr=dconv, stride_dconv_t=dconv.stride(0), stride_dconv_c=dconv.stride(1),
                     coef_ptr=coef, **_input_args(key, value, hidden_states, wk, wq, wc))
        stats_tok = _STATS_TOKENS
        _gate_stats_kernel[(triton.cdiv(T, stats_tok),)](
            T=T, H=H, M=M, eps_hi=eps_hi, eps_lo=eps_lo, sqrt_h=math.sqrt(H), IS_FP64=is_fp64(dt),
            TOK=stats_tok, CHUNK=stats_chunk, BLOCK_M=block_m, num_warps=_warps(block_m * stats_chunk // 2),
            **_family_args(eps, conv_eps, unit_offset), **grads)
        _gate_bwd_kernel[(tiles, triton.cdiv(H, bwd_chunk))](
            dk_ptr=dkey, dq_ptr=dhidden, dv_ptr=dvalue, part_ptr=part, T=T, H=H, M=M, C=C, **_gate_dtype_flags(dt),
            TOK=tok, CHUNK=bwd_chunk, BLOCK_M=block_m, num_warps=_warps(tok * bwd_chunk),
            UNIT_OFFSET=bool(unit_offset), **grads)
    dws = [torch.empty((C,), dtype=w.dtype, device=dev) for w in (wk, wq, wc)]
    flags = {}
    for name, w in zip(("WK", "WQ", "WC"), (wk, wq, wc), strict=True):
        flags[f"{name}_BF16"], flags[f"{name}_FP16"] = w.dtype == torch.bfloat16, w.dtype == torch.float16
    block_c = min(_SUM_BLOCK_C, triton.next_power_of_2(C))
    _gate_wsum_kernel[(triton.cdiv(C, block_c),)](
        part, tiles, C, wk, wk.stride(0), wq, wq.stride(0), dws[0], dws[1], dws[2], IS_FP64=is_fp64(dt), **flags,
        BLOCK=block_c, UNIT_OFFSET=bool(unit_offset), num_warps=4)
    return (dkey, dvalue, dhidden, *dws)


# ---- registration ----------------------------------------------------------------------------------


def _gate_bwd_impl(dgated: torch.Tensor, dconv: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   hidden_states: torch.Tensor, norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor,
                   norm_conv_weight: torch.Tensor, eps: float, conv_eps: float,
                   unit_offset: bool) -> list[torch.Tensor]:
    return list(_gate_bwd(dgated, dconv, key, value, hidden_states, norm_key_weight, norm_query_weight,
                          norm_conv_weight, eps, conv_eps, unit_offset))


def _gate_bwd_fake(dgated, dconv, key, value, hidden_states, wk, wq, wc, eps, conv_eps, unit_offset):
    return [torch.empty_like(key, memory_format=torch.contiguous_format),
            torch.empty_like(value, memory_format=torch.contiguous_format),
            torch.empty_like(hidden_states, memory_format=torch.contiguous_format),
            torch.empty_like(wk), torch.empty_like(wq), torch.empty_like(wc)]


_gate_bwd_op = register("ple_gate_backward", _gate_bwd_impl, fake=_gate_bwd_fake)


def _gate_impl(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor, norm_key_weight: torch.Tensor,
               norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor, eps: float, conv_eps: float,
               unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _gate_fwd(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps, conv_eps,
                     unit_offset)


def _gate_fake(key, value, hidden_states, wk, wq, wc, eps, conv_eps, unit_offset):
    return (torch.empty_like(key, memory_format=torch.contiguous_format),
            torch.empty_like(key, memory_format=torch.contiguous_format))


def _gate_setup(ctx, inputs, output):
    *tensors, eps, conv_eps, unit_offset = inputs
    ctx.save_for_backward(*tensors)
    ctx.eps, ctx.conv_eps, ctx.unit_offset = eps, conv_eps, unit_offset


def _gate_backward(ctx, dgated, dconv):
    tensors = ctx.saved_tensors
    dgated = torch.zeros_like(tensors[0]) if dgated is None else dgated
    dconv = torch.zeros_like(tensors[0]) if dconv is None else dconv
    grads = _gate_bwd_op(dgated, dconv, *tensors, ctx.eps, ctx.conv_eps, ctx.unit_offset)
    return (*grads, None, None, None)


_gate_op = register("ple_gate", _gate_impl, fake=_gate_fake, backward=_gate_backward, setup_context=_gate_setup)


@twin(_reference.ple_gate)
def ple_gate(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
             norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor,
             norm_conv_weight: torch.Tensor, eps: float, *, conv_eps: float | None = None,
             unit_offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward kernel (a program per token, every stream); the backward (``ple.ple_gate_backward``) is three
    launches without atomics, whose bits under ``torch.use_deterministic_algorithms(True)`` do not depend on the
    block sizes either. Everything is computed in float32 (float64 for float64 inputs) and rounded to the input
    dtype where the reference rounds (bfloat16 on the bits), but the sums over H run in chunks, in another order
    than the reference's: equal within the tolerance, not bit for bit. The backward recomputes the forward in
    float32 without those roundings. Registered as ``torch.ops.ple.ple_gate``; the gate has no value checks, so it
    never reads a tensor value on the host. CPU tensors are refused (``ValueError``) while the kernels are compiled;
    under ``TRITON_INTERPRET=1`` they run on the CPU. ``unit_offset`` is a compile-time flag of the kernels (each
    family has its own), the conv norm's epsilon a runtime argument."""
    _checks.gate_call(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
                      conv_eps=conv_eps, unit_offset=unit_offset)
    return _gate_op(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, float(eps),
                    float(eps if conv_eps is None else conv_eps), unit_offset)
