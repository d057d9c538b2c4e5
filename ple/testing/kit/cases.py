"""The tensors the checks build their cases from, for tests that draw cases of their own.

Every builder makes CPU tensors from plain values and, where it draws, a ``torch.Generator``
(so a case's tensors follow from its seed): `randn` (float64 draws rounded once to the dtype),
`to64`, `index_tensor` (an index tensor, possibly a strided column of a table), `rows_view`
(``[T, C]`` rows, possibly the first C columns of a wider buffer), `state_view` (a conv state in
one of the three legal layouts, and the buffer behind it), `clone_state` (a copy with the same
strides), `request_rows` (a call's offsets and where its logical rows lie) and `assign_slots`
(each request's state slot, the null slot among them). `conv.build_conv`, `conv.build_export` and
`prefill.build_prefill` make the checks' whole calls from them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, overload

import torch

__all__ = ["NAN", "randn", "to64", "index_tensor", "rows_view", "state_view", "clone_state", "request_rows",
           "assign_slots"]

NAN = float("nan")


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


def rows_view(T: int, C: int, dtype: torch.dtype, g: torch.Generator, wide: bool,
              scale: float = 1.0) -> torch.Tensor:
    """``[T, C]`` rows of `randn`; ``wide``: the first C columns of a ``[T, C + 3]`` buffer."""
    if wide:
        return randn((T, C + 3), dtype, g, scale)[:, :C]
    return randn((T, C), dtype, g, scale)


def state_view(num_slots: int, C: int, W: int, layout: str, dtype: torch.dtype,
               g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(the ``[num_slots, C, W]`` state, the buffer behind it), of `randn` values, laid out as ``layout``:
    ``"cw"`` contiguous, ``"wc"`` a transposed ``[num_slots, W, C]`` buffer, ``"tail"`` the last W columns
    of a transposed ``[num_slots, W + 2, C]`` one."""
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
    """The rows of a call of requests of ``lens`` rows: (``query_start_loc`` as a list, T the physical rows,
    the physical row of each logical row, ``token_indices``). ``extra_rows`` None: the logical rows are the
    physical ones (no ``token_indices``); else they lie in a random order among ``extra_rows`` more rows, and
    ``token_indices`` (an `index_tensor` of ``index_dtype``, a column of a table if ``column``) says where."""
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    num_rows = starts[-1]
    if extra_rows is None:
        return starts, num_rows, list(range(num_rows)), None
    T = num_rows + extra_rows
    rows = torch.randperm(T, generator=g)[:num_rows].tolist()
    return starts, T, rows, index_tensor(rows, index_dtype, column)


def assign_slots(num_requests: int, extra_slots: int, null_at_end: bool, null_requests: Sequence[bool],
                 g: torch.Generator) -> tuple[int, int, list[int]]:
    """(the number of state slots, the null slot, each request's slot): ``num_requests + extra_slots`` slots,
    the null slot the last or the first, request r on it where ``null_requests[r]``, the others on distinct
    slots in a random order."""
    num_slots = num_requests + extra_slots
    null_slot = num_slots - 1 if null_at_end else 0
    free = [s for s in range(num_slots) if s != null_slot]
    order = torch.randperm(len(free), generator=g).tolist()
    return num_slots, null_slot, [null_slot if null_requests[r] else free[order[r]] for r in range(num_requests)]
