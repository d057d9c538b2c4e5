"""Host-offloaded tables and prefetched lookups (``ple.offload``, ``Table.offload_`` / ``Table.prefetch``)."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from _helpers import assert_same_serving

from ple import PLEConfig, PLELayer
from ple.backends import triton_available
from ple.offload import is_offloaded, offload_table
from ple.testing.layers import random_layer as _random_layer
from ple.testing.numerics import assert_bitwise_equal
from ple.testing.serving import random_script

TINY = PLEConfig.preset("tiny")


def random_layer(cfg=TINY, index=0, dtype=torch.bfloat16, seed=0) -> PLELayer:
    return _random_layer(cfg, index, dtype, seed)



# ---- offload and prefetch -----------------------------------------------------------------------------
@pytest.mark.interpreter
@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_quantized_layer_on_the_fast_backend(scheme):
    """The layer's fast path (Triton gather of the raw rows) against its reference path, with a prefetch."""
    if not triton_available():
        pytest.skip("Triton cannot run here")
    ref = random_layer(seed=11)
    ref.ple_embedding.quantize_(scheme)
    fast = random_layer(seed=11)
    fast.ple_embedding.quantize_(scheme)
    fast.set_backend("triton")
    gen = torch.Generator().manual_seed(12)
    tokens = torch.randint(0, TINY.vocab_size, (19,), generator=gen)
    ids = ref.ops.ngram_ids(tokens, ref.ple_embedding.hash_params(), heads_per_ngram=TINY.heads_per_ngram,
                            eos_token_id=TINY.eos_token_id)
    expected = ref.embed(ids, torch.bfloat16)
    assert_bitwise_equal(fast.embed(ids, torch.bfloat16), expected, name="fast quantized embed")
    fast.start_prefetch(tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_bitwise_equal(fast.embed(ids, torch.bfloat16), expected, name="fast prefetched embed")


class PrefetchingLayer(PLELayer):
    """Calls ``start_prefetch`` with the step's tokens before every step, as a serving engine would."""

    def step(self, hidden_states, batch, cache):
        self.start_prefetch(batch.input_ids, batch.query_start_loc, batch.ngram_context)
        assert self.table.pending_prefetch is not None
        out = super().step(hidden_states, batch, cache)
        assert self.table.pending_prefetch is None                     # consumed
        return out


def twin_layers(scheme, num_layers=2, seed=5):
    plain = [random_layer(TINY, i, seed=seed + i) for i in range(num_layers)]
    pref = []
    for i, p in enumerate(plain):
        q = PrefetchingLayer(TINY, i, dtype=torch.bfloat16)
        q.load_state_dict(p.state_dict())
        pref.append(q)
    for layer in plain + pref:
        if scheme is not None:
            layer.ple_embedding.quantize_(scheme)
    for layer in pref:
        offload_table(layer)
    return plain, pref


@pytest.mark.parametrize("scheme", [None, "fp8", "int8"])
@pytest.mark.parametrize("seed", [0, 1])
def test_prefetched_serving_equals_in_memory(scheme, seed):
    """Serving traffic through step(): the prefetched, offloaded path gives the in-memory path's bits."""
    plain, pref = twin_layers(scheme)
    script = random_script(random.Random(seed), vocab_size=TINY.vocab_size, eos_token_id=TINY.eos_token_id,
                           num_requests=5, max_live=3, max_prompt=14, max_chunk=6, max_generate=5,
                           num_spec_tokens=2)
    assert_same_serving((plain, pref), script, seed=seed)


@pytest.mark.parametrize("scheme", [None, "fp8"])
def test_prefetch_forward_and_mismatch(scheme):
    plain, pref = twin_layers(scheme, num_layers=1)
    layer, ref = pref[0], plain[0]
    gen = torch.Generator().manual_seed(6)
    B, L = 2, 9
    h = torch.randn(B, L, TINY.hc_hidden_size, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, TINY.vocab_size, (B, L), generator=gen)
    with torch.no_grad():
        expected = ref(h, ids)
        layer.start_prefetch(ids.reshape(-1), torch.arange(B + 1) * L)
        assert_bitwise_equal(layer(h, ids), expected, name="prefetched forward")
        assert layer.table.pending_prefetch is None
        # A prefetch of other tokens is not used: looked up again, with a warning.
        layer.start_prefetch((ids.reshape(-1) + 1) % TINY.vocab_size, torch.arange(B + 1) * L)
        with pytest.warns(UserWarning, match="do not match"):
            got = layer(h, ids)
        assert_bitwise_equal(got, expected, name="forward after a stale prefetch")
        # prefetch_verify = False trusts any prefetch of the right shape (here, wrongly).
        layer.table.prefetch_verify = False
        layer.start_prefetch((ids.reshape(-1) + 1) % TINY.vocab_size, torch.arange(B + 1) * L)
        assert not torch.equal(layer(h, ids), expected)


def test_prefetch_bad_arguments_change_nothing():
    layer = random_layer()
    good = torch.tensor([5, 6, 7])
    layer.start_prefetch(good)
    pending = layer.table.pending_prefetch
    with pytest.raises(ValueError, match="input_ids"):
        layer.start_prefetch(torch.tensor([5, TINY.vocab_size]))
    with pytest.raises(TypeError, match="input_ids"):
        layer.start_prefetch(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="query_start_loc"):
        layer.start_prefetch(good, torch.tensor([0, 2]))
    assert layer.table.pending_prefetch is pending


def test_prefetch_not_used_when_the_table_needs_a_gradient():
    layer = random_layer(dtype=torch.float32)
    ids = torch.randint(0, TINY.vocab_size, (1, 6))
    h = torch.randn(1, 6, TINY.hc_hidden_size)
    layer.start_prefetch(ids.reshape(-1))
    with pytest.warns(UserWarning, match="gradient"):
        out = layer(h, ids)
    out.sum().backward()
    assert layer.ple_embedding.ngram_embedding.weight.grad is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(h, ids)                                               # no prefetch pending: no warning


def test_offload_table_keeps_values():
    layer = random_layer()
    w = layer.ple_embedding.ngram_embedding.weight.detach().clone()
    offload_table(layer, pin=False)
    t = layer.ple_embedding.ngram_embedding.weight
    assert t.device.type == "cpu" and isinstance(t, torch.nn.Parameter)
    assert_bitwise_equal(t.detach(), w, name="offloaded table")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [None, "fp8", "int8"])
@pytest.mark.parametrize("ids_on", ["cpu", "cuda"])
def test_offloaded_prefetch_on_cuda(scheme, ids_on):
    """Table pinned on the host, layer on the GPU: prefetched steps equal the all-GPU layer bit for bit."""
    dev = torch.device("cuda")
    ref = random_layer(seed=7)
    if scheme is not None:
        ref.ple_embedding.quantize_(scheme)
    ref.to(dev)
    layer = PLELayer(TINY, 0, dtype=torch.bfloat16, device=dev)
    if scheme is not None:
        layer.ple_embedding.quantize_(scheme)
    layer.load_state_dict(ref.state_dict())
    offload_table(layer)
    assert is_offloaded(layer) and layer.ple_embedding.ngram_embedding.weight.is_pinned()
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        tokens = torch.randint(0, TINY.vocab_size, (40,), generator=gen)
        qsl = torch.tensor([0, 7, 7, 40])
        ctx = torch.randint(0, TINY.vocab_size, (3, TINY.context_len), generator=gen)
        ids = ref.ops.ngram_ids(tokens.to(dev), ref.ple_embedding.hash_params(),
                                heads_per_ngram=TINY.heads_per_ngram, eos_token_id=TINY.eos_token_id,
                                query_start_loc=qsl.to(dev), ngram_context=ctx.to(dev))
        expected = ref.embed(ids, torch.bfloat16)
        layer.start_prefetch(tokens.to(ids_on), qsl.to(ids_on), ctx.to(ids_on))
        got = layer.embed(ids, torch.bfloat16)
        assert_bitwise_equal(got, expected, name="prefetched rows")
        assert_bitwise_equal(layer.embed(ids, torch.bfloat16), expected, name="host lookup without prefetch")
