"""``ple_prefill``'s backward in blocks of rows, for training on the CPU in float32 or float64 (docs/spec.md 4, 5, 8).

``prefill.BlockedPrefill`` is a ``torch.autograd.Function``: its forward is ``prefill._forward_blocked`` (the
same bits as the composition) and saves only the inputs; its backward, `backward_blocked`, recomputes what it
needs block by block in scratch buffers of one or two blocks made once per call (no ``[T, C]`` temporary; fresh
``[T, C]`` tensors cost a page fault per 4 KiB on first touch, more than the arithmetic), instead of autograd's
~50 products over fresh ``[T, C]`` tensors. The gates of all rows come at once from the forward's score sums,
then one pass over blocks of ``gate.BLOCK_ROWS`` rows, in row order, runs for block ``i``:

* the conv's backward: the block's conv inputs (``BlockGate.gate_rows``, ``keep`` applied), the conv's
  pre-activation from the window of the S inputs before the block (as the forward), ``dpre = dout *
  silu'(pre)`` (``aten.silu_backward``) and its transposed taps: ``dpre`` added back into the conv input's
  gradient of the rows up to S before it and each tap's weight gradient, every term inside its packed
  sequence. The conv input's gradient lives in two blocks of rows, block ``i - 1``'s and block ``i``'s
  (S is at most one block);
* then the rest of block ``i - 1``, whose conv input gradient no later block adds to: the conv norm's
  backward, the gate's, and the key and query norms' backward.

The norms' backward is written in closed form, per group of ``H`` channels: for ``y = s * x * r`` with
``r = rsqrt(mean(x^2) + eps)``, ``dx = r * s * dy - x * r^3 * sum(dy * s * x) / H``. For the key and query
norms the sum is the score itself (``sum(dkn * s_k * khat) = ds * sum(kn * qn)``), so their gradients are
three products each: ``dkey = z * hidden * s_k * s_q - key * rk^2 * ds * score / H`` with
``z = ds * rk * rq`` (and the mirror for ``hidden_states``), and both scales' gradients come from one row sum
of ``z * key * hidden``. Row sums of the scales' gradients are accumulated per row in a block-sized buffer
(``addcmul_``) and summed over rows once at the end.

Only for float32 and float64 inputs (``prefill.takes_blocked_backward_path``): a bfloat16 run keeps the
composition, whose every intermediate gradient is rounded as autograd rounds it (and as transformers' model
does). Gradients are within the tolerance of autograd's, not bit for bit: the sums run in other orders.
Not twice differentiable (``once_differentiable``).
"""

from __future__ import annotations

import math
from bisect import bisect_right

import torch

from ..reference.gate import GATE_CLAMP
from .gate import BLOCK_ROWS, BlockGate, _scale

__all__ = ["backward_blocked"]


def _inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``rsqrt(mean(x^2) + eps)`` over the last dimension of ``x`` (``[m, M, H]``): ``[m, M, 1]``."""
    ss = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_()
    return ss.div_(x.shape[-1]).add_(eps).rsqrt_()


def backward_blocked(grad_out: torch.Tensor, key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
                     norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor,
                     conv_weights: torch.Tensor, sums: torch.Tensor, eps: float, hidden_size: int, dilation: int,
                     query_start_loc: torch.Tensor, keep: torch.Tensor | None, conv_eps: float | None,
                     unit_offset: bool) -> tuple[torch.Tensor, ...]:
    """The gradients of key, value, hidden_states, the three norm weights and the conv weights (see the module).
    ``sums``: the forward's score sums (``[T, M]``)."""
    T, C = key.shape
    H = hidden_size
    M = C // H
    dt = key.dtype                                                      # float32 or float64: the acc dtype
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    ceps = eps if conv_eps is None else conv_eps
    wt = conv_weights.to(dt).t().contiguous()                           # [K, C]
    lags = [(K - 1 - j) * dilation for j in range(K)]
    n = -(-max(S, 1) // BLOCK_ROWS) * BLOCK_ROWS                        # a block holds the next one's look-back
    m_max = max(min(n, T), 1)
    s_k, s_q, s_c = (_scale(w, dt, unit_offset).view(M, H)
                     for w in (norm_key_weight, norm_query_weight, norm_conv_weight))
    s_kq = s_k * s_q
    mask = None if keep is None else (keep != 0).to(dt)[:, None, None]  # [T, 1, 1]
    offsets = query_start_loc.tolist()
    starts = sorted({min(max(s, 0), T) for s in offsets[:-1]} | {0})    # every row's sequence starts at one
    block = BlockGate(m_max, key, norm_key_weight, norm_query_weight, norm_conv_weight, eps, H, conv_eps,
                      unit_offset)

    # The gates of all rows and their slopes: the sigmoid's, the signed square root's (zero where the clamp
    # holds), / sqrt(H): d gate / d sum.
    s = sums / math.sqrt(H)
    mag = s.abs().clamp_min(GATE_CLAMP).sqrt()
    gates = torch.sigmoid(mag * s.sign())
    clamp = float(torch.tensor(GATE_CLAMP, dtype=dt))
    dgate_ds = gates * (1 - gates) * torch.where(s.abs() >= clamp, 0.5 / mag, 0.0) / math.sqrt(H)

    dci = key.new_zeros(n + m_max, C)                    # the conv input's gradient, rows a - n on: blocks i - 1, i
    acc_w = key.new_zeros(K, m_max, C)                   # each tap's weight gradient, per row
    acc_kq = key.new_zeros(m_max, M, H)                  # sum over rows of z * key * hidden
    acc_c = key.new_zeros(m_max, M, H)                   # sum over rows of dy * gv * rc
    gated = key.new_empty(m_max, C)
    window = key.new_zeros(S + m_max, C)                 # S rows of history, then the block's conv inputs
    pre, dpre = key.new_empty(m_max, C), key.new_empty(m_max, C)
    gv_, w_, dgv_ = (key.new_empty(m_max, M, H) for _ in range(3))
    dkey, dhidden, dvalue = torch.empty_like(key), torch.empty_like(hidden_states), torch.empty_like(value)

    def conv_backward(a: int, b: int) -> None:
        """Block ``[a, b)``'s conv: its taps' gradients into ``dci`` (rows ``a - n`` on at ``0``) and ``acc_w``."""
        m = b - a
        if a and S:
            window[:S].copy_(window[n:n + S])
        x = window[S:S + m]
        block.gate_rows(gates[a:b], value[a:b], gated[:m], x)
        if mask is not None:
            x.mul_(mask[a:b, 0])
        here = [t - a for t in starts if a <= t < b]                   # sequence starts in the block
        edges = sorted({0, *here, m})
        for r0, r1 in zip(edges, edges[1:]):
            if r0 in here:
                window[r0:r0 + S].zero_()                              # the S inputs before this start
            segment = torch.mul(window[r0 + S - lags[0]:r1 + S - lags[0]], wt[0], out=pre[r0:r1])
            for j in range(1, K):
                segment.addcmul_(window[r0 + S - lags[j]:r1 + S - lags[j]], wt[j])
            d = torch.ops.aten.silu_backward.grad_input(grad_out[a + r0:a + r1], segment, grad_input=dpre[r0:r1])
            start = starts[bisect_right(starts, a + r0) - 1]            # this segment's sequence's first row
            for j, lag in enumerate(lags):
                t0 = max(a + r0, start + lag)                          # rows whose tap j reads inside the sequence
                if t0 >= a + r1:
                    continue
                src = d[t0 - a - r0:]
                o = t0 - lag - (a - n)                                 # row t0 - lag in dci
                dci[o:o + a + r1 - t0].addcmul_(src, wt[j])
                acc_w[j, :a + r1 - t0].addcmul_(src, window[t0 - a + S - lag:r1 + S - lag])

    def rest_backward(a: int, b: int, dc: torch.Tensor) -> None:
        """Block ``[a, b)``'s conv norm, gate and key and query norms; ``dc`` its conv input's gradient."""
        m = b - a
        g = gates[a:b, :, None]                                         # [m, M, 1]
        go = grad_out[a:b].view(m, M, H)
        dy = dc.view(m, M, H)
        if mask is not None:
            go, dy = go * mask[a:b], dy * mask[a:b]
        # The conv norm (y = s_c * gv * rc, its input gv = g * value) and the direct path: dgv.
        gv = torch.mul(g, value[a:b, None, :], out=gv_[:m])
        rc = _inverse_rms(gv, ceps)
        w = torch.mul(dy, gv, out=w_[:m])
        acc_c[:m].addcmul_(w, rc)
        coef = w.mul_(s_c).sum(-1, keepdim=True).mul_(rc.pow(3)).div_(-H)
        dgv = torch.mul(dy, s_c, out=dgv_[:m]).mul_(rc).addcmul_(gv, coef).add_(go)
        # The gate: value's gradient and the score's (ds = d loss / d sum(kn * qn)).
        torch.bmm(g.view(m, 1, M), dgv, out=dvalue[a:b].view(m, 1, H))
        ds = torch.mul(dgv, value[a:b, None, :], out=w_[:m]).sum(-1, keepdim=True).mul_(dgate_ds[a:b, :, None])
        # The key and query norms, closed form (see the module docstring).
        kb, hb = key[a:b].view(m, M, H), hidden_states[a:b].view(m, M, H)
        rk, rq = _inverse_rms(kb, eps), _inverse_rms(hb, eps)
        z = ds * rk * rq
        shift = ds * sums[a:b, :, None] / H
        kz = torch.mul(kb, z, out=w_[:m])
        dh = torch.mul(kz, s_kq, out=dhidden[a:b].view(m, M, H))
        dh.addcmul_(hb, rq.square().mul_(shift), value=-1).add_(grad_out[a:b].view(m, M, H))
        acc_kq[:m].addcmul_(kz, hb)
        dk = torch.mul(hb, z, out=dkey[a:b].view(m, M, H)).mul_(s_kq)
        dk.addcmul_(kb, rk.square().mul_(shift), value=-1)

    for a in range(0, T, n):
        if a:
            dci[:n].copy_(dci[n:])                                     # block i - 1's rows, final after block i
            dci[n:].zero_()
        conv_backward(a, min(a + n, T))
        if a:
            rest_backward(a - n, a, dci[:n])
    if T:
        a = (T - 1) // n * n
        rest_backward(a, T, dci[n:n + T - a])
    kq = acc_kq.sum(0)
    dscales = (kq * s_q, kq * s_k, acc_c.sum(0))
    weights = (norm_key_weight, norm_query_weight, norm_conv_weight)
    return (dkey, dvalue, dhidden, *(d.reshape(C).to(w.dtype) for d, w in zip(dscales, weights)),
            acc_w.sum(1).t().to(conv_weights.dtype))
