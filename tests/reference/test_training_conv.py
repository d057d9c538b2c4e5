"""``dilated_causal_conv``, the training conv (docs/spec.md section 5): checked against ``torch.nn.functional.conv1d``,
packed against dense, gradcheck, and bfloat16 against its float64 run."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from ple.reference import dilated_causal_conv

INDEX_DTYPES = st.sampled_from([torch.int32, torch.int64])


def conv1d_reference(x: torch.Tensor, w: torch.Tensor, d: int) -> torch.Tensor:
    """``silu`` of a depthwise causal conv via ``F.conv1d``: ``x`` ``[B, L, C]``, ``w`` ``[C, K]``."""
    C, K = w.shape
    S = (K - 1) * d
    xp = F.pad(x.transpose(1, 2), (S, 0))  # [B, C, S + L], zeros on the left
    return F.silu(F.conv1d(xp, w[:, None, :], dilation=d, groups=C)).transpose(1, 2)


# ---- dilated_causal_conv ----------------------------------------------------------------------
@given(
    B=st.integers(1, 3),
    L=st.sampled_from([1, 2, 7, 13]),
    C=st.sampled_from([1, 3, 5, 6]),
    K=st.integers(1, 5),
    d=st.integers(1, 4),
    seed=st.integers(0, 2**31),
)
def test_dense_matches_conv1d_float64(B, L, C, K, d, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, C, generator=gen, dtype=torch.float64)
    w = torch.randn(C, K, generator=gen, dtype=torch.float64)
    y = dilated_causal_conv(x, w, dilation=d)
    assert y.dtype == torch.float64 and y.shape == x.shape
    torch.testing.assert_close(y, conv1d_reference(x, w, d), rtol=1e-12, atol=1e-12)
    # A 2-D input without cu_seqlens is one sequence.
    torch.testing.assert_close(dilated_causal_conv(x[0], w, dilation=d), y[0], rtol=1e-12, atol=1e-12)


@given(
    lens=st.lists(st.sampled_from([0, 1, 2, 5, 7, 11]), min_size=1, max_size=5),
    C=st.sampled_from([1, 3, 7]),
    K=st.integers(1, 4),
    d=st.integers(1, 3),
    seed=st.integers(0, 2**31),
    idx=INDEX_DTYPES,
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_packed_equals_dense_per_sequence(lens, C, K, d, seed, idx, dtype):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    x = torch.randn(T, C, generator=gen).to(dtype)
    w = torch.randn(C, K, generator=gen).to(dtype)
    cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=idx)
    y = dilated_causal_conv(x, w, dilation=d, cu_seqlens=cu)
    assert y.shape == (T, C) and y.dtype == dtype
    for a, b in pairwise(cu.tolist()):
        if b > a:
            dense = dilated_causal_conv(x[None, a:b], w, dilation=d)[0]
            torch.testing.assert_close(y[a:b], dense, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(
                y[a:b].double(),
                conv1d_reference(x[None, a:b].double(), w.double(), d)[0],
                rtol=1e-5,
                atol=1e-5,
            )


@pytest.mark.parametrize(
    "shape, cu", [((0, 3), [0]), ((0, 3), [0, 0]), ((0, 3), None), ((2, 0, 3), None), ((0, 4, 3), None)]
)
def test_dilated_causal_conv_empty_batches(shape, cu):
    x = torch.zeros(shape)
    cu_seqlens = None if cu is None else torch.tensor(cu)
    y = dilated_causal_conv(x, torch.ones(3, 2), dilation=2, cu_seqlens=cu_seqlens)
    assert y.shape == x.shape


@given(
    lens=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    C=st.sampled_from([1, 3]),
    K=st.integers(1, 3),
    d=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_dilated_causal_conv_gradcheck(lens, C, K, d, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    x = torch.randn(T, C, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, K, generator=gen, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))])
    assert torch.autograd.gradcheck(lambda x, w: dilated_causal_conv(x, w, dilation=d, cu_seqlens=cu), (x, w))
    xb = torch.randn(2, max(lens), C, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: dilated_causal_conv(x, w, dilation=d), (xb, w))


@given(
    B=st.integers(1, 2),
    L=st.sampled_from([1, 7, 20]),
    C=st.sampled_from([3, 5]),
    K=st.integers(1, 4),
    d=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_dilated_causal_conv_bfloat16_close_to_its_float64_run(B, L, C, K, d, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, C, generator=gen).bfloat16()
    w = (0.5 * torch.randn(C, K, generator=gen)).bfloat16()
    y = dilated_causal_conv(x, w, dilation=d)
    assert y.dtype == torch.bfloat16
    exact = dilated_causal_conv(x.double(), w.double(), dilation=d)
    # The pre-activation is rounded once and silu once: each a relative 2^-9, silu' <= 1.1.
    scale = F.conv1d(
        F.pad(x.double().abs().transpose(1, 2), ((K - 1) * d, 0)),
        w.double().abs()[:, None, :],
        dilation=d,
        groups=C,
    ).transpose(1, 2)
    err = (y.double() - exact).abs()
    assert bool((err <= 2**-7 * (scale + exact.abs()) + 1e-6).all()), f"max error {err.max():.3g}"
