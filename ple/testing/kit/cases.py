"""The tensors the checks build their cases from, for tests that draw cases of their own.

Every builder makes CPU tensors from plain values and, where it draws, a ``torch.Generator``
(so a case's tensors follow from its seed): `randn` (float64 draws rounded once to the dtype),
`to64`, `index_tensor` (an index tensor, possibly a strided column of a table), `rows_view`
(``[T, C]`` rows, possibly the first C columns of a wider buffer), `state_view` (a conv state in
one of the three legal layouts, and the buffer behind it), `clone_state` (a copy with the same
strides), `request_rows` (a call's offsets and where its logical rows lie), `assign_slots`
(each request's state slot, the null slot among them), `serving_state` (those slots, then their
state) and `distinct_nans` / `fill_nans_` (NaNs whose bits all differ, for what a call must neither
read nor move). `conv.build_conv`, `conv.build_export` and `prefill.build_prefill` make the checks'
whole calls from them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, overload

import torch

from ..._deprecation import deprecated_parameter

__all__ = ["NAN", "randn", "to64", "index_tensor", "rows_view", "state_view", "clone_state", "request_rows",
           "assign_slots", "serving_state", "distinct_nans", "fill_nans_", "HALF_DTYPES"]

NAN = float("nan")
HALF_DTYPES = (torch.bfloat16, torch.float16)
"""The low-precision dtypes: judged against a float64 run of the reference (docs/spec.md section 8)."""


def randn(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Standard normal draws in float64, times ``scale``, rounded once to ``dtype``."""
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    return (x if scale == 1.0 else x * scale).to(dtype)


@overload
def to64(t: torch.Tensor) -> torch.Tensor: ...


@overload
def to64(t: None) -> None: ...


def to64(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` in float64 (None stays None)."""
    return None if t is None else t.to(torch.float64)


def index_tensor(values: Sequence[int], dtype: torch.dtype, column: bool) -> torch.Tensor:
    """``values`` as a 1-D tensor of ``dtype``; ``column``: a column of a 2-D table (stride 2)."""
    t = torch.tensor(values, dtype=dtype)
    if column:
        t = torch.stack([t, torch.full_like(t, 12345)], 1)[:, 0]
    return t


@deprecated_parameter("T", "num_rows", since="0.1.0")
@deprecated_parameter("C", "channels", since="0.1.0")
def rows_view(num_rows: int, channels: int, dtype: torch.dtype, g: torch.Generator, wide: bool,
              scale: float = 1.0) -> torch.Tensor:
    """``[num_rows, channels]`` rows of `randn`; ``wide``: the first ``channels`` columns of a
    ``[num_rows, channels + 3]`` buffer."""
    if wide:
        return randn((num_rows, channels + 3), dtype, g, scale)[:, :channels]
    return randn((num_rows, channels), dtype, g, scale)


@deprecated_parameter("C", "channels", since="0.1.0")
@deprecated_parameter("W", "state_width", since="0.1.0")
def state_view(num_slots: int, channels: int, state_width: int, layout: str, dtype: torch.dtype,
               g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(the ``[num_slots, C, W]`` state, the buffer behind it), of `randn` values, laid out as ``layout``
    (C = ``channels``, W = ``state_width``): ``"cw"`` contiguous, ``"wc"`` a transposed ``[num_slots, W, C]``
    buffer, ``"tail"`` the last W columns of a transposed ``[num_slots, W + 2, C]`` one."""
    C, W = channels, state_width
    if layout == "cw":
        buf = randn((num_slots, C, W), dtype, g)
        return buf, buf
    if layout == "wc":
        buf = randn((num_slots, W, C), dtype, g)
        return buf.transpose(1, 2), buf
    buf = randn((num_slots, W + 2, C), dtype, g)
    return buf.transpose(1, 2)[..., 2:], buf


def clone_state(t: Mapping[str, Any], dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(a copy of the state ``t["state"]`` with its strides, over a copy of its buffer ``t["buf"]``); ``dtype``:
    the copy converted to it."""
    buf = t["buf"].clone() if dtype is None else t["buf"].to(dtype)
    view = torch.as_strided(buf, t["state"].shape, t["state"].stride(),
                            t["state"].storage_offset() - t["buf"].storage_offset())
    return view, buf


def request_rows(lens: Sequence[int], g: torch.Generator, extra_rows: int | None, index_dtype: torch.dtype,
                 column: bool) -> tuple[list[int], int, list[int], torch.Tensor | None]:
    """The rows of a call of requests of ``lens`` rows: (``query_start_loc_list``, ``query_start_loc`` as a
    list; T the physical rows; the physical row of each logical row; ``token_indices``). ``extra_rows`` None:
    the logical rows are the physical ones (no ``token_indices``); else they lie in a random order among
    ``extra_rows`` more rows, and ``token_indices`` (an `index_tensor` of ``index_dtype``, a column of a table
    if ``column``) says where."""
    query_start_loc_list = [0]
    for n in lens:
        query_start_loc_list.append(query_start_loc_list[-1] + n)
    num_rows = query_start_loc_list[-1]
    if extra_rows is None:
        return query_start_loc_list, num_rows, list(range(num_rows)), None
    T = num_rows + extra_rows
    rows = torch.randperm(T, generator=g)[:num_rows].tolist()
    return query_start_loc_list, T, rows, index_tensor(rows, index_dtype, column)


def assign_slots(num_requests: int, extra_slots: int, null_at_end: bool, null_requests: Sequence[bool],
                 g: torch.Generator) -> tuple[int, int, list[int]]:
    """(the number of state slots, the null slot, ``state_indices_list``: each request's slot):
    ``num_requests + extra_slots`` slots, the null slot the last or the first, request r on it where
    ``null_requests[r]``, the others on distinct slots in a random order."""
    num_slots = num_requests + extra_slots
    null_slot = num_slots - 1 if null_at_end else 0
    free = [s for s in range(num_slots) if s != null_slot]
    order = torch.randperm(len(free), generator=g).tolist()
    return num_slots, null_slot, [null_slot if null_requests[r] else free[order[r]] for r in range(num_requests)]


def serving_state(case: Mapping[str, Any], num_requests: int, channels: int, state_width: int, dtype: torch.dtype,
                  g: torch.Generator) -> tuple[int, int, list[int], torch.Tensor, torch.Tensor]:
    """A serving call's slots, then its state: (the number of slots, the null slot, ``state_indices_list``) of
    `assign_slots` (``case["extra_slots"]``, ``case["null_at_end"]``, ``case["null_requests"]``), then the state
    and its buffer of `state_view` (``case["layout"]``; in ``dtype``, or float32 where ``case["state_dtype"]`` is
    ``"float32"``), drawn from ``g`` in that order."""
    num_slots, null_slot, state_indices_list = assign_slots(num_requests, case["extra_slots"], case["null_at_end"],
                                                            case["null_requests"], g)
    sdt = dtype if case["state_dtype"] == "same" else torch.float32
    state, buf = state_view(num_slots, channels, state_width, case["layout"], sdt, g)
    return num_slots, null_slot, state_indices_list, state, buf


# dtype -> (the integers of its size, its mantissa bits)
_FLOAT_BITS = {torch.float16: (torch.int16, 10), torch.bfloat16: (torch.int16, 7), torch.float32: (torch.int32, 23),
               torch.float64: (torch.int64, 52)}


def distinct_nans(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """A ``shape`` tensor of quiet NaNs of ``dtype`` whose bits (payload and sign) differ, in row-major order:
    a value copied or moved onto another's place shows in a bit-for-bit comparison, and any arithmetic that
    reads one still gives NaN. All distinct where ``dtype`` has that many quiet NaNs (float32 and float64:
    millions; bfloat16 has 128, float16 1024): past that, each run of that many is, in an order drawn from
    ``g``, so no shift along any axis maps the values onto themselves."""
    ints, m = _FLOAT_BITS[dtype]
    n = 1
    for s in shape:
        n *= s
    quiet = 1 << (m - 1)                                 # payloads lie below the quiet bit
    patterns = 2 * quiet                                 # times two signs
    if n <= patterns:
        codes = torch.arange(n)
    else:
        codes = torch.cat([torch.randperm(patterns, generator=g) for _ in range(-(-n // patterns))])[:n]
    width = 8 * ints.itemsize
    nan = (((1 << (width - 1 - m)) - 1) << m) | quiet   # exponent all ones, the quiet bit
    bits = nan + codes % quiet
    bits = torch.where(codes >= quiet, bits | torch.iinfo(ints).min, bits)     # the sign bit
    return bits.to(ints).view(dtype).reshape(shape)


def fill_nans_(t: torch.Tensor, index: Any, g: torch.Generator) -> None:
    """``t[index] =`` `distinct_nans` (``index``: a boolean mask or a list of rows), in place."""
    t[index] = distinct_nans(tuple(t[index].shape), t.dtype, g)
