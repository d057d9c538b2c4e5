"""Hash parameters of any size: products wrap, rows stay inside their heads (docs/spec.md section 3).

The config's multipliers (section 2) never overflow for token ids below V, but a `HashParams` built by hand
may carry any int64 multipliers, as the serving engine's own n-gram tests do: large odd 63-bit multipliers,
negative ones, ones whose products with ordinary token ids pass 2**63. The engine defines their rows: each
product wraps modulo 2**64 as a signed int64, the XOR mixes them, and the floor remainder (Python's ``%``)
puts the row inside the head's range also for a negative mix. Every backend gives those rows (Triton's ``%``
truncates, so its kernel moves a negative remainder up by the head's size), for ``ngram_ids`` and the fused
``ngram_embedding``, and a layer loads such multipliers and runs with them.

The oracle here is Python integers: the window rule of section 3, products reduced to signed 64 bits by hand.
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ple import PLEConfig, PLELayer
from ple.params import HashParams

BACKENDS = [
    pytest.param("reference", id="reference"),
    pytest.param("torch", id="torch"),
    pytest.param("triton", id="triton", marks=pytest.mark.interpreter),
]
MODULES = {"reference": "ple.reference", "torch": "ple.vectorized", "triton": "ple.fast"}


def _ops(backend: str):
    return importlib.import_module(MODULES[backend])


# ---- the oracle: Python integers ----------------------------------------------------------------------------
def signed64(x: int) -> int:
    """``x`` reduced modulo 2**64 to a signed int64 (two's complement)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def oracle_rows(requests: list[list[int]], contexts: list[list[int]], multipliers: list[int], sizes: list[int],
                heads_per_ngram: int, eos: int) -> list[list[int]]:
    """Every token's NH rows: windows by the EOS rule, wrapped products XOR-ed, the floor remainder."""
    N, offsets = len(multipliers), [sum(sizes[:h]) for h in range(len(sizes))]
    out = []
    for tokens, ctx in zip(requests, contexts, strict=True):
        full = ctx + tokens
        for p in range(len(ctx), len(full)):
            window, reached_eos = [full[p]], False
            for k in range(1, N):
                back = full[p - k] if p - k >= 0 else eos
                window.append(eos if reached_eos else back)
                reached_eos = reached_eos or back == eos
            rows, mix = [], signed64(window[0] * multipliers[0])
            for n in range(2, N + 1):
                mix = signed64(mix ^ signed64(window[n - 1] * multipliers[n - 1]))
                for j in range(heads_per_ngram):
                    h = (n - 2) * heads_per_ngram + j
                    rows.append(mix % sizes[h] + offsets[h])           # Python's %: the floor remainder
            out.append(rows)
    return out


def _params(multipliers: list[int], sizes: list[int], vocab_size: int) -> HashParams:
    offsets = [sum(sizes[:h]) for h in range(len(sizes))]
    return HashParams(torch.tensor(multipliers, dtype=torch.int64), torch.tensor(sizes, dtype=torch.int64),
                      torch.tensor(offsets, dtype=torch.int64), sum(sizes), vocab_size)


# ---- the cases: hand-built multipliers whose products wrap ----------------------------------------------------
PRIMES = [101, 103, 107, 109, 113, 127, 131, 137, 139]
_rng = random.Random(20261204)
_RANDOM64 = [signed64(_rng.getrandbits(64)) for _ in range(12)]

# (multipliers, vocab_size, heads_per_ngram, eos, requests, contexts or None)
CASES = {
    "two huge odd multipliers": ([18014398509481983, 17114398509481981], 2**31, 1, 0,
                                 [[350000, 350001, 350002]], None),
    "2**63 - 1 twice": ([2**63 - 1, 2**63 - 1], 1000, 2, 0, [[1, 2, 3, 999, 4]], None),
    "2**62 + 1 and 3": ([2**62 + 1, 3], 64, 1, 63, [[2, 4, 8, 63, 5, 6]], None),
    "negative m0": ([-1, 3], 8, 2, 0, [[7, 7, 5, 6, 7]], None),
    "negative m1": ([5, -7], 8, 2, 0, [[7, 7, 5, 6, 7]], None),
    "both negative": ([-(2**62) - 1, -(2**61) - 3], 300, 1, 299, [[17, 299, 18, 19]], None),
    "int64 minimum": ([-(2**63), 2**63 - 1], 50, 1, 0, [[1, 2, 3, 4]], None),
    "one past the no-overflow limit": ([(2**63 - 1) // 7 + 1, 3], 8, 2, 0, [[7, 7, 5, 6, 7]], None),
    "trigrams of random 64-bit": (_RANDOM64[0:3], 248320, 2, 248044, [[5, 248319, 248044, 77, 1000, 248043]],
                                  None),
    "4-grams of random 64-bit": (_RANDOM64[3:7], 248320, 2, 248044, [[1, 2, 3, 4, 5, 6, 7]], None),
    "eos inside, random": (_RANDOM64[7:10], 1000, 3, 5, [[9, 5, 9, 9, 5, 5, 1]], None),
    "two requests with contexts": (_RANDOM64[0:3], 248320, 2, 7,
                                   [[100000, 200000], [248000, 7, 123456]], [[7, 3], [199999, 248319]]),
    "three requests, one empty": (_RANDOM64[9:12], 2**20, 1, 0,
                                  [[2**20 - 1, 2**19], [], [12345, 0, 54321]], [[1, 2], [3, 4], [0, 0]]),
}


def _run_case(ops, multipliers, V, P, eos, requests, contexts):
    N = len(multipliers)
    sizes = PRIMES[:(N - 1) * P]
    params = _params(multipliers, sizes, V)
    ctx_lists = contexts if contexts is not None else [[eos] * (N - 1) for _ in requests]
    flat = [t for r in requests for t in r]
    kw: dict = dict(heads_per_ngram=P, eos_token_id=eos)
    if contexts is not None or len(requests) > 1:
        starts = [0]
        for r in requests:
            starts.append(starts[-1] + len(r))
        kw.update(query_start_loc=torch.tensor(starts), ngram_context=torch.tensor(ctx_lists))
    ids = torch.tensor(flat, dtype=torch.int64)
    want = oracle_rows(requests, ctx_lists, multipliers, sizes, P, eos)
    return ops, params, ids, kw, want, sizes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_wrapping_multipliers_give_the_engine_rows(backend, case):
    ops, params, ids, kw, want, sizes = _run_case(_ops(backend), *CASES[case])
    got = ops.ngram_ids(ids, params, **kw)
    assert got.tolist() == want
    offsets = [sum(sizes[:h]) for h in range(len(sizes))]
    for h, (lo, size) in enumerate(zip(offsets, sizes, strict=True)):         # inside the head, always
        assert bool(((got[:, h] >= lo) & (got[:, h] < lo + size)).all()), h


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["two huge odd multipliers", "negative m0", "two requests with contexts"])
def test_the_fused_lookup_gathers_the_engine_rows(backend, case):
    ops, params, ids, kw, want, _ = _run_case(_ops(backend), *CASES[case])
    weight = torch.randn(params.num_rows, 3, generator=torch.Generator().manual_seed(1))
    emb = ops.ngram_embedding(weight, ids, params, **kw)
    assert torch.equal(emb, weight[torch.tensor(want)].reshape(ids.numel(), -1))


def test_the_example_of_docs_spec_section_3():
    """docs/spec.md section 3's example: ``350000 * m[0]`` wraps to a negative mix, whose floor remainder is 61."""
    from ple import reference
    params = _params([18014398509481983, 17114398509481981], [101], 2**31)
    assert reference.ngram_ids(torch.tensor([350000, 350001]), params, heads_per_ngram=1,
                               eos_token_id=0).tolist() == [[61], [34]]


@given(multipliers=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=2, max_size=4),
       tokens=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=8),
       P=st.integers(1, 2))
def test_any_int64_multipliers_agree_across_backends(multipliers, tokens, P):
    """Any int64 multipliers: the reference and the torch backend equal the oracle (Triton: the cases above)."""
    N = len(multipliers)
    sizes = PRIMES[:(N - 1) * P]
    params = _params(multipliers, sizes, 2**31)
    want = oracle_rows([tokens], [[0] * (N - 1)], multipliers, sizes, P, 0)
    for backend in ("reference", "torch"):
        got = _ops(backend).ngram_ids(torch.tensor(tokens), params, heads_per_ngram=P, eos_token_id=0)
        assert got.tolist() == want, backend


# ---- the layer loads and runs such multipliers ----------------------------------------------------------------
TINY = PLEConfig.preset("tiny")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_with_wrapping_multipliers_loads_and_hashes_them(backend):
    layer = PLELayer(TINY, backend=backend)
    sd = {k: v.clone() for k, v in layer.state_dict().items()}
    wrapping = [2**63 - 1, -(2**62) - 5, _RANDOM64[0]][: TINY.ngram_size]
    sd["ple_embedding.layer_multipliers"] = torch.tensor(wrapping, dtype=torch.int64)
    layer.load_state_dict(sd)
    assert layer.ple_embedding.layer_multipliers.tolist() == wrapping
    tokens = [1, 2, TINY.eos_token_id, 3, 4]
    sizes = layer.ple_embedding.ngram_heads_vocab_sizes.tolist()
    want = oracle_rows([tokens], [[TINY.eos_token_id] * (TINY.ngram_size - 1)], wrapping, sizes,
                       TINY.heads_per_ngram, TINY.eos_token_id)
    got = _ops(backend).ngram_ids(torch.tensor(tokens), layer.ple_embedding.hash_params(),
                                  heads_per_ngram=TINY.heads_per_ngram, eos_token_id=TINY.eos_token_id)
    assert got.tolist() == want
    hidden = torch.randn(1, len(tokens), TINY.hc_hidden_size)
    out = layer(hidden, torch.tensor([tokens]))
    assert out.shape == hidden.shape and bool(torch.isfinite(out).all())
