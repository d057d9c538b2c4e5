"""`check_ple_conv`, `check_export_conv_checkpoints`: a serving-step conv against ``ple.reference``.

Each draws cases with Hypothesis and runs the user's function and the reference on copies of
the same inputs and states. What a case can hold: channels beyond one tile and odd (up to
``max_channels``), K 1..5, dilation 1..4, int32 and int64 indices (some a strided column of a
table), states in three layouts (``[slots, C, W]``, a transposed ``[slots, W, C]`` buffer, the
last W columns of a wider one) and in the input dtype or float32, stale non-zero states read
or not by ``has_initial_states``, rows of the null slot, rows interleaved through
``token_indices`` among rows of other calls, every spec acceptance count including
all-accepted, NaN in every state column the call must not read (the null slot's included) and in
every input and residual row outside the call, each with bits of its own (``cases.distinct_nans``:
a column moved or copied among them shows), and NaN-poisoned ``torch.empty`` while the function
runs. Outputs are judged by the tolerance table (bfloat16 against a float64 reference run), states
bit for bit (the whole buffer, so columns and slots the call must not touch are checked too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from ... import _checks
from ... import reference as ref
from ._options import check_options
from ._report import compare_bits, compare_close, poisoned_empty, row_of
from .cases import (
    HALF_DTYPES,
    assign_slots,
    clone_state,
    fill_nans_,
    index_tensor,
    randn,
    request_rows,
    rows_view,
    state_view,
    to64,
)

__all__ = ["check_ple_conv", "check_export_conv_checkpoints", "conv_cases"]

MODES = ("prefill", "decode", "spec")
DTYPES = (torch.float32, torch.bfloat16)


def _channels(max_channels):
    small = st.sampled_from([c for c in (1, 5, 13, 40) if c <= max_channels])
    return st.one_of(small, st.integers(1, max_channels)) if max_channels > 1 else st.just(1)


@st.composite
def conv_cases(draw: st.DrawFn, mode: str, *, max_channels: int = 300, dtypes: Sequence[torch.dtype] = DTYPES,
               max_requests: int = 4) -> dict[str, Any]:
    """One ``ple_conv`` call's description (plain values; `build_conv` makes its tensors)."""
    spec_len = draw(st.integers(1, 5)) if mode == "spec" else 1
    if mode == "prefill":
        length = st.one_of(st.just(0), st.just(1), st.integers(2, 12), st.integers(30, 70))
        lens = draw(st.lists(length, min_size=0, max_size=max_requests))
    elif mode == "decode":
        lens = [1] * draw(st.integers(1, max_requests + 1))
    else:
        lens = draw(st.lists(st.integers(1, spec_len), min_size=1, max_size=max_requests))
    R = len(lens)
    flags = st.lists(st.booleans(), min_size=R, max_size=R)
    return dict(
        mode=mode, C=draw(_channels(max_channels)), K=draw(st.integers(1, 5)), dilation=draw(st.integers(1, 4)),
        spec_len=spec_len, lens=lens, dtype=draw(st.sampled_from(list(dtypes))),
        state_dtype=draw(st.sampled_from(["same", "float32"])), weight_layout=draw(st.sampled_from(["ck", "kc"])),
        layout=draw(st.sampled_from(["cw", "wc", "tail"])), extra_w=draw(st.integers(0, 2)),
        extra_slots=draw(st.integers(1, 3)), null_at_end=draw(st.booleans()), null_requests=draw(flags),
        init=draw(st.sampled_from([None, "bool", "int"])), init_values=draw(flags),
        accepted=[draw(st.sampled_from([spec_len, 1]) | st.integers(1, spec_len)) for _ in range(R)],
        token_indices=draw(st.booleans()), extra_rows=draw(st.integers(0, 3)), outer=draw(st.booleans()),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])), column_indices=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)))


def build_conv(case: dict[str, Any]) -> dict[str, Any]:
    """The tensors of one call, which state columns each request reads (the rest of the state is NaN, each
    element with bits of its own) and which it must rewrite (``written``). A ``case["wide_rows"]`` (optional,
    default False) makes the inputs, residual and outer residual the first C columns of wider buffers.

    Keys: the op's arguments (``inputs``, ``residual``, ``outer``, ``weights``, ``state`` over ``buf``,
    ``state_indices``, ``query_start_loc``, ``init``, ``accepted``, ``token_indices``, ``null_slot``), their
    host lists ``state_indices_list`` and ``query_start_loc_list``, ``rows`` (each logical row's physical
    row), ``outside`` (the physical rows of no logical row) and ``written``."""
    g = torch.Generator().manual_seed(case["seed"])
    mode, C, K, d, lens = case["mode"], case["C"], case["K"], case["dilation"], case["lens"]
    dt = case["dtype"]
    sdt = dt if case["state_dtype"] == "same" else torch.float32
    S = (K - 1) * d
    R = len(lens)
    W = S + case["spec_len"] - 1 + case["extra_w"]
    ix, col = case["index_dtype"], case["column_indices"]
    num_slots, null_slot, state_indices_list = assign_slots(R, case["extra_slots"], case["null_at_end"],
                                                            case["null_requests"], g)
    query_start_loc_list, T, rows, token_indices = request_rows(
        lens, g, case["extra_rows"] if case["token_indices"] else None, ix, col)
    wide = case.get("wide_rows", False)
    inputs, residual = rows_view(T, C, dt, g, wide), rows_view(T, C, dt, g, wide)
    outer = rows_view(T, C, dt, g, wide) if case["outer"] else None
    weights = randn((C, K), dt, g) if case["weight_layout"] == "ck" else randn((K, C), dt, g).t()
    state, buf = state_view(num_slots, C, W, case["layout"], sdt, g)
    init = None
    has_init = [mode != "prefill"] * R
    if case["init"] is not None:
        has_init = list(case["init_values"])
        init = torch.tensor(has_init, dtype=torch.bool if case["init"] == "bool" else ix)
    accepted = case["accepted"] if mode == "spec" else [1] * R
    outside = sorted(set(range(T)) - set(rows))
    for t in (inputs, residual, outer):
        if t is not None:
            fill_nans_(t, outside, g)                         # rows of other calls: never read nor written
    read = torch.zeros(num_slots, W, dtype=torch.bool)
    written = torch.zeros(num_slots, W, dtype=torch.bool)
    for r, slot in enumerate(state_indices_list):
        if slot == null_slot or lens[r] == 0:
            continue
        if mode == "spec" or has_init[r]:
            read[slot, accepted[r] - 1:accepted[r] - 1 + S] = True
        written[slot, :S + lens[r] - 1 if mode == "spec" else S] = True
    fill_nans_(state, ~read[:, None, :].expand(num_slots, C, W), g)   # stale columns no correct call reads
    return dict(inputs=inputs, residual=residual, outer=outer, weights=weights, state=state, buf=buf,
                state_indices=index_tensor(state_indices_list, ix, col), state_indices_list=state_indices_list,
                query_start_loc=torch.tensor(query_start_loc_list, dtype=ix),
                query_start_loc_list=query_start_loc_list, init=init, accepted=torch.tensor(accepted, dtype=ix),
                token_indices=token_indices, null_slot=null_slot, rows=rows, outside=outside, written=written)


def run_conv(fn: Callable[..., Any], t: dict[str, Any], case: dict[str, Any], *, residual: torch.Tensor,
             conv_state: torch.Tensor, inputs: torch.Tensor | None = None, weights: torch.Tensor | None = None,
             outer: torch.Tensor | None = None) -> None:
    """Run ``fn`` (the signature of ``ple.reference.ple_conv``) on the call `build_conv` made of ``case``,
    writing ``residual`` and ``conv_state``; ``inputs``, ``weights``, ``outer``: others than the call's (a
    float64 run)."""
    fn(t["inputs"] if inputs is None else inputs, residual, conv_state,
       t["weights"] if weights is None else weights, t["state_indices"], mode=case["mode"], dilation=case["dilation"],
       query_start_loc=None if case["mode"] == "decode" and case["seed"] % 2 else t["query_start_loc"],
       has_initial_states=t["init"], num_accepted_tokens=t["accepted"] if case["mode"] == "spec" else None,
       spec_query_len=case["spec_len"], token_indices=t["token_indices"],
       outer_residual=t["outer"] if outer is None else outer, null_slot=t["null_slot"])


def _state_where(slots_list, null_slot):
    """Where a state element lies, for a call whose request r writes slot ``slots_list[r]``."""
    owner = {s: r for r, s in enumerate(slots_list)}

    def where(idx):
        s, c, j = idx
        who = ("the null slot" if s == null_slot else
               f"request {owner[s]}'s slot" if s in owner else "a slot no request of the call owns")
        return f"state slot {s} ({who}), channel {c}, column {j}"
    return where


def check_one_conv(fn: Callable[..., Any], case: dict[str, Any]) -> None:
    """Run one `conv_cases` case through ``fn`` and the reference; ``AssertionError`` on a difference."""
    t = build_conv(case)
    res_ref, res_fn = t["residual"].clone(), t["residual"].clone()
    (st_ref, buf_ref), (st_fn, buf_fn) = clone_state(t), clone_state(t)
    run_conv(ref.ple_conv, t, case, residual=res_ref, conv_state=st_ref)
    with poisoned_empty():
        run_conv(fn, t, case, residual=res_fn, conv_state=st_fn)
    rows = t["rows"]
    exact = None
    if case["dtype"] in HALF_DTYPES:
        res64, st64 = to64(t["residual"]), to64(t["state"])
        run_conv(ref.ple_conv, t, case, residual=res64, conv_state=st64, inputs=to64(t["inputs"]),
                 weights=to64(t["weights"]), outer=to64(t["outer"]))
        exact = res64[rows]

    def where_row(idx):
        return f"{row_of(t['query_start_loc_list'], idx[0])} (physical row {rows[idx[0]]}), channel {idx[1]}"
    compare_close(res_fn[rows], res_ref[rows], exact, name=f"ple_conv {case['mode']}: residual",
                  where=where_row, case=case)
    outside = [i for i in range(res_fn.shape[0]) if i not in set(rows)]
    compare_bits(res_fn[outside], res_ref[outside], name=f"ple_conv {case['mode']}: a residual row outside the call",
                 where=lambda idx: f"physical row {outside[idx[0]]}, channel {idx[1]}", case=case)
    compare_bits(st_fn, st_ref, name=f"ple_conv {case['mode']}: conv_state",
                 where=_state_where(t["state_indices_list"], t["null_slot"]), case=case)
    compare_bits(buf_fn, buf_ref, name=f"ple_conv {case['mode']}: conv_state's buffer outside the view",
                 where=lambda idx: f"buffer element {idx}", case=case)


def _settings(max_examples, seed):
    kw = dict(max_examples=max_examples, deadline=None, database=None,
              report_multiple_bugs=False)           # one AssertionError (the smallest case), not an ExceptionGroup
    if seed is not None:
        kw["derandomize"] = False
    return settings(**kw)


def check_ple_conv(fn: Callable[..., Any], *, modes: Sequence[str] = MODES, dtypes: Sequence[torch.dtype] = DTYPES,
                   max_channels: int = 300,
                   max_examples: int = 25, seed: int | None = 0) -> None:
    """Check ``fn`` (the signature of ``ple.reference.ple_conv``) against the reference.

    Returns quietly, or raises ``AssertionError`` naming the smallest failing case Hypothesis
    found: mode, config of the call, request, slot, row, channel, column and both values.
    ``max_examples`` cases per mode; ``seed`` fixes the draw (None: Hypothesis's own randomness).
    Usable inside a pytest test.
    """
    check_options(dtypes=dtypes, max_channels=max_channels, max_examples=max_examples, seed=seed)
    modes = _checks.choices_arg("modes", modes, MODES)
    for mode in modes:

        @given(case=conv_cases(mode, max_channels=max_channels, dtypes=dtypes))
        @_settings(max_examples, seed)
        def prop(case):
            note(repr(case))
            check_one_conv(fn, case)

        _seeded(prop, seed)()


def _seeded(prop, seed):
    from hypothesis import seed as hseed
    return hseed(seed)(prop) if seed is not None else prop


@st.composite
def export_cases(draw: st.DrawFn, *, max_channels: int = 300,
                 dtypes: Sequence[torch.dtype] = DTYPES) -> dict[str, Any]:
    S = draw(st.integers(1, 9))
    lens = draw(st.lists(st.integers(0, 25), min_size=0, max_size=4))
    return dict(C=draw(_channels(max_channels)), S=S, lens=lens, dtype=draw(st.sampled_from(list(dtypes))),
                state_dtype=draw(st.sampled_from(["same", "float32"])),
                layout=draw(st.sampled_from(["cw", "wc", "tail"])),
                token_indices=draw(st.booleans()), null_at_end=draw(st.booleans()),
                choice=draw(st.lists(st.integers(0, 3), min_size=len(lens), max_size=len(lens))),
                index_dtype=draw(st.sampled_from([torch.int32, torch.int64])), seed=draw(st.integers(0, 2**31 - 1)))


def build_export(case: dict[str, Any]) -> dict[str, Any]:
    """The tensors of one ``export_conv_checkpoints`` call of ``case`` (the keys of `export_cases` but
    ``index_dtype``: the index tensors are the caller's to make, from ``query_start_loc_list``, ``offsets``
    and ``slots_list``): ``x`` (NaN in every row of no request), ``rows`` (``token_indices``, int64, or None),
    ``state`` (random values, the null slot's too, so an element moved shows) and ``buf``, ``null_slot``, and
    ``target``, the slots whose first S columns a checkpoint must rewrite (NaN now, each element with bits
    of its own)."""
    g = torch.Generator().manual_seed(case["seed"])
    C, S, lens, dt = case["C"], case["S"], case["lens"], case["dtype"]
    R = len(lens)
    num_slots = R + 2
    null_slot = num_slots - 1 if case["null_at_end"] else 0
    free = [s for s in range(num_slots) if s != null_slot]
    offsets, slots_list = [], []
    for r, n in enumerate(lens):
        kind = case["choice"][r] if n >= S else 0                          # 0: no checkpoint
        offsets.append({0: 0, 1: S, 2: n, 3: (S + n) // 2}[kind])
        slots_list.append(null_slot if kind == 3 and r % 2 else free[r])
    query_start_loc_list = [0]
    for n in lens:
        query_start_loc_list.append(query_start_loc_list[-1] + n)
    num_rows = query_start_loc_list[-1]
    T = num_rows + (2 if case["token_indices"] else 0)
    rows = torch.randperm(T, generator=g)[:num_rows] if case["token_indices"] else None
    x = randn((T, C), dt, g)
    if rows is not None:
        fill_nans_(x, sorted(set(range(T)) - set(rows.tolist())), g)
    sdt = dt if case["state_dtype"] == "same" else torch.float32
    state, buf = state_view(num_slots, C, S + 1, case["layout"], sdt, g)
    target = torch.zeros(num_slots, dtype=torch.bool)
    for o, s in zip(offsets, slots_list, strict=True):
        if o > 0 and s != null_slot:
            target[s] = True
    fill_nans_(state, (target, slice(None), slice(None, S)), g)             # must be fully rewritten
    return dict(x=x, rows=rows, state=state, buf=buf, query_start_loc_list=query_start_loc_list, offsets=offsets,
                slots_list=slots_list, null_slot=null_slot, target=target)


def check_one_export(fn: Callable[..., Any], case: dict[str, Any]) -> None:
    t = build_export(case)
    ix = case["index_dtype"]
    kw = dict(query_start_loc=torch.tensor(t["query_start_loc_list"], dtype=ix),
              offsets=torch.tensor(t["offsets"], dtype=ix), slots=torch.tensor(t["slots_list"], dtype=ix),
              state_len=case["S"], token_indices=None if t["rows"] is None else t["rows"].to(ix),
              null_slot=t["null_slot"])
    (v_ref, b_ref), (v_fn, b_fn) = clone_state(t), clone_state(t)
    ref.export_conv_checkpoints(t["x"], v_ref, **kw)
    with poisoned_empty():
        fn(t["x"], v_fn, **kw)
    compare_bits(v_fn, v_ref, name="export_conv_checkpoints: conv_state",
                 where=_state_where(t["slots_list"], t["null_slot"]), case=case)
    compare_bits(b_fn, b_ref, name="export_conv_checkpoints: conv_state's buffer outside the view",
                 where=lambda idx: f"buffer element {idx}", case=case)


def check_export_conv_checkpoints(fn: Callable[..., Any], *, dtypes: Sequence[torch.dtype] = DTYPES,
                                  max_channels: int = 300,
                                  max_examples: int = 25, seed: int | None = 0) -> None:
    """Check ``fn`` (the signature of ``ple.reference.export_conv_checkpoints``) against the reference:
    the whole state buffer bit for bit; see `check_ple_conv` for the options and the failure message."""
    check_options(dtypes=dtypes, max_channels=max_channels, max_examples=max_examples, seed=seed)

    @given(case=export_cases(max_channels=max_channels, dtypes=dtypes))
    @_settings(max_examples, seed)
    def prop(case):
        note(repr(case))
        check_one_export(fn, case)

    _seeded(prop, seed)()
