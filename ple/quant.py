"""Quantized n-gram tables: FP8 e4m3 with one per-tensor scale, int8 with one scale per row, and NF4, the
serving engine's 4-bit rows (a float16 scale per row times one of 16 Gaussian levels).

A quantized table keeps the model's key names: ``ple_embedding.ngram_embedding.weight``
holds the quantized values and, for FP8 and int8, ``ple_embedding.ngram_embedding.weight_scale``
the float32 scale(s). An FP8 / int8 row's values are ``weight[r].float() * scale``; an NF4 row
carries its own scale (docs/spec.md section 13):

========  ==========================  ========================  ==============================
scheme    ``weight``                  ``weight_scale``          scale
========  ==========================  ========================  ==============================
``fp8``   float8_e4m3fn ``[rows, D]`` ``[1]`` float32           ``max|table| / 448`` (the model's
                                                                per-tensor convention)
``int8``  int8 ``[rows, D]``          ``[rows, 1]`` float32     ``max|row| / 127``, per row
``nf4``   uint8 ``[rows, D/2 + 4]``   none: bytes ``D/2,        per row, ``rms(row) * f`` for the
                                      D/2+1`` of the row (a     best of 7 factors ``f`` in
                                      little-endian float16)    ``[0.85, 1.15]``
========  ==========================  ========================  ==============================

NF4 rows (``D`` even): value ``2i`` is the low nibble of byte ``i`` and value ``2i+1`` its
high nibble, each a code into `NF4_LEVELS` (the Lloyd-Max levels of a unit Gaussian, as
float32); bytes ``D/2, D/2+1`` hold the row's scale, two zero bytes end the row. A value is
``NF4_LEVELS[code] * float(scale)`` in float32, rounded once to the output dtype. The
quantizer (`quantize`) tries the scales ``float16(rms * f)`` for ``f = 0.85, 0.90, ..., 1.15`` in
that order, codes each value by the first of the 15 midpoints between the levels that is
``>= w / scale`` (``torch.bucketize``) and keeps the scale of smallest squared error, the earlier
one on a tie. ``rms`` is ``max(sqrt(mean(w * w)), 1e-12)`` in float32, the mean of the float32
squares accumulated in float64 and rounded once to float32, the square root correctly rounded
(torch's own float32 sqrt is not, on the CPU), and each candidate's error is the
float64 sum of its float32 terms ``(level[code] * scale - w)^2``, so neither depends on a device's
reduction order. A table whose values are not finite, or a row whose scale overflows float16
(``rms * 0.85 >= 65520``, i.e. rms above about 77,000), is a ``ValueError``: NF4 cannot hold it.
`nf4_pack` / `nf4_unpack` convert between the rows and ``(codes, scale)``.

The table (``ple.table.QuantizedTable``) gathers *quantized* rows (``ple.quant.gather_raw``:
raw bytes, so any gather kernel, e.g. ``ple.fast.embedding_lookup``, moves them bit for bit)
and `dequantize_rows` turns them into the model dtype: ``(q.float() * scale).to(dtype)``,
one rounding; for NF4 rows, only the rows gathered are unpacked. The reference
(`reference_lookup`) dequantizes the whole table first and then looks up; both give the same
bits. NF4 has two unpackers that give the same bits: this module's (`dequantize`,
`dequantize_rows`), vectorised (each byte indexes a table of its two levels), used by the
``"torch"`` and ``"triton"`` backends, and ``ple.reference.nf4_dequantize_rows``, written to be
read (nibbles, level table, scale), used by the ``"reference"`` backend.

Error against the float table ``w`` (bounds asserted elementwise by `error_bound` in
``tests/test_quant.py`` and ``tests/test_nf4.py``; measured there by ``test_error_report`` on a
bfloat16 normal(0, 1) table of 4096 rows of D = 160):

* fp8 e4m3, per-tensor scale ``s``: in float32, ``|deq - w| <= 2**-4 * |w| + 2**-10 * s``
  (3 mantissa bits, round to nearest; ``2**-10 * s`` is half the subnormal step, for
  values below ``2**-6 * s``). Measured: max relative error 0.058 (bfloat16 output:
  0.061), mean 0.023.
* int8, per-row scale: ``|deq - w| <= max|row| / 254`` in float32 (half a step of
  ``max|row| / 127``). Measured: max error / max|row| 0.0039 (bfloat16 output: 0.0073,
  where the output rounding dominates), mean absolute error 0.0057.
* nf4, per-row scale ``s`` in ``[0.85, 1.15] * rms(row)`` (up to float16 rounding):
  ``|deq - w| <= 0.3318 * s_max + max(0, |w| - 2.7326 * s_min)`` in float32, with
  ``s_max = 1.15 * rms * (1 + 2**-11) + 2**-25`` and ``s_min = max(0, 0.85 * rms * (1 - 2**-11) - 2**-25)``
  (0.3318 is half the widest gap between two levels, 2.0690 .. 2.7326; a value beyond the top
  level is clipped to it). Measured (float32 output; bfloat16 alike): root mean square error /
  rms(row) 0.091, mean absolute error 0.075; the largest errors are the clipped tails of the rows:
  max error 1.31, 1.27 * rms(row), at most 0.83 of the bound. Worst case: a row of one spike among
  zeros keeps at most ``2.7326 * s_max``, about ``3.14 * |spike| / sqrt(D)``, of the spike, so at
  D = 160 the spike loses at least 75% of its value (measured: 0.75 * |spike|, bound 0.85); NF4
  clips outliers.

Dequantizing to bfloat16 adds the output rounding, at most ``2**-8 * |deq|``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "Scheme", "SCHEMES", "scheme_of", "as_scheme", "quantize", "fp8_scale", "dequantize", "dequantize_rows",
    "gather_raw", "reference_lookup", "error_bound", "NF4_LEVELS", "nf4_pack", "nf4_unpack",
]


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme of the table.

    ``packed`` (NF4): the codes and each row's scale share one uint8 row of `weight_width` bytes,
    and there is no ``weight_scale``; ``per_row`` is then True (one scale a row) but the scales
    are in the rows.
    """

    name: str
    dtype: torch.dtype        # dtype of ``weight``
    qmax: float               # largest magnitude of a quantized value
    per_row: bool             # one scale per row (``[rows, 1]``) or one per tensor (``[1]``)
    packed: bool = False      # rows of codes and scale in one uint8 row (NF4), no ``weight_scale``

    def weight_width(self, dim: int) -> int:
        """Columns of ``weight`` for rows of ``dim`` values: ``dim``, or ``dim / 2 + 4`` bytes for NF4.

        A packed (NF4) row needs an even ``dim`` of at least 2: else a ``ValueError`` naming ``dim``.
        """
        if not self.packed:
            return dim
        if dim < 2 or dim % 2:
            raise ValueError(f"dim: an {self.name} row holds an even number of values (two a byte), at least 2; "
                             f"got {dim}")
        return dim // 2 + 4

    def dim_of(self, width: int) -> int:
        """Values per row of a ``weight`` of ``width`` columns (the inverse of `weight_width`)."""
        return 2 * (width - 4) if self.packed else width


NF4_LEVELS = torch.tensor([-2.7326, -2.0690, -1.6181, -1.2562, -0.9424, -0.6568, -0.3881, -0.1284,
                           0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326], dtype=torch.float32)
"""The 16 NF4 levels, code 0..15 (Lloyd-Max levels of a unit Gaussian), as float32 (docs/spec.md section 13)."""

_NF4_FACTORS = (0.85, 0.90, 0.95, 1.00, 1.05, 1.10, 1.15)    # candidate scales rms * f, tried in this order
_NF4_RMS_FLOOR = 1e-12
_NF4_BLOCK_ROWS = 8192                                       # rows quantized at a time (bounded memory)

SCHEMES: dict[str, Scheme] = {
    "fp8": Scheme("fp8", torch.float8_e4m3fn, 448.0, per_row=False),
    "int8": Scheme("int8", torch.int8, 127.0, per_row=True),
    "nf4": Scheme("nf4", torch.uint8, float(NF4_LEVELS[-1]), per_row=True, packed=True),
}


def scheme_of(dtype: torch.dtype) -> Scheme | None:
    """The scheme whose quantized dtype is ``dtype``, or None for an unquantized (float) dtype."""
    for s in SCHEMES.values():
        if s.dtype == dtype:
            return s
    return None


def as_scheme(scheme: Scheme | str) -> Scheme:
    """A `Scheme` from itself or its name (``"fp8"``, ``"int8"``, ``"nf4"``)."""
    if isinstance(scheme, Scheme):
        return scheme
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {sorted(SCHEMES)}, got {scheme!r}")
    return SCHEMES[scheme]


def fp8_scale(amax: float | torch.Tensor) -> torch.Tensor:
    """The per-tensor FP8 scale ``[1]`` float32 for a table whose largest magnitude is ``amax``."""
    amax = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    return torch.where(amax > 0, amax / SCHEMES["fp8"].qmax, torch.ones_like(amax))


def _check_float_table(table: object) -> torch.Tensor:
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or not table.dtype.is_floating_point \
            or scheme_of(table.dtype) is not None:
        what = f"{table.dtype} {tuple(table.shape)}" if isinstance(table, torch.Tensor) \
            else type(table).__name__
        raise ValueError(f"table: expected a 2-D float tensor (bfloat16, float16 or float32), got {what}")
    return table


def quantize(table: torch.Tensor, scheme: Scheme | str, *,
             scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize a float table ``[rows, D]``: returns ``(weight, weight_scale)``.

    ``fp8``: ``weight_scale`` is ``[1]``, ``max|table| / 448`` unless ``scale`` is given
    (so a table quantized in chunks, as ``python -m ple convert`` does, gets the same bits
    as when quantized whole). ``int8``: ``weight_scale`` is ``[rows, 1]``,
    ``max|row| / 127`` (1 for an all-zero row); rows are independent, so chunks never
    need a shared scale. Values are divided by the scale in float32, rounded to nearest
    and saturated at the scheme's range.

    ``nf4``: ``weight`` is uint8 ``[rows, D/2 + 4]`` and ``weight_scale`` is None (each row
    holds its float16 scale); rows are independent. The rule is the module docstring's
    (docs/spec.md section 13). ``D`` must be even (at least 2), the values finite and no row's
    scale may overflow float16: else a ``ValueError`` naming ``table``.
    """
    s = as_scheme(scheme)
    _check_float_table(table)
    x = table.detach().float()
    if s.packed:
        if scale is not None:
            raise ValueError("scale: NF4 scales are per row and computed from the rows; pass scale=None")
        return _nf4_quantize(x), None
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


# ---- NF4 -----------------------------------------------------------------------------------------------
@functools.cache
def _nf4_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(levels [16], midpoints [15], byte pairs [256, 2], factors [7])``, float32 on ``device``.

    The midpoints are ``(level[i] + level[i+1]) / 2`` in float32; byte ``b``'s pair is
    ``(level[b & 15], level[b >> 4])``, its two values in order.
    """
    levels = NF4_LEVELS.to(device)
    mids = (levels[:-1] + levels[1:]) / 2
    b = torch.arange(256, device=device)
    pairs = torch.stack([levels[b & 15], levels[b >> 4]], dim=1)
    factors = torch.tensor(_NF4_FACTORS, dtype=torch.float32, device=device)
    return levels, mids, pairs, factors


def _nf4_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` float32 ``[n, D]`` (finite) -> ``(codes uint8 [n, D], scale float16 [n])``, the NF4 rule."""
    levels, mids, _, factors = _nf4_constants(x.device)
    D = x.shape[1]
    mean_sq = ((x * x).sum(dim=1, dtype=torch.float64) / D).float()       # float32 squares, a float64 sum
    # The float32 square root, correctly rounded: taken in float64, then rounded to float32 (exact for a sqrt of
    # a float32). torch's float32 sqrt on the CPU (Sleef) is off by one ulp for some inputs.
    rms = torch.clamp_min(mean_sq.double().sqrt().float(), _NF4_RMS_FLOOR)
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None      # (err, scale, codes)
    for f in factors:
        scale = (rms * f).to(torch.float16)                                  # the candidate, float16
        s = scale.float()[:, None]                                           # read back as float32
        codes = torch.bucketize(x / s, mids)                                 # first midpoint >= w / s
        d = levels[codes] * s - x
        err = (d * d).sum(dim=1, dtype=torch.float64)
        if best is None:
            best = err, scale, codes
            continue
        better = err < best[0]                                               # strict: the earlier on a tie
        best = (torch.where(better, err, best[0]), torch.where(better, scale, best[1]),
                torch.where(better[:, None], codes, best[2]))
    assert best is not None
    _, best_scale, best_codes = best
    return best_codes.to(torch.uint8), best_scale


def _nf4_quantize(x: torch.Tensor) -> torch.Tensor:
    """A float32 table ``[rows, D]`` -> NF4 ``weight`` uint8 ``[rows, D/2 + 4]``, block by block."""
    rows, D = x.shape
    if D < 2 or D % 2:
        raise ValueError(f"table: NF4 packs two values a byte, so D must be even (at least 2); got D = {D}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("table: NF4 cannot hold NaN or infinite values; the table has some")
    out = torch.empty(rows, D // 2 + 4, dtype=torch.uint8, device=x.device)
    for a in range(0, rows, _NF4_BLOCK_ROWS):
        b = min(a + _NF4_BLOCK_ROWS, rows)
        codes, scale = _nf4_codes(x[a:b])
        bad = torch.isinf(scale).nonzero()
        if bad.numel():
            r = a + int(bad[0])
            raise ValueError(f"table: row {r}'s NF4 scale overflows float16 (its rms * 0.85 is past 65504, "
                             f"the largest float16); NF4 holds rows of rms up to about 77,000")
        out[a:b] = nf4_pack(codes, scale)
    return out


def nf4_pack(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """NF4 rows from codes uint8 ``[n, D]`` (each in ``[0, 16)``, ``D`` even) and scales float16 ``[n]``.

    Returns uint8 ``[n, D/2 + 4]``: value ``2i`` in the low nibble of byte ``i``, value ``2i+1``
    in its high nibble; bytes ``D/2, D/2+1`` the scale (little-endian float16); two zero bytes.
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() != 2 \
            or codes.shape[1] % 2:
        what = f"{codes.dtype} {tuple(codes.shape)}" if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise ValueError(f"codes: expected uint8 [n, D] with D even, got {what}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes: expected values in [0, 16) (4 bits), got up to {int(codes.max())}")
    n, D = codes.shape
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float16 or tuple(scale.shape) != (n,):
        what = f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"scale: expected float16 [{n}] (one scale per row of codes), got {what}")
    out = torch.zeros(n, D // 2 + 4, dtype=torch.uint8, device=codes.device)
    out[:, :D // 2] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    bits = scale.view(torch.int16).to(torch.int32) & 0xFFFF                    # the float16's 16 bits
    out[:, D // 2] = (bits & 0xFF).to(torch.uint8)                             # little-endian: low byte first
    out[:, D // 2 + 1] = (bits >> 8).to(torch.uint8)
    return out


def _check_nf4(name: str, weight: object) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.uint8 or weight.dim() != 2 \
            or weight.shape[1] < 5:
        what = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{name}: expected NF4 rows, uint8 [n, D/2 + 4] with D >= 2 even, got {what}")
    return weight


def nf4_unpack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 rows uint8 ``[n, D/2 + 4]`` -> ``(codes uint8 [n, D], scale float16 [n])`` (`nf4_pack` undone)."""
    _check_nf4("weight", weight)
    n, W = weight.shape
    half = W - 4                                                               # D / 2
    b = weight[:, :half]
    codes = torch.stack([b & 15, b >> 4], dim=2).reshape(n, 2 * half)
    return codes, _nf4_scale(weight)


def _nf4_scale(weight: torch.Tensor) -> torch.Tensor:
    """The float16 scales ``[n]`` of NF4 rows ``[n, D/2 + 4]``: bytes ``D/2`` (low) and ``D/2 + 1`` (high)."""
    half = weight.shape[1] - 4
    bits = weight[:, half].to(torch.int32) | (weight[:, half + 1].to(torch.int32) << 8)
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.float16)     # unsigned 16 bits -> int16


def _nf4_values(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """NF4 rows uint8 ``[n, D/2 + 4]`` -> ``[n, D]`` in ``dtype``: ``level[code] * float(scale)`` in float32.

    Vectorised: each code byte indexes a table of its two levels (``[256, 2]``).
    """
    n, W = weight.shape
    half = W - 4
    _, _, pairs, _ = _nf4_constants(weight.device)
    values = F.embedding(weight[:, :half].to(torch.int32), pairs).reshape(n, 2 * half)   # [n, D] levels
    return (values * _nf4_scale(weight).float()[:, None]).to(dtype)


# ---- dequantization and lookups ----------------------------------------------------------------------
def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``(weight.float() * weight_scale).to(dtype)`` for a table or a block of its rows (``[n, D]``).

    NF4 (``weight`` uint8 ``[n, D/2 + 4]``, ``weight_scale`` None): ``[n, D]``,
    ``NF4_LEVELS[code] * float(scale)`` in float32, then ``.to(dtype)``.
    """
    if isinstance(weight, torch.Tensor) and weight.dtype == torch.uint8:
        if weight_scale is not None:
            raise ValueError("weight_scale: an NF4 table has none (each row holds its scale); pass None")
        return _nf4_values(_check_nf4("weight", weight), dtype)
    if weight_scale is None:
        raise ValueError("weight_scale: expected the float32 scale(s) of an fp8 / int8 table, got None")
    return (weight.float() * weight_scale.float()).to(dtype)


def dequantize_rows(rows: torch.Tensor, row_scale: torch.Tensor | None, dtype: torch.dtype, *,
                    dim: int | None = None) -> torch.Tensor:
    """Quantized rows ``[T, NH*D]`` and their scales (``[1]`` or ``[T, NH]``) -> ``[T, NH*D]``, ``dtype``.

    NF4 rows (uint8 ``[T, NH * (D/2 + 4)]``, ``row_scale`` None) need ``dim`` = D and give
    ``[T, NH * D]``; only these rows are unpacked (vectorised; ``ple.reference.nf4_dequantize_rows``
    is the readable twin, bit for bit).
    """
    if rows.dtype == torch.uint8:
        if row_scale is not None:
            raise ValueError("row_scale: NF4 rows hold their scales; pass None")
        if dim is None:
            raise ValueError("dim: NF4 rows need the table's row width D (its rows are D/2 + 4 bytes)")
        W = SCHEMES["nf4"].weight_width(dim)
        T = rows.shape[0]
        if rows.dim() != 2 or rows.shape[1] % W:
            raise ValueError(f"rows: expected uint8 [T, NH * {W}] (NF4 rows of D = {dim}), got "
                             f"{tuple(rows.shape)}")
        NH = rows.shape[1] // W
        return _nf4_values(rows.reshape(T * NH, W), dtype).reshape(T, NH * dim)
    if row_scale is None:
        raise ValueError("row_scale: expected the scale(s) of fp8 / int8 rows, got None")
    if row_scale.dim() == 2:
        T, NH = row_scale.shape
        D = rows.shape[1] // NH if NH else 0
        return dequantize(rows.reshape(T, NH, D), row_scale[:, :, None], dtype).reshape(rows.shape)
    return dequantize(rows, row_scale, dtype)


def reference_lookup(weight: torch.Tensor, weight_scale: torch.Tensor | None, ids: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """The definition: dequantize the whole table, then look up ``[T, NH]`` ids -> ``[T, E]``."""
    T, NH = ids.shape
    table = dequantize(weight, weight_scale, dtype)
    return table[ids.to(torch.int64)].reshape(T, NH * table.shape[1])


def error_bound(table: torch.Tensor, scheme: Scheme | str, *,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The documented elementwise bound on ``|dequantize(quantize(table)) - table|`` (see the module doc).

    A float32 rounding allowance (``2**-22 * |w|``) is included. With ``out_dtype``
    bfloat16 / float16 the output rounding (half an ulp of the result,
    ``<= eps/2 * (|w| + bound)``) is added. NF4: ``table``'s D must be even (a ``ValueError``
    naming ``table``).
    """
    s = as_scheme(scheme)
    x = table.detach().float()
    if s.packed:
        _check_float_table(table)
        if x.shape[1] < 2 or x.shape[1] % 2:
            raise ValueError(f"table: NF4 packs two values a byte, so D must be even (at least 2); got "
                             f"D = {x.shape[1]}")
        rms = x.double().square().mean(dim=1, keepdim=True).sqrt().clamp_min(_NF4_RMS_FLOOR)
        s_max = 1.15 * rms * (1 + 2**-11) * (1 + 2**-20) + 2**-25
        s_min = (0.85 * rms * (1 - 2**-11) * (1 - 2**-20) - 2**-25).clamp_min(0)
        gap = float(NF4_LEVELS[-1] - NF4_LEVELS[-2]) / 2                           # 0.3318, the widest half gap
        top = float(NF4_LEVELS[-1])
        bound = (gap * s_max + (x.double().abs() - top * s_min).clamp_min(0)).float()
    elif s.per_row:
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
    gathered by the same ``lookup``. An NF4 table's rows are its packed uint8 rows,
    ``[T, NH * (D/2 + 4)]``, with ``row_scale`` None (the scales travel in them).
    `dequantize_rows` turns both into values.
    """
    if weight.dtype.is_floating_point and weight.element_size() == 1:
        rows = lookup(weight.view(torch.uint8), ids).view(weight.dtype)
    else:
        rows = lookup(weight, ids)                                            # differentiable
    if weight_scale is not None and weight_scale.dim() == 2:                  # per row: [rows, 1]
        return rows, lookup(weight_scale, ids)                                 # [T, NH]
    return rows, weight_scale
