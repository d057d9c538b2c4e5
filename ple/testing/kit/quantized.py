"""Quantized tables in the lookup checks (docs/spec.md section 13): what a table hands the user's gather.

A quantized table (``ple.table.QuantizedTable``) gathers its *stored* rows with the backend's
``embedding_lookup`` and turns only the rows gathered into values (``ple.quant.gather_raw``), so a
user's gather gets, beside float tables:

* ``"fp8"``: the float8_e4m3fn ``[rows, D]`` table as its raw bytes, uint8 ``[rows, D]`` (its scale
  is one float32 for the table, never gathered);
* ``"int8"``: the int8 ``[rows, D]`` table, and, by the same op, its float32 ``[rows, 1]`` row scales;
* ``"nf4"``: the packed uint8 ``[rows, D/2 + 4]`` rows: the 4-bit codes (value ``2i`` in the low
  nibble of byte ``i``), the row's float16 scale (little-endian) and two zero bytes.

Each must come back as a copy: ``[T, NH * width]`` in the stored dtype. `quantized_table` builds a
table of a scheme (rows of many magnitudes, some all zero) and `check_quantized` judges what the
user's op returned for it, in this order: the shape and dtype (a message saying the row width it
expects), the gathered int8 row scales, the values the rows stand for in each output dtype (unpacked
by the reference's rule, ``ple.reference.nf4_dequantize_rows`` for NF4, ``(q.float() * scale).to(dtype)``
otherwise) against the whole table dequantized and then looked up, and last the bytes themselves,
an NF4 row's padding included, all bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ... import _checks, quant
from ... import reference as ref
from ._report import compare_bits, fmt_case

__all__ = ["SCHEMES", "QuantTable", "as_schemes", "quantized_table", "check_quantized"]

SCHEMES = ("fp8", "int8", "nf4")
"""The quantized table schemes the lookup checks draw by default (``ple.quant.SCHEMES``)."""


def as_schemes(schemes: Sequence[str]) -> tuple[str, ...]:
    """``schemes`` checked: a sequence of names of `SCHEMES` (none at all: float tables only); not a sequence of
    strings (a single ``"nf4"`` too) is a ``TypeError``, an unknown name a ``ValueError``."""
    return _checks.choices_arg("schemes", schemes, SCHEMES, allow_empty=True)


def even_dim(dim: int) -> int:
    """``dim`` (D) made a width NF4 holds (two values a byte): rounded down to even, at least 2."""
    return max(2, dim - dim % 2)


@dataclass(frozen=True)
class QuantTable:
    """A quantized table as a user's gather sees it: ``stored`` (uint8 / int8 ``[rows, width]``, what
    the table passes to ``embedding_lookup``), ``scale`` (fp8: ``[1]``, int8: ``[rows, 1]`` float32,
    nf4: None) and ``dim`` (D, the values per row)."""

    scheme: str
    stored: torch.Tensor
    scale: torch.Tensor | None
    dim: int

    def unpack(self, rows: torch.Tensor, row_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows ``[n, k * width]`` (and int8's ``[n, k]`` row scales) -> their values ``[n, k * D]``."""
        if self.scheme == "nf4":
            return ref.nf4_dequantize_rows(rows, self.dim, dtype)           # the reference's own unpacker
        if self.scheme == "fp8":
            return quant.dequantize_rows(rows.view(torch.float8_e4m3fn), self.scale, dtype)
        return quant.dequantize_rows(rows, row_scale, dtype)

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole table dequantized, ``[rows, D]`` in ``dtype``."""
        return self.unpack(self.stored, self.scale, dtype)

    def gather(self, lookup: Callable[..., torch.Tensor], ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(rows, row_scale)`` of ``ids`` ``[T, NH]`` as the table gathers them with ``lookup`` (an
        ``embedding_lookup``): the stored rows, and for int8 the row scales ``[T, NH]`` too."""
        rows = lookup(self.stored, ids)
        return rows, (lookup(self.scale, ids) if self.scheme == "int8" else None)


def quantized_table(scheme: str, rows: int, dim: int, g: torch.Generator, *, strided: bool = False) -> QuantTable:
    """A ``scheme`` table of ``rows`` rows of ``dim`` values (NF4: ``dim`` even) whose rows span
    magnitudes ``2**-8 .. 2**7``, about one row in eight all zero. FP8 and int8: ``ple.quant.quantize``
    of normal draws (a zero int8 row has scale 1). NF4: rows packed by ``ple.quant.nf4_pack`` from
    codes drawn uniformly (every nibble) and positive float16 scales; a zero row is what the quantizer
    stores for one, scale 0 and codes 15 (bytes ``0xFF``). ``strided``: the stored table is the first
    ``width`` columns of a buffer two columns wider, filled beyond with ``0xEE`` bytes a gather must
    not read."""
    magnitude = torch.exp2(torch.randint(-8, 8, (rows, 1), generator=g).double())
    zero = torch.rand(rows, generator=g) < 0.125
    if scheme == "nf4":
        codes = torch.randint(0, 16, (rows, dim), generator=g, dtype=torch.uint8)
        codes[zero] = 15
        scale = (magnitude[:, 0] * (0.5 + torch.rand(rows, generator=g, dtype=torch.float64))).to(torch.float16)
        stored, table_scale = quant.nf4_pack(codes, torch.where(zero, 0.0, scale).to(torch.float16)), None
    else:
        x = torch.randn((rows, dim), generator=g, dtype=torch.float64) * magnitude
        x[zero] = 0.0
        weight, table_scale = quant.quantize(x.float(), scheme)
        stored = weight.view(torch.uint8) if weight.dtype.is_floating_point else weight   # fp8: its raw bytes
    if strided:
        buf = torch.full((rows, stored.shape[1] + 2), 0xEE, dtype=torch.uint8).view(stored.dtype)
        buf[:, :stored.shape[1]] = stored
        stored = buf[:, :stored.shape[1]]
    return QuantTable(scheme, stored, table_scale, dim)


def _byte_of(table: QuantTable, b: int) -> str:
    """What byte ``b`` of a stored row holds."""
    if table.scheme != "nf4":
        return f"column {b}"
    half = table.dim // 2
    if b < half:
        return f"byte {b} (the codes of values {2 * b} and {2 * b + 1})"
    return f"byte {b} ({['the scale, low byte', 'the scale, high byte', 'padding', 'padding'][b - half]})"


def _layout(table: QuantTable, num_heads: int) -> str:
    W = table.stored.shape[1]
    if table.scheme == "nf4":
        return f"NH = {num_heads} packed NF4 rows of D/2 + 4 = {W} bytes each (D = {table.dim}): a copy"
    what = "raw bytes of the float8_e4m3fn rows" if table.scheme == "fp8" else "int8 rows"
    return f"NH = {num_heads} {what} of {W} columns each: a copy"


def check_quantized(got: Any, want: torch.Tensor, table: QuantTable, ids: torch.Tensor, *,
                    dtypes: Sequence[torch.dtype], name: str, case: dict, where_head: Callable[[int, int], str],
                    scales: tuple[Any, torch.Tensor] | None = None) -> None:
    """Judge the rows ``got`` a user's op returned for ``table``'s rows ``ids`` ``[T, NH]`` against the
    reference's ``want`` (see the module doc): the values against ``table.values(dtype)`` looked up, for
    each of ``dtypes``. ``scales``: (the user's, the reference's) gathered int8 row scales, compared
    first. ``where_head(t, h)`` names token ``t``'s head ``h`` ("token 3, head 1 (table row 17)").
    Raises ``AssertionError``."""
    W, D, label = table.stored.shape[1], table.dim, f"{name}: the {table.scheme} output"
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        what = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else f"a {type(got).__name__}"
        raise AssertionError(f"{label}: got {what}, expected {tuple(want.shape)} {want.dtype} "
                             f"({_layout(table, ids.shape[1])})\n  case: {fmt_case(case)}")
    if scales is not None:                           # int8: the row scales, gathered by the same op
        compare_bits(scales[0], scales[1], name=f"{name}: the gather of the int8 row scales (weight_scale [rows, 1])",
                     case=case, where=lambda idx: where_head(idx[0], idx[1]))
    row_scale = ref.embedding_lookup(table.scale, ids) if table.scale is not None and table.scheme == "int8" else None
    nibble = (lambda c: f" (the {'high' if c % 2 else 'low'} nibble of byte {c // 2})") if table.scheme == "nf4" \
        else (lambda c: "")
    for dt in dict.fromkeys(dtypes):                 # the definition: the whole table dequantized, then looked up
        compare_bits(table.unpack(got, row_scale, dt), ref.embedding_lookup(table.values(dt), ids),
                     name=f"{label} unpacked to {str(dt).replace('torch.', '')}", case=case,
                     where=lambda idx: f"{where_head(idx[0], idx[1] // D)}, column {idx[1] % D}{nibble(idx[1] % D)}")
    compare_bits(got, want, name=label, case=case,
                 where=lambda idx: f"{where_head(idx[0], idx[1] // W)}, {_byte_of(table, idx[1] % W)}")
