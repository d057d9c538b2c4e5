"""Grouped RMS norms and the signed-sqrt gate (docs/spec.md section 4), with the reference's rounding points.

The ops and their order are the reference's (``ple.reference.gate``), so results are the same bit
for bit in every dtype; what differs is how many passes over ``[T, C]`` they take and how large
their temporaries are:

* a norm is ``xf = x.to(acc)``, ``xf * xf``, the group sum (``sum(-1)``, the kernel ``mean`` runs on
  the CPU, then the same division by ``H``), ``xf * r``, ``* (1 + w)`` (``* w`` with ``unit_offset=False``,
  the Engram family), the cast to the input dtype: no ``pow``, no mixed-dtype op (``bf16 * fp32`` takes an
  unvectorised path on the CPU, ~10x slower);
* the score's product ``kn * qn`` (rounded to the model dtype) is made once and summed in float32;
* the gated value is one broadcast product ``g[:, :, None] * value[:, None, :]``.

Two paths (`gate` chooses; ``ple/vectorized/__init__.py`` has the measurements):

* `_gate_whole_batch`, the general one: each op once over all rows (autograd, ``torch.compile``, any
  device);
* `BlockGate`, on the CPU when nothing records autograd or compiles and the rows fill more than one
  block: the rows in blocks of `BLOCK_ROWS`, every float32 temporary a buffer reused from block to
  block (~512 KiB at C = 2048) that stays in the core's cache, where a whole-batch one (16 MiB at
  T = C = 2048) streams through memory on every op. Blocks change no bit (every reduction is within
  a token). ``prefill``'s blocked forward runs on it too.
"""

from __future__ import annotations

import math

import torch

from .. import _checks
from .. import reference as _reference
from .._deprecation import MARKER, Deprecation, deprecated_function, deprecated_parameter, warn_deprecated
from ..backends import twin
from ..reference.gate import GATE_CLAMP, acc_dtype

__all__ = ["ple_gate", "gate", "takes_block_gate_path", "stream_scores", "records_grad", "BLOCK_ROWS", "BlockGate",
           "takes_blocked_path", "grouped_rms_norm", "block_rows"]

BLOCK_ROWS = 64
"""Rows per block of the blocked CPU paths (`BlockGate`, ``prefill``'s blocked forward).

Measured on a 2 MiB-L2 CPU at C = 2048: 64-row blocks (a float32 ``[64, C]`` temporary is 512 KiB)
beat 128 and 256 (temporaries spill) and 32 (per-op overhead). A multiple of 64 keeps every block's
elements on the vector lanes they have in the whole tensor: ATen's CPU loops run the last
``numel % (2 * lanes)`` elements through scalar code, whose ``exp`` (``sigmoid``, ``silu``) may differ
from the vector one in the last float32 bit, so a block with its own scalar tail would not be the
unblocked op bit for bit.
"""


def records_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records an op on ``tensors`` (then only out-of-place ops are used)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float, *,
                      out: torch.Tensor | None = None, unit_offset: bool = True) -> torch.Tensor:
    """``ple.reference.grouped_rms_norm`` of a ``[T, C]`` ``x``, unchecked, bit for bit (see the module docstring).

    ``out`` (``[T, C]``, ``x``'s dtype; not with autograd), if given, receives the result and is returned.
    ``unit_offset``: the scale is ``1 + w`` (True) or ``w`` (False), as the reference's.
    """
    acc = acc_dtype(x.dtype)
    T, C = x.shape
    H = group_size
    xf = x.to(acc).reshape(T, C // H, H)
    r = torch.rsqrt((xf * xf).sum(-1, keepdim=True) / H + eps)       # = rsqrt(mean(x^2) + eps): mean is sum / H
    y = ((xf * r).reshape(T, C) * _scale(weight, acc, unit_offset)).to(x.dtype)
    return y if out is None else out.copy_(y)


def _scale(weight: torch.Tensor, acc: torch.dtype, unit_offset: bool) -> torch.Tensor:
    """A norm's scale in the accumulation dtype: ``1 + w`` (``unit_offset``, Qwen4Exp) or ``w`` (Engram)."""
    return 1.0 + weight.to(acc) if unit_offset else weight.to(acc)


def stream_scores(key: torch.Tensor, hidden_states: torch.Tensor, norm_key_weight: torch.Tensor,
                  norm_query_weight: torch.Tensor, group_size: int, eps: float, *,
                  unit_offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, g)``, ``[T, M]`` in the input dtype: ``ple.reference.gate.stream_scores``, bit for bit."""
    H = group_size
    dt = key.dtype
    T, C = key.shape
    kn = _grouped_rms_norm(key, norm_key_weight, H, eps, unit_offset=unit_offset).view(T, C // H, H)
    qn = _grouped_rms_norm(hidden_states, norm_query_weight, H, eps, unit_offset=unit_offset).view(T, C // H, H)
    prod = kn * qn                                                  # rounded to the model dtype, as the model
    s = prod.to(acc_dtype(dt)).sum(-1).to(dt)                       # sum in float32 (= sum(dtype=float32))
    s = s / math.sqrt(H)
    mag = s.abs().clamp_min(GATE_CLAMP).sqrt()
    return s, torch.sigmoid(mag * s.sign())


@twin(_reference.ple_gate)
def ple_gate(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
             norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor,
             norm_conv_weight: torch.Tensor, eps: float, *, conv_eps: float | None = None,
             unit_offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Two paths with the reference's ops, in its order and with its rounding points: ``gate.BlockGate`` on
    the CPU, eagerly, with nothing recording autograd and more rows than ``gate.BLOCK_ROWS`` (the rows in
    blocks, every temporary a buffer reused from block to block), else ``gate._gate_whole_batch`` (each
    op once over all rows: autograd, ``torch.compile``, any device). The norms widen ``x`` and ``1 + w``
    (or ``w``; the weights in any float dtype) to the accumulation dtype and use no ``pow`` and no
    mixed-dtype op. The gate has no value checks, so it never reads a tensor value on the host."""
    H = _checks.gate_call(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight,
                          eps, conv_eps=conv_eps, unit_offset=unit_offset).group_size
    return gate(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps, H,
                conv_eps=conv_eps, unit_offset=unit_offset)


def _gate_whole_batch(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
                      hidden_size, conv_eps=None, unit_offset=True):
    """The general gate: each op once over all rows (autograd records, ``torch.compile`` traces, any device)."""
    H = hidden_size
    T, C = key.shape
    g = stream_scores(key, hidden_states, norm_key_weight, norm_query_weight, H, eps, unit_offset=unit_offset)[1]
    gated = (g[:, :, None] * value[:, None, :]).view(T, C)
    return gated, _grouped_rms_norm(gated, norm_conv_weight, H, eps if conv_eps is None else conv_eps,
                                    unit_offset=unit_offset)


class BlockGate:
    """The gate of a blocked op, in two passes over blocks of at most ``n`` rows, into scratch buffers it reuses.

    Same ops, same rounding points as `_gate_whole_batch` (so the same bits); what it saves is allocation,
    passes and small ops: every temporary is a buffer of this object, which stays in cache from block
    to block; the norms' scales (``1 + w``, or ``w``) are made once per call, not per block; a float32 call widens
    nothing; and the score's ops on ``[T, M]`` (the division by sqrt(H), the signed square root,
    the sigmoid) run once over all rows (`gates`) between the block pass that makes the scores
    (`score_sums`) and the one that uses the gates (`gate_rows`), instead of once per block.
    """

    @deprecated_parameter("H", "hidden_size", since="0.1.0")
    def __init__(self, n: int, like: torch.Tensor, norm_key_weight: torch.Tensor,
                 norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor, eps: float,
                 hidden_size: int, conv_eps: float | None = None, unit_offset: bool = True) -> None:
        C = like.shape[1]
        self.dt, self.acc, self.H, self.eps = like.dtype, acc_dtype(like.dtype), hidden_size, eps
        self.conv_eps = eps if conv_eps is None else conv_eps
        acc = self.acc
        wide = acc != self.dt
        self.x = like.new_empty(n, C, dtype=acc) if wide else None     # an input, widened
        self.sq2 = like.new_empty(2, n, C, dtype=acc)                  # squares, then the scaled norms
        self.kq = like.new_empty(2, n, C) if wide else self.sq2        # the two norms, rounded
        self.prod = like.new_empty(n, C)
        self.sq = like.new_empty(n, C, dtype=acc) if wide else None    # the conv norm's squares
        self.scales = [_scale(w, acc, unit_offset) for w in (norm_key_weight, norm_query_weight, norm_conv_weight)]

    def _norm(self, x: torch.Tensor, sq: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
              eps: float) -> torch.Tensor:
        """`_grouped_rms_norm`'s ops on ``x`` (``[m, C]``, the acc dtype) with ``sq`` as scratch; into ``out``."""
        H = self.H
        g = x.unflatten(-1, (-1, H))
        sqg = torch.mul(g, g, out=sq.unflatten(-1, (-1, H)))
        r = sqg.sum(-1, keepdim=True).div_(H).add_(eps).rsqrt_()        # = rsqrt(mean(x^2) + eps)
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
            self._norm(self._widen(src), sq[i], self.scales[i], kq[i], self.eps)
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
        self._norm(self._widen(gated), sq, self.scales[2], conv_input, self.conv_eps)


def takes_block_gate_path(key: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether `gate` runs a `BlockGate`: on the CPU, eagerly, nothing recording autograd, and more rows than one
    block (`BLOCK_ROWS`) holds (up to one block the whole-batch ops are as fast; see the module docstring)."""
    return (key.shape[0] > BLOCK_ROWS and key.device.type == "cpu" and not torch.compiler.is_compiling()
            and not records_grad(key, *tensors))


@deprecated_parameter("H", "hidden_size", since="0.1.0")
def gate(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor, norm_key_weight: torch.Tensor,
         norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor, eps: float,
         hidden_size: int, *, conv_eps: float | None = None,
         unit_offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`ple_gate` after its checks: ``(gated, conv_input)``; through a `BlockGate` where `takes_block_gate_path`,
    else `_gate_whole_batch`."""
    H = hidden_size
    T, C = key.shape
    args = (norm_key_weight, norm_query_weight, norm_conv_weight, eps, H)
    if not takes_block_gate_path(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight):
        return _gate_whole_batch(key, value, hidden_states, *args, conv_eps, unit_offset)
    n = BLOCK_ROWS
    gated, conv_input = key.new_empty(T, C), key.new_empty(T, C)
    block = BlockGate(n, key, *args, conv_eps, unit_offset)
    sums = key.new_empty(T, C // H)
    for a in range(0, T, n):
        block.score_sums(key[a:a + n], hidden_states[a:a + n], sums[a:a + n])
    g = block.gates(sums)
    for a in range(0, T, n):
        block.gate_rows(g[a:a + n], value[a:a + n], gated[a:a + n], conv_input[a:a + n])
    return gated, conv_input



def block_rows(T: int, C: int) -> int:
    """Deprecated since 0.1.0 (blocks are `BLOCK_ROWS` rows at every width now); kept for one release:
    ``T`` under ``torch.compile`` (one block), else `BLOCK_ROWS`."""
    warn_deprecated("ple.vectorized.gate.block_rows", "ple.vectorized.gate.BLOCK_ROWS", "0.1.0")
    return max(T, 1) if torch.compiler.is_compiling() else BLOCK_ROWS


setattr(block_rows, MARKER, (Deprecation("function", "block_rows", "BLOCK_ROWS", "0.1.0"),))


takes_blocked_path = deprecated_function(takes_block_gate_path, "takes_blocked_path", since="0.1.0")
"""Deprecated since 0.1.0 (``ple.vectorized.prefill.takes_blocked_path`` was another function):
`takes_block_gate_path`."""


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Deprecated since 0.1.0 (it shared its name with the checked op ``ple.vectorized.grouped_rms_norm``);
    kept for one release: the internal `_grouped_rms_norm`, unchecked, ``[T, C]`` only."""
    warn_deprecated("ple.vectorized.gate.grouped_rms_norm", "ple.vectorized.grouped_rms_norm", "0.1.0")
    return _grouped_rms_norm(x, weight, group_size, eps, out=out)


setattr(grouped_rms_norm, MARKER,
        (Deprecation("function", "grouped_rms_norm", "ple.vectorized.grouped_rms_norm", "0.1.0"),))
