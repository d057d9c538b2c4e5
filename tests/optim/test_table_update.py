"""``table_update`` (docs/spec.md section 11) on the reference and torch backends, against the kit's float64 oracle
(``ple.testing.kit.update``, the section's formulas); the two backends bit for bit with each other on the CPU;
untouched rows and their state bit for bit; repeated ids, one id for every lookup, empty steps; float32, bfloat16
and float16 tables; bad arguments refused with nothing modified. (``ple.fast``'s kernel:
``tests/fast/test_table_update.py``.)"""

from __future__ import annotations

import math

import pytest
import torch
from _tier import examples
from hypothesis import given, note, settings
from hypothesis import strategies as st

from ple import _checks
from ple import reference as ref
from ple import vectorized as vec
from ple.testing.kit.update import assert_near_oracle, oracle
from ple.testing.numerics import assert_bitwise_equal

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def cases(draw):
    rows = draw(st.integers(1, 40))
    D = draw(st.sampled_from([1, 2, 3, 8, 17, 160]))
    M = draw(st.integers(0, 60))
    pattern = draw(st.sampled_from(["random", "few", "one"]))
    rule = draw(st.sampled_from(["sgd", "adagrad", "adam"]))
    dtype = draw(st.sampled_from(DTYPES))
    hyper = dict(rule=rule, lr=draw(st.sampled_from([0.0, 1e-3, 0.1, 1.0])),
                 weight_decay=draw(st.sampled_from([0.0, 0.01])), eps=draw(st.sampled_from([1e-8, 1e-3])),
                 betas=draw(st.sampled_from([(0.9, 0.999), (0.0, 0.5)])), step=draw(st.integers(1, 5)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    hi = {"random": rows, "few": min(rows, 3), "one": 1}[pattern]
    ids = torch.randint(0, hi, (M,), generator=g, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    weight = torch.randn(rows, D, generator=g).to(dtype)
    grad = (torch.randn(M, D, generator=g) * 2.0 ** torch.randint(-4, 4, (M, 1), generator=g)).to(dtype)
    shapes = _checks.state_shapes(rule, rows, D)
    state = tuple(torch.rand(s, generator=g) * (0.1 if len(s) == 2 else 1.0) for s in shapes)
    note(f"rows={rows} D={D} M={M} {pattern} {hyper} {dtype} seed={seed}")
    return weight, ids, grad, state, hyper


def _run(fn, weight, ids, grad, state, hyper):
    w, s = weight.clone(), tuple(x.clone() for x in state)
    fn(w, ids, grad, s, **hyper)
    return w, s


@settings(max_examples=examples(40), deadline=None)
@given(cases())
def test_both_backends_equal_the_float64_oracle_and_each_other(case):
    weight, ids, grad, state, hyper = case
    w_ref, s_ref = _run(ref.table_update, weight, ids, grad, state, hyper)
    w_vec, s_vec = _run(vec.table_update, weight, ids, grad, state, hyper)
    assert_bitwise_equal(w_vec, w_ref, name="torch backend weight")
    for a, b in zip(s_vec, s_ref, strict=True):
        assert_bitwise_equal(a, b, name="torch backend state")
    w64, s64, w_scale, s_scale = oracle(weight, ids, grad, state, **hyper)
    touched = torch.zeros(weight.shape[0], dtype=torch.bool)
    touched[ids.long()] = True
    assert_near_oracle(w_ref[touched], w64[touched], w_scale[touched], weight.dtype, "weight", ulps=16)
    for a, b, c in zip(s_ref, s64, s_scale, strict=True):
        assert_near_oracle(a[touched], b[touched], c[touched], torch.float32, "state", ulps=16)
    # Rows not looked up, and their state: bit for bit as they were.
    assert_bitwise_equal(w_ref[~touched], weight[~touched], name="untouched rows")
    for a, b in zip(s_ref, state, strict=True):
        assert_bitwise_equal(a[~touched], b[~touched], name="untouched state")


@pytest.mark.parametrize("fn", [ref.table_update, vec.table_update], ids=["reference", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_looked_up_twice_is_updated_once_with_the_sum(fn, dtype):
    """Two lookups of a row = one lookup with the summed gradient (exact sums here), updated once."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(6, 4, generator=g).to(dtype)
    grad = torch.randint(-4, 5, (3, 4), generator=g).to(dtype) / 4
    for rule in ("sgd", "adagrad", "adam"):
        state = tuple(torch.zeros(s) for s in _checks.state_shapes(rule, 6, 4))
        w2, s2 = _run(fn, weight, torch.tensor([2, 5, 2]), grad, state, dict(rule=rule, lr=0.5))
        once = torch.stack([grad[0].float() + grad[2].float(), grad[1].float()]).to(dtype)
        w1, s1 = _run(fn, weight, torch.tensor([2, 5]), once, state, dict(rule=rule, lr=0.5))
        assert_bitwise_equal(w2, w1, name=f"{rule} weight")
        for a, b in zip(s2, s1, strict=True):
            assert_bitwise_equal(a, b, name=f"{rule} state")


@pytest.mark.parametrize("fn", [ref.table_update, vec.table_update], ids=["reference", "torch"])
def test_the_sum_is_in_lookup_order_in_float32(fn):
    """``g`` is summed one gradient row after another in lookup order, in float32: 1 + 2**-24 - 1 (in that order)
    is 0 in float32, where another order (or float64) keeps 2**-24."""
    weight = torch.zeros(2, 1)
    grad = torch.tensor([[1.0], [2.0**-24], [-1.0]])
    w, _ = _run(fn, weight, torch.tensor([1, 1, 1]), grad, (), dict(rule="sgd", lr=1.0))
    assert w[1].item() == 0.0 and w[0].item() == 0.0
    w, _ = _run(fn, weight, torch.tensor([1, 1, 1]), grad[[0, 2, 1]], (), dict(rule="sgd", lr=1.0))
    assert w[1].item() == -(2.0**-24)


@pytest.mark.parametrize("fn", [ref.table_update, vec.table_update], ids=["reference", "torch"])
def test_adam_bias_correction_and_the_row_mean(fn):
    """Adam's first step moves a row by about lr in the gradient's sign (the bias corrections undo the betas);
    Adagrad's state grows by the mean of the squares over the row (not their sum, not over the lookups)."""
    weight = torch.zeros(3, 4)
    grad = torch.tensor([[1.0, -2.0, 3.0, -4.0], [1.0, 1.0, 1.0, 1.0]])
    m, v = torch.zeros(3, 4), torch.zeros(3)
    w, _ = _run(fn, weight, torch.tensor([0, 2]), grad, (m, v), dict(rule="adam", lr=0.1, step=1))
    # m_hat = g, v_hat = mean(g*g): the update is 0.1 * g / sqrt(mean(g*g)).
    want = -0.1 * grad / grad.square().mean(1, keepdim=True).sqrt()
    torch.testing.assert_close(w[[0, 2]], want, rtol=1e-6, atol=1e-7)
    s = torch.zeros(3)
    w, (s_new,) = _run(fn, weight, torch.tensor([0, 0]), grad, (s,), dict(rule="adagrad", lr=1.0))
    row = grad.sum(0)
    assert s_new[0].item() == pytest.approx(float(row.square().mean()), rel=1e-6)
    assert s_new[1].item() == 0.0 and s_new[2].item() == 0.0


@pytest.mark.parametrize("fn", [ref.table_update, vec.table_update], ids=["reference", "torch"])
def test_empty_steps_change_nothing(fn):
    weight = torch.randn(5, 3)
    state = (torch.rand(5, 3), torch.rand(5))
    w, s = _run(fn, weight, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3), state,
                dict(rule="adam", lr=1.0, step=2))
    assert_bitwise_equal(w, weight, name="weight")
    for a, b in zip(s, state, strict=True):
        assert_bitwise_equal(a, b, name="state")


@pytest.mark.parametrize("fn", [ref.table_update, vec.table_update], ids=["reference", "torch"])
def test_bad_arguments_are_refused_naming_them_and_nothing_changes(fn):
    weight = torch.randn(5, 3)
    ids = torch.tensor([0, 4])
    grad = torch.randn(2, 3)
    s = (torch.zeros(5),)
    kept = weight.clone()
    bad = [
        (dict(lr=-1.0), ValueError, "^lr: "),
        (dict(eps=0.0), ValueError, "^eps: "),
        (dict(weight_decay=-0.1), ValueError, "^weight_decay: "),
        (dict(rule="adam", betas=(1.0, 0.9), state=(torch.zeros(5, 3), torch.zeros(5))), ValueError, r"^betas\[0\]: "),
        (dict(rule="adam", betas=(0.9, -0.1), state=(torch.zeros(5, 3), torch.zeros(5))), ValueError, r"^betas\[1\]: "),
        (dict(rule="lion"), ValueError, "^rule: "),
        (dict(lr=math.nan), ValueError, "^lr: "),
        (dict(step=0), ValueError, "^step: "),
        (dict(ids=torch.tensor([0, 5])), ValueError, "^ids: "),
        (dict(ids=torch.tensor([0.0, 1.0])), TypeError, "^ids: "),
        (dict(grad=torch.randn(3, 3)), ValueError, "^grad: "),
        (dict(state=()), ValueError, "^state: "),
        (dict(state=(torch.zeros(4),)), ValueError, r"^state\[0\]: "),
        (dict(state=(torch.zeros(5, dtype=torch.float64),)), TypeError, r"^state\[0\]: "),
        (dict(weight=torch.zeros(5, 3, dtype=torch.int32)), TypeError, "^weight: "),
    ]
    for change, err, match in bad:
        args = dict(weight=weight, ids=ids, grad=grad, state=s, rule="adagrad", lr=0.1)
        args.update(change)
        with pytest.raises(err, match=match):
            fn(args.pop("weight"), args.pop("ids"), args.pop("grad"), args.pop("state"), **args)
        assert_bitwise_equal(weight, kept, name="weight after a refused call")
        assert not s[0].any()
