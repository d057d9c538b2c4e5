"""Each path of the ``"torch"`` backend's ``ple_conv`` and ``dilated_causal_conv``, forced, against the reference.

``ple.vectorized.ple_conv`` has two paths (``ple/vectorized/__init__.py``): the general one (every mode,
layout and state dtype, eager or compiled) and, for eager decode rows on a state whose columns are rows in
memory (``PLECache``'s default ``channels_last`` layout, the kit's ``"wc"``) in the inputs' dtype, the row
path ``decode.decode_conv`` (``decode.takes_row_path``). The kit (``check_ple_conv``) draws layout, state
dtype and null requests at random, so a few examples may never reach the row path with a request on the
null slot: a mistake there (e.g. the null slot's rows given a conv term) once passed every other test.
Here each case runs on the path the test names (``"fast"``: the op as it is, checked to take the row path
exactly where ``takes_row_path`` says; ``"general"``: ``takes_row_path`` refused), with and without
null-slot requests, and is judged by the kit's ``check_one_conv`` (outputs as docs/spec.md section 8 says, states
and every untouched bit bit for bit) and by the reference's bits (outputs, states and the buffers around
them, in every dtype).

``dilated_causal_conv`` has two paths: ``_TapSum`` (eager) and ``_conv_gathered`` (under ``torch.compile``;
forced eagerly here by refusing ``takes_slice_path``): the output is the reference's bit for bit, the
gradients are within the tolerance table (the kit's ``check_dilated_causal_conv``).
"""

from __future__ import annotations

import pytest
import torch
from _tier import examples
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import ple.reference as ref
import ple.vectorized as vec
import ple.vectorized.conv as vec_conv
import ple.vectorized.training_conv as vec_training_conv
from ple.testing.kit.cases import clone_state
from ple.testing.kit.conv import build_conv, check_one_conv, conv_cases, run_conv
from ple.testing.kit.ops import check_dilated_causal_conv
from ple.vectorized.rows import state_rows

LAYOUTS = ("wc", "cw", "tail")      # wc: channels_last (the row path can run); cw / tail: the general path
DTYPES = (torch.float32, torch.bfloat16, torch.float64)
FIXTURE = [HealthCheck.function_scoped_fixture]          # the path fixtures patch once per test, not per example


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.fixture(params=["fast", "general"])
def conv_path(request, monkeypatch) -> tuple[str, list[bool]]:
    """``"fast"``: ``ple_conv`` as it is; ``"general"``: ``takes_row_path`` refused. Returns the path and a list
    with one entry per decode call: whether it took the row path."""
    took: list[bool] = []
    real = vec_conv.takes_row_path

    def spy(*args):
        took.append(request.param == "fast" and real(*args))
        return took[-1]
    monkeypatch.setattr(vec_conv, "takes_row_path", spy)
    return request.param, took


@pytest.fixture(params=["fast", "general"])
def dcc_path(request, monkeypatch) -> str:
    """``"fast"``: ``dilated_causal_conv`` as it is (eager: ``_TapSum``); ``"general"``: ``takes_slice_path``
    refused, so ``_conv_gathered`` runs eagerly."""
    if request.param == "general":
        monkeypatch.setattr(vec_training_conv, "takes_slice_path", lambda: False)
    return request.param


def same_bits_as_reference(case: dict) -> None:
    """``vec.ple_conv`` and the reference on copies of one `conv_cases` case: the residual buffer (the call's
    rows and the others) and the state's whole buffer hold the same bits."""
    t = build_conv(case)
    res_ref, res_vec = t["residual"].clone(), t["residual"].clone()
    (st_ref, buf_ref), (st_vec, buf_vec) = clone_state(t), clone_state(t)
    run_conv(ref.ple_conv, t, case, residual=res_ref, conv_state=st_ref)
    run_conv(vec.ple_conv, t, case, residual=res_vec, conv_state=st_vec)
    assert torch.equal(bits(res_vec), bits(res_ref)), "residual"
    assert torch.equal(bits(buf_vec), bits(buf_ref)), "conv_state"


def row_path_expected(case: dict) -> bool:
    """Where `decode.takes_row_path` sends an eager call of this case: decode rows, K > 1, a request, a state in
    the inputs' dtype whose columns are rows (``"wc"``; any layout when C = 1); the kit's null slot is inside
    the state."""
    same_dtype = case["state_dtype"] == "same" or case["dtype"] == torch.float32
    has_rows = state_rows(build_conv(case)["state"]) is not None
    return case["mode"] == "decode" and has_rows and same_dtype and case["K"] > 1 and bool(case["lens"])


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
def test_every_path_matches_the_reference(conv_path, mode, layout):
    which, took = conv_path

    @given(case=forced(mode, layout))
    @settings(max_examples=examples(25), deadline=None, suppress_health_check=FIXTURE)
    def prop(case):
        note(repr(case))
        took.clear()
        check_one_conv(vec.ple_conv, case)
        assert any(took) == (which == "fast" and row_path_expected(case))
        same_bits_as_reference(case)

    prop()


def test_null_slot_requests_on_the_serving_path(conv_path):
    """PLECache's layout, the inputs' dtype, a null-slot request among live ones: each dtype, with and
    without history and an outer residual (the cases the serving loop pads its steps with), on each path."""
    which, took = conv_path
    base = dict(mode="decode", C=7, K=3, dilation=2, spec_len=1, lens=[1, 1, 1, 1], state_dtype="same",
                weight_layout="ck", layout="wc", extra_w=0, extra_slots=2, null_at_end=False,
                null_requests=[False, True, False, True], init_values=[True, True, False, True],
                accepted=[1, 1, 1, 1], token_indices=True, extra_rows=2, index_dtype=torch.int32,
                column_indices=False)
    for dtype in DTYPES:
        for init in (None, "bool"):
            for outer in (False, True):
                for seed in (0, 1):               # odd seeds: decode without query_start_loc
                    case = dict(base, dtype=dtype, init=init, outer=outer, seed=seed)
                    took.clear()
                    check_one_conv(vec.ple_conv, case)
                    assert took and all(took) == (which == "fast")
                    same_bits_as_reference(case)


@pytest.mark.parametrize("mode", ["decode", "spec", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_null_slot_outside_the_state(conv_path, mode, dtype):
    """A null slot that is no slot of the state (the general path writes slot 0 as a stand-in with the bits it
    ends with; the row path is not taken): every bit as the reference, on both paths' dispatch."""
    which, took = conv_path
    g = torch.Generator().manual_seed(3)
    C, K, d, Q = 5, 3, 2, 3
    S = (K - 1) * d
    lens = {"decode": [1, 1, 1], "spec": [2, 3, 1], "prefill": [4, 0, 2]}[mode]
    T = sum(lens)
    for null_slot in (-1, 4):
        for slots in ([1, null_slot, 0], [null_slot, 2, 3]):              # slot 0 owned, or not
            state = torch.randn(4, C, S + Q - 1, generator=g).to(dtype)
            inputs, residual, outer = (torch.randn(T, C, generator=g).to(dtype) for _ in range(3))
            kw = dict(mode=mode, dilation=d, query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0)]),
                      outer_residual=outer, null_slot=null_slot)
            if mode == "spec":
                kw.update(spec_query_len=Q, num_accepted_tokens=torch.tensor([2, 1, 3]))
            if mode == "prefill":
                kw["has_initial_states"] = torch.tensor([True, False, True])
            w = torch.randn(C, K, generator=g).to(dtype)
            results = []
            for fn in (ref.ple_conv, vec.ple_conv):
                res, st_ = residual.clone(), state.clone()
                took.clear()
                fn(inputs, res, st_, w, torch.tensor(slots), **kw)
                results.append((res, st_))
            assert not any(took)
            for a, b in zip(*results):
                assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.deep)])
def test_compiled_serving_path_matches_the_reference(compiler):
    """The general path under ``torch.compile(fullgraph=True)`` on PLECache's layout with null-slot
    requests (a compiled decode never takes the row path): states bit for bit, outputs within the tolerance
    table (inductor may fuse the rounding). The quick tier traces through ``aot_eager`` (the graph inductor
    gets, run eagerly); the deep tier compiles it with inductor (~20 s of C++ with an empty cache)."""
    compiled = torch.compile(vec.ple_conv, fullgraph=True, dynamic=False, backend=compiler)
    base = dict(mode="decode", C=16, K=4, dilation=1, spec_len=1, lens=[1, 1, 1], state_dtype="same",
                weight_layout="ck", layout="wc", extra_w=0, extra_slots=1, null_at_end=True,
                null_requests=[False, True, False], init=None, init_values=[True, True, True],
                accepted=[1, 1, 1], token_indices=False, extra_rows=0, index_dtype=torch.int64,
                column_indices=False, outer=True, seed=2)
    for dtype in (torch.float32, torch.bfloat16):
        check_one_conv(lambda *a, **kw: compiled(*a, **dict(kw, validate=False)), dict(base, dtype=dtype))


@st.composite
def dcc_cases(draw: st.DrawFn) -> dict:
    packed = draw(st.booleans())
    return dict(C=draw(st.integers(1, 24)), K=draw(st.integers(1, 5)), dilation=draw(st.integers(1, 4)),
                packed=packed, lens=draw(st.lists(st.integers(0, 30), min_size=1, max_size=5)),
                B=draw(st.integers(1, 3)), L=draw(st.integers(0, 40)), dtype=draw(st.sampled_from(DTYPES)),
                seed=draw(st.integers(0, 2**16)))


@given(case=dcc_cases())
@settings(max_examples=examples(30), deadline=None, suppress_health_check=FIXTURE)
def test_dilated_causal_conv_paths_are_the_reference_bit_for_bit(dcc_path, case):
    """Dense and packed inputs (sequences shorter than the history, empty ones): the output's bits."""
    note(repr(case))
    g = torch.Generator().manual_seed(case["seed"])
    dt = case["dtype"]
    kw = dict(dilation=case["dilation"])
    if case["packed"]:
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(case["lens"]).cumsum(0).tolist()])
        x = torch.randn(sum(case["lens"]), case["C"], generator=g).to(dt)
    else:
        x = torch.randn(case["B"], case["L"], case["C"], generator=g).to(dt)
    w = (torch.randn(case["C"], case["K"], generator=g) * 0.5).to(dt)
    got, want = vec.dilated_causal_conv(x, w, **kw), ref.dilated_causal_conv(x, w, **kw)
    assert torch.equal(bits(got), bits(want))


def test_dilated_causal_conv_paths_pass_the_kit(dcc_path):
    """Outputs and the gradients of ``x`` and ``weight`` (autograd through each path) by the kit's judgement."""
    check_dilated_causal_conv(vec.dilated_causal_conv, max_channels=40, max_examples=examples(15))
