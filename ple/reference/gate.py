"""Grouped RMS norms and the signed-sqrt gate.

Specified in ``docs/spec.md`` (``../../docs/spec.md`` from this file), sections 4 (the math), 7.6 and 7.7
(the ops) and 8 (rounding); section 15 for the Engram family's norm form (``unit_offset=False``: the scale
is the weight itself, as ``nn.RMSNorm``'s) and its conv norm's own epsilon (``conv_eps``).

Each elementwise op is rounded to the model dtype where the model rounds it, so a
bfloat16 run of this reference is the model's bfloat16 numerics; reductions run
in float32 (float64 for float64 inputs). The Python scalars that take part in a rounding
(``eps``, ``sqrt(H)``, the clamp `GATE_CLAMP`) are rounded as torch rounds a Python scalar
combined with a tensor: to the dtype the op computes in, float32 for bfloat16, float16 and
float32 tensors (float64 for float64), before the op; each use below says so.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange

from .. import _checks

__all__ = ["grouped_rms_norm", "ple_gate", "stream_gates", "stream_scores", "GATE_CLAMP", "acc_dtype"]

GATE_CLAMP = 1e-6
"""``|s|`` is clamped to this before the square root, so the gate's slope stays finite at 0.

In the model dtype: ``max(|s|, 1e-6)`` is rounded to it, so the floor is 1e-6 rounded to that dtype
(bfloat16 ``9.98e-07``, float16 ``1.013e-06``, float32 ``9.99999997e-07``; float64 exact)."""


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions run in: float32, or float64 for float64 inputs (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float, *,
                     unit_offset: bool = True) -> torch.Tensor:
    """RMS-normalise each group of ``group_size`` channels and scale by ``1 + weight`` (docs/spec.md section 7.6).

    ``y = x * rsqrt(mean(x^2) + eps) * (1 + weight)`` over each group of H = ``group_size``
    consecutive channels, computed in float32 (float64 for float64 inputs) and rounded once to
    ``x``'s dtype. With ``unit_offset=False`` the scale is ``weight`` itself (the Engram family,
    docs/spec.md section 15: ``torch.nn.RMSNorm``'s ``x * rsqrt(mean(x^2) + eps) * weight``).

    Args:
        x: floating-point ``[..., C]``.
        weight: floating-point ``[C]`` on ``x``'s device (the norm's weight; it starts at zero, or at one
            with ``unit_offset=False``).
        group_size: H, a positive divisor of C.
        eps: a positive Python number, added to the mean of squares (rounded to float32 first,
            unless ``x`` is float64).
        unit_offset: True (default, the Qwen4Exp family): the scale is ``1 + weight``; False (the
            Engram family): ``weight``.

    Returns:
        ``[..., C]`` in ``x``'s dtype.

    Raises:
        TypeError: ``x`` or ``weight`` is not a floating-point tensor; ``group_size`` is not an int; ``eps`` is
            not a number (a bool counts as neither); ``unit_offset`` is not a bool.
        ValueError: ``x`` has no dimension; ``weight`` is not ``[C]`` or is on another device than ``x``.
        ValueError: ``group_size`` is below 1 or does not divide C.
        ValueError: ``eps`` is not positive.

    Example::

        >>> grouped_rms_norm(torch.tensor([[3.0, 4.0, 0.0, 2.0]]), torch.zeros(4), 2, 1e-6)
        tensor([[0.8485, 1.1314, 0.0000, 1.4142]])
        >>> grouped_rms_norm(torch.tensor([[3.0, 4.0, 0.0, 2.0]]), torch.ones(4), 2, 1e-6, unit_offset=False)
        tensor([[0.8485, 1.1314, 0.0000, 1.4142]])
    """
    _checks.tensor("x", x, kind="float")
    if x.dim() < 1:
        raise ValueError("x: expected [..., C], got a 0-dimensional tensor")
    C = x.shape[-1]
    _checks.tensor("weight", weight, kind="float", device=x.device, shape=(C,))
    _checks.int_arg("group_size", group_size, minimum=1)
    if C % group_size:
        raise ValueError(f"group_size: expected a divisor of C={C}, got {group_size}")
    _checks.float_arg("eps", eps, above=0)
    _checks.bool_arg("unit_offset", unit_offset)
    return _grouped_rms_norm(x, weight, group_size, eps, unit_offset=unit_offset)


def _grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float, *,
                      unit_offset: bool = True) -> torch.Tensor:
    """The body of `grouped_rms_norm`, for arguments already checked (by it, or by the gate's check)."""
    # docs/spec.md 4: the whole norm in the acc dtype (float32; float64 for float64 inputs), one rounding at the end.
    acc = acc_dtype(x.dtype)
    xf = rearrange(x.to(acc), "... (g h) -> ... g h", h=group_size)
    # + eps: the Python float is rounded to the acc dtype first (float32: 1e-6 -> 9.99999997e-07), then added.
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # The scale in the acc dtype: 1 + w (Qwen4Exp), or w itself (Engram, docs/spec.md section 15).
    y = rearrange(y, "... g h -> ... (g h)") * (1.0 + weight.to(acc) if unit_offset else weight.to(acc))
    return y.to(x.dtype)                                        # docs/spec.md 8: rounded after each norm


def ple_gate(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
             norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor,
             norm_conv_weight: torch.Tensor, eps: float, *, conv_eps: float | None = None,
             unit_offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate the value by how well each stream's key agrees with its hidden state (docs/spec.md sections 4, 7.7).

    For each stream m (channels ``[m * H, (m + 1) * H)``):
    ``s[m] = sum(norm_key(key)[m] * norm_query(hidden_states)[m]) / sqrt(H)``,
    ``g[m] = sigmoid(sign(s[m]) * sqrt(max(|s[m]|, 1e-6)))`` (so ``s = 0`` gives 0.5),
    ``gated[:, m] = g[m] * value`` and ``conv_input = norm_conv(gated)``; every elementwise op
    rounded to the input dtype (docs/spec.md section 8). The norms are `grouped_rms_norm`'s:
    ``norm_key`` and ``norm_query`` with ``eps``, ``norm_conv`` with ``conv_eps``, all three scaled by
    ``1 + w`` or, with ``unit_offset=False``, by ``w`` (the Engram family, docs/spec.md section 15:
    ``eps = torch.finfo(dtype).eps``, ``conv_eps = 1e-5``, weights starting at one).

    Args:
        key: floating-point ``[T, C]``, ``C = M * H``: the key projection.
        value: ``[T, H]``, ``key``'s dtype and device, H a positive divisor of C: the value projection.
        hidden_states: ``[T, C]``, ``key``'s dtype and device: the M residual streams.
        norm_key_weight, norm_query_weight, norm_conv_weight: floating-point ``[C]`` on ``key``'s
            device, the three grouped RMS norms' weights (any float dtype).
        eps: a positive Python number, the key and query norms' epsilon (``rms_norm_eps``); the conv
            norm's too unless ``conv_eps`` is given.
        conv_eps: a positive finite Python number, the conv norm's epsilon, or None (default): ``eps``.
        unit_offset: True (default, the Qwen4Exp family): every norm scales by ``1 + w``; False (the
            Engram family): by ``w``.

    Returns:
        ``(gated, conv_input)``, both ``[T, C]`` in ``key``'s dtype.

    Raises:
        TypeError: ``key``, ``value``, ``hidden_states`` or a norm weight is not a floating-point tensor;
            ``value`` or ``hidden_states`` has another dtype than ``key``; ``eps`` or ``conv_eps`` is not a
            number; ``unit_offset`` is not a bool.
        ValueError: ``key`` is not 2-D.
        ValueError: ``value`` is not ``[T, H]`` with H a positive divisor of C, or is on another device.
        ValueError: ``hidden_states`` is not ``[T, C]``, or is on another device.
        ValueError: a norm weight is not ``[C]``, or is on another device.
        ValueError: ``eps`` is not positive; ``conv_eps`` is not positive and finite.

    Example::

        >>> gated, conv_input = ple_gate(torch.randn(5, 8), torch.randn(5, 4), torch.randn(5, 8), torch.zeros(8),
        ...                              torch.zeros(8), torch.zeros(8), 1e-6)      # M = 2 streams of H = 4
        >>> gated, conv_input = ple_gate(torch.randn(5, 8), torch.randn(5, 4), torch.randn(5, 8), torch.ones(8),
        ...                              torch.ones(8), torch.ones(8), torch.finfo(torch.float32).eps,
        ...                              conv_eps=1e-5, unit_offset=False)       # the Engram family's norms
    """
    H = _checks.gate_call(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight,
                          eps, conv_eps=conv_eps, unit_offset=unit_offset).group_size
    return _ple_gate(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps, H,
                     conv_eps=conv_eps, unit_offset=unit_offset)


def _ple_gate(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor, norm_key_weight: torch.Tensor,
              norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor, eps: float,
              group_size: int, *, conv_eps: float | None = None,
              unit_offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The body of `ple_gate`, for a call already checked (by it, or by ``ple_prefill``'s one check)."""
    H = group_size
    g = stream_gates(key, hidden_states, norm_key_weight, norm_query_weight, H, eps, unit_offset=unit_offset)
    gated = rearrange(g[:, :, None] * value[:, None, :], "t m h -> t (m h)")  # docs/spec.md 8: g * value, rounded
    conv_input = _grouped_rms_norm(gated, norm_conv_weight, H, eps if conv_eps is None else conv_eps,
                                   unit_offset=unit_offset)                  # docs/spec.md 4: norm_conv(gated)
    return gated, conv_input


def stream_gates(key: torch.Tensor, hidden_states: torch.Tensor, norm_key_weight: torch.Tensor,
                 norm_query_weight: torch.Tensor, group_size: int, eps: float, *,
                 unit_offset: bool = True) -> torch.Tensor:
    """The gate ``g[t, m]`` of every token and stream, ``[T, M]`` in the input dtype (see `ple_gate`).

    Arguments as in `ple_gate` (``group_size`` is H; ``eps`` the key and query norms'), not checked: for
    callers that hold checked ones."""
    return stream_scores(key, hidden_states, norm_key_weight, norm_query_weight, group_size, eps,
                         unit_offset=unit_offset)[1]


def stream_scores(key: torch.Tensor, hidden_states: torch.Tensor, norm_key_weight: torch.Tensor,
                  norm_query_weight: torch.Tensor, group_size: int, eps: float, *,
                  unit_offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, g)``: the score ``s[t, m]`` (after the division by ``sqrt(H)``) and the gate ``g[t, m]``, both
    ``[T, M]`` in the input dtype (see `ple_gate`). Arguments as in `ple_gate` (``unit_offset=False``: the
    Engram family's norms, docs/spec.md section 15), not checked."""
    H = group_size
    dt = key.dtype
    kn = rearrange(_grouped_rms_norm(key, norm_key_weight, H, eps, unit_offset=unit_offset), "t (m h) -> t m h", h=H)
    qn = rearrange(_grouped_rms_norm(hidden_states, norm_query_weight, H, eps, unit_offset=unit_offset),
                   "t (m h) -> t m h", h=H)
    # docs/spec.md 4 and 8: every elementwise op in the input dtype, i.e. rounded where the model rounds it.
    s = (kn * qn).sum(-1, dtype=acc_dtype(dt)).to(dt)           # [T, M]; product rounded, sum in fp32, rounded
    # / sqrt(H): math.sqrt in float64, rounded to float32 as a Python scalar (float64 inputs: kept), the quotient
    # computed in float32 and rounded to the input dtype.
    s = s / math.sqrt(H)
    # max(|s|, 1e-6): GATE_CLAMP as a Python scalar (float32, or float64), the result in the input dtype; then
    # the square root, rounded.
    mag = s.abs().clamp_min(GATE_CLAMP).sqrt()
    return s, torch.sigmoid(mag * s.sign())                     # sign(s) * mag (exact), sigmoid rounded
