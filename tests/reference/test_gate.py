"""Grouped RMS norms and the signed-sqrt gate (docs/spec.md section 4)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st

from ple.reference import grouped_rms_norm, ple_gate

SIZES = dict(T=st.sampled_from([1, 2, 7, 9]), M=st.integers(1, 3), H=st.sampled_from([1, 2, 3, 5, 7, 12]))


# ---- an independent statement of docs/spec.md section 4, in float64 -----------------------------------------
def spec_norm(x: torch.Tensor, w: torch.Tensor, H: int, eps: float) -> torch.Tensor:
    T, C = x.shape
    g = x.double().reshape(T, C // H, H)
    y = g / torch.sqrt((g * g).mean(-1, keepdim=True) + eps)
    return y.reshape(T, C) * (1 + w.double())


def spec_scores(key, hidden, wk, wq, H, eps) -> torch.Tensor:
    T, C = key.shape
    kn = spec_norm(key, wk, H, eps).reshape(T, C // H, H)
    qn = spec_norm(hidden, wq, H, eps).reshape(T, C // H, H)
    return (kn * qn).sum(-1) / math.sqrt(H)  # [T, M]


def spec_gate(key, value, hidden, wk, wq, wc, eps):
    T, C = key.shape
    H = value.shape[1]
    s = spec_scores(key, hidden, wk, wq, H, eps)
    g = torch.sigmoid(torch.sign(s) * torch.sqrt(torch.clamp(s.abs(), min=1e-6)))
    gated = (g[:, :, None] * value.double()[:, None, :]).reshape(T, C)
    return gated, spec_norm(gated, wc, H, eps)


def gate_inputs(T, M, H, seed, dtype=torch.float64, *, key_scale=1.0, aligned=True):
    """Random gate inputs. With ``aligned``, each stream of the hidden state is +-(key + noise), so
    ``|s|`` is about ``sqrt(H)``: far from the clamp at 1e-6, with both signs."""
    gen = torch.Generator().manual_seed(seed)
    C = M * H
    key = torch.randn(T, C, generator=gen, dtype=torch.float64) * key_scale
    value = torch.randn(T, H, generator=gen, dtype=torch.float64)
    hidden = torch.randn(T, C, generator=gen, dtype=torch.float64)
    if aligned:
        sign = torch.where(torch.rand(T, M, 1, generator=gen) < 0.5, -1.0, 1.0).double()
        hidden = (sign * (key.reshape(T, M, H) + 0.3 * hidden.reshape(T, M, H))).reshape(T, C)
    ws = [0.3 * torch.randn(C, generator=gen, dtype=torch.float64) for _ in range(3)]
    return [t.to(dtype) for t in (key, value, hidden, *ws)]


@given(
    **SIZES,
    seed=st.integers(0, 2**31),
    eps=st.sampled_from([1e-6, 1e-5, 0.1]),
    key_scale=st.sampled_from([1e-9, 1e-4, 1.0, 30.0]),
    aligned=st.booleans(),
)
def test_ple_gate_float64_matches_spec(T, M, H, seed, eps, key_scale, aligned):
    note(f"T={T} M={M} H={H} seed={seed}")
    args = gate_inputs(T, M, H, seed, key_scale=key_scale, aligned=aligned)
    gated, conv_input = ple_gate(*args, eps)
    want_gated, want_conv = spec_gate(*args, eps)
    assert gated.dtype == conv_input.dtype == torch.float64
    assert gated.shape == conv_input.shape == (T, M * H)
    torch.testing.assert_close(gated, want_gated, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(conv_input, want_conv, rtol=1e-10, atol=1e-12)


@given(**SIZES, seed=st.integers(0, 2**31))
def test_ple_gate_float32_matches_spec(T, M, H, seed):
    args = gate_inputs(T, M, H, seed, dtype=torch.float32)
    before = [a.clone() for a in args]
    gated, conv_input = ple_gate(*args, 1e-6)
    want_gated, want_conv = spec_gate(*args, 1e-6)
    assert gated.dtype == conv_input.dtype == torch.float32
    torch.testing.assert_close(gated.double(), want_gated, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv_input.double(), want_conv, rtol=1e-5, atol=1e-5)
    for a, b in zip(args, before, strict=True):  # inputs are not modified
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_zero_score_gives_one_half(dtype):
    # A zero key normalises to zero, so s = 0 and the gate is sigmoid(0) = 0.5 exactly.
    key, value, hidden, wk, wq, wc = gate_inputs(5, 3, 4, 0, dtype)
    gated, _ = ple_gate(torch.zeros_like(key), value, hidden, wk, wq, wc, 1e-6)
    assert torch.equal(gated, (0.5 * value).to(dtype).repeat(1, 3))


@given(
    **SIZES, seed=st.integers(0, 2**31), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16])
)
def test_grouped_rms_norm_matches_spec(T, M, H, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(T, M * H, generator=gen)).to(dtype)
    w = torch.randn(M * H, generator=gen).to(dtype)
    y = grouped_rms_norm(x, w, H, 1e-5)
    assert y.dtype == dtype
    want = spec_norm(x, w, H, 1e-5)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
    # Zero weight: scale 1, each group has unit mean square (up to eps).
    y0 = grouped_rms_norm(x.double(), torch.zeros(M * H, dtype=torch.float64), H, 1e-12)
    ms = y0.reshape(T, M, H).pow(2).mean(-1)
    nonzero = x.double().reshape(T, M, H).abs().amax(-1) > 0
    torch.testing.assert_close(ms[nonzero], torch.ones_like(ms[nonzero]), rtol=1e-6, atol=1e-6)


@given(
    T=st.sampled_from([1, 3]), M=st.integers(1, 3), H=st.sampled_from([1, 3, 4]), seed=st.integers(0, 2**31)
)
def test_ple_gate_gradcheck(T, M, H, seed):
    args = [a.requires_grad_() for a in gate_inputs(T, M, H, seed)]
    s = spec_scores(args[0].detach(), args[2].detach(), args[3].detach(), args[4].detach(), H, 1e-6)
    assume(float(s.abs().min()) > 1e-2)  # far from the clamp at 1e-6 (rarely not)
    assert torch.autograd.gradcheck(lambda *a: ple_gate(*a, 1e-6), args, eps=1e-6, atol=1e-6, rtol=1e-4)


@given(**SIZES, seed=st.integers(0, 2**31))
def test_ple_gate_bfloat16_close_to_its_float64_run(T, M, H, seed):
    args = gate_inputs(T, M, H, seed, torch.bfloat16)
    gated, conv_input = ple_gate(*args, 1e-6)
    exact_gated, exact_conv = ple_gate(*[a.double() for a in args], 1e-6)
    assert gated.dtype == torch.bfloat16
    # A handful of bfloat16 roundings (2^-8 each) on values of order 1.
    for got, exact in ((gated, exact_gated), (conv_input, exact_conv)):
        err = (got.double() - exact).abs()
        bound = 2**-6 * exact.abs() + 2**-7
        assert bool((err <= bound).all()), f"max error {err.max():.3g}"
