"""The vectorised ``ple_conv`` / ``export_conv_checkpoints`` equal, bit for bit, the per-request loops
they replaced (kept here as the oracle: ``loop_ple_conv`` and ``loop_export``).

Hypothesis draws modes, input and state dtypes (mixed too), state layouts, ``token_indices``,
``outer_residual``, null-slot requests (the null slot poisoned with NaN; also a null slot outside
``[0, num_slots)``), empty requests and ``validate`` on or off. Residuals and the whole state buffer
are compared bit for bit. One caveat is the CPU's ``silu`` kernel, not the ops: its vector body and
its scalar tail (the last ``numel % 16`` elements of a contiguous block) can differ by an ulp in
float32 / float64, and the oracle applies silu per request while the op applies it to all rows at
once. So with float32 / float64 inputs C is a multiple of 16 (every element takes the vector path in
both), or the outputs are compared to an ulp; with bfloat16 / float16 inputs silu's result, rounded,
is the same either way (checked for every value in ``test_silu_rounding_is_layout_free``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from hypothesis import strategies as st

from ple import _checks
from ple.reference import export_conv_checkpoints, ple_conv
from ple.reference.gate import acc_dtype
from ple.testing.numerics import assert_bitwise_equal

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16]
LAYOUTS = ["contiguous", "transposed", "slot_strided", "window_view"]


# ---- the oracle: the per-request loops of the implementation before vectorisation ----------------
def conv_over_history(hist, weight, dilation):
    K = weight.shape[1]
    S = (K - 1) * dilation
    q = hist.shape[0] - S
    acc = acc_dtype(hist.dtype)
    h, w = hist.to(acc), weight.to(acc)
    out = torch.zeros(q, hist.shape[1], dtype=acc, device=hist.device)
    for j in range(K):
        lag = (K - 1 - j) * dilation
        out = out + w[:, j] * h[S - lag : S - lag + q]
    return F.silu(out.to(hist.dtype).to(acc)).to(hist.dtype)


def loop_ple_conv(inputs, residual, conv_state, conv_weights, state_indices, *, mode, dilation,
                  query_start_loc=None, has_initial_states=None, num_accepted_tokens=None, spec_query_len=1,
                  token_indices=None, outer_residual=None, null_slot=0):
    call = _checks.ple_conv_call(
        inputs, residual, conv_state, conv_weights, state_indices, mode=mode, dilation=dilation,
        query_start_loc=query_start_loc, has_initial_states=has_initial_states,
        num_accepted_tokens=num_accepted_tokens, spec_query_len=spec_query_len,
        token_indices=token_indices, outer_residual=outer_residual, null_slot=null_slot)
    S = call.state_len
    updates = []
    for r, slot in enumerate(call.slots):
        lo, hi = call.starts[r], call.starts[r + 1]
        if hi == lo:
            continue
        rows = torch.arange(lo, hi) if call.rows is None else torch.tensor(call.rows[lo:hi])
        if slot == null_slot:
            if outer_residual is not None:
                residual[rows] = residual[rows] + outer_residual[rows]
            continue
        state = conv_state[slot]
        x = inputs[rows]
        if mode == "spec":
            o = call.accepted[r] - 1
            prefix = state[:, o : o + S].T
        elif call.has_initial[r]:
            prefix = state[:, :S].T
        else:
            prefix = torch.zeros(S, x.shape[1], dtype=conv_state.dtype)
        hist = torch.cat([prefix.to(inputs.dtype), x], dim=0)
        y = conv_over_history(hist, conv_weights, dilation)
        out = residual[rows] + y
        if outer_residual is not None:
            out = out + outer_residual[rows]
        keep = hist[1:] if mode == "spec" else hist[-S:] if S else hist[:0]
        updates.append((rows, out, slot, keep))
    for rows, out, slot, keep in updates:
        residual[rows] = out
        conv_state[slot, :, : keep.shape[0]] = keep.T.to(conv_state.dtype)


def loop_export(inputs, conv_state, *, query_start_loc, offsets, slots, state_len, token_indices=None,
                null_slot=0):
    call = _checks.export_call(inputs, conv_state, query_start_loc=query_start_loc, offsets=offsets,
                               slots=slots, state_len=state_len, token_indices=token_indices,
                               null_slot=null_slot)
    for r, (off, slot) in enumerate(zip(call.offsets, call.slots)):
        if off == 0 or slot == null_slot:
            continue
        logical = list(range(call.starts[r] + off - state_len, call.starts[r] + off))
        rows = logical if call.rows is None else [call.rows[i] for i in logical]
        conv_state[slot, :, :state_len] = inputs[rows].T.to(conv_state.dtype)


# ---- helpers ------------------------------------------------------------------------------------
def make_state(layout, num_slots, C, W, dtype, gen):
    """A random state buffer and the function that views it as ``[num_slots, C, W]``."""
    shapes = {"contiguous": (num_slots, C, W), "transposed": (num_slots, W, C),
              "slot_strided": (2 * num_slots + 1, C, W), "window_view": (num_slots, C, W + 3)}
    views = {"contiguous": lambda b: b, "transposed": lambda b: b.transpose(1, 2),
             "slot_strided": lambda b: b[1::2][:num_slots], "window_view": lambda b: b[:, :, 2 : 2 + W]}
    return torch.randn(shapes[layout], generator=gen).to(dtype), views[layout]


def channels(data, dtype):
    """C: a multiple of 16 where silu's rounding depends on the layout (float32 / float64), else any."""
    exact = dtype in (torch.bfloat16, torch.float16) or data.draw(st.booleans(), label="C multiple of 16")
    options = [1, 3, 5, 16] if dtype in (torch.bfloat16, torch.float16) else [16, 32] if exact else [3, 5, 7]
    return data.draw(st.sampled_from(options), label="C"), exact


def assert_outputs_equal(actual, expected, exact, name):
    if exact:
        assert_bitwise_equal(actual, expected, name=name)
    else:  # silu may differ by an ulp (module docstring)
        torch.testing.assert_close(actual, expected, rtol=4e-7 if actual.dtype == torch.float32 else 1e-15,
                                   atol=0, equal_nan=True)


def test_silu_rounding_is_layout_free():
    """For every bfloat16 / float16 value, silu's vector body and scalar tail round to the same result."""
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float()
        spread = torch.zeros(2 * x.numel())
        spread[::2] = x
        vector, scalar = F.silu(x).to(dtype), F.silu(spread[::2]).to(dtype)  # a strided input takes the scalar loop
        assert_bitwise_equal(vector, scalar, name=f"silu in {dtype}")


# ---- ple_conv --------------------------------------------------------------------------------------
@settings(max_examples=200)
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_ple_conv_equals_per_request_loop(data, seed):
    draw = data.draw
    gen = torch.Generator().manual_seed(seed)
    mode = draw(st.sampled_from(["spec", "decode", "prefill"]), label="mode")
    dt = draw(st.sampled_from(DTYPES), label="inputs dtype")
    sdt = draw(st.sampled_from([dt] + DTYPES), label="state dtype")
    C, exact = channels(data, dt)
    K, d, Q = draw(st.integers(1, 4), label="K"), draw(st.integers(1, 3), label="d"), draw(st.integers(1, 3), label="Q")
    S = (K - 1) * d
    R = draw(st.integers(0, 5), label="R")
    num_slots = R + 2
    null = draw(st.sampled_from([0, num_slots - 1, num_slots + 1, -1]), label="null slot")
    free = [s for s in range(num_slots) if s != null]
    order = draw(st.permutations(free), label="slot order")
    slots = [null if draw(st.booleans(), label=f"null {r}") else order[r] for r in range(R)]
    if mode == "decode":
        lens = [1] * R
    elif mode == "spec":
        lens = [draw(st.integers(1, Q), label=f"q{r}") for r in range(R)]
    else:
        lens = [draw(st.sampled_from([3, 0, 1, 2, S + 2]), label=f"q{r}") for r in range(R)]
    N = sum(lens)
    starts = [sum(lens[:r]) for r in range(R + 1)]
    W = (S + Q - 1 if mode == "spec" else S) + draw(st.integers(0, 2), label="extra window")
    layout = draw(st.sampled_from(LAYOUTS), label="layout")
    idx = draw(st.sampled_from([torch.int64, torch.int32]), label="index dtype")
    use_rows = draw(st.booleans(), label="token_indices")
    T = N + (draw(st.integers(0, 2), label="spare rows") if use_rows else 0)
    kw = dict(mode=mode, dilation=d, null_slot=null, query_start_loc=torch.tensor(starts, dtype=idx))
    if use_rows:
        kw["token_indices"] = torch.randperm(T, generator=gen)[:N].to(idx)
    if mode == "spec":
        kw["spec_query_len"] = Q
        kw["num_accepted_tokens"] = torch.randint(1, Q + 1, (R,), generator=gen).to(idx)
    elif mode == "decode" and draw(st.booleans(), label="decode qsl None"):
        kw["query_start_loc"] = None
    if draw(st.booleans(), label="has_initial_states"):
        flags = torch.rand(R, generator=gen) < 0.5
        kw["has_initial_states"] = flags.to(draw(st.sampled_from([torch.bool, torch.int32]), label="flag dtype"))
    inputs = torch.randn(T, C, generator=gen).to(dt)
    residual = torch.randn(T, C, generator=gen).to(dt)
    if draw(st.booleans(), label="outer_residual"):
        kw["outer_residual"] = torch.randn(T, C, generator=gen).to(dt)
    w = torch.randn(C, K, generator=gen).to(dt)
    buf, view = make_state(layout, num_slots, C, W, sdt, gen)
    if 0 <= null < num_slots:
        view(buf)[null] = float("nan")          # outputs must not depend on it, and it must not change
    state_indices = torch.tensor(slots, dtype=idx)
    validate = draw(st.booleans(), label="validate")
    note(dict(lens=lens, slots=slots, C=C, K=K, d=d, Q=Q, W=W))

    want_res, want_buf = residual.clone(), buf.clone()
    loop_ple_conv(inputs, want_res, view(want_buf), w, state_indices, **kw)
    ple_conv(inputs, residual, view(buf), w, state_indices, validate=validate, **kw)
    assert_outputs_equal(residual, want_res, exact, "residual")
    assert_bitwise_equal(buf, want_buf, name="state buffer")


# ---- export_conv_checkpoints -------------------------------------------------------------------------
@settings(max_examples=100)
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_export_equals_per_request_loop(data, seed):
    draw = data.draw
    gen = torch.Generator().manual_seed(seed)
    dt, sdt = draw(st.sampled_from(DTYPES), label="inputs dtype"), draw(st.sampled_from(DTYPES), label="state dtype")
    C, S = draw(st.sampled_from([1, 3, 5]), label="C"), draw(st.integers(1, 4), label="S")
    R = draw(st.integers(0, 4), label="R")
    num_slots = 2 * R + 2
    null = draw(st.sampled_from([0, num_slots - 1, num_slots + 3]), label="null slot")
    lens = [draw(st.integers(0, 2 * S + 2), label=f"len{r}") for r in range(R)]
    offs = [draw(st.sampled_from([0] + list(range(S, n + 1))), label=f"off{r}") for r, n in enumerate(lens)]
    free = [s for s in range(num_slots) if s != null]
    order = draw(st.permutations(free), label="slot order")
    # Requests without a checkpoint may name any slot, even one another request writes.
    sl = [null if draw(st.booleans(), label=f"null {r}") else order[r] if offs[r] else
          draw(st.sampled_from(free), label=f"any slot {r}") for r in range(R)]
    N = sum(lens)
    kw = dict(query_start_loc=torch.tensor([sum(lens[:r]) for r in range(R + 1)]),
              offsets=torch.tensor(offs, dtype=torch.int64), slots=torch.tensor(sl, dtype=torch.int32),
              state_len=S, null_slot=null)
    T = N
    if draw(st.booleans(), label="token_indices"):
        T = N + 2
        kw["token_indices"] = torch.randint(0, T, (N,), generator=gen)    # repeats are allowed here
    inputs = torch.randn(T, C, generator=gen).to(dt)
    buf, view = make_state(draw(st.sampled_from(LAYOUTS), label="layout"), num_slots, C,
                           S + draw(st.integers(0, 2), label="extra"), sdt, gen)
    if 0 <= null < num_slots:
        view(buf)[null] = float("nan")
    note(dict(lens=lens, offs=offs, slots=sl, null=null))
    want = buf.clone()
    loop_export(inputs, view(want), **kw)
    export_conv_checkpoints(inputs, view(buf), validate=draw(st.booleans(), label="validate"), **kw)
    assert_bitwise_equal(buf, want, name="state buffer")
