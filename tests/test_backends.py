"""The backend switch (``ple.backends``): what ``"auto"`` resolves to here, and what `CustomOps` (a user's
``PLELayer(ops=...)``) carries over from the object it wraps."""

from __future__ import annotations

import types

import pytest
import torch

import ple
import ple.vectorized as vec
from ple import PLEConfig, PLELayer
from ple.backends import OP_NAMES, CustomOps, resolve_backend, traits, triton_compiled_available
from ple.state import PLECache, Prefill
from ple.testing.layers import random_layer
from ple.testing.serving import conv_inputs_of_step

TINY = PLEConfig.preset("tiny")


def torch_ops(**extra):
    return types.SimpleNamespace(**{n: getattr(vec, n) for n in OP_NAMES}, **extra)


def test_auto_resolves_to_what_runs_here():
    name, module = resolve_backend("auto")
    want = "triton" if triton_compiled_available() else "torch"
    assert name == want
    assert module is (ple.fast if want == "triton" else ple.vectorized)
    assert resolve_backend("reference") == ("reference", ple.reference)
    assert resolve_backend("torch") == ("torch", ple.vectorized)


def test_resolve_backend_names_a_bad_name():
    with pytest.raises(ValueError, match="backend: expected one of"):
        resolve_backend("cuda")


def test_custom_ops_declare_their_traits():
    assert traits(CustomOps(torch_ops())) == traits(torch_ops()) == traits(ple.reference)
    fused = CustomOps(torch_ops(FUSED_KV_PROJECTION=True))
    assert traits(fused).fused_kv_projection and not traits(fused).checks_values_when_compiled


def test_a_fused_prefills_own_conv_inputs_reach_the_replay_checker():
    """A user's fused ``ple_prefill`` may round its conv inputs its own way: the serving replay checker
    takes them from the ops' ``prefill_conv_inputs`` where the ops offer one (as ``ple.fast`` does)."""
    seen = []

    def conv_inputs(key, value, hidden, *rest):
        seen.append(key.shape)
        return torch.full_like(hidden, 7.0)

    base = random_layer(TINY, dtype=torch.float32, backend="torch")
    layer = PLELayer(TINY, ops=torch_ops(prefill_conv_inputs=conv_inputs))
    layer.load_state_dict(base.state_dict())
    cache = PLECache(TINY, 2, num_layers=1, dtype=torch.float32)
    batch = cache.schedule([Prefill(cache.allocate(), [5, 6, 7])])
    hidden = torch.randn(3, TINY.hc_hidden_size)
    got = conv_inputs_of_step(layer, hidden, batch)
    assert seen and torch.equal(got, torch.full_like(hidden, 7.0))
    plain = PLELayer(TINY, ops=torch_ops())
    plain.load_state_dict(base.state_dict())
    assert not hasattr(plain.ops, "prefill_conv_inputs")
    calls = len(seen)
    assert not torch.equal(conv_inputs_of_step(plain, hidden, batch), got)      # its ple_gate's, not the marker
    assert len(seen) == calls
