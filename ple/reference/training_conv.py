"""The dilated depthwise causal convolution over whole sequences, for training (SPEC section 5).

``y_t = silu( sum_{j=0..K-1} w[:, j] * x_{t - (K-1-j) * d} )`` inside each sequence, with
zero history before its start; dense ``[B, L, C]`` or packed ``[T, C]`` cut by
``cu_seqlens``. Autograd through plain PyTorch ops. Rounding follows the model: the tap
sum is accumulated in float32 (``acc_dtype``) and rounded to the input dtype, then silu,
rounded. The serving step over the same convolution is ``conv.ple_conv``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _checks
from .gate import acc_dtype

__all__ = ["dilated_causal_conv"]


def dilated_causal_conv(x: torch.Tensor, weight: torch.Tensor, *, dilation: int,
                        cu_seqlens: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """``silu(causal dilated depthwise conv(x))`` over whole sequences, with autograd.

    ``x`` is ``[B, L, C]`` (each row a sequence) or packed ``[T, C]`` with
    ``cu_seqlens`` (``[R+1]``) cutting it into sequences; a 2-D ``x`` without
    ``cu_seqlens`` is one sequence. ``weight`` is ``[C, K]``. Every sequence starts
    with zero history. Returns ``y`` with ``x``'s shape and dtype. A packed token finds its
    sequence with ``torch.searchsorted`` on the device ``cu_seqlens``.

    ``validate=False`` skips the value checks (the offsets of ``cu_seqlens``); for callers
    that validated on the host, e.g. ``PLECache.schedule``; out-of-range values are then
    undefined behaviour.
    """
    (_checks.dense_conv_call if validate else _checks.dense_conv_meta)(x, weight, dilation, cu_seqlens)
    K = weight.shape[1]
    acc = acc_dtype(x.dtype)
    xf, w = x.to(acc), weight.to(acc)
    if x.dim() == 3:
        L = x.shape[1]
        pos = torch.arange(L, device=x.device)
        time_dim = 1
    else:
        T = x.shape[0]
        pos = torch.arange(T, device=x.device)                  # position within its sequence
        if cu_seqlens is not None:
            cu = cu_seqlens.to(torch.int64)
            seq = torch.searchsorted(cu[1:], pos, right=True).clamp(max=max(cu.numel() - 2, 0))
            pos = pos - cu[seq]
        time_dim = 0
    out = torch.zeros_like(xf)
    for j in range(K):
        lag = (K - 1 - j) * dilation
        src = (torch.arange(pos.numel(), device=x.device) - lag).clamp(min=0)
        shifted = xf.index_select(time_dim, src)
        valid = (pos >= lag).to(acc)                            # zero history before each sequence
        valid = valid[:, None] if time_dim == 0 else valid[None, :, None]
        out = out + w[:, j] * shifted * valid
    return F.silu(out.to(x.dtype).to(acc)).to(x.dtype)
