"""Grouped RMS norms and the signed-sqrt gate (SPEC section 4), with the reference's rounding points.

The ops and their order are the reference's (``ple.reference.gate``), so results are the same bit
for bit in every dtype; what differs is how many passes over ``[T, C]`` they take and how large
their temporaries are:

* a norm is ``xf = x.to(acc)``, ``xf * xf``, the group sum (``sum(-1)``, the kernel ``mean`` runs on
  the CPU, then the same division by ``H``), ``xf * r``, ``* (1 + w)``, the cast to the input dtype:
  no ``pow``, no mixed-dtype op (``bf16 * fp32`` takes an unvectorised path on the CPU, ~10x
  slower), and, when nothing records autograd, the scale is applied in place and the cast writes
  straight into the output;
* the score's product ``kn * qn`` (rounded to the model dtype) is made once and summed in float32;
* the gated value is one broadcast product ``g[:, :, None] * value[:, None, :]``.

Every op is per token, so when nothing records autograd (and nothing is being compiled) the
tokens are processed in blocks of `block_rows` rows by a `BlockGate`: each float32 temporary is
then ~512 KiB, a buffer reused from block to block that stays in the core's cache, where a
whole-batch one (16 MiB at T = C = 2048) streams through memory on every op. Measured on a 2 MiB-L2
CPU at C = 2048: 64-row blocks beat 128 and 256 (temporaries spill) and 32 (per-op overhead).
Blocks change no bit (every reduction is within a token).
"""

from __future__ import annotations

import math

import torch

from .. import _checks
from .. import reference as _reference
from ..backends import twin
from ..reference.gate import GATE_CLAMP, acc_dtype

__all__ = ["ple_gate", "grouped_rms_norm", "records_grad", "block_rows", "BlockGate"]

BLOCK_BYTES = 1 << 19
"""Target size of one float32 ``[rows, C]`` temporary of a blocked op (see the module docstring)."""


def records_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records an op on ``tensors`` (then only out-of-place ops are used)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def block_rows(T: int, C: int) -> int:
    """Rows per block of a blocked op: ``T`` (one block) under ``torch.compile``, else ~`BLOCK_BYTES` of
    float32 per ``[rows, C]`` temporary, a multiple of 64.

    A multiple of 64 rows keeps every block's elements on the vector lanes they have in the whole
    tensor: ATen's CPU loops run the last ``numel % (2 * lanes)`` elements through scalar code, whose
    ``exp`` (``sigmoid``, ``silu``) may differ from the vector one in the last float32 bit, so a block
    with its own scalar tail would not be the unblocked op bit for bit.
    """
    if torch.compiler.is_compiling():
        return max(T, 1)
    return max(64, BLOCK_BYTES // (4 * max(C, 1)) // 64 * 64)


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``ple.reference.grouped_rms_norm`` of a ``[T, C]`` ``x``, bit for bit, in fewer passes (see the module).

    ``out`` (``[T, C]``, ``x``'s dtype; not with autograd) receives the result.
    """
    acc = acc_dtype(x.dtype)
    T, C = x.shape
    H = group_size
    xf = x.to(acc).reshape(T, C // H, H)
    scale = 1.0 + weight.to(acc)
    if records_grad(x, weight):
        r = torch.rsqrt((xf * xf).sum(-1, keepdim=True) / H + eps)
        return ((xf * r).reshape(T, C) * scale).to(x.dtype)
    sq = xf * xf
    r = sq.sum(-1, keepdim=True).div_(H).add_(eps).rsqrt_()        # = rsqrt(mean(x^2) + eps): mean is sum / H
    y = torch.mul(xf, r, out=sq).reshape(T, C)                      # the square's buffer, reused
    y.mul_(scale)
    if out is None:
        return y if y.dtype == x.dtype else y.to(x.dtype)
    return out.copy_(y)


PAIRED_ROWS = 128
"""Up to this many rows (a decode step) the key and query norms run as one norm of both stacked: half the
ops, for one copy of two small tensors."""


def _paired_norms(key, hidden_states, norm_key_weight, norm_query_weight, H, eps):
    """``(norm_key(key), norm_query(hidden_states))`` as one `grouped_rms_norm` of ``[2T, C]`` (per-token ops:
    the same bits)."""
    T, C = key.shape
    acc = acc_dtype(key.dtype)
    xf = torch.cat([key, hidden_states]).to(acc).view(2 * T, C // H, H)
    sq = xf * xf
    r = sq.sum(-1, keepdim=True).div_(H).add_(eps).rsqrt_()
    y = torch.mul(xf, r, out=sq).view(2, T, C)
    y.mul_(torch.stack([norm_key_weight.to(acc), norm_query_weight.to(acc)]).add_(1.0)[:, None])
    y = y.to(key.dtype)
    return y[0], y[1]


def scores_and_gates(key: torch.Tensor, hidden_states: torch.Tensor, norm_key_weight: torch.Tensor,
                     norm_query_weight: torch.Tensor, group_size: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, g)``, ``[T, M]`` in the input dtype: ``ple.reference.gate.stream_scores``, bit for bit."""
    H = group_size
    dt = key.dtype
    T, C = key.shape
    if T <= PAIRED_ROWS and not records_grad(key, hidden_states, norm_key_weight, norm_query_weight):
        kn, qn = _paired_norms(key, hidden_states, norm_key_weight, norm_query_weight, H, eps)
    else:
        kn = grouped_rms_norm(key, norm_key_weight, H, eps)
        qn = grouped_rms_norm(hidden_states, norm_query_weight, H, eps)
    kn, qn = kn.view(T, C // H, H), qn.view(T, C // H, H)
    prod = kn * qn                                                  # rounded to the model dtype, as the model
    s = prod.to(acc_dtype(dt)).sum(-1).to(dt)                       # sum in float32 (= sum(dtype=float32))
    s = s / math.sqrt(H)
    mag = s.abs().clamp_min(GATE_CLAMP).sqrt()
    return s, torch.sigmoid(mag * s.sign())


@twin(_reference.ple_gate)
def ple_gate(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
             norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor,
             norm_conv_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    H = _checks.gate_call(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight,
                          eps).group_size
    return gate(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps, H)


SMALL_ROWS = 32
"""Up to this many rows (and under ``torch.compile``) `gate` runs `_gate_block`: a `BlockGate`'s fixed cost
(its buffers, two passes) is more than it saves there (measured at C = 2048: 20 % slower at 8 rows, 18 %
faster at 64)."""


def _gate_block(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps, H):
    """The gate of rows not taken in blocks: autograd records, ``torch.compile`` traces, or `SMALL_ROWS` rows
    at most."""
    T, C = key.shape
    g = scores_and_gates(key, hidden_states, norm_key_weight, norm_query_weight, H, eps)[1]
    gated = (g[:, :, None] * value[:, None, :]).view(T, C)
    return gated, grouped_rms_norm(gated, norm_conv_weight, H, eps)


class BlockGate:
    """The gate of a blocked op, in two passes over blocks of at most ``n`` rows, into scratch buffers it reuses.

    Same ops, same rounding points as `_gate_block` (so the same bits); what it saves is allocation,
    passes and small ops: every temporary is a buffer of this object, which stays in cache from block
    to block; the norms' scales (``1 + w``) are made once per call, not per block; a float32 call widens
    nothing; and the score's ops on ``[T, M]`` (the division by sqrt(H), the signed square root,
    the sigmoid) run once over all rows (`gates`) between the block pass that makes the scores
    (`score_sums`) and the one that uses the gates (`gate_rows`), instead of once per block.
    """

    def __init__(self, n: int, like: torch.Tensor, norm_key_weight: torch.Tensor,
                 norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor, eps: float, H: int) -> None:
        C = like.shape[1]
        self.dt, self.acc, self.H, self.eps = like.dtype, acc_dtype(like.dtype), H, eps
        acc = self.acc
        wide = acc != self.dt
        self.x = like.new_empty(n, C, dtype=acc) if wide else None     # an input, widened
        self.sq2 = like.new_empty(2, n, C, dtype=acc)                  # squares, then the scaled norms
        self.kq = like.new_empty(2, n, C) if wide else self.sq2        # the two norms, rounded
        self.prod = like.new_empty(n, C)
        self.sq = like.new_empty(n, C, dtype=acc) if wide else None    # the conv norm's squares
        self.scales = [1.0 + w.to(acc) for w in (norm_key_weight, norm_query_weight, norm_conv_weight)]

    def _norm(self, x: torch.Tensor, sq: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``grouped_rms_norm``'s ops on ``x`` (``[m, C]``, the acc dtype) with ``sq`` as scratch; into ``out``."""
        H = self.H
        g = x.unflatten(-1, (-1, H))
        sqg = torch.mul(g, g, out=sq.unflatten(-1, (-1, H)))
        r = sqg.sum(-1, keepdim=True).div_(H).add_(self.eps).rsqrt_()   # = rsqrt(mean(x^2) + eps)
        torch.mul(g, r, out=sqg)
        if out.dtype == sq.dtype:
            return torch.mul(sq, scale, out=out)
        return out.copy_(sq.mul_(scale))                                # rounded to the input dtype

    def _widen(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.x is None else self.x[:t.shape[0]].copy_(t)

    def score_sums(self, key: torch.Tensor, hidden_states: torch.Tensor, out: torch.Tensor) -> None:
        """Pass 1, ``m <= n`` rows: ``out`` (``[m, M]``, the input dtype) = ``sum(kn * qn)``, rounded."""
        m, C = key.shape
        sq, kq = self.sq2[:, :m], self.kq[:, :m]
        for i, src in enumerate((key, hidden_states)):
            self._norm(self._widen(src), sq[i], self.scales[i], kq[i])
        prod = torch.mul(kq[0], kq[1], out=self.prod[:m]).view(m, C // self.H, self.H)   # rounded, as the model
        out.copy_(prod.to(self.acc).sum(-1))                            # summed in float32, rounded

    def gates(self, sums: torch.Tensor) -> torch.Tensor:
        """Between the passes, all rows at once: the gates ``[T, M]`` of the rounded sums."""
        s = sums / math.sqrt(self.H)
        return torch.sigmoid(s.abs().clamp_min(GATE_CLAMP).sqrt() * s.sign())

    def gate_rows(self, g: torch.Tensor, value: torch.Tensor, gated: torch.Tensor, conv_input: torch.Tensor) -> None:
        """Pass 2, ``m <= n`` rows: ``gated`` and ``conv_input`` (``[m, C]``, the input dtype) are written."""
        m, C = gated.shape
        torch.mul(g[:, :, None], value[:, None, :], out=gated.view(m, C // self.H, self.H))
        sq = self.sq2[0, :m] if self.sq is None else self.sq[:m]
        self._norm(self._widen(gated), sq, self.scales[2], conv_input)


def gate(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor, norm_key_weight: torch.Tensor,
         norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor, eps: float,
         H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ple_gate` after its checks: ``(gated, conv_input)``; through a `BlockGate` (in blocks of rows) when
    nothing records autograd and there are more than `SMALL_ROWS` rows."""
    T, C = key.shape
    args = (norm_key_weight, norm_query_weight, norm_conv_weight, eps, H)
    if (T <= SMALL_ROWS or torch.compiler.is_compiling()
            or records_grad(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight)):
        return _gate_block(key, value, hidden_states, *args)
    n = min(block_rows(T, C), T)
    gated, conv_input = key.new_empty(T, C), key.new_empty(T, C)
    block = BlockGate(n, key, *args)
    sums = key.new_empty(T, C // H)
    for a in range(0, T, n):
        block.score_sums(key[a:a + n], hidden_states[a:a + n], sums[a:a + n])
    g = block.gates(sums)
    for a in range(0, T, n):
        block.gate_rows(g[a:a + n], value[a:a + n], gated[a:a + n], conv_input[a:a + n])
    return gated, conv_input
