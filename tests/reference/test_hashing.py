"""Hash parameters and n-gram ids (docs/spec.md sections 2 and 3).

The library is checked against docs/spec.md's check values and against a small
pure-Python statement of the window rule and the hash (loops and Python ints, no
torch: the ``py_*`` functions of tests/_helpers.py), on token streams full of EOS.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from _helpers import py_head_sizes, py_is_prime, py_multipliers, py_rows, py_splitmix64, py_windows
from hypothesis import given, note
from hypothesis import strategies as st

from ple import PLEConfig
from ple.reference import hash_params, ngram_ids, splitmix64

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


# ---- an independent statement of docs/spec.md sections 2 and 3: py_* in tests/_helpers.py ------------------
def py_ngram_ids(tokens, ctx, cfg: PLEConfig, L: int = 0) -> list[list[int]]:
    mult = py_multipliers(cfg.vocab_size, cfg.ngram_size, cfg.seed, L)
    sizes = py_head_sizes(cfg.ngram_vocab_size_base, cfg.num_ngram_heads, L)
    return [
        py_rows(w, mult, sizes, cfg.heads_per_ngram)
        for w in py_windows(tokens, ctx, cfg.ngram_size, cfg.eos_token_id)
    ]


def hash_config(V: int, N: int, P: int, eos: int, *, base: int = 101, div: int = 16, seed: int = 1234):
    return PLEConfig(
        vocab_size=V,
        hidden_size=4,
        hc_count=1,
        eos_token_id=eos,
        ple_embed_dim=(N - 1) * P,
        ngram_size=N,
        heads_per_ngram=P,
        ngram_vocab_size_base=base,
        make_ngram_vocab_size_divisible_by=div,
        seed=seed,
    )


def lib_ids(tokens, cfg, *, L=0, dtype=torch.int64, **kw) -> torch.Tensor:
    return ngram_ids(
        torch.tensor(tokens, dtype=dtype),
        hash_params(cfg, L),
        heads_per_ngram=cfg.heads_per_ngram,
        eos_token_id=cfg.eos_token_id,
        **kw,
    )


# ---- docs/spec.md section 2 -------------------------------------------------------------------------------
def test_splitmix64_known_outputs():
    # The first two outputs of the SplitMix64 generator seeded with 0.
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(GOLDEN) == 0x6E789E6AA1B965F4


@given(x=st.integers(0, MASK64))
def test_splitmix64_matches_spec_formula(x):
    assert splitmix64(x) == py_splitmix64(x)


def test_multipliers_check_value():
    cfg = PLEConfig.preset("qwen4exp")
    p = hash_params(cfg, 0)
    assert p.multipliers.dtype == torch.int64
    assert p.multipliers.tolist() == [23703573157769, 20109073645365, 8052911324071]
    assert p.vocab_size == 248320


@given(
    V=st.one_of(st.integers(1, 300), st.sampled_from([248320, 2**31 - 1, 2**40 + 7])),
    N=st.integers(2, 6),
    seed=st.integers(0, 2**64),
    L=st.integers(0, 6),
)
def test_multipliers_follow_formula_odd_and_overflow_free(V, N, seed, L):
    cfg = PLEConfig(
        vocab_size=V,
        hidden_size=4,
        hc_count=1,
        eos_token_id=0,
        ple_embed_dim=N - 1,
        ngram_size=N,
        heads_per_ngram=1,
        ngram_vocab_size_base=2,
        seed=seed,
    )
    note(cfg)
    m = hash_params(cfg, L).multipliers.tolist()
    assert m == py_multipliers(V, N, seed, L)
    for mi in m:
        assert mi % 2 == 1 and mi >= 1
        assert (V - 1) * mi < 2**63


def test_multipliers_differ_between_layers():
    cfg = PLEConfig.preset("qwen4exp")
    assert hash_params(cfg, 1).multipliers.tolist() == py_multipliers(248320, 3, 1234, 1)
    assert hash_params(cfg, 1).multipliers.tolist() != hash_params(cfg, 0).multipliers.tolist()


@pytest.mark.parametrize("N, P", [(3, 2), (5, 1), (2, 4)])
def test_head_sizes_check_value(N, P):
    cfg = hash_config(200, N, P, 0, base=100, div=16)
    p0, p1 = hash_params(cfg, 0), hash_params(cfg, 1)
    assert p0.head_sizes.tolist() == [101, 103, 107, 109]
    assert p0.head_offsets.tolist() == [0, 101, 204, 311]
    assert p0.num_rows == 432  # 420 rounded up to a multiple of 16
    assert p1.head_sizes.tolist() == [113, 127, 131, 137]
    assert p1.head_offsets.tolist() == [0, 113, 240, 371]
    assert p1.num_rows == 512  # 508 -> 512
    assert p0.head_sizes.dtype == p0.head_offsets.dtype == torch.int64


@given(base=st.integers(2, 400), N=st.integers(2, 4), P=st.integers(1, 3), L=st.integers(0, 3), div=st.integers(1, 50))
def test_head_sizes_offsets_and_padding(base, N, P, L, div):
    cfg = hash_config(10, N, P, 0, base=base, div=div)
    p = hash_params(cfg, L)
    sizes = py_head_sizes(base, (N - 1) * P, L)
    assert p.head_sizes.tolist() == sizes
    assert p.head_offsets.tolist() == [sum(sizes[:h]) for h in range(len(sizes))]
    assert p.num_rows % div == 0 and sum(sizes) <= p.num_rows < sum(sizes) + div


def test_real_preset_table_rows():
    cfg = PLEConfig.preset("qwen4exp")
    p = hash_params(cfg, 0)
    sizes = p.head_sizes.tolist()
    assert p.num_rows == 320001536
    assert len(sizes) == 16 and sizes[0] >= 20_000_000
    assert sizes == sorted(set(sizes)) and all(py_is_prime(s) for s in sizes)
    # The first 16 primes >= the base, none skipped.
    assert [n for n in range(20_000_000, sizes[-1] + 1) if py_is_prime(n)] == sizes
    assert p.num_rows % 128 == 0 and 0 <= p.num_rows - sum(sizes) < 128


# ---- docs/spec.md section 3 -------------------------------------------------------------------------------
def test_eos_example_windows():
    # Oldest first, as docs/spec.md writes them.
    bigrams = [[99, 4], [4, 5], [5, 99], [99, 6]]
    trigrams = [[99, 99, 4], [99, 4, 5], [4, 5, 99], [99, 99, 6]]
    windows = py_windows([4, 5, 99, 6], [99, 99], 3, 99)
    assert [w[1::-1] for w in windows] == bigrams
    assert [w[::-1] for w in windows] == trigrams
    # The library hashes exactly those windows.
    cfg = hash_config(128, 3, 2, 99)
    p = hash_params(cfg, 0)
    mult, sizes = p.multipliers.tolist(), p.head_sizes.tolist()
    expected = [py_rows(tri[::-1], mult, sizes, 2) for tri in trigrams]
    assert lib_ids([4, 5, 99, 6], cfg).tolist() == expected
    # And the bigram heads only see the bigram: a window differing in w[2] alone keeps them.
    other = py_rows([6, 99, 5], mult, sizes, 2)
    assert other[:2] == expected[3][:2] and other[2:] != expected[3][2:]


def eos_heavy_tokens(V: int, eos: int, max_size: int = 40):
    return st.lists(
        st.one_of(st.just(eos), st.integers(0, V - 1), st.sampled_from([0, V - 1])), max_size=max_size
    )


@st.composite
def hash_setups(draw):
    V = draw(st.one_of(st.integers(1, 40), st.sampled_from([248320, 2**31 - 1])))
    N = draw(st.integers(2, 5))
    P = draw(st.integers(1, 3))
    eos = draw(st.one_of(st.just(0), st.just(V - 1), st.integers(0, V - 1)))
    base = draw(st.integers(2, 300))
    return hash_config(V, N, P, eos, base=base, seed=draw(st.integers(0, 2**20)))


@given(cfg=hash_setups(), data=st.data())
def test_ngram_ids_match_pure_python(cfg, data):
    tokens = data.draw(eos_heavy_tokens(cfg.vocab_size, cfg.eos_token_id), label="tokens")
    ctx = data.draw(
        st.lists(st.integers(0, cfg.vocab_size - 1), min_size=cfg.context_len, max_size=cfg.context_len)
        | st.just([cfg.eos_token_id] * cfg.context_len),
        label="ctx",
    )
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="dtype")
    if cfg.vocab_size > 2**31 - 1 and dtype == torch.int32:
        dtype = torch.int64
    note(cfg)
    got = lib_ids(tokens, cfg, dtype=dtype, ngram_context=torch.tensor([ctx], dtype=dtype))
    assert got.dtype == torch.int64 and tuple(got.shape) == (len(tokens), cfg.num_ngram_heads)
    assert got.tolist() == py_ngram_ids(tokens, ctx, cfg)
    # Without a context every request starts its sequence: the context is all EOS.
    assert lib_ids(tokens, cfg, dtype=dtype).tolist() == py_ngram_ids(
        tokens, [cfg.eos_token_id] * cfg.context_len, cfg
    )


@given(cfg=hash_setups(), L=st.integers(0, 2), data=st.data())
def test_rows_stay_inside_their_heads(cfg, L, data):
    tokens = data.draw(eos_heavy_tokens(cfg.vocab_size, cfg.eos_token_id, 30))
    p = hash_params(cfg, L)
    got = lib_ids(tokens, cfg, L=L)
    lo = p.head_offsets[None, :]
    assert bool(((got >= lo) & (got < lo + p.head_sizes[None, :])).all())
    assert got.tolist() == py_ngram_ids(tokens, [cfg.eos_token_id] * cfg.context_len, cfg, L)


def context_before(seq: list[int], start: int, n: int, eos: int) -> list[int]:
    """The ``n`` tokens before ``seq[start]``, oldest first, EOS before the sequence start."""
    padded = [eos] * n + seq
    return padded[start : start + n]


@given(cfg=hash_setups(), data=st.data())
def test_chunk_with_context_equals_whole_sequence(cfg, data):
    seq = data.draw(eos_heavy_tokens(cfg.vocab_size, cfg.eos_token_id, 30), label="seq")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(seq)), max_size=5), label="cuts"))
    dtype = (
        torch.int64 if cfg.vocab_size > 2**31 - 1 else data.draw(st.sampled_from([torch.int32, torch.int64]))
    )
    note(cfg)
    whole = lib_ids(seq, cfg, dtype=dtype)
    bounds = [0, *cuts, len(seq)]
    for a, b in pairwise(bounds):
        ctx = context_before(seq, a, cfg.context_len, cfg.eos_token_id)
        chunk = lib_ids(seq[a:b], cfg, dtype=dtype, ngram_context=torch.tensor([ctx], dtype=dtype))
        assert torch.equal(chunk, whole[a:b]), (a, b, ctx)


@given(cfg=hash_setups(), data=st.data())
def test_batched_varlen_equals_per_request(cfg, data):
    V, eos, n_ctx = cfg.vocab_size, cfg.eos_token_id, cfg.context_len
    R = data.draw(st.integers(1, 5), label="R")
    reqs = [data.draw(eos_heavy_tokens(V, eos, 12), label=f"tokens{r}") for r in range(R)]
    ctxs = [
        data.draw(
            st.lists(st.one_of(st.just(eos), st.integers(0, V - 1)), min_size=n_ctx, max_size=n_ctx),
            label=f"ctx{r}",
        )
        for r in range(R)
    ]
    dt = data.draw(st.sampled_from([torch.int32, torch.int64]), label="index dtype")
    tok_dt = torch.int64 if V > 2**31 - 1 else dt
    note(cfg)
    qsl = torch.tensor([0] + [sum(len(t) for t in reqs[: r + 1]) for r in range(R)], dtype=dt)
    flat = [t for req in reqs for t in req]
    got = lib_ids(
        flat, cfg, dtype=tok_dt, query_start_loc=qsl, ngram_context=torch.tensor(ctxs, dtype=tok_dt)
    )
    for r in range(R):
        alone = lib_ids(reqs[r], cfg, dtype=tok_dt, ngram_context=torch.tensor([ctxs[r]], dtype=tok_dt))
        assert torch.equal(got[int(qsl[r]) : int(qsl[r + 1])], alone), r
        assert alone.tolist() == py_ngram_ids(reqs[r], ctxs[r], cfg)
    # Default context: every request starts its own sequence (no leaking across request boundaries).
    fresh = lib_ids(flat, cfg, dtype=tok_dt, query_start_loc=qsl)
    for r in range(R):
        assert fresh[int(qsl[r]) : int(qsl[r + 1])].tolist() == py_ngram_ids(reqs[r], [eos] * n_ctx, cfg)


def test_empty_input():
    cfg = PLEConfig.preset("tiny")
    assert tuple(lib_ids([], cfg).shape) == (0, cfg.num_ngram_heads)
    got = lib_ids(
        [], cfg, query_start_loc=torch.tensor([0, 0, 0]), ngram_context=torch.zeros(2, 2, dtype=torch.int64)
    )
    assert tuple(got.shape) == (0, cfg.num_ngram_heads)


def test_batch_of_zero_requests():
    # A step with no requests of this kind: query_start_loc = [0].
    cfg = PLEConfig.preset("tiny")
    for ctx in (None, torch.zeros(0, cfg.context_len, dtype=torch.int64)):
        got = lib_ids([], cfg, query_start_loc=torch.tensor([0]), ngram_context=ctx)
        assert got.dtype == torch.int64 and tuple(got.shape) == (0, cfg.num_ngram_heads)


@pytest.mark.parametrize("bad", [-1, 1000, 10**6])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_token_ids_outside_vocab_raise(bad, dtype):
    cfg = PLEConfig.preset("tiny")  # V = 1000
    with pytest.raises(ValueError, match=r"^input_ids\b"):
        lib_ids([5, bad, 7], cfg, dtype=dtype)
    with pytest.raises(ValueError, match=r"^input_ids\b"):
        lib_ids([5, 6, 7, bad], cfg, dtype=dtype, query_start_loc=torch.tensor([0, 2, 4], dtype=dtype))
    with pytest.raises(ValueError, match=r"^ngram_context\b"):
        lib_ids([5, 6], cfg, dtype=dtype, ngram_context=torch.tensor([[2, bad]], dtype=dtype))


def test_vocab_edges_are_accepted():
    cfg = PLEConfig.preset("tiny")
    assert lib_ids([0, 999], cfg).tolist() == py_ngram_ids([0, 999], [2, 2], cfg)
