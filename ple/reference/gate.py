"""Grouped RMS norms and the signed-sqrt gate (SPEC section 4).

Each elementwise op is rounded to the model dtype where the model rounds it, so a
bfloat16 run of this reference is the model's bfloat16 numerics; reductions run
in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import math

import torch
from einops import rearrange

from .. import _checks

__all__ = ["grouped_rms_norm", "ple_gate", "stream_gates", "stream_scores", "GATE_CLAMP", "acc_dtype"]

GATE_CLAMP = 1e-6
"""``|s|`` is clamped to this before the square root, so the gate's slope stays finite at 0."""


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions run in: float32, or float64 for float64 inputs (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """RMS-normalise each group of ``group_size`` channels, scale by ``1 + weight``, in float32.

    ``x`` is ``[..., C]``, ``weight`` ``[C]``; the result has ``x``'s dtype.
    """
    # SPEC 4: the whole norm in acc dtype (float32; float64 for float64 inputs), one rounding at the end.
    acc = acc_dtype(x.dtype)
    xf = rearrange(x.to(acc), "... (g h) -> ... g h", h=group_size)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = rearrange(y, "... g h -> ... (g h)") * (1.0 + weight.to(acc))
    return y.to(x.dtype)                                        # SPEC 8: rounded after each norm


def ple_gate(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
             norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor,
             norm_conv_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate the value by how well each stream's key agrees with its hidden state.

    Shapes: ``key`` and ``hidden_states`` ``[T, C]``, ``value`` ``[T, H]`` with
    ``C = M * H``, norm weights ``[C]``. Returns ``(gated, conv_input)``, both
    ``[T, C]`` in the input dtype: ``gated[:, m] = g[m] * value`` and
    ``conv_input = norm_conv(gated)``, with ``g[m] = sigmoid(sign(s) sqrt(max(|s|, 1e-6)))``
    and ``s[m] = <norm_key(key)[m], norm_query(hidden)[m]> / sqrt(H)``.
    """
    H = _checks.gate_call(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight,
                          eps).group_size
    g = stream_gates(key, hidden_states, norm_key_weight, norm_query_weight, H, eps)    # [T, M]
    gated = rearrange(g[:, :, None] * value[:, None, :], "t m h -> t (m h)")      # SPEC 8: g * value, rounded
    conv_input = grouped_rms_norm(gated, norm_conv_weight, H, eps)               # SPEC 4: norm_conv(gated)
    return gated, conv_input


def stream_gates(key: torch.Tensor, hidden_states: torch.Tensor, norm_key_weight: torch.Tensor,
                 norm_query_weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """The gate ``g[t, m]`` of every token and stream, ``[T, M]`` in the input dtype (see `ple_gate`)."""
    return stream_scores(key, hidden_states, norm_key_weight, norm_query_weight, group_size, eps)[1]


def stream_scores(key: torch.Tensor, hidden_states: torch.Tensor, norm_key_weight: torch.Tensor,
                  norm_query_weight: torch.Tensor, group_size: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, g)``: the score ``s[t, m]`` (after the division by ``sqrt(H)``) and the gate ``g[t, m]``, both
    ``[T, M]`` in the input dtype (see `ple_gate`)."""
    H = group_size
    dt = key.dtype
    kn = rearrange(grouped_rms_norm(key, norm_key_weight, H, eps), "t (m h) -> t m h", h=H)
    qn = rearrange(grouped_rms_norm(hidden_states, norm_query_weight, H, eps), "t (m h) -> t m h", h=H)
    # SPEC 4 and 8: every elementwise op in the input dtype, i.e. rounded where the model rounds it.
    s = (kn * qn).sum(-1, dtype=acc_dtype(dt)).to(dt)           # [T, M]; product rounded, sum in fp32, rounded
    s = s / math.sqrt(H)                                        # / sqrt(H), rounded
    mag = s.abs().clamp_min(GATE_CLAMP).sqrt()                  # sqrt(max(|s|, 1e-6)), rounded
    return s, torch.sigmoid(mag * s.sign())                     # sign(s) * mag (exact), sigmoid rounded
