"""The dilated depthwise causal convolution over whole sequences, for training (docs/spec.md section 5).

``y_t = silu( sum_{j=0..K-1} w[:, j] * x_{t - (K-1-j) * d} )`` inside each sequence, with
zero history before its start; dense ``[B, L, C]`` or packed ``[T, C]`` cut by
``cu_seqlens``. Rounding follows the model: the tap sum is accumulated in float32
(``acc_dtype``) and rounded to the input dtype, then silu, rounded. The serving step over the
same convolution is ``conv.ple_conv``.

The tap sum is the reference's, term for term and in its order (``0 + w0 x + w1 x + ...``), but
each tap is one multiply-add of a shifted *slice* of the whole input into a zeroed accumulator
(no gathered copies, no validity masks). A tap skips the rows less than its lag from the start
of the input, which is what adding the reference's zero term does. In a packed batch the rows
near the start of every later sequence would read the sequence before; those rows, at most S
per sequence boundary, are recomputed with the reference's masked gather and written over the
whole-input result. So the sum is the reference's bit for bit in every dtype: each tap is a product
then an add (``addcmul`` fuses them on this CPU and rounds once, which differs in float32 and, where a
product underflows to a subnormal or a signed zero, in bfloat16 too), and a masked term multiplies the
weight by a zeroed input, as the reference's zero history does (so a non-finite weight gives what it
gives there, and a non-finite input of another sequence never leaks in).

Autograd: the tap sum is one ``autograd.Function`` (`_TapSum`) whose backward is the same slice
arithmetic (the input's gradient is the transposed tap sum, with the rows near the *end* of every
sequence but the last recomputed; each tap's weight gradient is one product and one column sum, the
cross-sequence rows zeroed), so no gathered copy or zero-filled slice gradient is made; the casts
and silu around it are plain autograd.

Two paths (`_conv` chooses; ``ple/vectorized/__init__.py`` has the measurements): `_conv_gathered`, the
general one, each tap a masked gather of the input in plain autograd ops, runs under ``torch.compile``
(inductor fuses the gathers with whatever produced the input); `_TapSum`, the slice arithmetic above,
runs eagerly, with autograd or without.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _checks
from .. import reference as _reference
from .._deprecation import deprecated_parameter
from ..backends import twin
from ..reference.gate import acc_dtype

__all__ = ["dilated_causal_conv", "takes_slice_path", "tap_sum", "conv_activation", "multiply_add_"]


def _lags(kernel_size: int, dilation: int) -> list[int]:
    """Tap j reads the input ``lag_j = (K-1-j) * dilation`` rows back (K = ``kernel_size``)."""
    K = kernel_size
    return [(K - 1 - j) * dilation for j in range(K)]


def _sequence_heads(cu_seqlens: torch.Tensor, span: int):
    """The first ``span`` rows of every sequence but the first: ``(rows [R-1, span], inside [R-1, span])``,
    ``inside`` false for candidates past the sequence's end (their rows are another sequence's)."""
    p = torch.arange(span, device=cu_seqlens.device)
    rows = cu_seqlens[1:-1, None] + p
    return rows, rows < cu_seqlens[2:, None]


def _sequence_tails(cu_seqlens: torch.Tensor, span: int):
    """The last ``span`` rows of every sequence but the last: ``(rows [R-1, span], inside [R-1, span])``,
    ``inside`` false for candidates before the sequence's start."""
    p = torch.arange(span, device=cu_seqlens.device)
    rows = cu_seqlens[1:-1, None] - span + p
    return rows, rows >= cu_seqlens[:-2, None]


def multiply_add_(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``out += a * w`` with the product rounded first (the reference's ``out + w * a``): a product and an
    add. Not ``addcmul_``: it may fuse them and round once, which differs in float32 and, for products that
    underflow (a subnormal, or a zero whose sign the add would change), in bfloat16 as well."""
    return out.add_(a * w)


@deprecated_parameter("cu", "cu_seqlens", since="0.1.0")
def tap_sum(xf: torch.Tensor, wt: torch.Tensor, dilation: int, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = 0 + sum_j wt[j] * xf[t - lag_j]`` over the time dim (-2) of ``xf`` (``[..., T, C]``, the
    accumulation dtype), terms before the start of the row's sequence skipped; ``wt`` is ``[K, C]``;
    ``cu_seqlens`` (int64, packed ``[T, C]`` only) cuts the rows into sequences (None: one)."""
    K = wt.shape[0]
    T = xf.shape[-2]
    lags = _lags(K, dilation)
    fix = cu_seqlens is not None and cu_seqlens.numel() > 2 and lags[0] > 0 and T > 0
    shape = list(xf.shape)
    shape[-2] = T + fix                                                # + a scratch row for the fix
    out = xf.new_zeros(shape)
    for j, lag in enumerate(lags):
        if lag < T:
            multiply_add_(out[..., lag:T, :], xf[..., :T - lag, :], wt[j])
    if not fix:
        return out
    assert cu_seqlens is not None
    rows, inside = _sequence_heads(cu_seqlens, lags[0])
    p = torch.arange(lags[0], device=xf.device)
    acc = xf.new_zeros(rows.numel(), xf.shape[1])
    for j, lag in enumerate(lags):                                     # the reference's masked terms
        valid = (p >= lag) & inside
        src = torch.where(valid, rows - lag, 0).flatten()
        acc = acc + wt[j] * torch.where(valid.flatten()[:, None], xf.index_select(0, src), 0.0)
    return out.index_copy_(0, torch.where(inside, rows, T).flatten(), acc)[:T]


def _tap_sum_transposed(g: torch.Tensor, wt: torch.Tensor, dilation: int,
                        cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """The gradient of `tap_sum` with respect to ``xf``: ``gx[s] = sum_j wt[j] * g[s + lag_j]`` over the
    terms inside ``s``'s sequence."""
    K = wt.shape[0]
    T = g.shape[-2]
    lags = _lags(K, dilation)
    fix = cu_seqlens is not None and cu_seqlens.numel() > 2 and lags[0] > 0 and T > 0
    shape = list(g.shape)
    shape[-2] = T + fix
    gx = g.new_zeros(shape)
    for j, lag in enumerate(lags):
        if lag < T:
            gx[..., :T - lag, :].addcmul_(g[..., lag:, :], wt[j])
    if not fix:
        return gx
    assert cu_seqlens is not None
    S = lags[0]
    rows, inside = _sequence_tails(cu_seqlens, S)
    ends = cu_seqlens[1:-1, None]
    acc = g.new_zeros(rows.numel(), g.shape[1])
    for j, lag in enumerate(lags):
        valid = (rows + lag < ends) & inside
        src = torch.where(valid, rows + lag, 0).flatten()
        acc = acc + wt[j] * torch.where(valid.flatten()[:, None], g.index_select(0, src), 0.0)
    return gx.index_copy_(0, torch.where(inside, rows, T).flatten(), acc)[:T]


def _tap_weight_grad(g: torch.Tensor, xf: torch.Tensor, dilation: int, cu_seqlens: torch.Tensor | None,
                     kernel_size: int) -> torch.Tensor:
    """The gradient of `tap_sum` with respect to ``wt``: ``gw[j] = sum_t g[t] * xf[t - lag_j]`` over the
    terms inside ``t``'s sequence, ``[K, C]``."""
    K = kernel_size
    T, C = xf.shape[-2], xf.shape[-1]
    lags = _lags(K, dilation)
    gw = xf.new_zeros(K, C)
    packed = cu_seqlens is not None and cu_seqlens.numel() > 2
    for j, lag in enumerate(lags):
        if lag >= T:
            continue
        if not packed or lag == 0:
            prod = g[..., lag:, :] * xf[..., :T - lag, :]
            gw[j] = prod.reshape(-1, C).sum(0)
            continue
        assert cu_seqlens is not None
        prod = xf.new_empty(T - lag + 1, C)                           # + a scratch row
        torch.mul(g[lag:], xf[:T - lag], out=prod[:T - lag])
        rows, inside = _sequence_heads(cu_seqlens, lag)                        # rows t < start + lag: no term
        prod.index_fill_(0, torch.where(inside & (rows >= lag), rows - lag, T - lag).flatten(), 0)
        prod[T - lag].zero_()
        gw[j] = prod.sum(0)
    return gw


class _TapSum(torch.autograd.Function):
    """`tap_sum` with its backward written out (see the module docstring)."""

    @staticmethod
    def forward(ctx, xf, wt, dilation, cu_seqlens):
        ctx.save_for_backward(xf, wt, cu_seqlens)
        ctx.dilation = dilation
        return tap_sum(xf, wt, dilation, cu_seqlens)

    @staticmethod
    def backward(ctx, g):
        xf, wt, cu_seqlens = ctx.saved_tensors
        g = g.contiguous()
        gx = _tap_sum_transposed(g, wt, ctx.dilation, cu_seqlens) if ctx.needs_input_grad[0] else None
        gw = _tap_weight_grad(g, xf, ctx.dilation, cu_seqlens, wt.shape[0]) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None


def conv_activation(out: torch.Tensor, dtype: torch.dtype, inplace: bool) -> torch.Tensor:
    """``silu(out.to(dtype).to(acc)).to(dtype)``, the model's rounding: the sum, then silu, each rounded."""
    if out.dtype == dtype:
        return F.silu(out, inplace=inplace)
    return F.silu(out.to(dtype), inplace=inplace)   # computed in float32, rounded: what the reference's casts do


@twin(_reference.dilated_causal_conv)
def dilated_causal_conv(x: torch.Tensor, weight: torch.Tensor, *, dilation: int,
                        cu_seqlens: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """Eagerly (``training_conv.takes_slice_path``) the tap sum is ``training_conv._TapSum``: each tap one
    multiply-add of a shifted slice of the whole input, the rows near every later sequence's start
    recomputed as the reference's masked gather, with a backward of the same slice arithmetic; under
    ``torch.compile`` it is ``_conv_gathered``, a masked gather per tap in plain autograd ops, which inductor
    fuses with what made ``x``. Both add the taps as the reference does (each product rounded, in tap
    order, in the accumulation dtype); gradients are within the tolerance (``_TapSum``'s input gradient
    fuses its multiply-adds). The checks read ``cu_seqlens`` on the host once (``validate=True``); after
    them nothing is read back, forward or backward."""
    check = _checks.dilated_causal_conv_call if _checks.validating(validate) else _checks.dilated_causal_conv_meta
    check(x, weight, dilation, cu_seqlens)
    return _conv(x, weight, dilation, cu_seqlens)


def _conv_gathered(x: torch.Tensor, weight: torch.Tensor, dilation: int,
                   cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """The general conv: one pointwise sum of K masked shifted products, in plain autograd ops.

    Each tap is a gather of ``x`` along time (index clamped at 0, masked where it would cross the start
    of its sequence: the reference's ``w * 0``). Under ``torch.compile`` inductor fuses each gather with
    whatever produced ``x``: in ``ple_prefill`` the conv input is recomputed per tap from the gates, the
    value and the norm's sums (all realised, being reductions or inputs) instead of being written to a
    ``[T, C]`` buffer and read back K times (the fused gate-and-conv kernel 8.4-8.9 ms -> 6.1-6.6 ms at
    C = 2048, T = 2048 in float32, against a zero-padded concatenation of ``x``, when it was written). The
    weights' columns are stacked into a buffer inductor realises (a transposed view it would gather
    element by element).
    """
    acc = acc_dtype(x.dtype)
    K = weight.shape[1]
    time_dim = x.dim() - 2
    T = x.shape[time_dim]
    pos = torch.arange(T, device=x.device)
    if cu_seqlens is not None and cu_seqlens.numel() > 2:
        last = cu_seqlens.numel() - 2
        pos = pos - cu_seqlens[torch.searchsorted(cu_seqlens[1:], pos, right=True).clamp(max=last)]
    t = torch.arange(T, device=x.device)
    wt = torch.stack(weight.to(acc).unbind(1))                           # [K, C]
    out = x.new_zeros(x.shape, dtype=acc)
    for j in range(K):
        lag = (K - 1 - j) * dilation
        xs = torch.where((pos >= lag)[:, None], x.index_select(time_dim, (t - lag).clamp(min=0)), 0.0) if lag else x
        out = out + xs.to(acc) * wt[j]                                   # a masked term: w * 0, as the reference
    return F.silu(out.to(x.dtype).to(acc)).to(x.dtype)


def takes_slice_path() -> bool:
    """Whether `_conv` runs `_TapSum`: eagerly (under ``torch.compile`` the gathers fuse; see the module)."""
    return not torch.compiler.is_compiling()


def _conv(x: torch.Tensor, weight: torch.Tensor, dilation: int, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """`dilated_causal_conv` after its checks: `_TapSum` where `takes_slice_path`, else `_conv_gathered`."""
    cu_seqlens = cu_seqlens.to(torch.int64) if x.dim() == 2 and cu_seqlens is not None else None
    if not takes_slice_path():
        return _conv_gathered(x, weight, dilation, cu_seqlens)
    acc = acc_dtype(x.dtype)
    wt = weight.to(acc).t().contiguous()                             # [K, C]: each tap's weights contiguous
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return conv_activation(_TapSum.apply(x.to(acc), wt, dilation, cu_seqlens), x.dtype, inplace=not grad)
