"""The kit on the fused entry points: ``check_ngram_embedding``, ``check_ple_prefill`` and ``check_layer``'s
use of them catch a planted mistake (a copy of an op with one thing wrong) and name the case; a layer on a
copy of the ``"torch"`` backend's ops with a wrong ``ple_prefill`` changes its outputs and fails
``check_layer``."""

from __future__ import annotations

import types

import pytest
import torch
from _helpers import assert_planted_mistake_caught

import ple
from ple import reference as ref
from ple.backends import OP_NAMES
from ple.state import PLECache
from ple.state.step import uses_fused_prefill
from ple.testing import check_layer, check_ngram_embedding, check_ple_prefill
from ple.testing.kit.layer import serving_script
from ple.testing.layers import random_layer
from ple.testing.serving import check_replay, replay

vec = ple.vectorized


# ---- planted mistakes in the fused ops ------------------------------------------------------------------

def ngram_embedding_shifted_head(weight, input_ids, params, **kw):
    ids = ref.ngram_ids(input_ids, params, **kw)
    ids[:, -1] = (ids[:, -1] + 1) % weight.shape[0]        # the last head reads the next table row
    return ref.embedding_lookup(weight, ids)


def ngram_embedding_without_grad(weight, *args, **kw):
    return ref.ngram_embedding(weight.detach(), *args, **kw)


def prefill_no_residual_on_null_rows(key, value, hidden_states, *args, **kw):
    out = ref.ple_prefill(key, value, hidden_states, *args, **kw)
    if kw.get("conv_state") is not None:                    # forgets "+ hidden_states" on rows of the null slot
        starts, slots = kw["query_start_loc"].tolist(), kw["state_indices"].tolist()
        ti = kw.get("token_indices")
        rows = ti.tolist() if ti is not None else list(range(key.shape[0]))
        for r, s in enumerate(slots):
            if s == kw.get("null_slot", 0):
                p = rows[starts[r]:starts[r + 1]]
                out[p] = out[p] - hidden_states[p]
    return out


def prefill_leaks_stale_state(*args, **kw):
    if kw.get("conv_state") is not None:                    # reads every slot's old columns
        kw["has_initial_states"] = torch.ones(kw["state_indices"].numel(), dtype=torch.bool)
    return ref.ple_prefill(*args, **kw)


def prefill_writes_null_slot(*args, **kw):
    out = ref.ple_prefill(*args, **kw)
    if kw.get("conv_state") is not None and kw["conv_state"].shape[0]:
        kw["conv_state"][kw.get("null_slot", 0)] = 0
    return out


def prefill_ignores_keep(*args, **kw):
    kw["keep"] = None
    return ref.ple_prefill(*args, **kw)


def prefill_conv_weights_without_grad(*args, **kw):
    args = list(args)
    args[7] = args[7].detach()
    return ref.ple_prefill(*args, **kw)


PLANTED = [
    (check_ngram_embedding, ngram_embedding_shifted_head, {}, ["ngram_embedding: output", "request", "row", "head"]),
    (check_ngram_embedding, ngram_embedding_without_grad, {}, ["ngram_embedding: weight gradient", "none was"]),
    (check_ple_prefill, prefill_no_residual_on_null_rows, dict(parts=("serving",)),
     ["ple_prefill serving: out", "request", "physical row", "null_requests=[True"]),
    (check_ple_prefill, prefill_leaks_stale_state, dict(parts=("serving",)), ["ple_prefill serving", "request"]),
    (check_ple_prefill, prefill_writes_null_slot, dict(parts=("serving",)), ["conv_state", "the null slot"]),
    (check_ple_prefill, prefill_ignores_keep, dict(parts=("forward",)), ["ple_prefill forward: out", "masked by keep"]),
    (check_ple_prefill, prefill_conv_weights_without_grad, dict(parts=("forward",)),
     ["gradient of conv_weights", "none was computed"]),
]


@pytest.mark.parametrize("check,fn,kw,words", PLANTED, ids=[p[1].__name__ for p in PLANTED])
def test_planted_mistake_is_caught_and_named(check, fn, kw, words):
    assert_planted_mistake_caught(check, fn, kw, words, max_examples=30)


def test_float32_states_by_tolerance_bfloat16_bit_for_bit():
    """A fused kernel's float32 conv input may end an ulp away (its own sum order): passes by default, not
    with ``exact_states=True``; in bfloat16 one ulp off a new state column always fails."""
    def one_ulp_off(*args, **kw):
        out = ref.ple_prefill(*args, **kw)
        state, S = kw["conv_state"], (args[7].shape[1] - 1) * kw["dilation"]
        starts, slots = kw["query_start_loc"].tolist(), kw["state_indices"].tolist()
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[state.element_size()]
        for r, s in enumerate(slots):
            if S and s != kw.get("null_slot", 0) and starts[r + 1] > starts[r]:    # column S-1: its last input
                state[s, :, S - 1] = (state[s, :, S - 1].contiguous().view(ints) + 1).view(state.dtype)
        return out
    kw = dict(parts=("serving",), max_examples=15)
    check_ple_prefill(one_ulp_off, dtypes=(torch.float32,), **kw)
    with pytest.raises(AssertionError, match="bit for bit"):
        check_ple_prefill(one_ulp_off, dtypes=(torch.float32,), exact_states=True, **kw)
    with pytest.raises(AssertionError, match="a new column, bit for bit"):
        check_ple_prefill(one_ulp_off, dtypes=(torch.bfloat16,), **kw)


# ---- check_layer through the fused entry points ----------------------------------------------------------

def torch_copy(**replace):
    ops = types.SimpleNamespace(**{n: getattr(vec, n) for n in OP_NAMES})
    for k, v in replace.items():
        setattr(ops, k, v)
    return ops


def prefill_flipped_taps(*args, **kw):
    args = list(args)
    args[7] = args[7].flip(1)                               # conv_weights: taps in the wrong order
    return vec.ple_prefill(*args, **kw)


def prefill_fresh_every_chunk(*args, **kw):
    kw["has_initial_states"] = None                         # a serving prefill never reads its history
    return vec.ple_prefill(*args, **kw)


def test_serving_script_has_prefill_only_and_mixed_steps():
    config = ple.PLEConfig.preset("tiny")
    layers = [random_layer(config, i, dtype=torch.float32, seed=i, backend="torch")
              for i in range(config.num_ple_layers)]
    cache = PLECache(config, num_slots=4, num_spec_tokens=2, num_layers=config.num_ple_layers, dtype=torch.float32)
    fused, carried = [], []

    def on_step(index, batch, seconds):
        fused.append(uses_fused_prefill(batch))
        carried.append(bool(batch.has_initial_states_p.any()) if batch.num_prefills else False)
    res = replay(layers, cache, serving_script(config, 0), on_step=on_step)
    check_replay(layers, res)
    assert fused[:6] == [True, True, False, False, True, False]
    assert any(f and c for f, c in zip(fused, carried, strict=True))      # a fused prefill reading states


def test_layer_on_a_wrong_prefill_changes_and_fails_check_layer():
    config = ple.PLEConfig.preset("tiny")
    good = random_layer(config, dtype=torch.float32, seed=1, backend="torch")
    bad = ple.PLELayer(config, ops=torch_copy(ple_prefill=prefill_flipped_taps), dtype=torch.float32)
    bad.load_state_dict(good.state_dict())
    hidden, ids = torch.randn(2, 7, config.hc_hidden_size), torch.randint(0, config.vocab_size, (2, 7))
    with torch.no_grad():
        assert not torch.allclose(bad(hidden, ids), good(hidden, ids))
    check_layer(torch_copy(), max_examples=2, max_hidden=12)
    with pytest.raises(AssertionError, match="layer forward") as e:
        check_layer(torch_copy(ple_prefill=prefill_flipped_taps), max_examples=10, max_hidden=12)
    assert "case:" in str(e.value)


def test_check_layer_serving_runs_the_ops_prefill_on_states():
    """Wrong only where a serving prefill reads its history: forward and gradients agree, the replay fails."""
    with pytest.raises(AssertionError, match="serving") as e:
        check_layer(torch_copy(ple_prefill=prefill_fresh_every_chunk), max_examples=10, max_hidden=12)
    assert "case:" in str(e.value)
