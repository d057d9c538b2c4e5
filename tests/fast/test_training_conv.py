"""``ple.fast.dilated_causal_conv`` (forward and backward) against ``ple.reference``: outputs and both
gradients judged by ``ple.testing.numerics.assert_close`` (bfloat16 against a float64 run of the
reference), every buffer the kernels allocate poisoned with NaN so a missed write shows.
"""

from __future__ import annotations

import pytest
import torch
from _tier import examples
from hypothesis import given, note, settings
from hypothesis import strategies as st

from ple import fast  # the public ops: torch.library custom ops
from ple import reference as ref
from ple.fast import training_conv as TC
from ple.testing.kit.cases import index_tensor, randn, to64
from ple.testing.numerics import assert_close, assert_no_nan

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("poisoned_empty")]

CHANNELS = [1, 5, 13, 40]


# ---- dilated_causal_conv ----------------------------------------------------------------------------


@given(
    kind=st.sampled_from(["dense", "packed", "single"]), C=st.sampled_from(CHANNELS), K=st.integers(1, 5),
    d=st.integers(1, 4), B=st.integers(1, 2), L=st.sampled_from([1, 7, 40]),
    lens=st.lists(st.sampled_from([0, 1, 5, 33]), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]), strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=examples(5))
def test_dilated_causal_conv_matches_reference(kind, C, K, d, B, L, lens, dtype, strided, seed):
    note(dict(kind=kind, C=C, K=K, d=d, B=B, L=L, lens=lens, dtype=dtype, strided=strided, seed=seed))
    _check_against_reference(kind, C, K, d, B, L, lens, dtype, strided, seed)


# Block sizes small enough that the cases above span many tiles, channel blocks and backward programs:
# (forward rows, forward channels, channel blocks per forward program, backward rows, backward channels,
# tiles per backward program).
SMALL_SIZES = [(16, 4, 2, 16, 4, 1), (32, 8, 1, 32, 2, 3), (16, 2, 3, 64, 8, 2)]


@given(
    sizes=st.sampled_from(SMALL_SIZES),
    kind=st.sampled_from(["dense", "packed"]), C=st.sampled_from([5, 13]), K=st.integers(1, 5),
    d=st.integers(1, 4), L=st.sampled_from([7, 40, 75]),
    lens=st.lists(st.sampled_from([0, 1, 5, 33, 70]), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=examples(3))
def test_dilated_causal_conv_small_tiles_match_reference(sizes, kind, C, K, d, L, lens, dtype, seed):
    """Tiles much shorter than the sequences: halos across tiles, several tiles per backward program."""
    note(dict(sizes=sizes, kind=kind, C=C, K=K, d=d, L=L, lens=lens, dtype=dtype, seed=seed))
    with pytest.MonkeyPatch.context() as m:
        for name, v in zip(("FWD_ROWS", "FWD_CHANNELS", "FWD_SUB", "BWD_ROWS", "BWD_CHANNELS", "BWD_TILES"),
                           sizes, strict=True):
            m.setattr(TC, name, v)
        m.setattr(TC, "MIN_OWNED", 1)
        _check_against_reference(kind, C, K, d, 2, L, lens, dtype, False, seed)


def _check_against_reference(kind, C, K, d, B, L, lens, dtype, strided, seed):
    g = torch.Generator().manual_seed(seed)
    cu_seqlens = None
    if kind == "dense":
        shape = (B, L, C)
    elif kind == "packed":                                  # strided: cu_seqlens a column of a table
        cu_seqlens = index_tensor([0] + torch.tensor(lens).cumsum(0).tolist(), torch.int32, strided)
        shape = (sum(lens), C)
    else:
        shape = (L, C)
    if strided:                                             # x a channel slice, weight conv1d.weight[:, 0, :]
        x = randn(shape[:-1] + (C + 2,), dtype, g)[..., 1:C + 1]
        w = randn((C, 1, K), dtype, g)[:, 0, :]
        dy = randn(shape[::-1], dtype, g).permute(*reversed(range(len(shape))))
    else:
        x = randn(shape, dtype, g)
        w = randn((C, K), dtype, g)
        dy = randn(shape, dtype, g)

    def run(op, x, w, dy):                                  # every buffer allocated starts NaN (poisoned_empty)
        x = x.detach().clone().requires_grad_()
        w = w.detach().clone().requires_grad_()
        y = op(x, w, dilation=d, cu_seqlens=cu_seqlens)
        y.backward(dy)
        return y.detach(), x.grad, w.grad

    got = run(fast.dilated_causal_conv, x, w, dy)
    want = run(ref.dilated_causal_conv, x, w, dy)
    exact = [None] * 3
    if dtype == torch.bfloat16:                             # the float64 run judges bfloat16
        exact = run(ref.dilated_causal_conv, to64(x), to64(w), to64(dy))
    for name, a, b, e in zip(("y", "dx", "dweight"), got, want, exact, strict=True):
        assert_no_nan(a, name=name)
        assert_close(a, b, exact64=e, name=name)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_dilated_causal_conv_reads_cu_seqlens_through_its_stride(dtype):
    g = torch.Generator().manual_seed(3)
    x = randn((40, 5), torch.float32, g).requires_grad_()
    w = randn((5, 3), torch.float32, g).requires_grad_()
    dy = randn((40, 5), torch.float32, g)
    cu_seqlens = torch.tensor([0, 99, 3, -7, 3, 5, 37, 1000, 40], dtype=dtype)[::2]      # [0, 3, 3, 37, 40], stride 2
    outs = []
    for op in (ref.dilated_causal_conv, fast.dilated_causal_conv):
        y = op(x, w, dilation=2, cu_seqlens=cu_seqlens)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        outs.append((y, dx, dw))
    for name, a, b in zip(("y", "dx", "dweight"), *outs, strict=True):
        assert_close(a, b, name=name)


def test_dilated_causal_conv_gradcheck():
    g = torch.Generator().manual_seed(0)
    w = randn((2, 3), torch.float64, g).requires_grad_()
    x = randn((1, 6, 2), torch.float64, g).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: fast.dilated_causal_conv(a, b, dilation=2), (x, w),
                                    fast_mode=True)
    xp = randn((7, 2), torch.float64, g).requires_grad_()
    cu_seqlens = torch.tensor([0, 3, 3, 7])
    assert torch.autograd.gradcheck(lambda a, b: fast.dilated_causal_conv(a, b, dilation=1, cu_seqlens=cu_seqlens),
                                    (xp, w), fast_mode=True)



def test_dilated_causal_conv_errors_match_reference():
    cu_seqlens, short = torch.tensor([0, 4]), torch.tensor([0, 3])
    for args, kw in [((torch.randn(4, 3), torch.randn(2, 2)), dict(dilation=1)),
                     ((torch.randn(4, 3), torch.randn(3, 2)), dict(dilation=0)),
                     ((torch.randn(1, 4, 3), torch.randn(3, 2)), dict(dilation=1, cu_seqlens=cu_seqlens)),
                     ((torch.randn(4, 3), torch.randn(3, 2)), dict(dilation=1, cu_seqlens=short))]:
        with pytest.raises((ValueError, TypeError)) as e_ref:
            ref.dilated_causal_conv(*args, **kw)
        with pytest.raises((ValueError, TypeError)) as e_fast:
            fast.dilated_causal_conv(*args, **kw)
        assert type(e_fast.value) is type(e_ref.value) and str(e_fast.value) == str(e_ref.value)
