"""``ple.fast.dilated_causal_conv`` in deterministic mode (``torch.use_deterministic_algorithms(True)``):
``dx`` and ``dW`` do not depend on the kernels' block sizes (bit for bit) and match the reference as in
the default mode. Every buffer the kernels allocate is poisoned with NaN, so a partial sum left
unwritten shows.
"""

from __future__ import annotations

import pytest
import torch

from ple import fast
from ple import reference as ref
from ple.fast import training_conv as TC
from ple.testing.numerics import assert_bitwise_equal, assert_close, assert_no_nan

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("poisoned_empty")]

# (rows per backward tile, channels per backward program, tiles per backward program, second-pass block)
SIZES = [(16, 4, 1, 8), (32, 8, 3, 1024), (64, 32, 8, 16)]


def _case(kind, dtype, K, seed):
    g = torch.Generator().manual_seed(seed)
    C = 13
    cu_seqlens = None
    if kind == "dense":
        shape = (2, 75, C)
    else:
        lens = [0, 37, 70, 1, 19]
        cu_seqlens = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        shape = (sum(lens), C)
    x, dy = (torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    w = torch.randn((C, K), generator=g, dtype=torch.float64).to(dtype)
    return x, w, dy, cu_seqlens


def _grads(op, x, w, dy, d, cu_seqlens):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    op(x, w, dilation=d, cu_seqlens=cu_seqlens).backward(dy)
    return x.grad, w.grad


def _with_sizes(monkeypatch, rows, channels, tiles, block):
    monkeypatch.setattr(TC, "BWD_ROWS", rows)
    monkeypatch.setattr(TC, "MIN_OWNED", 1)
    monkeypatch.setattr(TC, "BWD_CHANNELS", channels)
    monkeypatch.setattr(TC, "BWD_TILES", tiles)
    monkeypatch.setattr(TC, "SUM_BLOCK", block)


@pytest.mark.parametrize("kind", ["dense", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,d", [(4, 3), pytest.param(5, 4, marks=pytest.mark.deep)])   # K 5: the deep tier
def test_deterministic_gradients_do_not_depend_on_block_sizes(kind, dtype, K, d, deterministic_mode, monkeypatch):
    x, w, dy, cu_seqlens = _case(kind, dtype, K, seed=K * 10 + d)
    runs = []
    for sizes in SIZES:
        with monkeypatch.context() as m:
            _with_sizes(m, *sizes)
            runs.append(_grads(fast.dilated_causal_conv, x, w, dy, d, cu_seqlens))
    for (dx, dw), sizes in zip(runs[1:], SIZES[1:], strict=True):
        assert_bitwise_equal(dx, runs[0][0], name=f"dx at block sizes {sizes}")
        assert_bitwise_equal(dw, runs[0][1], name=f"dweight at block sizes {sizes}")
    want = _grads(ref.dilated_causal_conv, x, w, dy, d, cu_seqlens)
    exact = [None, None]
    if dtype == torch.bfloat16:
        exact = _grads(ref.dilated_causal_conv, x.double(), w.double(), dy.double(), d, cu_seqlens)
    for name, a, b, e in zip(("dx", "dweight"), runs[0], want, exact, strict=True):
        assert_no_nan(a, name=name)
        assert_close(a, b, exact64=e, name=name)


def test_deterministic_gradients_repeat_bit_for_bit(deterministic_mode):
    x, w, dy, cu_seqlens = _case("packed", torch.float32, 4, seed=1)
    first = _grads(fast.dilated_causal_conv, x, w, dy, 3, cu_seqlens)
    again = _grads(fast.dilated_causal_conv, x, w, dy, 3, cu_seqlens)
    for name, a, b in zip(("dx", "dweight"), again, first, strict=True):
        assert_bitwise_equal(a, b, name=name)



@pytest.mark.parametrize("kind", ["dense", "packed"])
def test_deterministic_weight_gradient_adds_its_chunks_in_token_order(kind, deterministic_mode):
    """The documented order, not merely a fixed one: with the conv weights at zero (silu' = 1/2 exactly)
    and one non-zero product per 16-position chunk, each chunk's sum is exact, so dW is exactly the chunks'
    sums added in token order in float32: ``(1 + 2**27) - 2**27 == 0``, where any other order (reversed,
    or the last two first) gives 1."""
    C, K, d, L = 2, 2, 1, 48
    contributions = [1.0, 2.0**27, -(2.0**27)]               # chunk by chunk; 2**27 + 1 rounds to 2**27
    positions = [3, 19, 35]                                   # one position in each 16-position chunk
    if kind == "dense":
        x, dy, cu_seqlens = torch.zeros(1, L, C), torch.zeros(1, L, C), None
        xs, dys = x[0], dy[0]
    else:                                                     # a first sequence of 5 tokens, then the chunks
        x, dy = torch.zeros(5 + L, C), torch.zeros(5 + L, C)
        cu_seqlens = torch.tensor([0, 5, 5 + L], dtype=torch.int32)
        xs, dys = x[5:], dy[5:]
    for p, v in zip(positions, contributions, strict=True):
        xs[p] = 1.0
        dys[p] = 2.0 * v                                      # g' = dy * silu'(0) = v
    w = torch.zeros(C, K)
    _, dw = _grads(fast.dilated_causal_conv, x, w, dy, d, cu_seqlens)
    in_order = torch.zeros((), dtype=torch.float32)
    for v in contributions:
        in_order = in_order + torch.tensor(v, dtype=torch.float32)
    assert in_order.item() == 0.0                             # the test's own premise
    want = torch.zeros(C, K)
    want[:, K - 1] = in_order                                 # the current-token tap; the other tap sees x = 0
    assert_bitwise_equal(dw, want, name="dweight (chunks summed in token order)")
