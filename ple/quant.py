"""Quantized n-gram tables: FP8 e4m3 with one per-tensor scale, int8 with one scale per row.

A quantized table keeps the model's key names: ``ple_embedding.ngram_embedding.weight``
holds the quantized values and ``ple_embedding.ngram_embedding.weight_scale`` the float32
scale(s). A row's values are ``weight[r].float() * scale``:

========  ==================  ========================  ==============================
scheme    ``weight``          ``weight_scale``          scale
========  ==================  ========================  ==============================
``fp8``   float8_e4m3fn       ``[1]`` float32           ``max|table| / 448`` (the model's
                                                        per-tensor convention)
``int8``  int8                ``[rows, 1]`` float32     ``max|row| / 127``, per row
========  ==================  ========================  ==============================

The table (``ple.table.QuantizedTable``) gathers *quantized* rows (``ple.quant.gather_raw``:
raw bytes, so any gather kernel, e.g. ``ple.fast.embedding_lookup``, moves them bit for bit)
and `dequantize_rows` turns them into the model dtype: ``(q.float() * scale).to(dtype)``,
one rounding. The reference (`reference_lookup`) dequantizes the whole table first and
then looks up; both give the same bits.

Error against the float table ``w`` (bounds asserted elementwise by `error_bound` in
``tests/test_quant.py``; measured there by ``test_error_report`` on a bfloat16
normal(0, 1) table of 4096 rows of D = 160):

* fp8 e4m3, per-tensor scale ``s``: in float32, ``|deq - w| <= 2**-4 * |w| + 2**-10 * s``
  (3 mantissa bits, round to nearest; ``2**-10 * s`` is half the subnormal step, for
  values below ``2**-6 * s``). Measured: max relative error 0.058 (bfloat16 output:
  0.061), mean 0.023.
* int8, per-row scale: ``|deq - w| <= max|row| / 254`` in float32 (half a step of
  ``max|row| / 127``). Measured: max error / max|row| 0.0039 (bfloat16 output: 0.0073,
  where the output rounding dominates), mean absolute error 0.0057.

Dequantizing to bfloat16 adds the output rounding, at most ``2**-8 * |deq|``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "Scheme", "SCHEMES", "scheme_of", "as_scheme", "quantize", "fp8_scale", "dequantize", "dequantize_rows",
    "gather_raw", "reference_lookup", "error_bound",
]


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme of the table."""

    name: str
    dtype: torch.dtype        # dtype of ``weight``
    qmax: float               # largest magnitude of a quantized value
    per_row: bool             # one scale per row (``[rows, 1]``) or one per tensor (``[1]``)


SCHEMES: dict[str, Scheme] = {
    "fp8": Scheme("fp8", torch.float8_e4m3fn, 448.0, per_row=False),
    "int8": Scheme("int8", torch.int8, 127.0, per_row=True),
}


def scheme_of(dtype: torch.dtype) -> Scheme | None:
    """The scheme whose quantized dtype is ``dtype``, or None for an unquantized (float) dtype."""
    for s in SCHEMES.values():
        if s.dtype == dtype:
            return s
    return None


def as_scheme(scheme: Scheme | str) -> Scheme:
    """A `Scheme` from itself or its name (``"fp8"``, ``"int8"``)."""
    if isinstance(scheme, Scheme):
        return scheme
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {sorted(SCHEMES)}, got {scheme!r}")
    return SCHEMES[scheme]


def fp8_scale(amax: float | torch.Tensor) -> torch.Tensor:
    """The per-tensor FP8 scale ``[1]`` float32 for a table whose largest magnitude is ``amax``."""
    amax = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    return torch.where(amax > 0, amax / SCHEMES["fp8"].qmax, torch.ones_like(amax))


def quantize(table: torch.Tensor, scheme: Scheme | str, *,
             scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float table ``[rows, D]``: returns ``(weight, weight_scale)``.

    ``fp8``: ``weight_scale`` is ``[1]``, ``max|table| / 448`` unless ``scale`` is given
    (so a table quantized in chunks, as ``python -m ple convert`` does, gets the same bits
    as when quantized whole). ``int8``: ``weight_scale`` is ``[rows, 1]``,
    ``max|row| / 127`` (1 for an all-zero row); rows are independent, so chunks never
    need a shared scale. Values are divided by the scale in float32, rounded to nearest
    and saturated at the scheme's range.
    """
    s = as_scheme(scheme)
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or not table.dtype.is_floating_point \
            or scheme_of(table.dtype) is not None:
        what = f"{table.dtype} {tuple(table.shape)}" if isinstance(table, torch.Tensor) \
            else type(table).__name__
        raise ValueError(f"table: expected a 2-D float tensor (bfloat16, float16 or float32), got {what}")
    x = table.detach().float()
    if s.per_row:
        if scale is not None:
            raise ValueError("scale: int8 scales are per row and computed from the rows; pass scale=None")
        amax = x.abs().amax(dim=1, keepdim=True) if x.shape[1] else x.new_zeros(x.shape[0], 1)
        w_scale = torch.where(amax > 0, amax / s.qmax, torch.ones_like(amax))            # [rows, 1]
        q = torch.round(x / w_scale).clamp_(-s.qmax, s.qmax).to(s.dtype)
        return q, w_scale
    if scale is None:
        scale = fp8_scale(x.abs().max() if x.numel() else 0.0)
    w_scale = torch.as_tensor(scale, dtype=torch.float32).reshape(1).to(x.device)
    q = (x / w_scale).clamp_(-s.qmax, s.qmax).to(s.dtype)
    return q, w_scale


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(weight.float() * weight_scale).to(dtype)`` for a table or a block of its rows (``[n, D]``)."""
    return (weight.float() * weight_scale.float()).to(dtype)


def dequantize_rows(rows: torch.Tensor, row_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Quantized rows ``[T, NH*D]`` and their scales (``[1]`` or ``[T, NH]``) -> ``[T, NH*D]``, ``dtype``."""
    if row_scale.dim() == 2:
        T, NH = row_scale.shape
        D = rows.shape[1] // NH if NH else 0
        return dequantize(rows.reshape(T, NH, D), row_scale[:, :, None], dtype).reshape(rows.shape)
    return dequantize(rows, row_scale, dtype)


def reference_lookup(weight: torch.Tensor, weight_scale: torch.Tensor, ids: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """The definition: dequantize the whole table, then look up ``[T, NH]`` ids -> ``[T, E]``."""
    T, NH = ids.shape
    return dequantize(weight, weight_scale, dtype)[ids.to(torch.int64)].reshape(T, NH * weight.shape[1])


def error_bound(table: torch.Tensor, scheme: Scheme | str, *,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The documented elementwise bound on ``|dequantize(quantize(table)) - table|`` (see the module doc).

    A float32 rounding allowance (``2**-22 * |w|``) is included. With ``out_dtype``
    bfloat16 / float16 the output rounding (half an ulp of the result,
    ``<= eps/2 * (|w| + bound)``) is added.
    """
    s = as_scheme(scheme)
    x = table.detach().float()
    if s.per_row:
        bound = (x.abs().amax(dim=1, keepdim=True) / 254.0).expand_as(x)
    else:
        scale = fp8_scale(x.abs().max() if x.numel() else 0.0)
        bound = 2**-4 * x.abs() + 2**-10 * scale
    bound = bound * (1 + 2**-20) + 2**-22 * x.abs() + torch.finfo(torch.float32).tiny   # float32 rounding
    if out_dtype != torch.float32:
        bound = bound + torch.finfo(out_dtype).eps / 2 * (x.abs() + bound)
    return bound


def gather_raw(weight: torch.Tensor, weight_scale: torch.Tensor | None, ids: torch.Tensor,
               lookup: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stored rows of hash ids ``[T, NH]``: ``(rows [T, NH * D] in weight's dtype, row_scale)``.

    ``lookup(table, ids)`` is an ``embedding_lookup``. A 1-byte float table (FP8) is
    gathered as its raw bytes, so any gather kernel moves it bit for bit. ``row_scale``
    is None (float table), the per-tensor ``[1]`` scale, or ``[T, NH]`` per-row scales
    gathered by the same ``lookup``. `dequantize_rows` turns both into values.
    """
    if weight.dtype.is_floating_point and weight.element_size() == 1:
        rows = lookup(weight.view(torch.uint8), ids).view(weight.dtype)
    else:
        rows = lookup(weight, ids)                                            # differentiable
    if weight_scale is not None and weight_scale.dim() == 2:                  # per row: [rows, 1]
        return rows, lookup(weight_scale, ids)                                 # [T, NH]
    return rows, weight_scale
