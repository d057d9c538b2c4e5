"""`check_table_update`: one row-wise optimizer step (docs/spec.md section 11) against a float64 oracle.

``table_update(weight, ids, grad, state, *, rule, lr, ...)`` updates, in place, the rows a step looked up
and their state. The check builds each case on the CPU, runs the user's function on copies (fresh buffers
NaN-poisoned) and judges what it wrote:

* every row looked up, and its state, against `oracle`: the section's formulas in float64 from ``g``, the
  float32 sum of the row's gradient rows in lookup order (computed exactly as the section prescribes it),
  within section 8's float32 tolerance (1e-5) of the scale of the terms each value is made of, plus, for a
  bfloat16 / float16 table, the one rounding of the float32 result to the table's dtype
  (`assert_near_oracle`). The reference's bits are not required: a fused kernel may sum ``mean(g * g)``
  in its own order;
* everything else bit for bit: the rows not looked up and their state (in some cases NaNs whose bits all
  differ), the columns beside a table that is a column slice of a wider buffer, ``ids`` and ``grad``.

A failure names the rule, the row (how often and where it was looked up), the column, the value with its
bits, the float64 value and the tolerance, what the reference gives there, and the smallest case.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from hypothesis import strategies as st

from ... import _checks
from ... import reference as ref
from ..numerics import TOLERANCES
from ._options import check_options
from ._report import _value, compare_bits, fmt_case, poisoned_empty
from .cases import fill_nans_, index_tensor, randn
from .ops import _prop

__all__ = ["RULES", "Oracle", "oracle", "row_gradients", "tolerance", "assert_near_oracle", "update_cases",
           "hyperparameters", "build_update", "check_one_update", "check_table_update"]

RULES = ("sgd", "adagrad", "adam")
"""The rules of ``table_update`` (docs/spec.md section 11)."""

RTOL = TOLERANCES[torch.float32][0]
"""Section 8's float32 tolerance, 1e-5 (about 168 float32 ulps), taken relative to the scale of the terms."""

MANTISSA = {torch.float64: 52, torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


# ---- the oracle ------------------------------------------------------------------------------------------

class Oracle(NamedTuple):
    """A step in float64: the new table and state (rows not looked up as given), and for each value the
    scale of its float32 rounding errors (the sum of the magnitudes of the terms it is made of)."""

    weight: torch.Tensor
    state: list[torch.Tensor]
    weight_scale: torch.Tensor
    state_scales: list[torch.Tensor]


def row_gradients(ids: torch.Tensor, grad: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each distinct row's ``g`` as section 11 prescribes it, keyed by row in the order of first lookup: the
    float32 sum of its gradient rows, from zeros, one add after another in lookup order."""
    grad32 = grad.detach().cpu().float()
    out: dict[int, torch.Tensor] = {}
    for i, r in enumerate(ids.tolist()):
        out[r] = out.get(r, torch.zeros(grad.shape[1], dtype=torch.float32)) + grad32[i]   # rounded at each add
    return out


def oracle(weight: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, state: Sequence[torch.Tensor], *,
           rule: str, lr: float, weight_decay: float = 0.0, eps: float = 1e-8,
           betas: tuple[float, float] = (0.9, 0.999), step: int = 1) -> Oracle:
    """The section's formulas in float64, from ``g`` of `row_gradients` (float32, as prescribed); nothing is
    modified. The scales follow each rounding error through the formulas: ``g``'s terms (``|g| +
    weight_decay * |w|``), the mean of their squares, the state's terms, and for the step ``lr * num /
    denom`` both the numerator's terms and the relative error of the denominator (``s_scale / s``)."""
    w = weight.detach().cpu().double().clone()
    w_scale = w.abs()
    st_ = [s.detach().cpu().double().clone() for s in state]
    st_scale = [s.abs() for s in st_]
    b1, b2 = betas
    for r, g32 in row_gradients(ids, grad).items():
        g, g_scale = g32.double(), g32.double().abs()
        if weight_decay:
            g, g_scale = g + weight_decay * w[r], g_scale + weight_decay * w[r].abs()
        if rule == "sgd":
            step_r, step_scale = lr * g, lr * g_scale
        else:
            sq, sq_scale = (g * g).mean(), (g_scale * g_scale).mean()
            if rule == "adagrad":
                s, s_scale = st_[0][r] + sq, st_[0][r].abs() + sq_scale
                st_[0][r], st_scale[0][r] = s, s_scale
                num, num_scale, denom, ratio = lr * g, lr * g_scale, s.sqrt() + eps, s_scale / s if s > 0 else 1.0
            else:
                m, m_scale = b1 * st_[0][r] + (1 - b1) * g, b1 * st_[0][r].abs() + (1 - b1) * g_scale
                v, v_scale = b2 * st_[1][r] + (1 - b2) * sq, b2 * st_[1][r].abs() + (1 - b2) * sq_scale
                st_[0][r], st_scale[0][r], st_[1][r], st_scale[1][r] = m, m_scale, v, v_scale
                c1, c2 = 1 - b1**step, 1 - b2**step
                num, num_scale = lr * m / c1, lr * m_scale / c1
                denom, ratio = (v / c2).sqrt() + eps, v_scale / v if v > 0 else 1.0
            step_r = num / denom
            step_scale = num_scale / denom + step_r.abs() * ratio
        w_scale[r] = w[r].abs() + step_scale
        w[r] = w[r] - step_r
    return Oracle(w, st_, w_scale, st_scale)


def tolerance(want64: torch.Tensor, scale64: torch.Tensor, dtype: torch.dtype, rtol: float = RTOL) -> torch.Tensor:
    """The error allowed a value of ``dtype`` against its float64 value ``want64``: ``rtol`` times the scale
    of its terms (the float32 math), then one rounding to ``dtype`` (half an ulp of it), and a floor of
    float32's smallest normal (a subnormal flushed to zero) plus half ``dtype``'s smallest subnormal."""
    u = 2.0 ** -(MANTISSA[dtype] + 1)
    err32 = rtol * scale64
    floor = torch.finfo(torch.float32).smallest_normal + torch.finfo(dtype).smallest_normal * u
    return err32 + u * (want64.abs() + err32) + floor


def assert_near_oracle(got: torch.Tensor, want64: torch.Tensor, scale64: torch.Tensor, dtype: torch.dtype,
                       name: str, ulps: float | None = None, *, mask: torch.Tensor | None = None,
                       where: Callable[[tuple], str] | None = None, case: dict | None = None,
                       reference: Callable[[], torch.Tensor] | None = None) -> None:
    """``got`` (of ``dtype``) within `tolerance` of the float64 value ``want64`` wherever ``mask`` (default:
    everywhere); ``ulps``: the float32 part as that many float32 ulps of the scale (2**-24 each) instead of
    section 8's 1e-5. A NaN where ``want64`` has none always fails. The first failing element (row-major)
    is named by ``where`` with its bits, its float64 value and, if ``reference`` is given (a function that
    returns the reference's tensor, run only then), the reference's value."""
    got_c, want, scale = got.detach().cpu(), want64.detach().cpu(), scale64.detach().cpu()
    tol = tolerance(want, scale, dtype, RTOL if ulps is None else ulps * 2.0**-24)
    err = (got_c.double() - want).abs()
    bad = ~(err <= tol) & ~(torch.isnan(got_c) & torch.isnan(want))
    if mask is not None:
        bad &= mask
    if not bool(bad.any()):
        return
    idx = tuple(bad.nonzero()[0].tolist())
    at = where(idx) if where is not None else f"element {idx}"
    theirs = ""
    if reference is not None:
        theirs = f"; the reference gives {_value(reference().detach().cpu(), idx)}"
    raise AssertionError(
        f"{name} differs at {at}: got {_value(got_c, idx)}, expected {want[idx].item():.9g} (the float64 "
        f"oracle; error {err[idx].item():.3g}, allowed {tol[idx].item():.3g}{theirs}; {int(bad.sum())} of "
        f"{bad.numel()} values outside)" + ("" if case is None else f"\n  case: {fmt_case(case)}"))


# ---- cases -----------------------------------------------------------------------------------------------

@st.composite
def update_cases(draw: st.DrawFn, *, rules: Sequence[str] = RULES,
                 dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16), max_dim: int = 200,
                 max_lookups: int = 64) -> dict[str, Any]:
    """One ``table_update`` call's description (plain values; `build_update` makes its tensors).

    ``ids``: ``"random"`` rows, ``"few"`` (at most 3 rows, each looked up often) or ``"one"`` (one row for
    every lookup); ``grad_dtype`` float32 or the table's; ``column_ids``: ids a strided column;
    ``wide``: the table and the gradient column slices of wider buffers (their other columns NaN);
    ``fresh_state``: zero state (a new optimizer); ``cancel``: a row looked up 3 times or more gets a large
    gradient at its first lookup and its negation at its last (the order of the sum shows); ``nan_rows``:
    the rows not looked up, and their state, NaNs with distinct bits. Hyperparameters are drawn for the
    rule only (``eps`` for Adagrad and Adam, ``betas`` and ``step``, 1 or more, for Adam)."""
    dims = [d for d in (1, 2, 3, 8, 17, 160) if d <= max_dim]
    case: dict[str, Any] = dict(
        rule=draw(st.sampled_from(list(rules))), rows=draw(st.integers(1, 40)),
        D=draw(st.one_of(st.sampled_from(dims), st.integers(1, max_dim))), M=draw(st.integers(0, max_lookups)),
        ids=draw(st.sampled_from(["random", "few", "one"])), dtype=draw(st.sampled_from(list(dtypes))))
    case.update(grad_dtype=draw(st.sampled_from([torch.float32, case["dtype"]])),
                index_dtype=draw(st.sampled_from([torch.int64, torch.int32])), column_ids=draw(st.booleans()),
                wide=draw(st.booleans()), fresh_state=draw(st.booleans()), cancel=draw(st.booleans()),
                nan_rows=draw(st.booleans()), lr=draw(st.sampled_from([1.0, 0.1, 1e-3, 0.0])),
                weight_decay=draw(st.sampled_from([0.0, 0.01, 0.5])))
    if case["rule"] != "sgd":
        case["eps"] = draw(st.sampled_from([1e-8, 1e-3]))
    if case["rule"] == "adam":
        case["betas"] = draw(st.sampled_from([(0.9, 0.999), (0.0, 0.5), (0.5, 0.9)]))
        case["step"] = draw(st.one_of(st.just(1), st.integers(2, 10), st.just(1000)))
    case["seed"] = draw(st.integers(0, 2**31 - 1))
    return case


def hyperparameters(case: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of the case's call (``rule``, ``lr`` and the rule's others)."""
    return {k: case[k] for k in ("rule", "lr", "weight_decay", "eps", "betas", "step") if k in case}


def build_update(case: dict[str, Any]) -> dict[str, Any]:
    """The tensors of an `update_cases` case: ``weight`` (a view of ``weight_buf``), ``ids``, ``grad`` (a view
    of ``grad_buf``), ``state``, ``positions`` (each distinct row's lookups) and ``touched`` (bool ``[rows]``)."""
    g = torch.Generator().manual_seed(case["seed"])
    rows, D, M, dt = case["rows"], case["D"], case["M"], case["dtype"]
    distinct = {"random": rows, "few": min(rows, 3), "one": 1}[case["ids"]]
    pool = torch.randperm(rows, generator=g)[:distinct]                   # the rows this step may look up
    values = pool[torch.randint(0, distinct, (M,), generator=g)].tolist()
    ids = index_tensor(values, case["index_dtype"], case["column_ids"])
    positions: dict[int, list[int]] = {}
    for i, r in enumerate(values):
        positions.setdefault(r, []).append(i)
    touched = torch.zeros(rows, dtype=torch.bool)
    touched[list(positions)] = True
    extra = 2 if case["wide"] else 0
    weight_buf = randn((rows, D + extra), dt, g)
    if extra:
        fill_nans_(weight_buf, (slice(None), slice(D, None)), g)         # beside the table: never read
    grad64 = torch.randn(M, D + extra, generator=g, dtype=torch.float64)
    grad64 *= 2.0 ** torch.randint(-4, 4, (M, 1), generator=g)           # lookups of many magnitudes
    if case["cancel"]:                  # a large pair that cancels in the sum: the low bits between show its order
        big = 2.0**10 if case["grad_dtype"] == torch.float16 else 2.0**16        # float16: below its largest
        for p in positions.values():
            if len(p) >= 3:
                grad64[p[0]] *= big
                grad64[p[-1]] = -grad64[p[0]]
    grad_buf = grad64.to(case["grad_dtype"])
    if extra:
        fill_nans_(grad_buf, (slice(None), slice(D, None)), g)
    shapes = _checks.state_shapes(case["rule"], rows, D)
    if case["fresh_state"]:
        state = tuple(torch.zeros(s, dtype=torch.float32) for s in shapes)
    else:                                                                # m signed; s and v >= 0
        state = tuple((torch.randn(s, generator=g, dtype=torch.float32) * 0.1) if len(s) == 2 else
                      torch.rand(s, generator=g, dtype=torch.float32) for s in shapes)
    if case["nan_rows"] and not bool(touched.all()):
        fill_nans_(weight_buf, ~touched, g)
        for s in state:
            fill_nans_(s, ~touched, g)
    return dict(weight=weight_buf[:, :D], weight_buf=weight_buf, ids=ids, grad=grad_buf[:, :D], grad_buf=grad_buf,
                state=state, positions=positions, touched=touched)


def _run(fn: Callable[..., Any], t: dict[str, Any], case: dict[str, Any], poison: bool = False):
    """``fn`` on copies of the case's table (its buffer) and state: (the table, its buffer, the state)."""
    buf = t["weight_buf"].clone()
    state = tuple(s.clone() for s in t["state"])
    weight = buf[:, :case["D"]]
    if poison:
        with poisoned_empty():
            fn(weight, t["ids"], t["grad"], state, **hyperparameters(case))
    else:
        fn(weight, t["ids"], t["grad"], state, **hyperparameters(case))
    return weight, buf, state


# ---- the check -------------------------------------------------------------------------------------------

_STATE_NAMES = {"adagrad": ["s (Adagrad's sum of mean squares)"], "adam": ["m (Adam's first moment)",
                                                                            "v (Adam's second moment)"]}


def _row_text(positions: dict[int, list[int]], r: int) -> str:
    p = positions.get(r)
    if p is None:
        return f"table row {r} (not looked up in this step)"
    if len(p) == 1:
        return f"table row {r} (looked up once, at lookup {p[0]})"
    shown = ", ".join(map(str, p[:4])) + (", ..." if len(p) > 4 else "")
    return f"table row {r} (looked up {len(p)} times, at lookups {shown})"


def check_one_update(fn: Callable[..., Any], case: dict[str, Any]) -> None:
    """Run one `update_cases` case through ``fn`` and judge it; ``AssertionError`` on a difference."""
    t = build_update(case)
    rule, D, positions, touched = case["rule"], case["D"], t["positions"], t["touched"]
    label = f"table_update {rule}"
    ids_before, grad_before = t["ids"].clone(), t["grad_buf"].clone()
    weight, buf, state = _run(fn, t, case, poison=True)
    compare_bits(t["ids"], ids_before, name=f"{label}: ids (an input)", case=case,
                 where=lambda idx: f"lookup {idx[0]}")
    compare_bits(t["grad_buf"], grad_before, name=f"{label}: grad (an input)", case=case,
                 where=lambda idx: f"lookup {idx[0]}, column {idx[1]}")
    want = oracle(t["weight"], t["ids"], t["grad"], t["state"], **hyperparameters(case))
    reference: dict[str, Any] = {}

    def from_reference(i: int | None) -> Callable[[], torch.Tensor]:
        """The reference's table (``i`` None) or ``state[i]`` for the case, run only when a message needs it."""
        def get() -> torch.Tensor:
            if not reference:
                w_ref, _, s_ref = _run(ref.table_update, t, case)
                reference.update(weight=w_ref, state=s_ref)
            return reference["weight"] if i is None else reference["state"][i]
        return get

    def where(idx: tuple) -> str:
        return _row_text(positions, idx[0]) + (f", column {idx[1]}" if len(idx) > 1 else "")
    for i, (got, w64, s64, name) in enumerate(zip(state, want.state, want.state_scales, _STATE_NAMES.get(rule, []),
                                                  strict=True)):
        assert_near_oracle(got, w64, s64, torch.float32, f"{label}: state[{i}], {name},",
                           mask=touched.reshape(-1, *[1] * (got.dim() - 1)), where=where, case=case,
                           reference=from_reference(i))
    assert_near_oracle(weight, want.weight, want.weight_scale, case["dtype"], f"{label}: weight", mask=touched[:, None],
                       where=where, case=case, reference=from_reference(None))
    # Everything else as it was: the rows not looked up (and the columns beside the table), and their state.
    kept = t["weight_buf"].clone()
    kept[touched, :D] = buf[touched, :D]
    compare_bits(buf, kept, name=f"{label}: weight", case=case, where=lambda idx: where(idx) if idx[1] < D else (
        f"table row {idx[0]}, column {idx[1]} of the buffer the table is a slice of (beyond its {D} columns: "
        f"never read or written)"))
    for i, (got, before) in enumerate(zip(state, t["state"], strict=True)):
        kept_s = before.clone()
        kept_s[touched] = got[touched]
        compare_bits(got, kept_s, name=f"{label}: state[{i}], {_STATE_NAMES[rule][i]},", case=case, where=where)


def _as_rules(rules: Sequence[str]) -> tuple[str, ...]:
    return _checks.choices_arg("rules", rules, RULES)


def check_table_update(fn: Callable[..., Any], *, rules: Sequence[str] = RULES,
                       dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16), max_dim: int = 200,
                       max_lookups: int = 64, max_examples: int = 25, seed: int | None = 0) -> None:
    """Check ``fn`` (the signature of ``ple.reference.table_update``, updating ``weight`` and ``state`` in
    place) for each of ``rules`` on tables of each of ``dtypes`` (float32, bfloat16, float16, float64).

    Each looked-up row and its float32 state must be within section 8's float32 tolerance (1e-5) of the
    scale of their terms from a float64 run of the section 11 formulas on ``g``, the float32 sum of the
    row's gradient rows in lookup order; a bfloat16 / float16 table's new row may differ from that by one
    rounding more. Everything else must be bit for bit as it was: rows not looked up and their state
    (sometimes NaNs with distinct bits), the columns beside a table sliced from a wider buffer, ``ids`` and
    ``grad``. Cases: tables of 1 to 40 rows, widths 1 to ``max_dim``, 0 to ``max_lookups`` lookups (empty
    steps), random ids, repeated ones and one id for every lookup, int32 / int64 ids (sometimes a strided
    column), float32 or the table's gradients of many magnitudes (sometimes a large pair that cancels in
    the sum), strided tables and gradients, fresh and used state, ``weight_decay`` 0 and above, Adam's
    ``step`` 1 and above; fresh buffers NaN-poisoned while ``fn`` runs. Returns quietly, or raises
    ``AssertionError`` naming the smallest failing case, the rule, the row and column and both values.
    """
    check_options(dtypes=dtypes, max_dim=max_dim, max_lookups=max_lookups, max_examples=max_examples, seed=seed)
    rules = _as_rules(rules)
    _prop(update_cases(rules=rules, dtypes=dtypes, max_dim=max_dim, max_lookups=max_lookups),
          lambda case: check_one_update(fn, case), max_examples, seed)
