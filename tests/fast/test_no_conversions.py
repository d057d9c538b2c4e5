"""``validate=False``: every fast op with value checks runs without turning a tensor into a Python value.

Each test calls an op with ``validate=True`` and, on copies of the same inputs, with
``validate=False`` under ``ple.testing.conversions.count_host_conversions``: the second call
makes no conversion (on a GPU: no device-to-host synchronisation; under the interpreter this
counts the Python-level conversions) and gives the same bits. Modes: prefill (long requests
over many time tiles, empty requests), decode, spec, checkpoints, the packed training conv
forward and backward, the n-gram ids and embedding, the table lookup.
"""

from __future__ import annotations

import pytest
import torch

from ple import fast
from ple.config import PRESETS
from ple.testing.conversions import count_host_conversions
from ple.testing.numerics import assert_bitwise_equal

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("poisoned_empty")]

C, K, D = 13, 4, 3                          # channels, taps, dilation
S = (K - 1) * D


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _unchecked(fn):
    """Run ``fn()`` (a ``validate=False`` call) counting conversions; assert none; return its result."""
    with count_host_conversions() as seen:
        out = fn()
    assert seen.count == 0, seen.report()
    return out


def _conv_case(mode, dtype=torch.float32, layout="wc"):
    g = _g({"prefill": 1, "decode": 2, "spec": 3}[mode])
    if mode == "prefill":
        lens = [0, 70, 1, 0, 33, 32, 0]                         # 70 and 33 rows span 3 and 2 tiles of 32
    elif mode == "decode":
        lens = [1, 1, 1, 1]
    else:
        lens = [1, 3, 2, 3]
    R = len(lens)
    q = 3 if mode == "spec" else 1
    n = sum(lens)
    T = n + 2
    rows = torch.randperm(T, generator=g)[:n]
    W = S + q - 1 + 1
    num_slots = R + 2
    state = torch.randn((num_slots, W, C) if layout == "wc" else (num_slots, C, W), generator=g).to(dtype)
    state = state.transpose(1, 2) if layout == "wc" else state
    state_indices = torch.randperm(num_slots - 1, generator=g)[:R] + 1
    state_indices[R // 2] = 0                                           # one request on the null slot
    kw = dict(mode=mode, dilation=D, token_indices=rows, null_slot=0,
              query_start_loc=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32),
              outer_residual=torch.randn(T, C, generator=g).to(dtype))
    if mode == "spec":
        kw.update(num_accepted_tokens=torch.randint(1, q + 1, (R,), generator=g), spec_query_len=q)
    else:
        kw.update(has_initial_states=torch.rand(R, generator=g) < 0.6)
    args = (torch.randn(T, C, generator=g).to(dtype), torch.randn(T, C, generator=g).to(dtype), state,
            torch.randn(C, K, generator=g).to(dtype), state_indices)
    return args, kw


# The bfloat16 channels-last prefill (~6.5 s under the interpreter) runs in the deep tier.
@pytest.mark.parametrize("mode,dtype,layout", [
    pytest.param(m, dt, lay, marks=[pytest.mark.deep] if (m, lay) == ("prefill", "cw") else [])
    for m in ("prefill", "decode", "spec") for dt, lay in ((torch.float32, "wc"), (torch.bfloat16, "cw"))])
def test_ple_conv_unchecked(mode, dtype, layout):
    (x, res, state, w, state_indices), kw = _conv_case(mode, dtype, layout)
    res_a, res_b = res.clone(), res.clone()
    st_a, st_b = state.clone(), state.clone()
    with count_host_conversions() as checked:
        fast.ple_conv(x, res_a, st_a, w, state_indices, **kw)
    assert checked.count > 0, "the validated call reads its index values: the counter must see it"
    _unchecked(lambda: fast.ple_conv(x, res_b, st_b, w, state_indices, **kw, validate=False))
    assert_bitwise_equal(res_b, res_a, name="residual")
    assert_bitwise_equal(st_b, st_a, name="conv_state")
    assert not torch.equal(res_a, res), "the call changed nothing: the test would prove nothing"


def test_export_checkpoints_unchecked():
    g = _g(4)
    lens = [0, 40, 12, 9, 30]
    offsets = torch.tensor([0, 37, 0, 9, 20])
    T = sum(lens)
    x = torch.randn(T, C, generator=g)
    state = torch.randn(7, S + 1, C, generator=g).transpose(1, 2)
    kw = dict(query_start_loc=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()), offsets=offsets,
              slots=torch.tensor([1, 2, 3, 0, 5]), state_len=S, token_indices=torch.randperm(T, generator=g))
    st_a, st_b = state.clone(), state.clone()
    fast.export_conv_checkpoints(x, st_a, **kw)
    _unchecked(lambda: fast.export_conv_checkpoints(x, st_b, **kw, validate=False))
    assert_bitwise_equal(st_b, st_a)
    assert not torch.equal(st_a, state)


@pytest.mark.parametrize("packed", [True, False])
def test_training_conv_unchecked_forward_and_backward(packed):
    g = _g(5)
    if packed:
        lens = [0, 45, 3, 0, 64, 1]
        x = torch.randn(sum(lens), C, generator=g, dtype=torch.float64)
        cu_seqlens = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    else:
        x, cu_seqlens = torch.randn(2, 40, C, generator=g, dtype=torch.float64), None
    w = torch.randn(C, K, generator=g, dtype=torch.float64)
    dy = torch.randn(x.shape, generator=g, dtype=torch.float64)

    def run(validate):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fast.dilated_causal_conv(xa, wa, dilation=D, cu_seqlens=cu_seqlens, validate=validate)
        y.backward(dy)
        return y.detach(), xa.grad, wa.grad

    y_a, dx_a, dw_a = run(True)
    y_b, dx_b, dw_b = _unchecked(lambda: run(False))
    assert_bitwise_equal(y_b, y_a, name="y")
    assert_bitwise_equal(dx_b, dx_a, name="dx")
    torch.testing.assert_close(dw_b, dw_a, rtol=1e-12, atol=1e-12)   # atomic adds: order may differ


def _hash_case():
    config = PRESETS["tiny"]
    params = fast.hash_params(config, 0)
    g = _g(6)
    lens = [0, 70, 5, 0, 1]
    ids = torch.randint(0, config.vocab_size, (sum(lens),), generator=g)
    ids[::7] = config.eos_token_id
    kw = dict(heads_per_ngram=config.heads_per_ngram, eos_token_id=config.eos_token_id,
              query_start_loc=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()),
              ngram_context=torch.randint(0, config.vocab_size, (len(lens), config.ngram_size - 1), generator=g))
    return config, params, ids, kw


def test_ngram_ids_and_embedding_unchecked():
    config, params, ids, kw = _hash_case()
    want = fast.ngram_ids(ids, params, **kw)
    got = _unchecked(lambda: fast.ngram_ids(ids, params, **kw, validate=False))
    assert_bitwise_equal(got, want, name="ngram ids")
    rows = int(params.head_offsets[-1] + params.head_sizes[-1])
    table = torch.randn(rows, 5, generator=_g(7))
    emb_a = fast.ngram_embedding(table, ids, params, **kw)
    emb_b = _unchecked(lambda: fast.ngram_embedding(table, ids, params, **kw, validate=False))
    assert_bitwise_equal(emb_b, emb_a, name="ngram embedding")
    look_a = fast.embedding_lookup(table, want)
    look_b = _unchecked(lambda: fast.embedding_lookup(table, want, validate=False))
    assert_bitwise_equal(look_b, look_a, name="embedding_lookup")
    assert_bitwise_equal(look_a, emb_a, name="lookup of the ids against the fused embedding")
