"""``ple.testing.device.on_device``: how the suite runs compiled kernels on a GPU with CPU-built cases."""

from __future__ import annotations

import pytest
import torch

import ple
from ple.testing.device import on_device

pytestmark = pytest.mark.gpu


def test_in_place_changes_and_results_come_back_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    C, K, d = 6, 3, 2
    S = (K - 1) * d
    inputs = torch.randn(5, C, generator=g)
    residual = torch.randn(5, C, generator=g)
    buf = torch.randn(3, S, C, generator=g)                     # a transposed (strided) state view
    state = buf.transpose(1, 2)
    w = torch.randn(C, K, generator=g)
    args = dict(mode="prefill", dilation=d, query_start_loc=torch.tensor([0, 2, 5]),
                has_initial_states=torch.tensor([1, 0]))
    want_res, want_buf = residual.clone(), buf.clone()
    ple.reference.ple_conv(inputs, want_res, want_buf.transpose(1, 2), w, torch.tensor([1, 2]), **args)
    on_device(ple.reference.ple_conv, "cuda")(inputs, residual, state, w, torch.tensor([1, 2]), **args)
    assert residual.device.type == "cpu" and torch.equal(residual, want_res)
    assert torch.equal(buf, want_buf)                           # written back through the view


def test_gradients_reach_the_cpu_leaves():
    x = torch.randn(1, 7, 4, requires_grad=True)
    w = torch.randn(4, 2, requires_grad=True)
    y = on_device(ple.reference.dilated_causal_conv, "cuda")(x, w, dilation=1)
    assert y.device.type == "cpu"
    y.sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ple.reference.dilated_causal_conv(x2, w2, dilation=1).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_tensors_inside_a_tuple_changed_in_place_come_back():
    """``table_update``'s ``state`` is a tuple of tensors it updates in place: they are written back too."""
    g = torch.Generator().manual_seed(0)
    weight, grad = torch.randn(5, 3, generator=g), torch.randn(4, 3, generator=g)
    ids = torch.tensor([4, 0, 4, 2])
    state = (torch.zeros(5, 3), torch.zeros(5))
    want_w, want_s = weight.clone(), tuple(s.clone() for s in state)
    ple.reference.table_update(want_w, ids, grad, want_s, rule="adam", lr=0.1)
    on_device(ple.reference.table_update, "cuda")(weight, ids, grad, state, rule="adam", lr=0.1)
    assert weight.device.type == "cpu" and torch.equal(weight, want_w)
    assert all(torch.equal(a, b) for a, b in zip(state, want_s, strict=True)) and state[1].any()
