"""Deterministic mode, the whole layer: under ``torch.use_deterministic_algorithms(True)`` the Triton layer's
outputs and every gradient are bit-identical across runs and across the kernels' block sizes."""

from __future__ import annotations

import pytest
import torch
from _helpers import deterministic_algorithms

import ple
from ple.fast import embedding as E
from ple.fast import gate as G
from ple.fast import hashing as Hs
from ple.fast import training_conv as TC
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

pytestmark = pytest.mark.interpreter

OTHER_BLOCKS = [  # (module, name, another legal value) for every knob a reduction could depend on
    (G, "_FWD_CHUNK_H", 8), (G, "_STATS_CHUNK_H", 8), (G, "_STATS_TOKENS", 4), (G, "_BWD_BLOCK_T", 4),
    (G, "_BWD_CHUNK_H", 8), (G, "_SUM_BLOCK_C", 16),
    (TC, "FWD_ROWS", 32), (TC, "BWD_ROWS", 128), (TC, "FWD_CHANNELS", 16), (TC, "BWD_CHANNELS", 8),
    (TC, "BWD_TILES", 2), (TC, "SUM_BLOCK", 64),
    (E, "_BLOCK_ROWS", 32), (E, "_BLOCK_D", 8), (E, "_DET_UNROLL", 2), (E, "_DET_BLOCK_D", 16),
    (Hs, "_BLOCK_T", 16), (Hs, "_FUSED_ROWS", 32), (Hs, "_BLOCK_D", 16),
]


@pytest.fixture
def deterministic_mode():
    """The documented switch, ``torch.use_deterministic_algorithms(True)``, here warn-only for torch's own CPU ops
    (the conftest's fixture of this name is strict)."""
    with deterministic_algorithms(warn_only=True):
        yield


def _run(config, dtype, seed):
    layer = random_layer(config, 0, dtype=dtype, seed=seed, backend="triton")
    g = torch.Generator().manual_seed(seed)
    B, L, C = 2, 24, config.hc_hidden_size           # 24 > every token block and the 16-token dW chunk
    hidden = torch.randn(B, L, C, generator=g).to(dtype).requires_grad_(True)
    ids = torch.randint(0, 5, (B, L), generator=g)          # few tokens: table rows hit many times
    out = layer(hidden, ids)
    out.backward(torch.randn(B, L, C, generator=g).to(dtype))
    return [out.detach(), hidden.grad] + [p.grad for p in layer.parameters()]


# The deep tier: the whole layer (~17 s interpreted); the quick tier checks each kernel's deterministic
# backward on its own (tests/fast/test_gate.py, test_embedding.py, test_hashing.py,
# test_training_conv_deterministic.py).
@pytest.mark.deep
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_bits_do_not_depend_on_runs_or_block_sizes(dtype, monkeypatch, deterministic_mode):
    config = ple.PLEConfig(vocab_size=40, hidden_size=40, hc_count=2, ple_embed_dim=12, ple_conv_kernel_size=4,
                           ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=11,
                           make_ngram_vocab_size_divisible_by=1, eos_token_id=3, ple_layer_ids=(1,))
    first = _run(config, dtype, 0)
    again = _run(config, dtype, 0)
    for mod, name, value in OTHER_BLOCKS:
        monkeypatch.setattr(mod, name, value)
    other = _run(config, dtype, 0)
    names = ["output", "hidden grad"] + [n for n, _ in random_layer(config, 0).named_parameters()]
    for n, a, b, c in zip(names, first, again, other, strict=True):
        assert_bitwise_equal(b, a, name=f"{n}, second run")
        assert_bitwise_equal(c, a, name=f"{n}, other block sizes")
