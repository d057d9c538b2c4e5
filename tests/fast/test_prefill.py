"""``ple.fast.ple_prefill`` (the fused gate + conv kernel) against ``ple.reference.ple_prefill`` (the
composition of the reference gate, mask, conv and adds); Triton kernels, the interpreter on a CPU.

Outputs and the states' rewritten columns are judged against a float64 run of the reference (the
fast error at most twice the same-dtype reference's own, plus a small floor: the float32 sums over H
run in another order than torch's, and the gate's signed square root amplifies that near s = 0);
every other bit of the state buffers must be unchanged, and state columns that are copies of old
columns must be equal bit for bit. Chunking a request into two calls that carry the state gives the
same bits as one call. Gradients of the forward case against the reference's autograd.
Fresh buffers are poisoned with NaN (``poisoned_empty``), so an element never written shows up.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from _tier import examples
from hypothesis import given, note, settings
from hypothesis import strategies as st

from ple.fast.prefill import ple_prefill as fast_prefill
from ple.fast.prefill import rows_per_program
from ple.reference.prefill import ple_prefill as ref_prefill
from ple.testing.kit.cases import NAN, clone_state, index_tensor, randn, request_rows, rows_view, serving_state
from ple.testing.kit.prefill import prefill_state_masks
from ple.testing.numerics import assert_bitwise_equal, assert_close, assert_no_nan

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("poisoned_empty")]

EPS = 1e-6


def _judge(actual, expected, exact64, name):
    """``|fast - f64| <= 2 |ref - f64| + floor`` (max over the tensor); float64 compared directly."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    if actual.dtype == torch.bfloat16:
        assert_close(actual, expected, exact64=exact64, name=name)
        return
    if actual.dtype == torch.float64:
        assert_close(actual, expected, name=name)
        return
    assert_no_nan(actual, name=name, allowed=expected)
    if actual.numel() == 0:
        return
    ok = ~torch.isnan(expected)
    err_fast = (actual.double() - exact64)[ok].abs().max().item() if ok.any() else 0.0
    err_ref = (expected.double() - exact64)[ok].abs().max().item() if ok.any() else 0.0
    scale = max(1.0, exact64[ok].abs().max().item()) if ok.any() else 1.0
    assert err_fast <= 2 * err_ref + 1e-5 * scale, f"{name}: error {err_fast:.3g} vs reference's {err_ref:.3g}"


@st.composite
def cases(draw, serving):
    lens = draw(st.lists(st.one_of(st.just(0), st.just(1), st.integers(2, 12), st.integers(40, 130)),
                         min_size=1, max_size=4))
    return dict(
        serving=serving, lens=lens, M=draw(st.integers(1, 3)), H=draw(st.sampled_from([1, 3, 8, 40])),
        K=draw(st.integers(1, 5)), dilation=draw(st.integers(1, 4)),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64])),
        keep=draw(st.sampled_from([None, "bool", "int"])),
        weight_layout=draw(st.sampled_from(["ck", "kc"])),
        strided_rows=draw(st.booleans()),
        state_dtype=draw(st.sampled_from(["same", "float32"])),
        layout=draw(st.sampled_from(["cw", "wc", "tail"])),
        extra_w=draw(st.integers(0, 2)), extra_slots=draw(st.integers(1, 3)),
        null_at_end=draw(st.booleans()),
        null_requests=draw(st.lists(st.booleans(), min_size=len(lens), max_size=len(lens))),
        init=draw(st.sampled_from([None, "bool", "int"])),
        init_values=draw(st.lists(st.booleans(), min_size=len(lens), max_size=len(lens))),
        token_indices=draw(st.booleans()) if serving else False,
        extra_rows=draw(st.integers(0, 3)),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        column_indices=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _build(case):
    g = torch.Generator().manual_seed(case["seed"])
    M, H, K, d, lens, dt = case["M"], case["H"], case["K"], case["dilation"], case["lens"], case["dtype"]
    C, S, R = M * H, (K - 1) * d, len(lens)
    ix, col = case["index_dtype"], case["column_indices"]
    query_start_loc_list, T, rows, token_indices = request_rows(
        lens, g, case["extra_rows"] if case["token_indices"] else None, ix, col)

    def rows_of(width, scale=1.0):
        return rows_view(T, width, dt, g, case["strided_rows"], scale)

    t = dict(key=rows_of(C, 2.0), value=rows_of(H), hidden=rows_of(C),
             weights=[randn((C,), dt, g, 0.5) for _ in range(3)],
             conv_weights=randn((C, K), dt, g) if case["weight_layout"] == "ck" else randn((K, C), dt, g).t(),
             query_start_loc=torch.tensor(query_start_loc_list, dtype=ix), token_indices=token_indices, rows=rows, T=T,
             outside=sorted(set(range(T)) - set(rows)), keep=None, state=None, buf=None, state_indices=None, init=None,
             null_slot=0)
    for name in ("key", "value", "hidden"):                 # rows outside the call: never read
        t[name][t["outside"]] = NAN
    if case["keep"] is not None:
        kv = torch.rand(T, generator=g) < 0.7
        t["keep"] = kv if case["keep"] == "bool" else kv.to(ix) * 3   # non-zero keeps
    if not case["serving"]:
        return t
    W = S + case["extra_w"]
    num_slots, null_slot, state_indices_list, state, buf = serving_state(case, R, C, W, dt, g)
    has_init = [False] * R
    if case["init"] is not None:
        has_init = list(case["init_values"])
        t["init"] = torch.tensor(has_init, dtype=torch.bool if case["init"] == "bool" else ix)
    masks = prefill_state_masks(state_indices_list, lens, has_init, null_slot, S, num_slots, W)
    state[~masks["read"][:, None, :].expand(state.shape)] = NAN      # poison every column the call must not read
    t.update(state=state, buf=buf, state_indices=index_tensor(state_indices_list, ix, col), null_slot=null_slot,
             written=masks["written"], copied=masks["copied"], has_init=has_init)   # copied: old columns moved
    return t


def _call(op, t, case, state=None, dtype=None):
    cast = (lambda x: x) if dtype is None else (lambda x: x.to(dtype))
    kw = dict(dilation=case["dilation"], query_start_loc=t["query_start_loc"], keep=t["keep"])
    if case["serving"]:
        kw.update(conv_state=state, state_indices=t["state_indices"], has_initial_states=t["init"],
                  token_indices=t["token_indices"], null_slot=t["null_slot"])
    return op(cast(t["key"]), cast(t["value"]), cast(t["hidden"]), *[cast(w) for w in t["weights"]], EPS,
              cast(t["conv_weights"]), **kw)


def _check(case):
    t = _build(case)
    serving = case["serving"]
    (st_ref, buf_ref), (st_fast, buf_fast), (st64, buf64) = ((None, None),) * 3
    if serving:
        (st_ref, buf_ref), (st_fast, buf_fast) = clone_state(t), clone_state(t)
        st64, buf64 = clone_state(t, torch.float64)
    out_ref = _call(ref_prefill, t, case, st_ref)
    out_fast = _call(fast_prefill, t, case, st_fast)
    out64 = _call(ref_prefill, t, case, st64, torch.float64)
    rows = t["rows"]
    _judge(out_fast[rows], out_ref[rows], out64[rows], "out")
    assert_no_nan(out_fast[rows], name="out rows of the call")
    if t["outside"]:
        assert (out_fast[t["outside"]] == 0).all(), "a row outside the call is not zero"
    if not serving:
        return
    written = t["written"][:, None, :].expand(st_fast.shape)
    copied = t["copied"][:, None, :].expand(st_fast.shape)
    fresh = written & ~copied                              # new columns computed from this call's rows
    _judge(st_fast[fresh], st_ref[fresh], st64[fresh].to(torch.float64), "new state columns")
    assert_bitwise_equal(st_fast[copied], st_ref[copied], name="state columns moved from old columns")
    assert_no_nan(st_fast[written], name="state columns the call must rewrite")
    st_fast[written] = 0                                    # everything else: the bits it had
    st_ref[written] = 0
    assert_bitwise_equal(buf_fast, buf_ref, name="conv_state buffer outside the new columns")


@given(data=st.data())
@settings(max_examples=examples(4))
def test_prefill_forward_matches_reference(data):
    case = data.draw(cases(False))
    note(repr(case))
    _check(case)


@settings(max_examples=examples(3))
@given(data=st.data())
def test_prefill_serving_matches_reference(data):
    case = data.draw(cases(True))
    note(repr(case))
    _check(case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_model_shape_tiles(dtype):
    """K 4, dilation 3 (S 9), requests spanning several tiles, halos read from the state and across tiles."""
    tile = rows_per_program(9) - 9
    case = dict(serving=True, lens=[2 * tile + 5, 4, 0, tile + 1, 3], M=2, H=8, K=4, dilation=3, dtype=dtype,
                keep="bool", weight_layout="ck", strided_rows=False, state_dtype="same", layout="wc", extra_w=0,
                extra_slots=1, null_at_end=False, null_requests=[False, False, False, True, False],
                init="bool", init_values=[True, True, False, True, False], token_indices=True, extra_rows=2,
                index_dtype=torch.int32, column_indices=True, seed=3)
    _check(case)
    _check(dict(case, serving=False, token_indices=False))


@settings(max_examples=examples(3))
@given(n=st.integers(1, 80), cut=st.integers(0, 80), K=st.integers(1, 5), d=st.integers(1, 3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), init=st.booleans(), keep=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_prefill_chunks_carry_state_bitwise(n, cut, K, d, dtype, init, keep, seed):
    """One request in two calls (the second reading the state the first wrote) = one call, bit for bit."""
    cut = min(cut, n)
    note(dict(n=n, cut=cut, K=K, d=d, dtype=dtype, init=init, keep=keep, seed=seed))
    g = torch.Generator().manual_seed(seed)
    M, H = 2, 8
    C, S = M * H, (K - 1) * d
    key, value, hidden = randn((n, C), dtype, g, 2.0), randn((n, H), dtype, g), randn((n, C), dtype, g)
    weights = [randn((C,), dtype, g, 0.5) for _ in range(3)]
    w = randn((C, K), dtype, g)
    kp = torch.rand(n, generator=g) < 0.7 if keep else None
    state0 = randn((3, S + 1, C), dtype, g).transpose(1, 2)

    def call(lo, hi, state, has_init):
        return fast_prefill(key[lo:hi], value[lo:hi], hidden[lo:hi], *weights, EPS, w, dilation=d,
                            query_start_loc=torch.tensor([0, hi - lo]), keep=None if kp is None else kp[lo:hi],
                            conv_state=state, state_indices=torch.tensor([2]),
                            has_initial_states=torch.tensor([has_init]))

    whole_state = state0.clone()
    whole = call(0, n, whole_state, init)
    split_state = state0.clone()
    first = call(0, cut, split_state, init)
    second = call(cut, n, split_state, True if cut else init)
    assert_bitwise_equal(torch.cat([first, second]), whole, name="out")
    assert_bitwise_equal(split_state, whole_state, name="conv_state")
    if not init:   # a fresh sequence: the serving prefill is the forward
        fwd = fast_prefill(key, value, hidden, *weights, EPS, w, dilation=d, query_start_loc=torch.tensor([0, n]),
                           keep=kp)
        assert_bitwise_equal(fwd, whole, name="forward vs serving prefill")


def _grads(fn, tensors, dout, case):
    leaves = [x.detach().requires_grad_() for x in tensors]
    key, value, hidden, wk, wq, wc, w = leaves
    out = fn(key, value, hidden, wk, wq, wc, EPS, w, dilation=case["d"], query_start_loc=case["query_start_loc"],
             keep=case["keep"])
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


@settings(max_examples=examples(2))
@given(lens=st.lists(st.integers(0, 20), min_size=1, max_size=3), M=st.integers(1, 2),
       H=st.sampled_from([3, 8]), K=st.integers(1, 4), d=st.integers(1, 3), keep=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_prefill_gradients(lens, M, H, K, d, keep, dtype, seed):
    """The forward case's gradients (all seven inputs) against the reference's autograd."""
    note(dict(lens=lens, M=M, H=H, K=K, d=d, keep=keep, dtype=dtype, seed=seed))
    g = torch.Generator().manual_seed(seed)
    T, C = sum(lens), M * H
    tensors = [randn((T, C), dtype, g, 2.0), randn((T, H), dtype, g), randn((T, C), dtype, g),
               *[randn((C,), dtype, g, 0.5) for _ in range(3)], randn((C, K), dtype, g)]
    query_start_loc_list = [0]
    for n in lens:
        query_start_loc_list.append(query_start_loc_list[-1] + n)
    case = dict(d=d, query_start_loc=torch.tensor(query_start_loc_list),
                keep=(torch.rand(T, generator=g) < 0.7) if keep else None)
    dout = randn((T, C), dtype, g)
    exp = _grads(ref_prefill, tensors, dout, case)
    act = _grads(fast_prefill, tensors, dout, case)
    e64 = _grads(ref_prefill, [x.double() for x in tensors], dout.double(), case)
    names = ("out", "key", "value", "hidden_states", "norm_key_weight", "norm_query_weight", "norm_conv_weight",
             "conv_weights")
    for name, a, e, x in zip(names, act, exp, e64, strict=True):
        _judge(a, e, x, f"grad {name}" if name != "out" else name)


@pytest.mark.deep       # ~10 s interpreted; quick: test_prefill_gradients judges the gradients against float64
def test_prefill_gradcheck_float64():
    g = torch.Generator().manual_seed(5)
    T, M, H, K = 7, 2, 3, 3
    C = M * H
    tensors = [randn(s, torch.float64, g).requires_grad_() for s in ((T, C), (T, H), (T, C), (C,), (C,), (C,),
                                                                      (C, K))]
    query_start_loc, keep = torch.tensor([0, 4, 7]), torch.tensor([True, True, False, True, True, True, False])

    def f(key, value, hidden, wk, wq, wc, w):
        return fast_prefill(key, value, hidden, wk, wq, wc, EPS, w, dilation=2, query_start_loc=query_start_loc,
                            keep=keep)

    assert torch.autograd.gradcheck(f, tensors, eps=1e-6, atol=1e-5, rtol=1e-4, fast_mode=True)


def _bad_calls():
    g = torch.Generator().manual_seed(0)
    T, C, H, K = 4, 6, 3, 2
    base = [randn(s, torch.float32, g) for s in ((T, C), (T, H), (T, C), (C,), (C,), (C,))]
    w = randn((C, K), torch.float32, g)
    query_start_loc = torch.tensor([0, 1, 4])
    state = torch.zeros(3, C, 2)
    kw = dict(dilation=1, query_start_loc=query_start_loc)
    yield "token_indices without a state", dict(kw, token_indices=torch.arange(4)), base, w
    yield "keep shape", dict(kw, keep=torch.ones(3, dtype=torch.bool)), base, w
    yield "keep float", dict(kw, keep=torch.ones(4)), base, w
    yield "offsets end", dict(kw, query_start_loc=torch.tensor([0, 3])), base, w
    yield "conv_weights channels", kw, base, randn((C + 1, K), torch.float32, g)
    yield "state without indices", dict(kw, conv_state=state), base, w
    yield "slot range", dict(kw, conv_state=state, state_indices=torch.tensor([1, 5])), base, w
    yield "repeated slot", dict(kw, conv_state=state, state_indices=torch.tensor([1, 1])), base, w
    yield "value dtype", kw, [base[0], base[1].double(), *base[2:]], w


@pytest.mark.parametrize("case", list(_bad_calls()), ids=lambda c: c[0])
def test_prefill_errors_match_reference(case):
    _, kw, tensors, w = case
    with pytest.raises((ValueError, TypeError)) as expected:
        ref_prefill(*tensors, EPS, w, **kw)
    with pytest.raises(expected.type) as actual:
        fast_prefill(*tensors, EPS, w, **kw)
    assert str(actual.value) == str(expected.value)
    assert str(expected.value).split(":")[0] in inspect.signature(ref_prefill).parameters     # names its argument
