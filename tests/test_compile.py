"""``torch.compile(fullgraph=True)`` of the layer's forward and of ``layer.step`` on every backend (docs/spec.md
section 7): no graph break, and the eager results. On the Triton backend the kernels are opaque to the
compiler, so serving outputs and states are bit for bit; on the ``"torch"`` backend inductor fuses the
elementwise and reduction ops, which rounds differently, so everything is judged by the tolerance table.
The reference is exempt (docs/spec.md section 7: it may read values and break graphs).

Two compilers: ``aot_eager`` (the quick tier) traces exactly what inductor gets (dynamo with
``fullgraph=True``, AOT autograd, fake tensors, the custom ops' fake kernels) and runs the traced graph
eagerly, so graph breaks and tracing errors fail here in seconds and the results are the eager bits;
``inductor`` (the deep tier: minutes of C++ compilation with an empty cache) adds code generation and its
fused rounding."""

from __future__ import annotations

import pytest
import torch

import ple
import ple.vectorized.prefill as vec_prefill
from ple.state import Decode, PLECache, Prefill, Spec
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal, assert_close

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter)]
COMPILERS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.deep)]


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_forward_and_step_equal_eager(backend, compiler, monkeypatch):
    """Compiled forward, gradient and serving steps against eager. The torch backend's eager float32 gradient
    comes from its blocked backward (``prefill.BlockedPrefill``, CPU only, never compiled), summed in another
    order than autograd's: it is compared within the tolerance, and the compiled gradient bit for bit
    with eager autograd's composition (the blocked path refused), which is what the compiled graph traces."""
    config = ple.PLEConfig.preset("tiny")
    layer = random_layer(config, 0, torch.float32, seed=3)
    layer.set_backend(backend)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, config.hc_hidden_size, generator=g, requires_grad=True)
    ids = torch.randint(0, config.vocab_size, (2, 5), generator=g)
    mask = torch.ones(2, 5, dtype=torch.int64)
    mask[1, :2] = 0
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend=compiler)
    y = compiled(x, ids, mask)
    (gx,) = torch.autograd.grad(y.sum(), x)
    y_eager = layer(x, ids, mask)
    (gx_eager,) = torch.autograd.grad(y_eager.sum(), x)
    close = assert_bitwise_equal if compiler == "aot_eager" else assert_close
    close(y, y_eager, name="compiled forward")
    if backend == "torch":
        assert_close(gx, gx_eager, name="compiled gradient against the blocked backward")
        monkeypatch.setattr(vec_prefill, "takes_blocked_backward_path", lambda *a: False)
        (gx_eager,) = torch.autograd.grad(layer(x, ids, mask).sum(), x)
    close(gx, gx_eager, name="compiled gradient")

    caches = [PLECache(config, 4, num_spec_tokens=2, num_layers=1) for _ in range(2)]
    step = torch.compile(layer.step, fullgraph=True, backend=compiler)
    h1 = torch.randn(6, config.hc_hidden_size, generator=g)
    h2 = torch.randn(4, config.hc_hidden_size, generator=g)
    h3 = torch.randn(4, config.hc_hidden_size, generator=g)
    results = []
    for run, cache in zip((step, layer.step), caches):
        a, b = cache.allocate(), cache.allocate()
        o1 = run(h1, cache.schedule([Prefill(a, [5, 6, 7, 8]), Prefill(b, [9, 10])]), cache)
        o2 = run(h2, cache.schedule([Spec(a, [1, 2, 3]), Decode(b, 4)]), cache)
        cache.accept(a, 2)
        o3 = run(h3, cache.schedule([Decode(a, 11), Spec(b, [12, 13, 14])]), cache)
        results.append((o1, o2, o3))
    same = assert_bitwise_equal if backend == "triton" or compiler == "aot_eager" else assert_close
    for got, want in zip(*results, strict=True):
        same(got, want, name="compiled step output")
    same(caches[0].conv_states, caches[1].conv_states, name="compiled step states")
    assert caches[0]._slots == caches[1]._slots
