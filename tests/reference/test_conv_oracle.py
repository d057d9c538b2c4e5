"""The vectorised ``ple_conv`` / ``export_conv_checkpoints`` (``ple.vectorized``, the ``"torch"`` backend)
equal the reference's per-request loops bit for bit: residuals and the whole state buffer.

Hypothesis draws modes, input and state dtypes (mixed too), state layouts, ``token_indices``,
``outer_residual``, null-slot requests (the null slot poisoned with NaN; also a null slot outside
``[0, num_slots)``, and no slots at all), empty requests, index dtypes and ``validate`` on or off
(for each side). Both apply silu once over all logical rows, so float32 / float64 results are
equal bit for bit too (the CPU's silu kernel rounds its vector body and its scalar tail
differently, by up to an ulp, so applying it per request would not be); in bfloat16 / float16
the rounded silu is the same either way (``test_silu_rounding_is_layout_free``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from hypothesis import strategies as st

from ple import reference, vectorized
from ple.testing.numerics import assert_bitwise_equal

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16]
LAYOUTS = ["contiguous", "transposed", "slot_strided", "window_view"]


def make_state(layout, num_slots, C, W, dtype, gen):
    """A random state buffer and the function that views it as ``[num_slots, C, W]``."""
    shapes = {"contiguous": (num_slots, C, W), "transposed": (num_slots, W, C),
              "slot_strided": (2 * num_slots + 1, C, W), "window_view": (num_slots, C, W + 3)}
    views = {"contiguous": lambda b: b, "transposed": lambda b: b.transpose(1, 2),
             "slot_strided": lambda b: b[1::2][:num_slots], "window_view": lambda b: b[:, :, 2 : 2 + W]}
    return torch.randn(shapes[layout], generator=gen).to(dtype), views[layout]


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
def test_vectorized_ple_conv_equals_reference(data, seed):
    draw = data.draw
    gen = torch.Generator().manual_seed(seed)
    mode = draw(st.sampled_from(["spec", "decode", "prefill"]), label="mode")
    dt = draw(st.sampled_from(DTYPES), label="inputs dtype")
    sdt = draw(st.sampled_from([dt] + DTYPES), label="state dtype")
    C = draw(st.sampled_from([1, 3, 5, 16, 17]), label="C")
    K, d, Q = draw(st.integers(1, 4), label="K"), draw(st.integers(1, 3), label="d"), draw(st.integers(1, 3), label="Q")
    S = (K - 1) * d
    R = draw(st.integers(0, 5), label="R")
    no_slots = draw(st.integers(0, 9), label="no slots") == 0         # every request on the null slot
    num_slots = 0 if no_slots else R + 2
    null = draw(st.sampled_from([0, num_slots - 1, num_slots + 1, -1]), label="null slot")
    free = [s for s in range(num_slots) if s != null]
    order = draw(st.permutations(free), label="slot order")
    slots = [null if no_slots or draw(st.booleans(), label=f"null {r}") else order[r] for r in range(R)]
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
    note(dict(lens=lens, slots=slots, C=C, K=K, d=d, Q=Q, W=W))

    want_res, want_buf = residual.clone(), buf.clone()
    reference.ple_conv(inputs, want_res, view(want_buf), w, state_indices,
                       validate=draw(st.booleans(), label="validate (reference)"), **kw)
    vectorized.ple_conv(inputs, residual, view(buf), w, state_indices,
                        validate=draw(st.booleans(), label="validate (vectorized)"), **kw)
    assert_bitwise_equal(residual, want_res, name="residual")
    assert_bitwise_equal(buf, want_buf, name="state buffer")


# ---- export_conv_checkpoints -------------------------------------------------------------------------
@settings(max_examples=100)
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_vectorized_export_equals_reference(data, seed):
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
    reference.export_conv_checkpoints(inputs, view(want), validate=draw(st.booleans(), label="validate (reference)"),
                                      **kw)
    vectorized.export_conv_checkpoints(inputs, view(buf), validate=draw(st.booleans(), label="validate (vectorized)"),
                                       **kw)
    assert_bitwise_equal(buf, want, name="state buffer")
