"""The dilated depthwise causal convolution over whole sequences, for training (SPEC section 5).

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
    """``silu(causal dilated depthwise conv(x))`` over whole sequences, with autograd.

    ``x`` is ``[B, L, C]`` (each row a sequence) or packed ``[T, C]`` with
    ``cu_seqlens`` (``[R+1]``) cutting it into sequences; a 2-D ``x`` without
    ``cu_seqlens`` is one sequence. ``weight`` is ``[C, K]``. Every sequence starts
    with zero history: ``y_t = silu(sum_j w[:, j] * x_{t - (K-1-j) * d})``, terms before the
    sequence's start being 0. Returns ``y`` with ``x``'s shape and dtype. Rounding is the
    model's: the tap sum accumulated in float32 (float64 for float64 inputs) in tap order and
    rounded to ``x``'s dtype, then silu computed in float32 and rounded.

    ``validate=False`` skips the value checks (the offsets of ``cu_seqlens``); for callers
    that validated on the host, e.g. ``PLECache.schedule``; out-of-range values are then
    undefined behaviour.
    """
    (_checks.dense_conv_call if validate else _checks.dense_conv_meta)(x, weight, dilation, cu_seqlens)
    S = (weight.shape[1] - 1) * dilation
    C, dt = x.shape[-1], x.dtype
    acc = acc_dtype(dt)                             # float32 (float64 for float64 inputs)
    xa, w = x.reshape(-1, C).to(acc), weight.to(acc)    # [B, L, C]: B sequences of L rows, end to end
    if x.dim() == 3:
        starts = [b * x.shape[1] for b in range(x.shape[0] + 1)]
    else:
        starts = [0, x.shape[0]] if cu_seqlens is None else cu_seqlens.tolist()
    spans = list(pairwise(starts)) or [(0, 0)]      # no sequence means no rows: one empty one (keeps the graph)
    # Each sequence from S zeros of history. Tap by tap (conv_sums), not F.conv1d: the model's conv sums
    # the K products in float32 in tap order and rounds once to x's dtype (SPEC 8), and a conv1d kernel
    # would sum in its own order.
    sums = torch.cat([conv_sums(torch.cat([xa.new_zeros(S, C), xa[a:b]]), w, dilation) for a, b in spans])
    # silu once over all rows, not per sequence: the CPU kernel's vector body and scalar tail may differ
    # by an ulp in float32, and one call over the whole tensor gives the vectorised backend's bits.
    y = F.silu(sums.to(dt).to(acc)).to(dt)          # SPEC 8: the tap sum rounded, silu in acc dtype, rounded
    return y.reshape(x.shape)
