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


@pytest.fixture
def deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


def _case(kind, dtype, K, seed):
    g = torch.Generator().manual_seed(seed)
    C = 13
    cu = None
    if kind == "dense":
        shape = (2, 75, C)
    else:
        lens = [0, 37, 70, 1, 19]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        shape = (sum(lens), C)
    x, dy = (torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    w = torch.randn((C, K), generator=g, dtype=torch.float64).to(dtype)
    return x, w, dy, cu


def _grads(op, x, w, dy, d, cu):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    op(x, w, dilation=d, cu_seqlens=cu).backward(dy)
    return x.grad, w.grad


def _with_sizes(monkeypatch, rows, channels, tiles, block):
    monkeypatch.setattr(TC, "BWD_ROWS", rows)
    monkeypatch.setattr(TC, "MIN_OWNED", 1)
    monkeypatch.setattr(TC, "BWD_CHANNELS", channels)
    monkeypatch.setattr(TC, "BWD_TILES", tiles)
    monkeypatch.setattr(TC, "SUM_BLOCK", block)


@pytest.mark.parametrize("kind", ["dense", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,d", [(4, 3), (5, 4)])
def test_deterministic_gradients_do_not_depend_on_block_sizes(kind, dtype, K, d, deterministic, monkeypatch):
    x, w, dy, cu = _case(kind, dtype, K, seed=K * 10 + d)
    runs = []
    for sizes in SIZES:
        with monkeypatch.context() as m:
            _with_sizes(m, *sizes)
            runs.append(_grads(fast.dilated_causal_conv, x, w, dy, d, cu))
    for (dx, dw), sizes in zip(runs[1:], SIZES[1:], strict=True):
        assert_bitwise_equal(dx, runs[0][0], name=f"dx at block sizes {sizes}")
        assert_bitwise_equal(dw, runs[0][1], name=f"dweight at block sizes {sizes}")
    want = _grads(ref.dilated_causal_conv, x, w, dy, d, cu)
    exact = [None, None]
    if dtype == torch.bfloat16:
        exact = _grads(ref.dilated_causal_conv, x.double(), w.double(), dy.double(), d, cu)
    for name, a, b, e in zip(("dx", "dweight"), runs[0], want, exact, strict=True):
        assert_no_nan(a, name=name)
        assert_close(a, b, exact64=e, name=name)


def test_deterministic_gradients_repeat_bit_for_bit(deterministic):
    x, w, dy, cu = _case("packed", torch.float32, 4, seed=1)
    first = _grads(fast.dilated_causal_conv, x, w, dy, 3, cu)
    again = _grads(fast.dilated_causal_conv, x, w, dy, 3, cu)
    for name, a, b in zip(("dx", "dweight"), again, first, strict=True):
        assert_bitwise_equal(a, b, name=name)

