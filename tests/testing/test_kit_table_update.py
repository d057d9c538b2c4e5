"""``ple.testing.check_table_update`` (docs/spec.md sections 10 and 11): it passes on every backend's
``table_update`` and fails, naming the rule, the row and the column, on each planted mistake (a copy of the
reference's loop with one thing wrong); ``python -m ple check`` runs it on an object that has the op."""

from __future__ import annotations

import re
import textwrap

import pytest
import torch
from _helpers import assert_planted_mistake_caught
from _tier import examples

import ple
from ple import reference as ref
from ple.__main__ import main
from ple.reference.table_update import rule_constants
from ple.testing import check_table_update
from ple.testing.kit.update import RULES, assert_near_oracle, build_update, check_one_update, oracle


def test_reference_passes():
    check_table_update(ref.table_update, max_examples=30)


def test_torch_backend_passes_in_every_table_dtype():
    check_table_update(ple.vectorized.table_update, max_examples=30,
                       dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64))


@pytest.mark.interpreter
def test_fast_backend_passes():
    from ple import fast
    from ple.fast._library import INTERPRETED
    fn = fast.table_update
    if not INTERPRETED and torch.cuda.is_available():          # compiled: the kernel runs on the GPU
        from ple.testing.device import on_device
        fn = on_device(fn, "cuda")
    check_table_update(fn, max_examples=examples(3), max_dim=40, max_lookups=12)


@pytest.mark.deep
def test_both_backends_pass_many_cases():
    for fn in (ref.table_update, ple.vectorized.table_update):
        check_table_update(fn, max_examples=examples(300), dtypes=(torch.float32, torch.bfloat16, torch.float16))


def test_options_are_checked():
    # A wrong Python type (a single name or dtype where a sequence belongs) is a TypeError, an unknown or missing
    # choice a ValueError; tests/test_error_types.py drives every option of every check.
    for bad, err in (("adam", TypeError), ((), ValueError), (["adam", "lion"], ValueError)):
        with pytest.raises(err, match="^rules: "):
            check_table_update(ref.table_update, rules=bad)
    for bad, err in (((), ValueError), ((torch.int32,), ValueError), (torch.float32, TypeError)):
        with pytest.raises(err, match="^dtypes: "):
            check_table_update(ref.table_update, dtypes=bad)


def test_the_oracle_sums_g_in_lookup_order_and_judges_against_float64():
    """``g`` is the float32 sum in lookup order (1 + 2**-24 - 1 is 0 there), the rest float64; one float32
    rounding of a value passes, a relative error of 1e-4 does not, nor does a NaN."""
    w = torch.zeros(2, 1)
    grad = torch.tensor([[1.0], [2.0**-24], [-1.0]])
    want = oracle(w, torch.tensor([1, 1, 1]), grad, (), rule="sgd", lr=1.0)
    assert want.weight[1].item() == 0.0 and want.weight.dtype == torch.float64
    want = oracle(w, torch.tensor([1, 1, 1]), grad[[0, 2, 1]], (), rule="sgd", lr=1.0)
    assert want.weight[1].item() == -(2.0**-24)
    x = torch.tensor([[1 / 3, 7.0, -1e-3]], dtype=torch.float64)
    assert_near_oracle(x.float(), x, x.abs(), torch.float32, "x")
    assert_near_oracle(x.to(torch.bfloat16), x, x.abs(), torch.bfloat16, "x")
    for bad in (x * (1 + 1e-4), torch.full_like(x, float("nan"))):
        with pytest.raises(AssertionError, match="^x differs at element"):
            assert_near_oracle(bad.float(), x, x.abs(), torch.float32, "x")


def test_the_oracle_scales_follow_the_terms():
    """A value that is a small difference of large terms is judged by the terms' size, the state's too."""
    weight, grad, ids = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 2.0 - 2.0**-20]]), torch.tensor([0])
    want = oracle(weight, ids, grad, (), rule="sgd", lr=1.0)
    assert want.weight[0, 1].item() == 2.0**-20 and want.weight_scale[0, 1] > 3.0
    want = oracle(weight, ids, grad, (-weight, torch.zeros(1)), rule="adam", lr=0.5, betas=(0.5, 0.5))
    assert want.state[0][0, 1].item() == -(2.0**-21) and want.state_scales[0][0, 1] > 1.0


# ---- planted mistakes: copies of the reference's loop with one thing wrong ----------------------------------

def _loop(weight, ids, grad, state, *, rule, lr, weight_decay=0.0, eps=1e-8, betas=(0.9, 0.999), step=1,
          validate=True, square_mean=None, bias_correction=True, write_state=True, add_dtype=torch.float32,
          eps_inside=False, new_buffer=torch.zeros):
    """The reference's loop over the distinct rows; each keyword after ``validate`` plants one mistake."""
    k = rule_constants(rule, lr, weight_decay, eps, betas, step)
    positions: dict[int, list[int]] = {}
    for i, r in enumerate(ids.tolist()):
        positions.setdefault(r, []).append(i)
    for r, where in positions.items():
        w = weight[r].float()
        g = new_buffer(weight.shape[1])
        for i in where:
            g = (g + grad[i].float()).to(add_dtype).float()
        if weight_decay != 0:
            g = g + k["weight_decay"] * w
        sq = (g * g).mean() if square_mean is None else square_mean(g, len(where))
        c1, c2 = (k.get("correction1", 1.0), k.get("correction2", 1.0)) if bias_correction else (1.0, 1.0)
        if rule == "sgd":
            new = w - k["lr"] * g
        elif rule == "adagrad":
            s_r = state[0][r] + sq
            denom = torch.sqrt(s_r + k["eps"]) if eps_inside else torch.sqrt(s_r) + k["eps"]
            new = w - (k["lr"] * g) / denom
            if write_state:
                state[0][r] = s_r
        else:
            m_r = k["b1"] * state[0][r] + k["one_minus_b1"] * g
            v_r = k["b2"] * state[1][r] + k["one_minus_b2"] * sq
            new = w - (k["lr"] * (m_r / c1)) / (torch.sqrt(v_r / c2) + k["eps"])
            if write_state:
                state[0][r], state[1][r] = m_r, v_r
        weight[r] = new.to(weight.dtype)


def duplicates_applied_twice(weight, ids, grad, state, **kw):
    for i in range(ids.shape[0]):                            # each lookup updates its row on its own
        ref.table_update(weight, ids[i:i + 1], grad[i:i + 1], state, **kw)


def padding_lane_updates_row_0(weight, ids, grad, state, **kw):
    ref.table_update(weight, ids, grad, state, **kw)
    if ids.shape[0] and not bool((ids == 0).any()):          # a lane past the end updates row 0, gradient zero
        ref.table_update(weight, ids.new_zeros(1), grad.new_zeros(1, grad.shape[1]), state, **kw)


def mean_over_the_lookups(*args, **kw):
    _loop(*args, square_mean=lambda g, n: (g * g).sum() / n, **kw)


def sum_instead_of_mean(*args, **kw):
    _loop(*args, square_mean=lambda g, n: (g * g).sum(), **kw)


def bias_correction_dropped(*args, **kw):
    _loop(*args, bias_correction=False, **kw)


def eps_inside_the_square_root(*args, **kw):
    _loop(*args, eps_inside=True, **kw)                      # sqrt(s + eps) for sqrt(s) + eps (Adagrad)


def sum_starts_in_an_unwritten_buffer(*args, **kw):
    _loop(*args, new_buffer=torch.empty, **kw)              # torch.empty for torch.zeros: poisoned, NaN


def state_not_written(*args, **kw):
    _loop(*args, write_state=False, **kw)


def sum_rounded_to_bfloat16_per_add(*args, **kw):
    _loop(*args, add_dtype=torch.bfloat16, **kw)


PLANTED = [
    (duplicates_applied_twice, {}, ["table_update", "looked up 2 times", "column", "case: rule="]),
    (padding_lane_updates_row_0, dict(rules=("adam",)), ["table_update adam", "table row 0 (not looked up"]),
    (mean_over_the_lookups, dict(rules=("adagrad", "adam")), ["table_update", "table row", "the reference gives"]),
    (sum_instead_of_mean, dict(rules=("adagrad",)), ["table_update adagrad", "state[0], s ", "table row"]),
    (bias_correction_dropped, dict(rules=("adam",)), ["table_update adam: weight", "column", "step="]),
    (eps_inside_the_square_root, dict(rules=("adagrad",)), ["table_update adagrad: weight", "eps=0.001"]),
    (state_not_written, dict(rules=("adagrad", "adam")), ["state[0]", "table row", "0x"]),
    (sum_starts_in_an_unwritten_buffer, {}, ["table_update", "got nan", "table row"]),
    (sum_rounded_to_bfloat16_per_add, dict(dtypes=(torch.bfloat16,)), ["table_update", "table row", "float64"]),
]


@pytest.mark.parametrize("fn,kw,words", PLANTED, ids=[p[0].__name__ for p in PLANTED])
def test_planted_mistake_is_caught_and_named(fn, kw, words):
    assert_planted_mistake_caught(check_table_update, fn, kw, words, max_examples=40)


def test_the_loop_without_a_planted_mistake_passes():
    """The copy the planted mistakes are made from passes as it is: each mistake is its one change."""
    check_table_update(_loop, max_examples=30)


def test_a_row_written_beside_the_table_or_an_input_changed_is_caught():
    case = dict(rule="sgd", rows=4, D=3, M=2, ids="random", dtype=torch.float32, grad_dtype=torch.float32,
                index_dtype=torch.int64, column_ids=False, wide=True, fresh_state=False, cancel=False,
                nan_rows=False, lr=0.1, weight_decay=0.0, seed=3)
    check_one_update(ref.table_update, case)
    assert build_update(case)["weight"].stride() == (5, 1)

    def writes_beside(weight, *args, **kw):
        ref.table_update(weight, *args, **kw)
        torch.as_strided(weight, (weight.shape[0], 1), weight.stride(), weight.storage_offset() + 3).zero_()

    def sorts_grad(weight, ids, grad, state, **kw):
        ref.table_update(weight, ids, grad, state, **kw)
        grad.copy_(grad.flip(0))
    for fn, words in ((writes_beside, "beyond its 3 columns"), (sorts_grad, "grad (an input)")):
        with pytest.raises(AssertionError, match=re.escape(words)):
            check_one_update(fn, case)


# ---- python -m ple check ------------------------------------------------------------------------------------

def test_the_cli_runs_it_on_an_object_with_the_op(tmp_path, capsys):
    code = main(["check", "ple.vectorized", "--ops", "table_update", "--max-examples", "5"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and len(out) == 1 and out[0].startswith("table_update") and out[0].endswith("ok"), out
    (tmp_path / "my_update.py").write_text(textwrap.dedent("""
        import ple

        def table_update(weight, ids, grad, state, **kw):
            for i in range(ids.shape[0]):             # the planted mistake: a duplicate applied twice
                ple.reference.table_update(weight, ids[i:i + 1], grad[i:i + 1], state, **kw)
    """))
    code = main(["check", str(tmp_path / "my_update.py"), "--max-examples", "30", "--dtypes", "float32"])
    out = capsys.readouterr().out.splitlines()
    lines = dict(line.split(maxsplit=1) for line in out if not line.startswith("("))
    assert code == 1 and list(lines) == ["table_update"], out
    assert "calls" in lines["table_update"] and "FAIL: table_update" in lines["table_update"], out
    assert "; case: rule=" in lines["table_update"], out
    assert out[-1].startswith("(not checked: ngram_ids,") and out[-1].endswith("ple_prefill absent; layer needs "
                                                                                "every op)"), out


def test_rules_are_all_judged():
    """Each rule's state is compared: a case of each rule builds its state from ``state_shapes``."""
    for rule in RULES:
        case = dict(rule=rule, rows=5, D=4, M=6, ids="few", dtype=torch.bfloat16, grad_dtype=torch.bfloat16,
                    index_dtype=torch.int32, column_ids=True, wide=False, fresh_state=True, cancel=True,
                    nan_rows=True, lr=0.1, weight_decay=0.5, eps=1e-3, betas=(0.9, 0.999), step=2, seed=1)
        t = build_update(case)
        assert len(t["state"]) == {"sgd": 0, "adagrad": 1, "adam": 2}[rule]
        assert torch.isnan(t["weight"][~t["touched"]]).all() and not torch.isnan(t["weight"][t["touched"]]).any()
        check_one_update(ple.vectorized.table_update, case)
