"""With ``validate=False`` the ``"torch"`` backend's ops (``ple.vectorized``) turn no tensor into a Python
value (docs/spec.md section 7: a serving step makes no device-to-host synchronisation), and they trace under
``torch.compile(fullgraph=True)``; with ``validate=True`` (the default) the value checks still run.

On the CPU, `count_host_conversions` sees every Python-level conversion (``.item``, ``.tolist``,
``int()``, ``bool()``, ...); data-dependent shapes inside torch (``nonzero``, boolean masks,
``repeat_interleave`` without ``output_size``) are what the ``fullgraph=True`` traces catch.
"""

from __future__ import annotations

import pytest
import torch

from ple import PRESETS
from ple.testing.conversions import count_host_conversions
from ple.testing.numerics import assert_bitwise_equal
from ple.vectorized import (
    dilated_causal_conv,
    embedding_lookup,
    export_conv_checkpoints,
    hash_params,
    ngram_ids,
    ple_conv,
)

CONFIG = PRESETS["tiny"]
C, K, D = 6, 3, 2
S = (K - 1) * D
NAN = float("nan")


def conv_args(mode: str, *, token_indices: bool = False, null_rows: bool = True, initial: bool = True,
              outer: bool = True, seed: int = 0) -> tuple[tuple, dict]:
    """Valid ``ple_conv`` arguments of ``mode``: three requests (the last on the null slot when
    ``null_rows``), the null slot (0) poisoned with NaN."""
    gen = torch.Generator().manual_seed(seed)
    Q = 3
    lens = {"decode": [1, 1, 1], "spec": [2, 3, 1], "prefill": [4, 0, 2]}[mode]
    N = sum(lens)
    T = N + 1 if token_indices else N
    state = torch.randn(5, C, S + Q - 1, generator=gen)
    state[0] = NAN
    kw = dict(mode=mode, dilation=D, query_start_loc=torch.tensor([0, lens[0], lens[0] + lens[1], N]),
              outer_residual=torch.randn(T, C, generator=gen) if outer else None)
    if token_indices:
        kw["token_indices"] = torch.randperm(T, generator=gen)[:N].to(torch.int32)
    if mode == "spec":
        kw.update(spec_query_len=Q, num_accepted_tokens=torch.tensor([2, 1, 3]))
    if mode == "prefill" and initial:
        kw["has_initial_states"] = torch.tensor([True, False, True])
    slots = torch.tensor([3, 1, 0 if null_rows else 4])
    args = (torch.randn(T, C, generator=gen), torch.randn(T, C, generator=gen), state,
            torch.randn(C, K, generator=gen), slots)
    return args, kw


CONV_CASES = {
    "decode": dict(mode="decode"),
    "decode, no query_start_loc": dict(mode="decode", drop_qsl=True),
    "spec": dict(mode="spec"),
    "spec, token_indices": dict(mode="spec", token_indices=True),
    "prefill, initial states": dict(mode="prefill"),
    "prefill, new sequences": dict(mode="prefill", initial=False),
    "prefill, token_indices, no null rows": dict(mode="prefill", token_indices=True, null_rows=False),
    "decode, no outer_residual": dict(mode="decode", outer=False, token_indices=True),
}


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_ple_conv_makes_no_host_conversion(case):
    spec = dict(CONV_CASES[case])
    drop_qsl = spec.pop("drop_qsl", False)
    args, kw = conv_args(**spec)
    if drop_qsl:
        kw["query_start_loc"] = None
    checked = [a.clone() for a in args]
    null_before = args[2][0].clone()
    ple_conv(*checked, **kw)                                           # validated, for comparison
    with count_host_conversions() as seen:
        ple_conv(*args, validate=False, **kw)
    assert seen.count == 0, seen.report()
    assert_bitwise_equal(args[1], checked[1], name="residual")
    assert_bitwise_equal(args[2], checked[2], name="conv_state")
    assert_bitwise_equal(args[2][0], null_before, name="null slot")
    assert not args[1].isnan().any(), "an output read the NaN null slot"


def export_args(*, token_indices: bool):
    gen = torch.Generator().manual_seed(3)
    state = torch.randn(5, C, S + 1, generator=gen)
    state[0] = NAN
    kw = dict(query_start_loc=torch.tensor([0, 6, 6, 11]), offsets=torch.tensor([5, 0, S]),
              slots=torch.tensor([2, 2, 0]), state_len=S)
    T = 11
    if token_indices:
        T = 13
        kw["token_indices"] = torch.randint(0, T, (11,), generator=gen)
    return torch.randn(T, C, generator=gen), state, kw


@pytest.mark.parametrize("token_indices", [False, True])
def test_checkpoints_make_no_host_conversion(token_indices):
    inputs, state, kw = export_args(token_indices=token_indices)
    checked = state.clone()
    export_conv_checkpoints(inputs, checked, **kw)
    with count_host_conversions() as seen:
        export_conv_checkpoints(inputs, state, validate=False, **kw)
    assert seen.count == 0, seen.report()
    assert_bitwise_equal(state, checked)


def hash_args():
    params = hash_params(CONFIG, 0)
    ids = torch.tensor([4, 5, CONFIG.eos_token_id, 6, 7, 8, 9])
    kw = dict(heads_per_ngram=CONFIG.heads_per_ngram, eos_token_id=CONFIG.eos_token_id,
              query_start_loc=torch.tensor([0, 3, 3, 7], dtype=torch.int32),
              ngram_context=torch.tensor([[1, 2], [3, 4], [5, 6]]))
    return ids, params, kw


@pytest.mark.parametrize("chunked", [True, False])
def test_ngram_ids_and_lookup_make_no_host_conversion(chunked):
    ids, params, kw = hash_args()
    if not chunked:
        kw = dict(heads_per_ngram=kw["heads_per_ngram"], eos_token_id=kw["eos_token_id"])
    weight = torch.randn(params.num_rows, 3)
    want = ngram_ids(ids, params, **kw)
    with count_host_conversions() as seen:
        rows = ngram_ids(ids, params, validate=False, **kw)
        emb = embedding_lookup(weight, rows, validate=False)
    assert seen.count == 0, seen.report()
    assert torch.equal(rows, want)
    assert torch.equal(emb, embedding_lookup(weight, want))


@pytest.mark.parametrize("packed", [True, False])
def test_dilated_causal_conv_makes_no_host_conversion(packed):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, C, generator=gen) if packed else torch.randn(2, 4, C, generator=gen)
    w = torch.randn(C, K, generator=gen)
    kw = dict(dilation=D, cu_seqlens=torch.tensor([0, 4, 4, 9]) if packed else None)
    want = dilated_causal_conv(x, w, **kw)
    with count_host_conversions() as seen:
        y = dilated_causal_conv(x, w, validate=False, **kw)
    assert seen.count == 0, seen.report()
    assert torch.equal(y, want)


def test_validate_true_reads_values_and_raises():
    """The default still validates values (so it converts), with the documented errors, changing nothing."""
    args, kw = conv_args("decode")
    with count_host_conversions() as seen:
        ple_conv(*[a.clone() for a in args], **kw)
    assert seen.count > 0
    bad = (*args[:4], torch.tensor([3, 1, 7]))
    before = [a.clone() for a in args]
    with pytest.raises(ValueError, match="state_indices"):
        ple_conv(*bad, **kw)
    with pytest.raises(ValueError, match="state_indices"):
        ple_conv(*args[:4], torch.tensor([3, 3, 1]), **kw)
    for a, b in zip(args, before):
        assert_bitwise_equal(a, b)
    inputs, state, ekw = export_args(token_indices=False)
    with pytest.raises(ValueError, match="offsets"):
        export_conv_checkpoints(inputs, state, **{**ekw, "offsets": torch.tensor([S - 1, 0, 0])})
    ids, params, hkw = hash_args()
    with pytest.raises(ValueError, match="input_ids"):
        ngram_ids(torch.tensor([4, CONFIG.vocab_size, 0, 1, 2, 3, 4]), params, **hkw)
    with pytest.raises(ValueError, match="cu_seqlens"):
        dilated_causal_conv(torch.randn(5, C), torch.randn(C, K), dilation=D, cu_seqlens=torch.tensor([0, 3, 4]))
    with pytest.raises(ValueError, match="ids"):
        embedding_lookup(torch.randn(4, 2), torch.tensor([[0, 4]]))


# ---- torch.compile(fullgraph=True) -----------------------------------------------------------------
def compiled(fn):
    # aot_eager: Dynamo and AOTAutograd trace with fake tensors (a data-dependent shape or a value read
    # is a graph break, an error under fullgraph=True), then run the traced ops eagerly: results are exact.
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=False, backend="aot_eager")


@pytest.mark.parametrize("case", ["decode", "spec", "spec, token_indices", "prefill, initial states"])
def test_ple_conv_traces_fullgraph(case):
    args, kw = conv_args(**CONV_CASES[case])
    eager = [a.clone() for a in args]
    ple_conv(*eager, validate=False, **kw)

    def step(inputs, residual, state, w, slots):
        ple_conv(inputs, residual, state, w, slots, validate=False, **kw)

    compiled(step)(*args)
    assert_bitwise_equal(args[1], eager[1], name="residual")
    assert_bitwise_equal(args[2], eager[2], name="conv_state")


def test_ngram_ids_checkpoints_and_packed_conv_trace_fullgraph():
    ids, params, kw = hash_args()
    got = compiled(lambda t: ngram_ids(t, params, validate=False, **kw))(ids)
    assert torch.equal(got, ngram_ids(ids, params, **kw))

    inputs, state, ekw = export_args(token_indices=True)
    eager = state.clone()
    export_conv_checkpoints(inputs, eager, validate=False, **ekw)
    compiled(lambda x, s: export_conv_checkpoints(x, s, validate=False, **ekw))(inputs, state)
    assert_bitwise_equal(state, eager)

    x, w, cu = torch.randn(9, C), torch.randn(C, K), torch.tensor([0, 4, 4, 9])
    y = compiled(lambda x, w, cu: dilated_causal_conv(x, w, dilation=D, cu_seqlens=cu, validate=False))(x, w, cu)
    assert torch.equal(y, dilated_causal_conv(x, w, dilation=D, cu_seqlens=cu))
