"""Hash parameters whose products could overflow int64 are refused on every backend (docs/spec.md section 3).

A `HashParams` built by hand with a multiplier ``m`` such that ``m * (V - 1) >= 2**63`` (or ``m < 0``) would
make ``token * m`` wrap negative for some token id below V; Triton's ``%`` keeps the dividend's sign, so
``ple.fast`` returned rows before the head's (the issue's case: ``[-92, 34, 19]`` where the reference gave
``[9, 34, 19]``). Every backend's ``ngram_ids`` and ``ngram_embedding`` refuse such parameters with a
``ValueError`` naming ``params``; the largest multiplier that fits (``m * (V - 1) == 2**63 - 1``) is accepted
and hashes to the rows computed here in Python integers; a layer refuses a checkpoint holding such
multipliers when it loads, before anything is loaded (so a step, which reads nothing on the host, never
meets them).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from ple import PLEConfig, PLELayer
from ple.params import HashParams

BACKENDS = [
    pytest.param("reference", id="reference"),
    pytest.param("torch", id="torch"),
    pytest.param("triton", id="triton", marks=pytest.mark.interpreter),
]
MODULES = {"reference": "ple.reference", "torch": "ple.vectorized", "triton": "ple.fast"}

LIMIT_V8 = (2**63 - 1) // 7                  # V = 8: m * (V - 1) == 2**63 - 1 exactly (2**63 - 1 = 7 * LIMIT_V8)
assert LIMIT_V8 * 7 == 2**63 - 1


def _ops(backend: str):
    return importlib.import_module(MODULES[backend])


def _params(multipliers: list[int], sizes: list[int], vocab_size: int) -> HashParams:
    offsets = [sum(sizes[:h]) for h in range(len(sizes))]
    return HashParams(torch.tensor(multipliers, dtype=torch.int64), torch.tensor(sizes, dtype=torch.int64),
                      torch.tensor(offsets, dtype=torch.int64), sum(sizes), vocab_size)


def _both_ops(ops, params: HashParams, ids: torch.Tensor, P: int, eos: int) -> None:
    """``ngram_ids`` and ``ngram_embedding`` (a table with every row the hash addresses) of ``ids``."""
    ops.ngram_ids(ids, params, heads_per_ngram=P, eos_token_id=eos)
    weight = torch.randn(params.num_rows, 2, generator=torch.Generator().manual_seed(0))
    ops.ngram_embedding(weight, ids, params, heads_per_ngram=P, eos_token_id=eos)


# ---- refused ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["ngram_ids", "ngram_embedding"])
def test_the_issue_case_is_refused(backend, op):
    params = HashParams(torch.tensor([18014398509481983, 17114398509481981]), torch.tensor([101]),
                        torch.tensor([0]), 101, 2**31)
    ids = torch.tensor([350000, 350001, 350002])
    ops = _ops(backend)
    with pytest.raises(ValueError, match=r"^params: multipliers .* m\[0\] = 18014398509481983, "
                                         r"m\[1\] = 17114398509481981"):
        if op == "ngram_ids":
            ops.ngram_ids(ids, params, heads_per_ngram=1, eos_token_id=0)
        else:
            weight = torch.zeros(101, 4)
            ops.ngram_embedding(weight, ids, params, heads_per_ngram=1, eos_token_id=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("multipliers, bad", [
    ([LIMIT_V8, LIMIT_V8 + 1], r"m\[1\] = 1317624576693539402"),     # (LIMIT + 1) * 7 = 2**63 + 6
    ([LIMIT_V8 + 1, 3], r"m\[0\] = 1317624576693539402"),             # m[0] goes with the current token
    ([-1, 3], r"m\[0\] = -1"),                                        # negative: the products are negative
], ids=["m1 one past the limit", "m0 one past the limit", "negative"])
def test_multipliers_past_the_limit_are_refused(backend, multipliers, bad):
    params = _params(multipliers, [101, 103], 8)
    ids = torch.tensor([7, 7, 5, 6, 7])
    with pytest.raises(ValueError, match=rf"^params: .*\[0, {LIMIT_V8}\] for vocab_size=8.* {bad}"):
        _both_ops(_ops(backend), params, ids, 2, 0)


# ---- the boundary is accepted ---------------------------------------------------------------------------
def _expected_rows(tokens: list[int], multipliers: list[int], sizes: list[int], P: int, eos: int) -> list[list[int]]:
    """docs/spec.md section 3 for N = 2, one request from its start, no EOS among ``tokens``: Python integers."""
    assert eos not in tokens
    offsets = [sum(sizes[:h]) for h in range(len(sizes))]
    out = []
    for p, t in enumerate(tokens):
        back = tokens[p - 1] if p else eos
        mix = (t * multipliers[0]) ^ (back * multipliers[1])
        assert 0 <= mix < 2**63
        out.append([mix % sizes[j] + offsets[j] for j in range(P)])
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_largest_multipliers_that_fit_are_accepted(backend):
    sizes, P, eos = [101, 103], 2, 0
    multipliers = [LIMIT_V8, LIMIT_V8 - 2]                  # token 7 * LIMIT_V8 == 2**63 - 1
    params = _params(multipliers, sizes, 8)
    tokens = [7, 7, 5, 6, 7, 1]
    ops = _ops(backend)
    got = ops.ngram_ids(torch.tensor(tokens), params, heads_per_ngram=P, eos_token_id=eos)
    want = _expected_rows(tokens, multipliers, sizes, P, eos)
    assert got.tolist() == want
    weight = torch.randn(params.num_rows, 3, generator=torch.Generator().manual_seed(1))
    emb = ops.ngram_embedding(weight, torch.tensor(tokens), params, heads_per_ngram=P, eos_token_id=eos)
    assert torch.equal(emb, weight[torch.tensor(want)].reshape(len(tokens), P * 3))


def test_a_vocabulary_of_one_token_takes_any_non_negative_multiplier():
    from ple import reference
    params = _params([2**63 - 1, 2**63 - 1], [5], 1)       # token 0 only: every product is 0
    assert reference.ngram_ids(torch.tensor([0, 0]), params, heads_per_ngram=1, eos_token_id=0).tolist() == [[0], [0]]


# ---- the layer: refused when the buffers load -----------------------------------------------------------
TINY = PLEConfig.preset("tiny")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_with_overflowing_multipliers_is_refused_on_load(backend):
    layer = PLELayer(TINY, backend=backend)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    sd = {k: v.clone() for k, v in before.items()}
    sd["norm_key.weight"] += 1                              # would be loaded if anything were
    limit = (2**63 - 1) // (TINY.vocab_size - 1)
    sd["ple_embedding.layer_multipliers"][1] = limit + 1
    with pytest.raises(ValueError, match=r"^params \(ple_embedding\.layer_multipliers\): .* m\[1\] = "
                                         + str(limit + 1)):
        layer.load_state_dict(sd)
    for k, v in layer.state_dict().items():                 # nothing of the layer was loaded
        assert torch.equal(v, before[k]), k
    sd["ple_embedding.layer_multipliers"][1] = limit        # the largest that fits loads
    layer.load_state_dict(sd)
    assert layer.ple_embedding.layer_multipliers[1].item() == limit


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_layer_forward_refuses_buffers_changed_in_place(backend):
    # Eager ``forward`` validates its hash (validate=True), so buffers edited after loading are refused too.
    layer = PLELayer(TINY, backend=backend)
    layer.ple_embedding.layer_multipliers[0] = -3
    hidden = torch.zeros(1, 4, TINY.hc_hidden_size)
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match=r"^params: .* m\[0\] = -3"):
        layer(hidden, ids)
