"""``ple.testing``'s kit: each check passes on both backends' ops, and fails with a message naming the
case on a planted mistake (a copy of the reference op with one thing wrong)."""

from __future__ import annotations

import types

import pytest
import torch
from _helpers import assert_planted_mistake_caught
from _tier import examples

import ple
from ple import reference as ref
from ple.backends import OP_NAMES
from ple.testing import (
    check_dilated_causal_conv,
    check_embedding_lookup,
    check_export_conv_checkpoints,
    check_layer,
    check_ngram_embedding,
    check_ngram_ids,
    check_ple_conv,
    check_ple_gate,
    check_ple_prefill,
)

CHECKS = {"ngram_ids": check_ngram_ids, "embedding_lookup": check_embedding_lookup,
          "ngram_embedding": check_ngram_embedding, "ple_gate": check_ple_gate, "ple_conv": check_ple_conv,
          "export_conv_checkpoints": check_export_conv_checkpoints, "dilated_causal_conv": check_dilated_causal_conv,
          "ple_prefill": check_ple_prefill}


def test_the_kit_has_a_check_per_op():
    assert set(CHECKS) == set(OP_NAMES)
    extra = {"check_layer", "check_table_update", "poisoned_empty"}       # the layer; the row optimizers' op
    assert {f"check_{n}" for n in OP_NAMES} | extra == set(ple.testing.__all__)


@pytest.mark.parametrize("op", list(CHECKS))
def test_reference_passes_its_own_check(op):
    CHECKS[op](getattr(ref, op), max_examples=8)


@pytest.mark.parametrize("op", list(CHECKS))
def test_torch_backend_passes(op):
    kw = dict(exact_states=True) if op == "ple_prefill" else {}    # composed ops: states bit for bit in every dtype
    CHECKS[op](getattr(ple.vectorized, op), max_examples=8, **kw)


@pytest.mark.interpreter
# The kit over the interpreted gate and conv kernels takes ~7 s each: the deep tier (their own property tests,
# tests/fast/test_gate.py and test_conv.py, stay quick).
@pytest.mark.parametrize("op", [pytest.param(op, marks=[pytest.mark.deep] if op in ("ple_gate", "ple_conv") else [])
                                for op in CHECKS])
def test_fast_ops_pass(op):
    from ple import fast
    kw = dict(max_examples=examples(2))
    if op == "ple_prefill":
        kw.update(max_examples=examples(2), max_hidden=24, max_requests=2)
    elif op != "ngram_ids":
        kw["max_channels" if op in ("ple_conv", "export_conv_checkpoints", "dilated_causal_conv") else
           "max_hidden" if op == "ple_gate" else "max_dim"] = 70
    CHECKS[op](getattr(fast, op), **kw)


# ---- planted mistakes ---------------------------------------------------------------------------------

def conv_ignoring_initial_states(*args, **kw):
    if kw.get("mode") == "prefill":
        kw["has_initial_states"] = None
    return ref.ple_conv(*args, **kw)


def conv_wrong_beyond_32_channels(inputs, residual, *args, **kw):
    ref.ple_conv(inputs, residual, *args, **kw)
    if residual.shape[1] > 32:
        residual[:, 32:] += 1e-3                           # wrong only beyond the first 32 channels


def export_short(inputs, conv_state, *, state_len, **kw):
    before = conv_state.clone()
    ref.export_conv_checkpoints(inputs, conv_state, state_len=state_len, **kw)
    conv_state[:, :, 0] = before[:, :, 0]                  # forgets the first column


def ngram_ids_eos_off(input_ids, params, *, eos_token_id, **kw):
    return ref.ngram_ids(input_ids, params, eos_token_id=(eos_token_id + 1) % params.vocab_size, **kw)


def lookup_off_by_one(weight, ids, validate=True):
    return ref.embedding_lookup(weight, torch.clamp(ids + (ids.shape[0] > 3), max=weight.shape[0] - 1))


def gate_wrong_eps(*args, eps):
    return ref.ple_gate(*args, eps=eps * 100 + 1e-3)


def dcc_flipped_taps(x, weight, *, dilation, cu_seqlens=None, validate=True):
    return ref.dilated_causal_conv(x, weight.flip(1), dilation=dilation, cu_seqlens=cu_seqlens)


PLANTED = [
    (check_ple_conv, conv_ignoring_initial_states, dict(modes=("prefill",)), ["ple_conv prefill", "request", "case:"]),
    (check_ple_conv, conv_wrong_beyond_32_channels, dict(modes=("decode",)), ["channel 3", "C="]),
    (check_export_conv_checkpoints, export_short, {}, ["conv_state", "column 0", "slot"]),
    (check_ngram_ids, ngram_ids_eos_off, {}, ["ngram_ids", "head", "request"]),
    (check_embedding_lookup, lookup_off_by_one, {}, ["embedding_lookup", "token", "table row"]),
    (check_ple_gate, gate_wrong_eps, {}, ["ple_gate", "stream", "channel"]),
    (check_dilated_causal_conv, dcc_flipped_taps, {}, ["dilated_causal_conv", "channel"]),
]


@pytest.mark.parametrize("check,fn,kw,words", PLANTED, ids=[p[1].__name__ for p in PLANTED])
def test_planted_mistake_is_caught_and_named(check, fn, kw, words):
    assert_planted_mistake_caught(check, fn, kw, words, max_examples=40)


# ---- the layer on the user's ops ------------------------------------------------------------------------

def reference_copy(**replace):
    ops = types.SimpleNamespace(**{n: getattr(ref, n) for n in OP_NAMES})
    for k, v in replace.items():
        setattr(ops, k, v)
    return ops


def test_layer_on_custom_ops_runs_them():
    calls = []

    def counted(name):
        def op(*a, **kw):
            calls.append(name)
            return getattr(ref, name)(*a, **kw)
        return op
    config = ple.PLEConfig.preset("tiny")
    layer = ple.PLELayer(config, ops=reference_copy(**{n: counted(n) for n in OP_NAMES}))
    assert layer.backend == "custom" and not calls
    layer(torch.randn(1, 3, config.hc_hidden_size), torch.tensor([[1, 2, 3]]))
    assert calls == ["ngram_embedding", "ple_prefill"]            # the forward is the two fused entry points
    layer.set_backend("reference")
    assert layer.backend == "reference" and layer.ops is ref


def test_layer_ops_missing_names_is_a_type_error():
    with pytest.raises(TypeError, match="ops: .*lacks ple_conv"):
        ple.PLELayer(ple.PLEConfig.preset("tiny"), ops=types.SimpleNamespace(
            **{n: getattr(ref, n) for n in OP_NAMES if n != "ple_conv"}))


def test_check_layer_passes_on_reference_and_catches_a_planted_prefill():
    check_layer(reference_copy(), max_examples=3)
    with pytest.raises(AssertionError) as e:
        check_layer(reference_copy(ple_conv=conv_ignoring_initial_states), max_examples=10)
    assert "serving" in str(e.value) and "case:" in str(e.value)


@pytest.mark.deep           # ~17 s interpreted; quick: tests/fast/test_layer.py and the per-op kit checks of ple.fast
@pytest.mark.interpreter
def test_check_layer_passes_on_fast_ops():
    from ple import fast
    check_layer(fast, max_examples=examples(1), max_hidden=12)


# ---- columns no call reads: each with bits of its own, so a shuffle among them shows -------------------------

def conv_rolls_the_null_slot(inputs, residual, conv_state, *args, null_slot=0, **kw):
    ref.ple_conv(inputs, residual, conv_state, *args, null_slot=null_slot, **kw)
    if 0 <= null_slot < conv_state.shape[0]:
        conv_state[null_slot] = conv_state[null_slot].roll(1, -1)          # its columns in another order


def prefill_shifts_slots_it_does_not_own(*args, conv_state=None, state_indices=None, null_slot=0, **kw):
    out = ref.ple_prefill(*args, conv_state=conv_state, state_indices=state_indices, null_slot=null_slot, **kw)
    if conv_state is not None:
        owned = set(state_indices.tolist()) - {null_slot}
        for s in range(conv_state.shape[0]):
            if s not in owned:                                             # each column copied over its left one
                conv_state[s, :, :-1] = conv_state[s, :, 1:].clone()
    return out


SHUFFLES = [
    (check_ple_conv, conv_rolls_the_null_slot, dict(modes=("decode", "spec", "prefill")),
     ["ple_conv", "conv_state", "the null slot"]),
    (check_ple_prefill, prefill_shifts_slots_it_does_not_own, dict(parts=("serving",)),
     ["ple_prefill serving: conv_state", "never read or written"]),
]


@pytest.mark.parametrize("check,fn,kw,words", SHUFFLES, ids=[p[1].__name__ for p in SHUFFLES])
def test_a_shuffle_among_columns_no_call_reads_is_caught(check, fn, kw, words):
    """The null slot and every state column a call must not read are NaN, each with a payload of its own
    (``ple.testing.kit.cases.distinct_nans``): a function that moves them among themselves is caught."""
    assert_planted_mistake_caught(check, fn, kw, words, max_examples=10)
