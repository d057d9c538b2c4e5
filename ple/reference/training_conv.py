"""The dilated depthwise causal convolution over whole sequences, for training.

Specified in ``docs/spec.md`` (``../../docs/spec.md`` from this file), sections 5 (the convolution),
7.10 (``dilated_causal_conv``) and 8 (rounding).

``y_t = silu( sum_{j=0..K-1} w[:, j] * x_{t - (K-1-j) * d} )`` inside each sequence, with
zero history before its start; dense ``[B, L, C]`` or packed ``[T, C]`` cut by
``cu_seqlens``. Written as the specification: a Python loop over the sequences (reading
``cu_seqlens`` on the host), each convolved from ``S`` zeros of history with the serving
step's tap sum (``conv.conv_sums``), autograd through plain PyTorch ops. ``ple.vectorized``
computes the same bits without the loop.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F

from .. import _checks
from .conv import conv_sums
from .gate import acc_dtype

__all__ = ["dilated_causal_conv"]


def dilated_causal_conv(x: torch.Tensor, weight: torch.Tensor, *, dilation: int,
                        cu_seqlens: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """``silu(causal dilated depthwise conv(x))`` over whole sequences, with autograd (docs/spec.md section 7.10).

    Every sequence starts with zero history: ``y_t = silu(sum_j w[:, j] * x_{t - (K-1-j) * d})``
    (``w = weight``), terms before the sequence's start being 0. Rounding is the model's: the tap
    sum accumulated in float32 (float64 for float64 inputs) in tap order and rounded to ``x``'s
    dtype, then silu computed in float32 and rounded.

    Args:
        x: floating-point ``[B, L, C]`` (each of the B rows a sequence) or packed ``[T, C]``; a 2-D
            ``x`` without ``cu_seqlens`` is one sequence. Autograd reaches it.
        weight: floating-point ``[C, K]``, ``K >= 1``, on ``x``'s device (the serving ops call it
            ``conv_weights``; tap ``K - 1`` is on the current token). Autograd reaches it.
        dilation: d, an int ``>= 1``.
        cu_seqlens: int32 or int64 ``[R+1]`` (the name flash-attn gives ``query_start_loc``), packed ``x``
            only: offsets cutting its rows into sequences, from 0, non-decreasing, ending at T.
        validate: False skips the value checks (the offsets of ``cu_seqlens``; the metadata checks still
            run); out-of-range values are then undefined behaviour.

    Returns:
        ``y`` with ``x``'s shape and dtype.

    Raises:
        TypeError: ``x`` or ``weight`` is not a floating-point tensor; ``cu_seqlens`` is not an int32 /
            int64 tensor; ``dilation`` is not an int.
        ValueError: ``x`` is neither 2-D nor 3-D; ``cu_seqlens`` is given with a 3-D ``x``.
        ValueError: ``weight`` is not ``[C, K]`` with ``K >= 1``, or is on another device than ``x``.
        ValueError: ``dilation`` is below 1.
        ValueError: ``cu_seqlens`` is not 1-D, is empty, is on another device (or the meta device), does
            not start at 0, decreases, or does not end at T.

    Example::

        >>> x = torch.randn(7, 4, requires_grad=True)                   # two packed sequences, of 3 and 4 rows
        >>> dilated_causal_conv(x, torch.randn(4, 3), dilation=2, cu_seqlens=torch.tensor([0, 3, 7])).shape
        torch.Size([7, 4])
    """
    check = _checks.dilated_causal_conv_call if _checks.validating(validate) else _checks.dilated_causal_conv_meta
    check(x, weight, dilation, cu_seqlens)
    return _dilated_causal_conv(x, weight, dilation, cu_seqlens)


def _dilated_causal_conv(x: torch.Tensor, weight: torch.Tensor, dilation: int,
                         cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """The body of `dilated_causal_conv`, for a call already checked (by it, or by ``ple_prefill``'s one check)."""
    S = (weight.shape[1] - 1) * dilation
    C, dt = x.shape[-1], x.dtype
    acc = acc_dtype(dt)                             # float32 (float64 for float64 inputs)
    xa, w = x.reshape(-1, C).to(acc), weight.to(acc)    # [B, L, C]: B sequences of L rows, end to end
    if x.dim() == 3:                                # the offsets of the B sequences of L rows
        cu_seqlens_list = [b * x.shape[1] for b in range(x.shape[0] + 1)]
    else:
        cu_seqlens_list = [0, x.shape[0]] if cu_seqlens is None else cu_seqlens.tolist()
    spans = list(pairwise(cu_seqlens_list)) or [(0, 0)]   # no sequence means no rows: one empty one (keeps the graph)
    # Each sequence from S zeros of history. Tap by tap (conv_sums), not F.conv1d: the model's conv sums
    # the K products in float32 in tap order and rounds once to x's dtype (docs/spec.md 8), and a conv1d kernel
    # would sum in its own order.
    sums = torch.cat([conv_sums(torch.cat([xa.new_zeros(S, C), xa[a:b]]), w, dilation) for a, b in spans])
    # silu once over all rows, not per sequence: the CPU kernel's vector body and scalar tail may differ
    # by an ulp in float32, and one call over the whole tensor gives the vectorised backend's bits.
    y = F.silu(sums.to(dt).to(acc)).to(dt)          # docs/spec.md 8: the tap sum rounded, silu in acc dtype, rounded
    return y.reshape(x.shape)
