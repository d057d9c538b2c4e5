"""The ``"torch"`` backend's serving ops (``ple.vectorized``) at corners random cases seldom reach, against the
reference bit for bit: every residual row (those outside the call included), every bit of the state's buffer.

* The null slot and every state column a call must not read hold NaNs that all differ
  (``ple.testing.kit.cases.distinct_nans``), in both layouts (columns as rows, ``PLECache``'s default, and
  channels first): a path that writes the null slot's columns back in another order, or copies an unread
  column over another, changes bits (with one NaN value everywhere it would not).
* States and residuals that are views at a storage offset no multiple of 16 bytes: the row path moves
  state and residual rows as 16-byte words where sizes, strides and offsets allow, so at such an
  offset it must fall back and still give the reference's bits.
"""

from __future__ import annotations

import pytest
import torch

import ple.reference as ref
import ple.vectorized as vec
from ple.testing.kit.cases import clone_state
from ple.testing.kit.conv import build_conv, build_export, run_conv
from ple.testing.kit.prefill import build_prefill, check_one_serving
from ple.testing.numerics import assert_bitwise_equal

DTYPES = (torch.float32, torch.bfloat16)
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
LENS = {"decode": [1, 1, 1, 1], "spec": [3, 1, 2, 3], "prefill": [5, 0, 2, 7]}


def conv_case(mode: str, dtype: torch.dtype, layout: str, seed: int = 0) -> dict:
    """A `build_conv` case of ``mode``: 4 requests (one on the null slot, one without history but in spec),
    3 slots no request owns, two columns past the window, rows among others (``token_indices``)."""
    return dict(mode=mode, C=16, K=3, dilation=2, spec_len=3, lens=LENS[mode], dtype=dtype, state_dtype="same",
                weight_layout="ck", layout=layout, extra_w=2, extra_slots=3, null_at_end=False,
                null_requests=[False, True, False, False], init="bool" if mode != "spec" else None,
                init_values=[True, True, False, True], accepted=[2, 1, 1, 3], token_indices=True, extra_rows=2,
                outer=True, index_dtype=torch.int64, column_indices=False, seed=seed)


def _same_bits(t: dict, case: dict, residual: torch.Tensor, res_buf: torch.Tensor, state: torch.Tensor,
               state_buf: torch.Tensor) -> None:
    """Run the torch backend on (``residual`` over ``res_buf``, ``state`` over ``state_buf``) and the reference
    on copies with the same strides: the buffers, every bit."""
    ref_res_buf, ref_state_buf = res_buf.clone(), state_buf.clone()
    as_in = lambda v, b: torch.as_strided(b, v.shape, v.stride(), v.storage_offset())  # noqa: E731
    run_conv(ref.ple_conv, t, case, residual=as_in(residual, ref_res_buf), conv_state=as_in(state, ref_state_buf))
    run_conv(vec.ple_conv, t, case, residual=residual, conv_state=state)
    assert not torch.isnan(residual[t["rows"]]).any(), "a row of the call read a NaN column"
    assert_bitwise_equal(res_buf, ref_res_buf, name=f"{case['mode']}: residual buffer")
    assert_bitwise_equal(state_buf, ref_state_buf, name=f"{case['mode']}: conv_state buffer")


# ---- the null slot and unread columns: NaNs that all differ ---------------------------------------------------
@pytest.mark.parametrize("layout", ["wc", "cw"])
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("mode", ["decode", "spec", "prefill"])
def test_null_slot_and_unread_columns_keep_their_bits(mode, dtype, layout):
    case = conv_case(mode, dtype, layout)
    t = build_conv(case)
    state, buf = clone_state(t)
    null = state[t["null_slot"]]
    assert torch.isnan(null).all()
    assert torch.unique(null.reshape(-1).view(torch.int16 if dtype == torch.bfloat16 else torch.int32)).numel() \
        == null.numel()                                                  # every NaN of the null slot its own
    residual = t["residual"].clone()
    _same_bits(t, case, residual, residual, state, buf)


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_export_and_prefill_leave_unread_columns_bit_for_bit(dtype):
    """``export_conv_checkpoints`` and a serving ``ple_prefill`` on states whose unread columns and null slot
    are distinct values: the whole buffer as the reference leaves it."""
    for layout in ("wc", "cw"):
        case = dict(C=16, S=4, lens=[9, 2, 6, 5], dtype=dtype, state_dtype="same", layout=layout,
                    token_indices=True, null_at_end=False, choice=[1, 0, 2, 3], index_dtype=torch.int64, seed=3)
        t = build_export(case)
        kw = dict(query_start_loc=torch.tensor(t["query_start_loc_list"]), offsets=torch.tensor(t["offsets"]),
                  slots=torch.tensor(t["slots_list"]), state_len=case["S"], token_indices=t["rows"],
                  null_slot=t["null_slot"])
        (v_ref, b_ref), (v_vec, b_vec) = clone_state(t), clone_state(t)
        ref.export_conv_checkpoints(t["x"], v_ref, **kw)
        vec.export_conv_checkpoints(t["x"], v_vec, **kw)
        assert_bitwise_equal(b_vec, b_ref, name=f"export ({layout}): conv_state buffer")
        prefill = dict(part="serving", lens=[6, 0, 3, 1], M=2, H=8, K=3, dilation=2, dtype=dtype, eps=1e-6,
                       scale=1.0, keep="bool", weight_layout="ck", strided=False, index_dtype=torch.int64,
                       column_indices=False, state_dtype="same", layout=layout, extra_w=2, extra_slots=3,
                       null_at_end=True, null_requests=[False, False, True, False], init="bool",
                       init_values=[True, True, True, False], token_indices=True, extra_rows=2, seed=5)
        state = build_prefill(prefill)["state"]
        null = state[state.shape[0] - 1]
        assert torch.isnan(null).all()
        check_one_serving(vec.ple_prefill, prefill, exact_states=True)   # states bit for bit, out by the table


# ---- views at a storage offset no multiple of 16 bytes -------------------------------------------------------
def _at_offset(rows: torch.Tensor, offset: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of ``rows`` (contiguous) ``offset`` elements into a buffer of random values: (the view, the buffer)."""
    buf = torch.randn(offset + rows.numel() + 3, generator=g, dtype=torch.float64).to(rows.dtype)
    view = buf[offset:offset + rows.numel()].view(rows.shape)
    view.copy_(rows)
    return view, buf


@pytest.mark.parametrize("dtype,offset", [(torch.float32, 1), (torch.float32, 2), (torch.bfloat16, 1),
                                          (torch.bfloat16, 4)], ids=["float32-4B", "float32-8B", "bfloat16-2B",
                                                                     "bfloat16-8B"])
@pytest.mark.parametrize("mode", ["decode", "spec", "prefill"])
def test_state_and_residual_views_at_unaligned_offsets(mode, dtype, offset):
    """A ``channels_last`` state (its columns are rows in memory: the row path) and a residual, each a view
    ``offset`` elements into its buffer (4, 8, 2 or 8 bytes: never a multiple of 16); rows of 64 or 32 bytes,
    which a 16-byte word would divide. The buffers as the reference leaves them, every bit (the values
    around the views included)."""
    case = conv_case(mode, dtype, "wc", seed=offset)
    t = build_conv(case)
    g = torch.Generator().manual_seed(offset)
    rows, state_buf = _at_offset(t["state"].transpose(1, 2).contiguous(), offset, g)    # [num_slots, W, C]
    residual, res_buf = _at_offset(t["residual"], offset, g)
    state = rows.transpose(1, 2)                                                         # [num_slots, C, W]
    isz = dtype.itemsize
    assert (state.storage_offset() * isz) % 16 and (residual.storage_offset() * isz) % 16
    assert (state.shape[1] * isz) % 16 == 0 and rows.stride(1) == state.shape[1]     # rows 16-byte divisible
    _same_bits(t, case, residual, res_buf, state, state_buf)
