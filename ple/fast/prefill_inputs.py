"""``prefill_conv_inputs``: the conv inputs a serving ``ple_prefill`` writes into the conv state, for tests.

``ple.fast.prefill``'s state kernel recomputes each new state column, the conv input of one position,
from ``key``, ``value`` and ``hidden_states`` (``_gate_math.row_scalars``, then ``conv_inputs_chunk``
per chunk of H) at its own tile shape, ``[next_power_of_2(S), BLOCK_H]`` with
``STATE_WARPS`` warps. ``_conv_inputs_kernel`` runs the same code at the same shape over every row, so
a test can check a state against the conv inputs of its history bit for bit
(``ple.testing.serving.replay``). Test-only: no op registration, no autograd. Public as
``ple.fast.prefill_conv_inputs`` (and ``ple.fast.prefill.prefill_conv_inputs``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._gate_math import BLOCK_H, STATE_WARPS, conv_inputs_chunk, row_scalars
from ._numerics import down, eps_parts, is_fp64, scalars

__all__ = ["prefill_conv_inputs"]


@triton.jit
def _conv_inputs_kernel(
    key_ptr, value_ptr, hid_ptr, wk_ptr, wq_ptr, wc_ptr, out_ptr,
    T, H, eps_hi, eps_lo, ceps_hi, ceps_lo, sqrt_h,
    stride_key_t, stride_key_c, stride_value_t, stride_value_h, stride_hid_t, stride_hid_c,
    stride_wk_c, stride_wq_c, stride_wc_c, stride_out_t, stride_out_c,
    IS_BF16: tl.constexpr, IS_FP64: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
):
    """Conv inputs of ``BLOCK_S`` rows, stream ``program_id(1)``: the state kernel's arithmetic and tile shape."""
    XT = key_ptr.dtype.element_ty
    eps, root = scalars(H, eps_hi, eps_lo, sqrt_h, IS_FP64)
    ceps, _ = scalars(H, ceps_hi, ceps_lo, sqrt_h, IS_FP64)
    m = tl.program_id(1).to(tl.int64)
    prow = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    rmask = prow < T
    g, r_x = row_scalars(key_ptr, value_ptr, hid_ptr, wk_ptr, wq_ptr, prow, rmask, m, H,
                         stride_key_t, stride_key_c, stride_value_t, stride_value_h, stride_hid_t, stride_hid_c,
                         stride_wk_c, stride_wq_c, eps, ceps, root, XT, IS_BF16, IS_FP64, BLOCK_S, BLOCK_H,
                         UNIT_OFFSET)
    hh = tl.arange(0, BLOCK_H).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + hh
        hm, c, u = conv_inputs_chunk(value_ptr, stride_value_t, stride_value_h, wc_ptr, stride_wc_c, prow, rmask,
                                     m, H, h, g, r_x, XT, IS_BF16, IS_FP64, UNIT_OFFSET)
        tl.store(out_ptr + prow[:, None] * stride_out_t + c[None, :] * stride_out_c, down(u, XT, IS_BF16),
                 mask=rmask[:, None] & hm[None, :])


def prefill_conv_inputs(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
                        norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor,
                        norm_conv_weight: torch.Tensor, eps: float, state_len: int, *,
                        conv_eps: float | None = None, unit_offset: bool = True) -> torch.Tensor:
    """``[T, C]`` conv inputs (no mask) as the serving prefill writes them into a state of ``state_len`` S.

    The gate's conv input computed by the state kernel's own code at its own tile shape, so its bits are
    those ``ple_prefill`` leaves in the conv state. (In bfloat16 they equal ``ple_gate``'s; in float32 the
    sums over H may end one ulp apart, their order being chunked differently.) For tests that check a
    state against the conv inputs of its history, e.g. ``ple.testing.serving.replay``. ``conv_eps`` and
    ``unit_offset`` are ``ple_prefill``'s (the Engram family's norms, docs/spec.md section 15).
    """
    T, C = key.shape
    out = torch.empty((T, C), dtype=key.dtype, device=key.device)
    if T == 0 or C == 0:
        return out
    H = value.shape[1]
    eps_hi, eps_lo = eps_parts(eps)
    ceps_hi, ceps_lo = eps_parts(eps if conv_eps is None else conv_eps)
    block = triton.next_power_of_2(max(state_len, 1))
    wk, wq, wc = norm_key_weight, norm_query_weight, norm_conv_weight
    _conv_inputs_kernel[(triton.cdiv(T, block), C // H)](
        key_ptr=key, value_ptr=value, hid_ptr=hidden_states, wk_ptr=wk, wq_ptr=wq, wc_ptr=wc, out_ptr=out,
        T=T, H=H, eps_hi=eps_hi, eps_lo=eps_lo, ceps_hi=ceps_hi, ceps_lo=ceps_lo, sqrt_h=math.sqrt(H),
        stride_key_t=key.stride(0), stride_key_c=key.stride(1), stride_value_t=value.stride(0),
        stride_value_h=value.stride(1), stride_hid_t=hidden_states.stride(0), stride_hid_c=hidden_states.stride(1),
        stride_wk_c=wk.stride(0), stride_wq_c=wq.stride(0), stride_wc_c=wc.stride(0),
        stride_out_t=out.stride(0), stride_out_c=out.stride(1),
        IS_BF16=key.dtype == torch.bfloat16, IS_FP64=is_fp64(key.dtype),
        BLOCK_S=block, BLOCK_H=BLOCK_H, UNIT_OFFSET=bool(unit_offset), num_warps=STATE_WARPS)
    return out
