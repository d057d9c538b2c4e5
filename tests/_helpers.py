"""What several test files share, in one place (``tests/`` is on ``sys.path``: ``pythonpath`` in pyproject.toml).

Fixtures are in ``tests/conftest.py`` (``poisoned_empty``, ``deterministic_mode``); the tensors of kernel
cases (random rows, index tensors, conv states in every layout, slots and token_indices) in the kit,
``ple.testing.kit.cases``. Here: deterministic mode as a context manager, "nothing changed" snapshots of a
cache or of an op's arguments, layers with every parameter random, the hash parameters of the tiny preset,
a planted mistake the kit must catch, and one process's answer over a packed batch (the gloo tests).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence

import pytest
import torch

import ple
from ple.testing.numerics import assert_bitwise_equal


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True, *, warn_only: bool = False) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(enabled, warn_only=warn_only)`` inside, the previous mode after."""
    was = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn_only)


# ---- nothing changed -----------------------------------------------------------------------------------
def cache_snapshot(cache) -> tuple:
    """A ``PLECache``'s states, slot bookkeeping and version, copied."""
    return cache.conv_states.clone(), copy.deepcopy(cache._slots), cache._version


def assert_cache_unchanged(cache, snap: tuple) -> None:
    """The cache holds what `cache_snapshot` copied: states bit for bit, the same slots and version."""
    states, slots, version = snap
    assert_bitwise_equal(cache.conv_states, states, name="conv_states")
    assert cache._slots == slots
    assert cache._version == version


def args_snapshot(args: dict) -> dict:
    """Copies of every tensor argument of an op call and of the base of its conv state."""
    out = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    state = args.get("conv_state")
    if isinstance(state, torch.Tensor) and state._base is not None:
        out["conv_state._base"] = state._base.clone()
    return out


def assert_args_unchanged(args: dict, before: dict) -> None:
    """Every tensor `args_snapshot` copied is as it was, bit for bit."""
    for k, v in before.items():
        now = args["conv_state"]._base if k == "conv_state._base" else args[k]
        assert_bitwise_equal(now, v, name=k)


# ---- layers and inputs ---------------------------------------------------------------------------------
def nonzero_layers(config: ple.PLEConfig, num_layers: int = 1, *, seed: int = 0, dtype: torch.dtype = torch.float64,
                   draw_dtype: torch.dtype = torch.float64, **kwargs) -> list[ple.PLELayer]:
    """Layers 0 .. num_layers - 1 with every parameter non-zero (norms and conv too, which the model starts at
    zero), so each part of the layer shows in the output: normal draws in ``draw_dtype`` from one generator,
    in ``dtype``, times 0.5; the same in every process. ``kwargs`` go to `PLELayer` (``backend``, ...)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(num_layers):
        layer = ple.PLELayer(config, i, dtype=dtype, **kwargs)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=draw_dtype).to(dtype) * 0.5)
        layers.append(layer)
    return layers


def tiny_hash_setup() -> tuple:
    """(the hash parameters of the tiny preset's PLE layer 0, the keywords ``ngram_ids`` takes with them)."""
    config = ple.PLEConfig.preset("tiny")
    return ple.reference.hash_params(config, 0), dict(heads_per_ngram=config.heads_per_ngram,
                                                       eos_token_id=config.eos_token_id)


def packed_reference(full: ple.PLELayer, starts: Sequence[int], eos_at: int, seed: int = 6) -> dict:
    """A packed float64 batch of sequences ``starts`` (one EOS at row ``eos_at``) and one process's answer:
    ``ids``, ``hidden``, ``probe`` (the loss is ``(out * probe).sum()``), ``ref`` (every sequence through
    ``full``'s forward, concatenated) and ``h``, the hidden states it ran on, whose ``grad`` (like ``full``'s
    parameters') holds the loss's gradient."""
    config = full.config
    T = starts[-1]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (T,), generator=g)
    ids[eos_at] = config.eos_token_id
    hidden = torch.randn(T, config.hc_hidden_size, generator=g, dtype=torch.float64)
    probe = torch.randn(T, config.hc_hidden_size, generator=g, dtype=torch.float64)
    h = hidden.clone().requires_grad_(True)
    ref = torch.cat([full(h[a:b][None], ids[a:b][None])[0] for a, b in zip(starts, starts[1:]) if b > a])
    (ref * probe).sum().backward()
    return dict(ids=ids, hidden=hidden, probe=probe, ref=ref, h=h)


# ---- the kit -------------------------------------------------------------------------------------------
def assert_planted_mistake_caught(check, fn, kw: dict, words: Sequence[str], max_examples: int) -> None:
    """``check(fn, max_examples=..., **kw)`` raises ``AssertionError`` and its message names every one of ``words``."""
    with pytest.raises(AssertionError) as e:
        check(fn, max_examples=max_examples, **kw)
    msg = str(e.value)
    for w in words:
        assert w in msg, msg


def assert_same_serving(layer_sets: Sequence, script: Sequence, *, seed: int, num_spec_tokens: int = 2) -> None:
    """Replay ``script`` (``ple.testing.strategies.random_script``) through each set of layers, each on a new
    bfloat16 cache of 4 slots, with every warning an error (a prefetch left unused warns): the same tokens
    and every output bit for bit equal to the first set's."""
    import warnings

    from ple.state import PLECache
    from ple.testing.serving import replay

    results = []
    for layers in layer_sets:
        cache = PLECache(layers[0].config, 4, num_spec_tokens=num_spec_tokens, num_layers=len(layers),
                         dtype=torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            results.append(replay(layers, cache, script, generator=torch.Generator().manual_seed(seed),
                                  check_states=False))
    first = results[0]
    for other in results[1:]:
        assert other.tokens == first.tokens
        for rid in first.outputs:
            for x, y in zip(first.outputs[rid], other.outputs[rid], strict=True):
                assert_bitwise_equal(y, x, name=f"request {rid} output")
