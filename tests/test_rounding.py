"""bfloat16 bit for bit: the properties that pin where the layer rounds and the order of its adds.

The reference rounds to the model dtype after every elementwise op of the gate (the product before
the group sum, ...), after the conv's tap sum (before silu), after silu and after each residual add,
``(gated + y) + hidden`` (docs/spec.md section 8). Two independent computations must then agree bit for bit
in bfloat16, so moving any rounding point or reordering an add in one of them shows:

* serving equals forward: ``layer.step`` over a random serving script (its conv is ``ple_conv``)
  gives, for every accepted token, the bits ``layer(...)`` gives over the whole sequence (its conv is
  ``dilated_causal_conv``), on each backend;
* the kernels equal the reference: the Triton layer's forward and serving outputs are the reference
  layer's bits (the kernels round where the reference does; their float32 reductions may differ
  in order, which stays below a bfloat16 rounding step at these sizes).
"""

from __future__ import annotations

import random

import pytest
import torch
from _tier import examples
from hypothesis import given, note, settings
from hypothesis import strategies as st

import ple.reference
from ple.state import PLECache
from ple.testing import strategies as pst
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal
from ple.testing.serving import check_replay, random_script, replay

BF16 = torch.bfloat16


def _layers(config, backend, seed):
    return [random_layer(config, i, dtype=BF16, seed=seed + i, backend=backend)
            for i in range(config.num_ple_layers)]


def _replay(layers, config, seed, num_requests=4):
    cache = PLECache(config, 5, num_spec_tokens=2, dtype=BF16)
    script = random_script(random.Random(seed), vocab_size=config.vocab_size, eos_token_id=config.eos_token_id,
                           num_requests=num_requests, max_live=3, max_prompt=14, max_chunk=6, max_generate=4,
                           num_spec_tokens=2, eos_rate=0.1, append_rate=0.2)
    with torch.no_grad():
        return replay(layers, cache, script, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", ["reference", "torch"])
@settings(max_examples=examples(4), deadline=None)
@given(config=pst.configs(max_hidden=40, max_hc=3), seed=pst.seeds())
def test_serving_equals_forward_bit_for_bit(backend, config, seed):
    layers = _layers(config, backend, seed)
    check_replay(layers, _replay(layers, config, seed), rtol=0, atol=0)


def _forward_inputs(config, seed):
    g = torch.Generator().manual_seed(seed)
    B, L = 2, 19
    hidden = torch.randn(B, L, config.hc_hidden_size, generator=g).to(BF16)
    ids = torch.randint(0, config.vocab_size, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.int64)
    mask[0, :3] = 0                                          # left padding
    mask[1, -2:] = 0                                         # right padding
    return hidden, ids, mask


@pytest.mark.parametrize("backend", ["torch",           # triton: ~20 s under the interpreter, the deep tier
                                     pytest.param("triton", marks=[pytest.mark.interpreter, pytest.mark.deep])])
@settings(max_examples=examples(1), deadline=None)
@given(config=pst.configs(max_hidden=16, max_hc=3), seed=pst.seeds(), masked=st.booleans())
def test_backend_equals_reference_bit_for_bit(backend, config, seed, masked):
    """Forward (with padding) and a serving replay: the backend's layer == reference layer, bfloat16 bits;
    and the backend's serving equals its own forward."""
    note(dict(backend=backend, C=config.hc_hidden_size, K=config.ple_conv_kernel_size, seed=seed))
    ref_layers, fast_layers = _layers(config, "reference", seed), _layers(config, backend, seed)
    hidden, ids, mask = _forward_inputs(config, seed)
    with torch.no_grad():
        want = ref_layers[0](hidden, ids, mask if masked else None)
        got = fast_layers[0](hidden, ids, mask if masked else None)
    assert_bitwise_equal(got, want, name=f"{backend} forward vs reference forward (bfloat16)")
    ref_run, fast_run = _replay(ref_layers, config, seed, 2), _replay(fast_layers, config, seed, 2)
    for rid, outs in ref_run.outputs.items():
        if outs:
            assert_bitwise_equal(torch.cat(fast_run.outputs[rid]), torch.cat(outs),
                                 name=f"{backend} serving vs reference serving, request {rid} (bfloat16)")
    check_replay(fast_layers, fast_run, rtol=0, atol=0)


def _gate_args(T, M, H, seed):
    """bfloat16 gate inputs with the scores' scale varied per token (near 0, of order 1, large) and the hidden
    state of each stream partly aligned with its key, so scores of both signs and every size occur."""
    g = torch.Generator().manual_seed(seed)
    C = M * H
    key = torch.randn(T, C, generator=g, dtype=torch.float64) * torch.logspace(-3, 1.5, T, dtype=torch.float64)[:, None]
    hidden = 0.5 * key + torch.randn(T, C, generator=g, dtype=torch.float64)
    value = torch.randn(T, H, generator=g, dtype=torch.float64)
    norms = [0.3 * torch.randn(C, generator=g, dtype=torch.float64) for _ in range(3)]
    return [t.to(BF16) for t in (key, value, hidden, *norms)]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_gate_bfloat16_with_groups_of_two_or_more_is_the_reference_bit_for_bit(backend):
    """``ple_gate`` in bfloat16 with H >= 2 and several streams: ``gated`` and ``conv_input`` are the reference's
    bits. With H = 1 the product ``kn * qn`` rounded before the group sum and the division by ``sqrt(1)`` round
    nothing, so only H >= 2 pins those rounding points (and the order of the float32 sum); H = 3 and 5 make
    ``sqrt(H)`` irrational. A direct check, a few calls: the quick tier reaches it. The torch backend's calls
    span its whole-batch and blocked paths (more rows than one block of ``BLOCK_ROWS``: blocks and a
    rest); the interpreter's are small."""
    from ple.backends import backend_module
    ops = backend_module(backend)
    cases = [(24, 3, 2, 1e-6, 0), (150, 2, 3, 1e-5, 1), (16, 4, 5, 1e-6, 2), (70, 2, 8, 0.1, 3)]
    if backend == "triton":
        cases = [(8, 3, 2, 1e-6, 0), (6, 2, 3, 1e-5, 1)]
    for T, M, H, eps, seed in cases:
        args = _gate_args(T, M, H, seed)
        with torch.no_grad():
            want = ple.reference.ple_gate(*args, eps)
            got = ops.ple_gate(*args, eps)
        for name, a, b in zip(("gated", "conv_input"), got, want, strict=True):
            assert_bitwise_equal(a, b, name=f"{backend} ple_gate {name}, T={T} M={M} H={H} (bfloat16)")
