"""Rows of a conv state: the ``[num_slots * W, C]`` row view of a state and a fast row scatter into it.

* `state_rows`: ``conv_state`` (``[num_slots, C, W]``) as its rows, column w of slot s being row
  ``s * W + w``; a view (the ``channels_last`` layout ``PLECache`` uses by default), or None.
* `copy_rows_`: ``dst.index_copy_(0, index, src)`` for ``[n, C]`` rows. ATen's CPU ``index_copy_`` costs
  per *element* (a 2 MiB bfloat16 row scatter takes ~10x an ``index_select`` of it), so the rows are
  reinterpreted as 16-byte (else 8-byte) elements where their sizes, strides and offsets allow: the
  same bits copied 8x (4x) fewer times. Bits are copied, never computed on.

Under ``torch.compile`` `copy_rows_` is the operator ``ple_torch::copy_rows_`` (schema
``(Tensor(a!) dst, Tensor index, Tensor src) -> ()``, defined with ``torch.library.Library``).
``dst`` is a view of a slice of ``PLECache.conv_states``, a graph input: a plain in-place op on such
a view makes AOTAutograd rebuild and copy back the *whole* input (every slot of every layer, twice,
each step), whereas the operator's declared mutation of the view is applied in place. It is a
``Library`` operator rather than a ``torch.library.custom_op``: the latter's Python wrapper cost
~50 us a call on a decode step's 576-row scatter (itself ~170 us) on a CPU.
"""

from __future__ import annotations

import torch

__all__ = ["state_rows", "copy_rows_", "copy_rows_eager", "bits"]


def state_rows(conv_state: torch.Tensor) -> torch.Tensor | None:
    """``conv_state`` (``[num_slots, C, W]``) as its ``[num_slots * W, C]`` rows (column w of slot s is row
    ``s * W + w``), a view; None where the layout has no such view (``channels_first``)."""
    n, C, W = conv_state.shape
    sv = conv_state.transpose(1, 2)                                             # [num_slots, W, C]
    if n * W == 0 or (n > 1 and W > 1 and sv.stride(0) != W * sv.stride(1)):
        return None
    return sv.view(n * W, C)


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the signed integers of its element size (a view of the same bits; real dtypes)."""
    return t.view(_BITS[t.element_size()])


def _wide_type(*ts: torch.Tensor) -> torch.dtype | None:
    """The widest element type (16 or 8 bytes) every ``[n, C]`` tensor of ``ts`` can be viewed as, or None."""
    isz = ts[0].element_size()
    for wide in (torch.complex128, torch.int64):
        w = wide.itemsize
        if w > isz and all(t.dim() == 2 and t.element_size() == isz and not t.is_complex() and t.shape[1] > 0
                           and t.stride(1) == 1 and (t.shape[1] * isz) % w == 0 and (t.stride(0) * isz) % w == 0
                           and (t.storage_offset() * isz) % w == 0 for t in ts):
            return wide
    return None


def copy_rows_eager(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """`copy_rows_` outside ``torch.compile``: ``index_copy_`` on the widest view `_wide_type` finds."""
    wide = _wide_type(dst, src)
    if wide is None:
        dst.index_copy_(0, index, src)
    else:
        dst.view(wide).index_copy_(0, index, src.view(wide))


_LIB = torch.library.Library("ple_torch", "DEF")
_LIB.define("copy_rows_(Tensor(a!) dst, Tensor index, Tensor src) -> ()")
_LIB.impl("copy_rows_", copy_rows_eager, "CompositeExplicitAutograd")


@torch.library.register_fake("ple_torch::copy_rows_")
def _copy_rows_fake(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    return None


def copy_rows_(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(0, index, src)`` for ``[n, C]`` rows, on a wide view of both where they allow one;
    under ``torch.compile`` the operator ``ple_torch::copy_rows_`` (see the module docstring)."""
    if torch.compiler.is_compiling():
        torch.ops.ple_torch.copy_rows_(dst, index, src)
    else:
        copy_rows_eager(dst, index, src)
