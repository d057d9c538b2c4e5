"""``ple.fast.ple_conv`` and ``export_conv_checkpoints`` against ``ple.reference`` (Triton kernels;
the interpreter on a CPU).

Every test runs the reference and the kernels on identical copies of the same inputs and
states. Outputs are judged with ``ple.testing.numerics.assert_close`` (bfloat16 against a
float64 run of the reference), states bit for bit. Buffers are poisoned with NaN wherever
a correct kernel must not read, so a stray read shows up as NaN in an output, and where
it must write, so a missed write shows up as a NaN left behind.
"""

from __future__ import annotations

import pytest
import torch
from _tier import examples
from hypothesis import given, note, settings
from hypothesis import strategies as st

from ple import fast  # the public ops: torch.library custom ops over ple.fast.conv / training_conv
from ple import reference as ref
from ple.testing.kit.cases import clone_state, randn, to64
from ple.testing.kit.conv import build_conv, build_export, run_conv
from ple.testing.numerics import assert_bitwise_equal, assert_close, assert_no_nan

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("poisoned_empty")]

CHANNELS = [1, 5, 13, 40]


# ---- ple_conv ---------------------------------------------------------------------------------------


@st.composite
def conv_cases(draw, mode):
    C = draw(st.sampled_from(CHANNELS))
    K = draw(st.integers(1, 5))
    d = draw(st.integers(1, 4))
    spec_len = draw(st.integers(1, 5)) if mode == "spec" else 1
    if mode == "prefill":
        length = st.one_of(st.just(0), st.just(1), st.integers(2, 12), st.integers(30, 70))
        lens = draw(st.lists(length, min_size=0, max_size=4))
    elif mode == "decode":
        lens = [1] * draw(st.integers(1, 5))
    else:
        lens = draw(st.lists(st.integers(1, spec_len), min_size=1, max_size=4))
    return dict(
        mode=mode, C=C, K=K, dilation=d, spec_len=spec_len, lens=lens,
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64])),
        state_dtype=draw(st.sampled_from(["same", "float32"])),
        weight_layout=draw(st.sampled_from(["ck", "kc"])),
        layout=draw(st.sampled_from(["cw", "wc", "tail"])),
        extra_w=draw(st.integers(0, 2)),
        extra_slots=draw(st.integers(1, 3)),
        null_at_end=draw(st.booleans()),
        null_requests=draw(st.lists(st.booleans(), min_size=len(lens), max_size=len(lens))),
        init=draw(st.sampled_from([None, "bool", "int"])),
        init_values=draw(st.lists(st.booleans(), min_size=len(lens), max_size=len(lens))),
        accepted=draw(st.lists(st.integers(1, spec_len), min_size=len(lens), max_size=len(lens))),
        token_indices=draw(st.booleans()),
        extra_rows=draw(st.integers(0, 3)),
        outer=draw(st.booleans()),
        wide_rows=draw(st.booleans()),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        column_indices=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@pytest.mark.parametrize("mode", ["prefill", "decode", "spec"])
@settings(max_examples=examples(3))
@given(data=st.data())
def test_ple_conv_matches_reference(mode, data):
    case = data.draw(conv_cases(mode))
    note(repr(case))
    _check_against_reference(case)


def _check_against_reference(case):
    """One ``ple_conv`` call of ``case``: the fast op against the reference (outputs close, states bit for bit)."""
    t = build_conv(case)
    res_ref, res_fast = t["residual"].clone(), t["residual"].clone()
    (st_ref, buf_ref), (st_fast, buf_fast) = clone_state(t), clone_state(t)
    run_conv(ref.ple_conv, t, case, residual=res_ref, conv_state=st_ref)
    run_conv(fast.ple_conv, t, case, residual=res_fast, conv_state=st_fast)

    rows = t["rows"]
    exact = None
    if case["dtype"] == torch.bfloat16:                      # the float64 run judges bfloat16
        res64 = to64(t["residual"])
        st64 = to64(t["state"])
        run_conv(ref.ple_conv, t, case, residual=res64, conv_state=st64, inputs=to64(t["inputs"]),
                 weights=to64(t["weights"]), outer=to64(t["outer"]))
        exact = res64[rows]
    assert_close(res_fast[rows], res_ref[rows], exact64=exact, name="residual")
    assert_no_nan(res_fast[rows], name="residual rows of the call")
    assert torch.isnan(res_fast[t["outside"]]).all(), "a residual row outside the call was written"
    assert_bitwise_equal(buf_fast, buf_ref, name="conv_state buffer")
    written = t["written"][:, None, :].expand(st_fast.shape)
    assert_no_nan(st_fast[written], name="state columns the step must rewrite")


# Prefill at the model's widths takes ~6-8 s a case under the interpreter: one of its four layouts in the quick tier.
WIDE_CASES = [pytest.param(m, w, lay, marks=[pytest.mark.deep] if m == "prefill" and (w, lay) != ("ck", "wc")
                           else [])
              for m in ("prefill", "decode", "spec") for w in ("ck", "kc") for lay in ("wc", "cw")]


@pytest.mark.parametrize("mode,weight_layout,layout", WIDE_CASES)
def test_ple_conv_model_widths_tiles_and_packed_taps(mode, weight_layout, layout):
    """The model's K = 4, dilation 3 in bfloat16, prefill requests longer than a time tile.

    Prefill tiles after a request's first take their window from the inputs, the first from
    the state (or zeros); contiguous ``[C, K]`` bfloat16 weights are read as one packed word
    per channel (``conv_decode.weight_args``), transposed ones tap by tap.
    """
    from ple.fast import conv as F
    from ple.fast.conv_decode import weight_args

    bt = F.PREFILL_BLOCK_T
    lens = {"prefill": [bt + 1, 2 * bt + 5, 3, 0, 1], "decode": [1] * 5, "spec": [3, 1, 2, 3, 3]}[mode]
    R = len(lens)
    case = dict(mode=mode, C=40, K=4, dilation=3, spec_len=3, lens=lens, dtype=torch.bfloat16, state_dtype="same",
                weight_layout=weight_layout, layout=layout, extra_w=1, extra_slots=2, null_at_end=False,
                null_requests=[False, False, False, False, True], init="bool" if mode != "spec" else None,
                init_values=[True, False, True, True, True], accepted=[2, 1, 3, 1, 2], token_indices=True,
                extra_rows=2, outer=True, wide_rows=False, index_dtype=torch.int32, column_indices=False, seed=R)
    w = build_conv(case)["weights"]
    assert weight_args(w)["w_ptr"].dtype == (torch.int64 if weight_layout == "ck" else torch.bfloat16)
    _check_against_reference(case)


def _mixed_layout(n_spec, n_dec, n_pre, g):
    """A random physical order of a step's spec, decode and prefill rows: token_indices per group."""
    perm = torch.randperm(n_spec + n_dec + n_pre, generator=g)
    return perm[:n_spec], perm[n_spec:n_spec + n_dec], perm[n_spec + n_dec:]


@settings(max_examples=examples(3))
@given(
    C=st.sampled_from(CHANNELS), K=st.integers(1, 5), d=st.integers(1, 4), spec_len=st.integers(1, 4),
    spec_lens=st.lists(st.integers(1, 4), min_size=1, max_size=3), n_dec=st.integers(1, 3),
    pre_lens=st.lists(st.sampled_from([0, 1, 3, 17, 40]), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1),
)
def test_ple_conv_mixed_batch(C, K, d, spec_len, spec_lens, n_dec, pre_lens, dtype, seed):
    """A serving step: spec rows, then decodes, then prefills, interleaved in one ``inputs``.

    The fast step matches the reference, and gives the same bits whatever the interleaving.
    """
    spec_lens = [min(q, spec_len) for q in spec_lens]
    note(dict(C=C, K=K, d=d, spec_len=spec_len, spec_lens=spec_lens, n_dec=n_dec, pre_lens=pre_lens,
              dtype=dtype, seed=seed))
    g = torch.Generator().manual_seed(seed)
    S = (K - 1) * d
    n_spec, n_pre = sum(spec_lens), sum(pre_lens)
    T = n_spec + n_dec + n_pre
    R_s, R_p = len(spec_lens), len(pre_lens)
    num_slots = 1 + R_s + n_dec + R_p
    state_indices_list = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()
    logical = randn((T, C), dtype, g)                      # rows in logical order: spec, decode, prefill
    res0 = randn((T, C), dtype, g)
    outer0 = randn((T, C), dtype, g)
    state0 = randn((num_slots, S + spec_len - 1, C), dtype, g).transpose(1, 2)
    w = randn((C, K), dtype, g)
    query_start_loc_spec = torch.tensor([0] + torch.tensor(spec_lens).cumsum(0).tolist())
    query_start_loc_prefill = torch.tensor([0] + torch.tensor(pre_lens).cumsum(0).tolist())
    nat = torch.randint(1, spec_len + 1, (R_s,), generator=g)
    init_d = torch.rand(n_dec, generator=g) < 0.7
    init_p = torch.rand(R_p, generator=g) < 0.5

    def step(op, layout):
        ti_s, ti_d, ti_p = layout
        phys = torch.cat([ti_s, ti_d, ti_p])
        x = torch.empty_like(logical)
        x[phys] = logical
        res = torch.empty_like(res0)
        res[phys] = res0
        outer = torch.empty_like(outer0)
        outer[phys] = outer0
        state = state0.clone()
        non_spec = torch.cat([ti_d, ti_p])
        op(x, res, state, w, torch.tensor(state_indices_list[:R_s]), mode="spec", dilation=d,
           query_start_loc=query_start_loc_spec, num_accepted_tokens=nat, spec_query_len=spec_len, token_indices=ti_s,
           outer_residual=outer)
        ti_d2, ti_p2 = torch.split(non_spec, [n_dec, n_pre])
        op(x, res, state, w, torch.tensor(state_indices_list[R_s:R_s + n_dec]), mode="decode", dilation=d,
           has_initial_states=init_d, token_indices=ti_d2, outer_residual=outer)
        op(x, res, state, w, torch.tensor(state_indices_list[R_s + n_dec:]), mode="prefill", dilation=d,
           query_start_loc=query_start_loc_prefill, has_initial_states=init_p, token_indices=ti_p2,
           outer_residual=outer)
        return res[phys], state

    layout_a = _mixed_layout(n_spec, n_dec, n_pre, g)
    layout_b = _mixed_layout(n_spec, n_dec, n_pre, g)
    out_ref, state_ref = step(ref.ple_conv, layout_a)
    out_a, state_a = step(fast.ple_conv, layout_a)
    out_b, state_b = step(fast.ple_conv, layout_b)
    exact = None
    if dtype == torch.bfloat16:
        logical, res0, outer0, state0, w = map(to64, (logical, res0, outer0, state0, w))
        exact, _ = step(ref.ple_conv, layout_a)
    assert_close(out_a, out_ref, exact64=exact, name="residual")
    assert_bitwise_equal(state_a, state_ref)
    assert_bitwise_equal(out_b, out_a, name="residual under another interleaving")
    assert_bitwise_equal(state_b, state_a, name="state under another interleaving")


# ---- export_conv_checkpoints ------------------------------------------------------------------------


@given(
    C=st.sampled_from(CHANNELS), S=st.integers(1, 9),
    lens=st.lists(st.integers(0, 25), min_size=0, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]), state_dtype=st.sampled_from(["same", "float32"]),
    layout=st.sampled_from(["cw", "wc", "tail"]), token_indices=st.booleans(), null_at_end=st.booleans(),
    choice=st.lists(st.integers(0, 3), min_size=4, max_size=4), seed=st.integers(0, 2**31 - 1),
)
def test_export_checkpoints_matches_reference(C, S, lens, dtype, state_dtype, layout, token_indices,
                                              null_at_end, choice, seed):
    case = dict(C=C, S=S, lens=lens, dtype=dtype, state_dtype=state_dtype, layout=layout,
                token_indices=token_indices, null_at_end=null_at_end, choice=choice, seed=seed)
    note(case)
    t = build_export(case)
    kw = dict(query_start_loc=torch.tensor(t["query_start_loc_list"], dtype=torch.int64),
              offsets=torch.tensor(t["offsets"], dtype=torch.int32),
              slots=torch.tensor(t["slots_list"], dtype=torch.int64), state_len=S, token_indices=t["rows"],
              null_slot=t["null_slot"])
    (view_ref, buf_ref), (view_fast, buf_fast) = clone_state(t), clone_state(t)
    ref.export_conv_checkpoints(t["x"], view_ref, **kw)
    fast.export_conv_checkpoints(t["x"], view_fast, **kw)
    assert_bitwise_equal(buf_fast, buf_ref, name="conv_state buffer")
    assert_no_nan(view_fast[t["target"], :, :S], name="checkpoint columns")


@settings(max_examples=examples(3))
@given(
    C=st.sampled_from(CHANNELS), K=st.integers(1, 5), d=st.integers(1, 4), extra=st.integers(0, 20),
    rest=st.integers(1, 20), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_checkpoint_restore_continues_bit_for_bit(C, K, d, extra, rest, dtype, seed):
    """Prefill, export a checkpoint at an offset, prefill the rest from it: the one-shot outputs."""
    note(dict(C=C, K=K, d=d, extra=extra, rest=rest, dtype=dtype, seed=seed))
    g = torch.Generator().manual_seed(seed)
    S = (K - 1) * d
    off = max(S, 1) + extra
    L = off + rest
    x = randn((L, C), dtype, g)
    res0 = randn((L, C), dtype, g)
    w = randn((C, K), dtype, g)
    state = randn((3, S + 1, C), dtype, g).transpose(1, 2)
    query_start_loc = torch.tensor([0, L])
    full = res0.clone()
    fast.ple_conv(x, full, state, w, torch.tensor([1]), mode="prefill", dilation=d, query_start_loc=query_start_loc)
    if S > 0:
        fast.export_conv_checkpoints(x, state, query_start_loc=query_start_loc, offsets=torch.tensor([off]),
                                     slots=torch.tensor([2]), state_len=S)
    resumed = res0[off:].clone()
    fast.ple_conv(x[off:], resumed, state, w, torch.tensor([2]), mode="prefill", dilation=d,
                  query_start_loc=torch.tensor([0, rest]), has_initial_states=torch.tensor([S > 0]))
    assert_bitwise_equal(resumed, full[off:], name="outputs after restoring the checkpoint")
    assert_bitwise_equal(state[2, :, :S], state[1, :, :S], name="state after restoring the checkpoint")



# ---- errors -----------------------------------------------------------------------------------------


def _bad_calls():
    C, K, d = 5, 3, 2
    x = torch.randn(4, C)
    base = dict(inputs=x, residual=torch.randn(4, C), conv_state=torch.randn(3, C, 8),
                conv_weights=torch.randn(C, K), state_indices=torch.tensor([1, 2]), mode="prefill",
                dilation=d, query_start_loc=torch.tensor([0, 1, 4]))
    return {
        "residual dtype": dict(base, residual=torch.randn(4, C, dtype=torch.float64)),
        "slot out of range": dict(base, state_indices=torch.tensor([1, 3])),
        "repeated slot": dict(base, state_indices=torch.tensor([2, 2])),
        "bad mode": dict(base, mode="chunked"),
        "accepted out of range": dict(base, mode="spec", query_start_loc=torch.tensor([0, 2, 4]),
                                      num_accepted_tokens=torch.tensor([1, 3]), spec_query_len=2),
        "float flags": dict(base, has_initial_states=torch.tensor([1.0, 0.0])),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_ple_conv_errors_match_reference_and_leave_state(case):
    def call(op):
        kw = _bad_calls()[case]
        before = (kw["residual"].clone(), kw["conv_state"].clone())
        args = [kw.pop(k) for k in ("inputs", "residual", "conv_state", "conv_weights", "state_indices")]
        with pytest.raises((ValueError, TypeError)) as err:
            op(*args, **kw)
        assert_bitwise_equal(args[1], before[0], name="residual")
        assert_bitwise_equal(args[2], before[1])
        return err.value

    e_ref, e_fast = call(ref.ple_conv), call(fast.ple_conv)
    assert type(e_fast) is type(e_ref) and str(e_fast) == str(e_ref)


def test_export_errors_match_reference():
    x = torch.randn(10, 3)
    state = torch.randn(2, 3, 4)
    kw = dict(query_start_loc=torch.tensor([0, 10]), offsets=torch.tensor([2]), slots=torch.tensor([1]),
              state_len=4)
    with pytest.raises(ValueError) as e_ref:
        ref.export_conv_checkpoints(x, state.clone(), **kw)
    before = state.clone()
    with pytest.raises(ValueError) as e_fast:
        fast.export_conv_checkpoints(x, state, **kw)
    assert str(e_fast.value) == str(e_ref.value)
    assert_bitwise_equal(state, before)
