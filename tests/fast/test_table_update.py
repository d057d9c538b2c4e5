"""``ple.fast.table_update`` (docs/spec.md section 11): the Triton kernel against ``ple.reference`` and a float64
oracle written here from the reference's formulas.

* Wherever the sum of ``g * g`` is exact (integer-valued gradients and weights, a power-of-two weight decay),
  every rule equals the reference bit for bit: the order of operations, the float32 scalars, the correctly
  rounded square roots and divisions, the one rounding to the table's dtype. The state (no square root in it)
  equals the plain reference's; the rows equal the reference run with a correctly rounded square root
  (`reference_ieee`: torch's CPU float32 ``sqrt`` is one ulp off for some inputs), SGD's the plain reference's.
* On random values: SGD and Adam's first moment (which hold ``g`` with no mean) bit for bit; the rest within
  the float32 tolerance of ``ple.testing.numerics`` of the float64 oracle (bfloat16 / float16 tables judged
  by ``assert_close(..., exact64=...)``).
* Untouched rows and their state bit for bit; repeated ids, one id for every lookup, empty steps; the same
  bits run after run and for every ``_UNROLL``; int32 / int64 ids; non-contiguous gradients and tables.

The kernel runs under ``TRITON_INTERPRET=1`` on the CPU (small shapes) and compiled on a GPU (`_fast` moves
the call there and copies the updated rows and state back).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from _tier import examples
from hypothesis import given, note, settings
from hypothesis import strategies as st

import ple.fast
from ple import _checks
from ple import reference as ref
from ple.fast._library import INTERPRETED
from ple.testing.numerics import TOLERANCES, assert_bitwise_equal, assert_close

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("poisoned_empty")]

TU = importlib.import_module("ple.fast.table_update")      # the module (``ple.fast.table_update`` is the op)
TU_REF = importlib.import_module("ple.reference.table_update")
RULES = ("sgd", "adagrad", "adam")
TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def _fast(weight, ids, grad, state, **hyper):
    """``ple.fast.table_update`` in place; on a GPU machine (kernels compiled) run on the GPU, copied back."""
    if INTERPRETED or not torch.cuda.is_available():
        return ple.fast.table_update(weight, ids, grad, state, **hyper)
    moved = [t.to("cuda") for t in (weight, ids, grad, *state)]
    ple.fast.table_update(moved[0], moved[1], moved[2], tuple(moved[3:]), **hyper)
    with torch.no_grad():
        for orig, new in zip((weight, *state), (moved[0], *moved[3:]), strict=True):
            orig.copy_(new)


def _run(fn, weight, ids, grad, state, hyper):
    """``fn`` on copies of ``weight`` and ``state`` (the same strides, a view's base included)."""
    w = _clone(weight)
    s = tuple(_clone(x) for x in state)
    fn(w, ids, grad, s, **hyper)
    return w, s


def _clone(t):
    """A copy with ``t``'s strides; a view of a wider buffer stays a view of a copy of that buffer."""
    if t._base is not None:
        return t._base.clone().as_strided(t.shape, t.stride(), t.storage_offset())
    return t.clone()


def oracle64(weight, ids, grad, state, *, rule, lr, weight_decay=0.0, eps=1e-8, betas=(0.9, 0.999), step=1):
    """The reference's formulas in float64 (exact hyperparameters, exact row sums): ``(weight, state)``."""
    w = weight.double().clone()
    s = [x.double().clone() for x in state]
    g_all, flat = grad.double(), ids.long()
    b1, b2 = betas
    for r in dict.fromkeys(flat.tolist()):
        g = g_all[flat == r].sum(0)
        if weight_decay:
            g = g + weight_decay * w[r]
        if rule == "sgd":
            w[r] = w[r] - lr * g
        elif rule == "adagrad":
            s[0][r] += (g * g).mean()
            w[r] = w[r] - lr * g / (s[0][r].sqrt() + eps)
        else:
            s[0][r] = b1 * s[0][r] + (1 - b1) * g
            s[1][r] = b2 * s[1][r] + (1 - b2) * (g * g).mean()
            w[r] = w[r] - lr * (s[0][r] / (1 - b1**step)) / ((s[1][r] / (1 - b2**step)).sqrt() + eps)
    return w, s


class _IEEETorch:
    """``torch`` with a correctly rounded float32 ``sqrt`` (float64's, rounded once to float32: exact for a square
    root), for `reference_ieee`. torch's own CPU float32 ``sqrt`` is not correctly rounded everywhere (torch 2.13:
    about one input in seven is one ulp off), where ``tl.sqrt_rn`` and the reference's stated rounding are."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def sqrt(x):
        return torch.sqrt(x.double()).to(x.dtype)


def reference_ieee(weight, ids, grad, state, **hyper):
    """``ple.reference.table_update`` with every float32 operation correctly rounded (its ``sqrt`` as `_IEEETorch`)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TU_REF, "torch", _IEEETorch())
        ref.table_update(weight, ids, grad, state, **hyper)


def _touched(ids, rows):
    t = torch.zeros(rows, dtype=torch.bool)
    t[ids.long()] = True
    return t


def _assert_untouched(weight, state, w_new, s_new, ids):
    """Rows not looked up, and their state, bit for bit as they were."""
    keep = ~_touched(ids, weight.shape[0])
    assert_bitwise_equal(w_new[keep], weight[keep], name="untouched rows")
    for i, (a, b) in enumerate(zip(s_new, state, strict=True)):
        assert_bitwise_equal(a[keep], b[keep], name=f"untouched state[{i}]")


def _state(rule, rows, D, g):
    """Random float32 state: Adagrad's s and Adam's v >= 0, Adam's m of either sign."""
    shapes = _checks.state_shapes(rule, rows, D)
    return tuple(torch.randn(s, generator=g) if len(s) == 2 else torch.rand(s, generator=g) for s in shapes)


def _layout(weight, grad, strided):
    """``strided``: the table a column slice of a wider buffer, the gradient stored transposed."""
    if not strided:
        return weight, grad
    wide = torch.full((weight.shape[0], weight.shape[1] + 3), -5.0, dtype=weight.dtype)
    wide[:, 1:1 + weight.shape[1]] = weight
    return wide[:, 1:1 + weight.shape[1]], grad.t().contiguous().t()


def _assert_reference_bits(weight, ids, grad, state, hyper, w_fast, s_fast):
    """Where every sum of ``g * g`` is exact: the state is the reference's bit for bit (no square root in it);
    the rows are the reference's with a correctly rounded square root (`reference_ieee`) bit for bit, and SGD's
    (no square root) the plain reference's."""
    rule = hyper["rule"]
    w_ref, s_ref = _run(ref.table_update, weight, ids, grad, state, hyper)
    w_ieee, _ = _run(reference_ieee, weight, ids, grad, state, hyper)
    assert_bitwise_equal(w_fast, w_ieee, name=f"{rule} weight")
    if rule == "sgd":
        assert_bitwise_equal(w_fast, w_ref, name="sgd weight (the plain reference)")
    for i, (a, b) in enumerate(zip(s_fast, s_ref, strict=True)):
        assert_bitwise_equal(a, b, name=f"{rule} state[{i}]")


@st.composite
def cases(draw, exact: bool):
    """A call: table, ids, gradient, state, hyperparameters. ``exact``: integer-valued weights and gradients and
    a power-of-two weight decay, so every sum of ``g * g`` is exact in float32, whatever its order."""
    rows, D, M = draw(st.integers(1, 6)), draw(st.integers(1, 9)), draw(st.integers(0, 14))
    rule, dtype = draw(st.sampled_from(RULES)), draw(st.sampled_from(TABLE_DTYPES))
    hyper = dict(rule=rule, lr=draw(st.sampled_from([1e-3, 0.1, 0.7, 1.0])),
                 weight_decay=draw(st.sampled_from([0.0, 0.25, 0.5] if exact else [0.0, 0.01, 0.3])),
                 eps=draw(st.sampled_from([1e-8, 1e-3, 0.1])),
                 betas=draw(st.sampled_from([(0.9, 0.999), (0.0, 0.5), (0.5, 0.0), (0.3, 0.77)])),
                 step=draw(st.sampled_from([1, 1, 2, 7])))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    hi = draw(st.sampled_from([rows, min(rows, 2), 1]))             # every row, few rows (long runs), one row
    ids = torch.randint(0, hi, (M,), generator=g).to(draw(st.sampled_from(INDEX_DTYPES)))
    grad_dtype = draw(st.sampled_from(GRAD_DTYPES))
    if exact:
        weight = torch.randint(-8, 9, (rows, D), generator=g).to(dtype)
        grad = torch.randint(-16, 17, (M, D), generator=g).to(grad_dtype)
    else:
        weight = torch.randn(rows, D, generator=g).to(dtype)
        grad = torch.randn(M, D, generator=g).to(grad_dtype)
    weight, grad = _layout(weight, grad, draw(st.booleans()))
    state = _state(rule, rows, D, g)
    note(f"rows={rows} D={D} M={M} hi={hi} {dtype} grad {grad_dtype} ids {ids.dtype} {hyper} seed={seed} "
         f"strided={not grad.is_contiguous()}")
    return weight, ids, grad, state, hyper


@settings(max_examples=examples(25), deadline=None)
@given(cases(exact=True))
def test_every_rule_equals_the_reference_bit_for_bit_where_the_sums_are_exact(case):
    weight, ids, grad, state, hyper = case
    w_fast, s_fast = _run(_fast, weight, ids, grad, state, hyper)
    _assert_reference_bits(weight, ids, grad, state, hyper, w_fast, s_fast)
    _assert_untouched(weight, state, w_fast, s_fast, ids)
    if weight._base is not None:                                    # the buffer's other columns: untouched
        assert_bitwise_equal(w_fast._base, _with_columns(weight, w_fast), name="the table's buffer")


def _with_columns(view, new):
    """``view``'s whole buffer with ``new``'s values in ``view``'s columns."""
    out = _clone(view)
    out.copy_(new)
    return out._base


def _judge(name, got, want_ref, want64):
    """Fast against the reference and the float64 oracle: float32 tolerance (``TOLERANCES``) for float32 /
    float64 results (the kernel computes in float32 for every table), ``exact64`` for bfloat16 / float16."""
    if got.dtype in (torch.bfloat16, torch.float16):
        assert_close(got, want_ref, exact64=want64, name=name)
        return
    rtol, atol = TOLERANCES[torch.float32]
    torch.testing.assert_close(got.double(), want64, rtol=rtol, atol=atol, msg=lambda m: f"{name} vs float64: {m}")
    torch.testing.assert_close(got.double(), want_ref.double(), rtol=rtol, atol=atol,
                               msg=lambda m: f"{name} vs reference: {m}")


@settings(max_examples=examples(25), deadline=None)
@given(cases(exact=False))
def test_random_values_against_the_float64_oracle(case):
    weight, ids, grad, state, hyper = case
    rule = hyper["rule"]
    w_ref, s_ref = _run(ref.table_update, weight, ids, grad, state, hyper)
    w_fast, s_fast = _run(_fast, weight, ids, grad, state, hyper)
    w64, s64 = oracle64(weight, ids, grad, state, **hyper)
    if rule == "sgd":                                               # no mean: the reference's bits
        assert_bitwise_equal(w_fast, w_ref, name="sgd weight")
    if rule == "adam":                                              # m holds g (and no mean): its bits
        assert_bitwise_equal(s_fast[0], s_ref[0], name="adam m")
    touched = _touched(ids, weight.shape[0])
    _judge(f"{rule} weight", w_fast[touched], w_ref[touched], w64[touched])
    for i, (a, b, c) in enumerate(zip(s_fast, s_ref, s64, strict=True)):
        _judge(f"{rule} state[{i}]", a[touched], b[touched], c[touched])
    _assert_untouched(weight, state, w_fast, s_fast, ids)


@pytest.mark.parametrize("rule", RULES)
def test_the_same_bits_run_after_run_and_for_every_unroll(rule, monkeypatch):
    """Long runs of few rows, gradients over a wide range (so the order of the adds shows in the bits): the
    same bits on every run and whatever ``_UNROLL`` is; ``g`` the reference's (SGD and Adam's m equal it)."""
    g = torch.Generator().manual_seed(7)
    rows, D, M = 4, 11, 29
    weight = torch.randn(rows, D, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 3, (M,), generator=g)                   # row 3 is never looked up
    grad = torch.randn(M, D, generator=g) * 2.0 ** torch.randint(-20, 20, (M, 1), generator=g)
    state = _state(rule, rows, D, g)
    hyper = dict(rule=rule, lr=0.1, weight_decay=0.01, step=3)
    results = []
    for unroll in (8, 1, 3, 8, 32):
        monkeypatch.setattr(TU, "_UNROLL", unroll)
        results.append(_run(_fast, weight, ids, grad, state, hyper))
    for w, s in results[1:]:
        assert_bitwise_equal(w, results[0][0], name="weight, another run / unroll")
        for a, b in zip(s, results[0][1], strict=True):
            assert_bitwise_equal(a, b, name="state, another run / unroll")
    w_ref, s_ref = _run(ref.table_update, weight, ids, grad, state, hyper)
    if rule == "sgd":
        assert_bitwise_equal(results[0][0], w_ref, name="sgd weight")
    if rule == "adam":
        assert_bitwise_equal(results[0][1][0], s_ref[0], name="adam m")
    _assert_untouched(weight, state, *results[0], ids)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_lookup_the_same_row(rule, dtype):
    """One run over all M positions: the row updated once with the sum in lookup order (the reference's bits on
    integer gradients), every other row and its state untouched."""
    g = torch.Generator().manual_seed(11)
    rows, D, M = 5, 7, 23
    weight = torch.randint(-8, 9, (rows, D), generator=g).to(dtype)
    ids = torch.full((M,), 3, dtype=torch.int32)
    grad = torch.randint(-16, 17, (M, D), generator=g).float()
    state = _state(rule, rows, D, g)
    hyper = dict(rule=rule, lr=0.25, weight_decay=0.5, step=2)
    w_fast, s_fast = _run(_fast, weight, ids, grad, state, hyper)
    _assert_reference_bits(weight, ids, grad, state, hyper, w_fast, s_fast)
    _assert_untouched(weight, state, w_fast, s_fast, ids)
    assert not torch.equal(w_fast[3], weight[3])


@pytest.mark.parametrize(("rule", "D"), [("adagrad", 160), ("adam", 160), ("adam", 300)])
def test_rows_of_the_model_width_and_wider(rule, D):
    """D 160 (the model's, one program's 256 columns masked to 160) and 300 (512 columns): bfloat16 table and
    gradient, integer values: the reference's bits."""
    g = torch.Generator().manual_seed(D)
    rows, M = 6, 9
    weight = torch.randint(-8, 9, (rows, D), generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 4, (M,), generator=g)
    grad = torch.randint(-16, 17, (M, D), generator=g).to(torch.bfloat16)
    state = _state(rule, rows, D, g)
    hyper = dict(rule=rule, lr=0.01, weight_decay=0.25, step=3)
    w_fast, s_fast = _run(_fast, weight, ids, grad, state, hyper)
    _assert_reference_bits(weight, ids, grad, state, hyper, w_fast, s_fast)
    _assert_untouched(weight, state, w_fast, s_fast, ids)


def test_the_sum_is_in_lookup_order_in_float32():
    """1 + 2**-24 - 1 in lookup order is 0 in float32, where another order (or float64) keeps 2**-24."""
    grad = torch.tensor([[1.0], [2.0**-24], [-1.0]])
    ids = torch.tensor([1, 1, 1])
    w, _ = _run(_fast, torch.zeros(2, 1), ids, grad, (), dict(rule="sgd", lr=1.0))
    assert w[1].item() == 0.0 and w[0].item() == 0.0
    w, _ = _run(_fast, torch.zeros(2, 1), ids, grad[[0, 2, 1]], (), dict(rule="sgd", lr=1.0))
    assert w[1].item() == -(2.0**-24)


@pytest.mark.parametrize("rule", RULES)
def test_an_empty_step_launches_nothing_and_changes_nothing(rule, monkeypatch):
    monkeypatch.setattr(TU, "_update_kernel", None)                 # a launch would fail
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(5, 3, generator=g)
    state = _state(rule, 5, 3, g)
    w, s = _run(_fast, weight, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3), state,
                dict(rule=rule, lr=1.0, step=2))
    assert_bitwise_equal(w, weight, name="weight")
    for a, b in zip(s, state, strict=True):
        assert_bitwise_equal(a, b, name="state")


def test_bad_ids_are_refused_and_nothing_changes():
    weight, s = torch.randn(5, 3), (torch.rand(5),)
    kept, kept_s = weight.clone(), s[0].clone()
    with pytest.raises(ValueError, match="^ids: "):
        _fast(weight, torch.tensor([0, 5]), torch.randn(2, 3), s, rule="adagrad", lr=1.0)
    with pytest.raises(TypeError, match=r"^state\[0\]: "):
        _fast(weight, torch.tensor([0, 4]), torch.randn(2, 3), (torch.rand(5, dtype=torch.float64),),
              rule="adagrad", lr=1.0)
    assert_bitwise_equal(weight, kept, name="weight")
    assert_bitwise_equal(s[0], kept_s, name="state")
    _fast(weight, torch.tensor([0, 4]), torch.randn(2, 3), s, rule="adagrad", lr=1.0, validate=False)
    assert not torch.equal(weight, kept) and not torch.equal(s[0], kept_s)


def test_the_registered_op_passes_opcheck():
    """``torch.ops.ple.table_update``: schema (weight and state mutated), fake and dispatch (``opcheck``)."""
    g = torch.Generator().manual_seed(5)
    args = (torch.randn(4, 3, generator=g), torch.tensor([1, 3, 1]), torch.randn(3, 3, generator=g),
            [torch.randn(4, 3, generator=g), torch.rand(4, generator=g)], "adam", 0.1, 0.0, 1e-8, 0.9, 0.999, 2, True)
    if not INTERPRETED and torch.cuda.is_available():
        args = tuple(a.cuda() if isinstance(a, torch.Tensor) else [t.cuda() for t in a] if isinstance(a, list)
                     else a for a in args)
    torch.library.opcheck(torch.ops.ple.table_update.default, args)
