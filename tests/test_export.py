"""``torch.export`` of ``PLELayer.forward`` and of a decode step (``ple.state.export.DecodeStep``), on the
``"torch"`` backend and on Triton (its custom ops trace through their fake kernels; the exported program runs
the kernels, under the interpreter on a CPU). The exported programs give the eager bits."""

from __future__ import annotations

import pytest
import torch

import ple
from ple.state import Decode, PLECache, Prefill, Spec
from ple.state.export import DecodeStep
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

CONFIG = ple.PLEConfig.preset("tiny")
C = CONFIG.hc_hidden_size
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter)]


def _layer(backend, dtype=torch.float32):
    layer = random_layer(CONFIG, 0, dtype, seed=1)
    layer.set_backend(backend)
    return layer


@pytest.mark.parametrize("backend", BACKENDS)
def test_exported_forward_equals_eager(backend):
    layer = _layer(backend)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 7, C, generator=g)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.int64)
    mask[1, :3] = 0
    program = torch.export.export(layer, (h, ids, mask))
    h2 = torch.randn(2, 7, C, generator=g)
    ids2 = torch.randint(0, CONFIG.vocab_size, (2, 7), generator=g)
    with torch.no_grad():
        assert_bitwise_equal(program.module()(h2, ids2, mask), layer(h2, ids2, mask), name="exported forward")


@pytest.mark.parametrize("backend", BACKENDS)
def test_exported_decode_step_equals_layer_step(backend):
    layer = _layer(backend)
    caches = [PLECache(CONFIG, 5, num_spec_tokens=2, num_layers=1) for _ in range(2)]
    slots = [[c.allocate() for _ in range(3)] for c in caches]
    g = torch.Generator().manual_seed(3)
    h = torch.randn(9, C, generator=g)
    hs = torch.randn(4, C, generator=g)
    for c, s in zip(caches, slots):                   # a prefill, then a spec step: the decode realigns
        layer.step(h, c.schedule([Prefill(x, [1 + i, 2, 3]) for i, x in enumerate(s)]), c)
        layer.step(hs, c.schedule([Spec(s[0], [4, 5]), Decode(s[1], 6), Decode(s[2], 7)]), c)
        c.accept(s[0], 1)
    step = DecodeStep(layer, caches[0], num_requests=3)
    program = torch.export.export(step, step.example_inputs()).module()
    for t in range(3):
        hd = torch.randn(3, C, generator=g)
        items = [[Decode(x, 7 + t + i) for i, x in enumerate(s)] for s in slots]
        b0 = caches[0].schedule(items[0])
        got = program(*step.inputs_of(hd, b0))
        caches[0].end_layer(b0, 0)
        want = layer.step(hd, caches[1].schedule(items[1]), caches[1])
        assert_bitwise_equal(got, want, name=f"exported decode step {t}")
        assert_bitwise_equal(caches[0].conv_states, caches[1].conv_states, name=f"states after step {t}")


def test_decode_step_refuses_other_plans():
    layer = _layer("torch")
    cache = PLECache(CONFIG, 4, num_layers=1)
    a = cache.allocate()
    step = DecodeStep(layer, cache, num_requests=1)
    with pytest.raises(ValueError, match="batch"):
        step.inputs_of(torch.zeros(2, C), cache.schedule([Prefill(a, [1, 2])]))


def test_the_reference_does_not_export():
    """The reference reads index values on the host (docs/spec.md section 7 exempts it): export refuses it."""
    layer = _layer("reference")
    h = torch.randn(1, 5, C)
    ids = torch.randint(0, CONFIG.vocab_size, (1, 5))
    with pytest.raises(Exception, match=r"(?i)data.dependent|guard|tolist|item|unsupported"):
        torch.export.export(layer, (h, ids))
