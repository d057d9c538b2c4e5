"""Every code path of the ``"torch"`` backend's ``ple_conv`` against the reference, on purpose.

``ple.vectorized.ple_conv`` picks its path by the call: decode rows on states whose columns are rows in
memory (``PLECache``'s default ``channels_last`` layout, the kit's ``"wc"``) in the inputs' dtype take a
row-gather path (and, under ``torch.compile``, a compiled variant); other layouts or a float32 state of a
bfloat16 call take the general one. The kit (``check_ple_conv``) draws layout, state dtype and null
requests at random, so a few examples may never reach the serving hot path with a request on the null
slot: a mistake there (e.g. the null slot's rows given a conv term) once passed every other test. Here
each path is forced, with and without null-slot requests, and judged by the kit's ``check_one_conv``
(outputs as SPEC section 8 says, states and every untouched bit bit for bit).
"""

from __future__ import annotations

import pytest
import torch
from _tier import examples
from hypothesis import given, note, settings
from hypothesis import strategies as st

import ple.vectorized as vec
from ple.testing.kit.conv import check_one_conv, conv_cases

LAYOUTS = ("wc", "cw", "tail")      # wc: channels_last (the row path); cw / tail: the general path
DTYPES = (torch.float32, torch.bfloat16, torch.float64)


@st.composite
def forced(draw: st.DrawFn, mode: str, layout: str) -> dict:
    """A `conv_cases` case of ``mode`` on ``layout``, K >= 2 (a history to read), some requests on the
    null slot or none."""
    case = draw(conv_cases(mode, max_channels=40, dtypes=DTYPES))
    case["layout"] = layout
    case["K"] = max(case["K"], 2)
    case["state_dtype"] = draw(st.sampled_from(["same", "same", "float32"]))
    if case["lens"] and draw(st.booleans()):                        # at least one request on the null slot
        case["null_requests"][draw(st.integers(0, len(case["lens"]) - 1))] = True
    return case


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["decode", "spec", "prefill"])
def test_every_path_matches_the_reference(mode, layout):
    @given(case=forced(mode, layout))
    @settings(max_examples=examples(25), deadline=None)
    def prop(case):
        note(repr(case))
        check_one_conv(vec.ple_conv, case)

    prop()


def test_null_slot_requests_on_the_serving_path():
    """PLECache's layout, the inputs' dtype, a null-slot request among live ones: each dtype, with and
    without history and an outer residual (the cases the serving loop pads its steps with)."""
    base = dict(mode="decode", C=7, K=3, dilation=2, spec_len=1, lens=[1, 1, 1, 1], state_dtype="same",
                weight_layout="ck", layout="wc", extra_w=0, extra_slots=2, null_at_end=False,
                null_requests=[False, True, False, True], init_values=[True, True, False, True],
                accepted=[1, 1, 1, 1], token_indices=True, extra_rows=2, index_dtype=torch.int32,
                column_indices=False)
    for dtype in DTYPES:
        for init in (None, "bool"):
            for outer in (False, True):
                for seed in (0, 1):               # odd seeds: decode without query_start_loc
                    check_one_conv(vec.ple_conv, dict(base, dtype=dtype, init=init, outer=outer, seed=seed))


def test_compiled_serving_path_matches_the_reference():
    """The compiled decode path (``torch.compile(fullgraph=True)``) on PLECache's layout with null-slot
    requests: states bit for bit, outputs within the tolerance table (inductor may fuse the rounding)."""
    compiled = torch.compile(vec.ple_conv, fullgraph=True, dynamic=False)
    base = dict(mode="decode", C=16, K=4, dilation=1, spec_len=1, lens=[1, 1, 1], state_dtype="same",
                weight_layout="ck", layout="wc", extra_w=0, extra_slots=1, null_at_end=True,
                null_requests=[False, True, False], init=None, init_values=[True, True, True],
                accepted=[1, 1, 1], token_indices=False, extra_rows=0, index_dtype=torch.int64,
                column_indices=False, outer=True, seed=2)
    for dtype in (torch.float32, torch.bfloat16):
        check_one_conv(lambda *a, **kw: compiled(*a, **dict(kw, validate=False)), dict(base, dtype=dtype))
