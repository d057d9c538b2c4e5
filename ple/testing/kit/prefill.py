"""`check_ple_prefill`: the gate, mask, conv and both residual adds of whole requests against ``ple.reference``.

Two Hypothesis properties, ``parts=("forward", "serving")``:

Both gate families are drawn (``families``, as ``check_ple_gate``'s): the Engram family's cases pass
``unit_offset=False`` and a ``conv_eps`` other than ``eps`` (docs/spec.md section 15).

* **forward** (``conv_state=None``, the training / evaluation path): varlen ``query_start_loc``
  (empty and one-token requests, requests beyond one tile), ``keep`` masks (bool, or integers
  where any non-zero keeps), strided rows, both conv-weight layouts; ``out`` by the tolerance
  table and the gradients of key, value, hidden_states, the three norm weights and
  conv_weights by the same table.
* **serving** (``conv_state`` given): states in three layouts (``[slots, C, W]``, a transposed
  ``[slots, W, C]`` buffer, the last W columns of a wider one) and in the input dtype or
  float32, ``has_initial_states`` mixes (None, bool, int), requests on the null slot (first
  or last slot), empty requests, rows permuted among extra rows through ``token_indices``,
  int32 / int64 index tensors (some a strided column of a table). Every state column the call
  must not read is NaN (stale slots whose ``has_initial_states`` is 0, columns past S, the
  null slot, slots no request owns), each element with bits of its own (a column moved or
  copied among them shows), as is every input row no logical row maps to.
  ``out`` of the call's rows by the tolerance table; physical rows no logical row maps to
  must be 0.

States (docs/spec.md sections 6 and 8). After the call, column i of a live request's slot is
``hist[n + i]`` (n its rows): for ``n + i < S`` a copy of old column ``n + i`` (or a zero
without an initial state), else the conv input of its row ``n + i - S``. The copies, and every
bit of the buffer the call must not write, are compared bit for bit. The computed columns
("fresh") are the call's own conv inputs, which a fused kernel never writes to memory, so
they cannot be checked against the function's own conv inputs; against the reference's they
are judged by ``exact_states``:

* ``None`` (default): bit for bit when the inputs are bfloat16 or float16 (the rounding to
  the low-precision dtype absorbs a float32 sum order); for float32 and float64 inputs within
  that dtype's tolerance (a fused kernel sums over H in its own order, so a conv input may
  end an ulp away; where a gate score lies within 0.05 of zero, float32 is judged against the
  float64 run as outputs are);
* ``True``: bit for bit in every dtype (what a backend that composes ``ple_gate`` and
  ``ple_conv`` gives, e.g. ``ple.reference`` and the ``"torch"`` backend);
* ``False``: by the tolerance table in every dtype (bfloat16 against the float64 run).

Fresh buffers are NaN-poisoned (``poisoned_empty``) while the function runs. A failure raises
``AssertionError`` naming the part, the smallest case, and the element: request, row (logical
and physical), channel (stream), or state slot, channel, column and what the column holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from ... import _checks
from ... import reference as ref
from ._options import check_options
from ._report import compare_bits, compare_close, fmt_case, poisoned_empty, row_of
from .cases import HALF_DTYPES, clone_state, fill_nans_, index_tensor, randn, request_rows, serving_state
from .ops import (
    FAMILIES,
    _grads,
    _prop,
    _scores,
    call_with_family,
    draw_gate_family,
    gate_family_kwargs,
    gate_weight,
)

__all__ = ["check_ple_prefill", "prefill_cases"]

PARTS = ("forward", "serving")
DTYPES = (torch.float32, torch.bfloat16, torch.float64)
NAMES = ("key", "value", "hidden_states", "norm_key_weight", "norm_query_weight", "norm_conv_weight",
         "conv_weights")


@st.composite
def prefill_cases(draw: st.DrawFn, part: str, *, dtypes: Sequence[torch.dtype] = DTYPES, max_hidden: int = 160,
                  max_requests: int = 4, families: Sequence[str] = FAMILIES) -> dict[str, Any]:
    """One ``ple_prefill`` call's description (plain values; the tensors come from ``seed``)."""
    length = st.one_of(st.integers(2, 12), st.integers(30, 70), st.sampled_from([0, 1]))   # empty requests too
    empty = draw(st.integers(0, 9)) == 0                      # now and then a batch of no requests
    lens = [] if empty else draw(st.lists(length, min_size=1, max_size=max_requests))
    R = len(lens)
    flags = st.lists(st.booleans(), min_size=R, max_size=R)
    small = [h for h in (1, 2, 3, 8, 40, 127, 160) if h <= max_hidden]
    M = draw(st.integers(1, 4))
    H = draw(st.one_of(st.sampled_from(small), st.integers(1, max_hidden)))
    K, dilation, dtype = draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.sampled_from(list(dtypes)))
    family = draw_gate_family(draw, families, dtype, [1e-6, 1e-5, 0.1])
    case = dict(part=part, lens=lens, M=M, H=H, K=K, dilation=dilation, dtype=dtype, **family,
                scale=draw(st.sampled_from([1.0, 1e-3, 30.0])),
                keep=draw(st.sampled_from([None, "bool", "int"])), weight_layout=draw(st.sampled_from(["ck", "kc"])),
                strided=draw(st.booleans()), index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                column_indices=draw(st.booleans()))
    if part == "serving":
        case.update(state_dtype=draw(st.sampled_from(["same", "float32"])),
                    layout=draw(st.sampled_from(["cw", "wc", "tail"])), extra_w=draw(st.integers(0, 2)),
                    extra_slots=draw(st.integers(1, 3)), null_at_end=draw(st.booleans()), null_requests=draw(flags),
                    init=draw(st.sampled_from([None, "bool", "int"])), init_values=draw(flags),
                    token_indices=draw(st.booleans()), extra_rows=draw(st.integers(0, 3)))
    case["seed"] = draw(st.integers(0, 2**31 - 1))
    return case


def build_prefill(case: dict[str, Any]) -> dict[str, Any]:
    """The tensors of one call, and (serving) the masks of the state columns it reads and computes.

    Keys: ``inputs`` (the op's positional arguments by name), ``query_start_loc`` and its host list
    ``query_start_loc_list``, ``rows`` (each logical row's physical row), ``outside`` (the physical rows of
    no logical row), ``keep`` / ``keep_list``, ``token_indices``; serving: ``state`` over ``buf``,
    ``state_indices`` and ``state_indices_list``, ``null_slot``, ``init`` / ``has_init``, ``fresh``."""
    g = torch.Generator().manual_seed(case["seed"])
    M, H, K, d, lens, dt = case["M"], case["H"], case["K"], case["dilation"], case["lens"], case["dtype"]
    C, S, R = M * H, (K - 1) * d, len(lens)
    serving = case["part"] == "serving"
    ix, col = case["index_dtype"], case["column_indices"]
    query_start_loc_list, T, rows, token_indices = request_rows(
        lens, g, case["extra_rows"] if serving and case["token_indices"] else None, ix, col)

    def rows_of(n, scale):
        x = randn((T, n + 3) if case["strided"] else (T, n), dt, g) * scale
        return x[:, :n]
    s = case["scale"]
    inputs = dict(key=rows_of(C, s), value=rows_of(H, 1.0), hidden_states=rows_of(C, s),
                  norm_key_weight=gate_weight((C,), dt, g, case), norm_query_weight=gate_weight((C,), dt, g, case),
                  norm_conv_weight=gate_weight((C,), dt, g, case), eps=case["eps"],
                  conv_weights=(randn((C, K), dt, g) if case["weight_layout"] == "ck" else randn((K, C), dt, g).t())
                  * 0.5)
    outside = sorted(set(range(T)) - set(rows))
    for name in ("key", "value", "hidden_states"):
        fill_nans_(inputs[name], outside, g)                  # rows of no logical row: their values never matter
    keep = keep_list = None
    if case["keep"] is not None:
        keep_list = (torch.rand(T, generator=g) < 0.7).tolist()
        keep = index_tensor([int(k) * (3 if case["keep"] == "int" else 1) for k in keep_list],
                            torch.bool if case["keep"] == "bool" else ix, col)     # int: any non-zero keeps
    t = dict(inputs=inputs, query_start_loc_list=query_start_loc_list, rows=rows, outside=outside, C=C, S=S, H=H,
             keep=keep, keep_list=keep_list, query_start_loc=torch.tensor(query_start_loc_list, dtype=ix),
             token_indices=token_indices, serving=serving)
    if not serving:
        return t
    W = S + case["extra_w"]
    num_slots, null_slot, state_indices_list, state, buf = serving_state(case, R, C, W, dt, g)
    has_init, init = [False] * R, None
    if case["init"] is not None:
        has_init = list(case["init_values"])
        init = index_tensor([int(f) for f in has_init], torch.bool if case["init"] == "bool" else ix, col)
    masks = prefill_state_masks(state_indices_list, lens, has_init, null_slot, S, num_slots, W)
    fill_nans_(state, ~masks["read"][:, None, :].expand(num_slots, C, W), g)   # stale and untouched: never read
    t.update(state=state, buf=buf, state_indices=index_tensor(state_indices_list, ix, col),
             state_indices_list=state_indices_list, null_slot=null_slot,
             init=init, has_init=has_init, fresh=masks["fresh"][:, None, :].expand(num_slots, C, W))
    return t


def prefill_state_masks(state_indices_list: Sequence[int], lens: Sequence[int], has_init: Sequence[bool],
                        null_slot: int, state_len: int, num_slots: int, state_width: int) -> dict[str, torch.Tensor]:
    """The ``[num_slots, state_width]`` state columns a serving prefill touches (request r: ``lens[r]`` rows on
    slot ``state_indices_list[r]``; S = ``state_len``): ``read``, the old columns :S of a live request (one
    with rows, off the null slot) with an initial state; ``written``, columns :S of every live request; of
    those, ``copied``, the old columns moved (column i < S - n, with an initial state), and ``fresh``, this
    call's conv inputs (S - n <= i < S)."""
    S = state_len
    masks = {k: torch.zeros(num_slots, state_width, dtype=torch.bool) for k in ("read", "written", "copied", "fresh")}
    for r, slot in enumerate(state_indices_list):
        n = lens[r]
        if slot == null_slot or n == 0:
            continue
        if has_init[r]:
            masks["read"][slot, :S] = True
            masks["copied"][slot, :max(S - n, 0)] = True
        masks["written"][slot, :S] = True
        masks["fresh"][slot, max(S - n, 0):S] = True
    return masks


def _kwargs(t: dict, case: dict, conv_state=None) -> dict:
    kw = dict(dilation=case["dilation"], query_start_loc=t["query_start_loc"], keep=t["keep"],
              **gate_family_kwargs(case))
    if t["serving"]:
        kw.update(conv_state=conv_state, state_indices=t["state_indices"], has_initial_states=t["init"],
                  token_indices=t["token_indices"], null_slot=t["null_slot"])
    return kw


def _to64(inputs: dict) -> dict:
    return {k: v.to(torch.float64) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _row_where(t: dict, what: str = "") -> Callable[[tuple], str]:
    query_start_loc_list, rows, H, kl = t["query_start_loc_list"], t["rows"], t["H"], t["keep_list"]

    def where(idx):
        i, c = idx[0], idx[1]
        p = rows[i]
        masked = ", masked by keep" if kl is not None and not kl[p] else ""
        phys = f" (physical row {p}{masked})" if t["serving"] else (" (masked by keep)" if masked else "")
        return f"{what}{row_of(query_start_loc_list, i)}{phys}, channel {c} (stream {c // H}, {c % H} of it)"
    return where


def _grad_where(name: str, t: dict) -> Callable[[tuple], str]:
    H = t["H"]
    if name in ("key", "hidden_states", "value"):
        return _row_where(t)
    if name == "conv_weights":
        return lambda idx: f"channel {idx[0]} (stream {idx[0] // H}), tap {idx[1]}"
    return lambda idx: f"channel {idx[0]} (stream {idx[0] // H}, {idx[0] % H} of it)"


def _ill(t: dict, case: dict) -> bool:
    """docs/spec.md section 8: a float32 gate score within 0.05 of zero is judged like bfloat16."""
    scores = _scores(t["inputs"], t["H"], case["eps"], unit_offset=case.get("unit_offset", True))
    return case["dtype"] == torch.float32 and bool((scores.abs() < 0.05).any())


def check_one_forward(fn: Callable[..., Any], case: dict[str, Any]) -> None:
    """One forward case (``conv_state=None``): ``out`` and the seven gradients."""
    t = build_prefill(case)
    kw = _kwargs(t, case)
    g = torch.Generator().manual_seed(case["seed"] + 1)
    up = (randn((len(t["rows"]), t["C"]), case["dtype"], g),)
    want, gw = _grads(ref.ple_prefill, t["inputs"], list(NAMES), lambda outs: up, **kw)
    with poisoned_empty():
        got, gg = call_with_family("ple_prefill", lambda: _grads(fn, t["inputs"], list(NAMES), lambda outs: up, **kw),
                                   case)
    ill = _ill(t, case)
    exact, g64 = (None,), {}
    if case["dtype"] in HALF_DTYPES or ill:
        exact, g64 = _grads(ref.ple_prefill, _to64(t["inputs"]), list(NAMES), lambda outs: (up[0].double(),), **kw)
    compare_close(got[0], want[0], exact[0], name="ple_prefill forward: out", where=_row_where(t), case=case,
                  judge64=ill)
    for k in NAMES:
        compare_close(gg[k], gw[k], g64.get(k), name=f"ple_prefill forward: gradient of {k}", grad=True,
                      where=_grad_where(k, t), case=case, judge64=ill)


def _state_where(t: dict, case: dict, what: str) -> Callable[[tuple], str]:
    owner = {s: r for r, s in enumerate(t["state_indices_list"]) if s != t["null_slot"]}
    S, lens = t["S"], case["lens"]

    def where(idx):
        s, c, j = idx
        if s == t["null_slot"]:
            who = "the null slot: never read or written"
        elif s not in owner:
            who = "a slot no request of the call owns: never read or written"
        else:
            r = owner[s]
            n = lens[r]
            who = f"request {r}'s slot, {n} rows, has_initial_states {int(t['has_init'][r])}"
            if j >= S:
                who += f"; column past S={S}: left as it was"
            elif n == 0:
                who += "; an empty request changes nothing"
            elif n + j >= S:
                who += f"; the conv input of its row {n + j - S}"
            else:
                who += f"; old column {n + j}" if t["has_init"][r] else "; zero (no initial state)"
        return f"{what}state slot {s} ({who}), channel {c} (stream {c // t['H']}), column {j}"
    return where


def check_one_serving(fn: Callable[..., Any], case: dict[str, Any], exact_states: bool | None = None) -> None:
    """One serving case (``conv_state`` given): ``out`` and the whole state buffer."""
    t = build_prefill(case)
    (st_ref, buf_ref), (st_fn, buf_fn) = clone_state(t), clone_state(t)
    with torch.no_grad():
        want = ref.ple_prefill(*t["inputs"].values(), **_kwargs(t, case, st_ref))
        with poisoned_empty():
            got = call_with_family("ple_prefill", lambda: fn(*t["inputs"].values(), **_kwargs(t, case, st_fn)), case)
        ill = _ill(t, case)
        exact = st64 = None
        if case["dtype"] in HALF_DTYPES or ill:
            st64, _ = clone_state(t, torch.float64)
            exact = ref.ple_prefill(*_to64(t["inputs"]).values(), **_kwargs(t, case, st64))
    name = "ple_prefill serving"
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise AssertionError(f"{name}: out: got {shape} {getattr(got, 'dtype', '')}, expected {tuple(want.shape)} "
                             f"{want.dtype}\n  case: {fmt_case(case)}")
    rows, outside = t["rows"], t["outside"]
    compare_close(got[rows], want[rows], None if exact is None else exact[rows], name=f"{name}: out",
                  where=_row_where(t), case=case, judge64=ill)
    compare_bits(got[outside].abs(), want[outside].abs(), case=case,
                 name=f"{name}: out at a physical row no logical row maps to (must be 0)",
                 where=lambda idx: f"physical row {outside[idx[0]]}, channel {idx[1]}")
    fresh = t["fresh"]
    positions = fresh.nonzero().tolist()
    at = _state_where(t, case, "")
    where_fresh = lambda idx: at(tuple(positions[idx[0]]))  # noqa: E731
    bits = exact_states if exact_states is not None else case["dtype"] in HALF_DTYPES
    if bits:
        compare_bits(st_fn[fresh], st_ref[fresh], name=f"{name}: conv_state (a new column, bit for bit)",
                     where=where_fresh, case=case)
    else:
        compare_close(st_fn[fresh], st_ref[fresh], None if st64 is None else st64[fresh].double(), case=case,
                      name=f"{name}: conv_state (a new column, by the tolerance table)", where=where_fresh,
                      judge64=ill)
    st_fn[fresh] = 0                                          # the rest: bit for bit
    st_ref[fresh] = 0
    compare_bits(st_fn, st_ref, name=f"{name}: conv_state", where=at, case=case)
    compare_bits(buf_fn, buf_ref, name=f"{name}: conv_state's buffer outside the view",
                 where=lambda idx: f"buffer element {idx}", case=case)


def check_ple_prefill(fn: Callable[..., Any], *, parts: Sequence[str] = PARTS, dtypes: Sequence[torch.dtype] = DTYPES,
                      max_hidden: int = 160, max_requests: int = 4, exact_states: bool | None = None,
                      families: Sequence[str] = FAMILIES, max_examples: int = 25, seed: int | None = 0) -> None:
    """Check ``fn`` (the signature of ``ple.reference.ple_prefill``) against the reference.

    ``parts``: ``"forward"`` (``conv_state=None``: ``out`` and the gradients of key, value,
    hidden_states, the three norm weights and conv_weights) and ``"serving"`` (``conv_state``
    given: ``out`` and the whole state buffer). ``max_examples`` cases per part; ``seed`` fixes
    the draw (None: Hypothesis's own randomness). ``exact_states`` says how the state columns
    computed from this call's rows are judged (see the module docstring): default bit for bit
    for bfloat16 / float16 inputs and by the float32 / float64 tolerance otherwise; copies of
    old columns and every bit the call must not write are always compared bit for bit.
    ``families``: the gate families drawn (``ple.testing.kit.ops.FAMILIES``; ``("qwen4exp",)`` checks a function
    that does not take ``unit_offset`` / ``conv_eps``). Returns quietly, or raises ``AssertionError`` naming the
    smallest failing case.
    """
    check_options(dtypes=dtypes, max_hidden=max_hidden, max_requests=max_requests, exact_states=exact_states,
                  max_examples=max_examples, seed=seed)
    parts = _checks.choices_arg("parts", parts, PARTS)
    families = _checks.choices_arg("families", families, FAMILIES)
    for part in parts:
        if part == "forward":
            body = lambda case: check_one_forward(fn, case)  # noqa: E731
        else:
            body = lambda case: check_one_serving(fn, case, exact_states)  # noqa: E731
        _prop(prefill_cases(part, dtypes=dtypes, max_hidden=max_hidden, max_requests=max_requests, families=families),
              body, max_examples, seed)
