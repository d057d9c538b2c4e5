"""``ple.fast.ngram_ids`` and the fused ``ngram_embedding`` against ``ple.reference``.

Every test runs Triton kernels (compiled on a GPU, under ``TRITON_INTERPRET=1`` on the CPU), so
shapes are small; fresh buffers are poisoned (the ``poisoned_empty`` fixture of ``tests/conftest.py``)
so an element a kernel never writes shows up as a mismatch.

* ``ngram_ids``: equal to the reference exactly (N 2..5, P 1..4, EOS-heavy streams, varlen cuts with
  empty requests, contexts, int32/int64 index tensors, strided ids and index tensors).
* ``ngram_embedding`` (fused hash + gather): equal bit for bit to ``embedding_lookup(weight, ngram_ids(...))``;
  its table gradient equals the lookup's.
"""


from __future__ import annotations

import pytest
import torch
from _helpers import deterministic_algorithms, tiny_hash_setup
from hypothesis import given, note
from hypothesis import strategies as st

from ple import PLEConfig
from ple import reference as ref
from ple.fast import ngram_embedding
from ple.fast import ngram_ids as fast_ngram_ids
from ple.testing.numerics import assert_bitwise_equal, assert_close

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("poisoned_empty")]

INDEX_DTYPES = (torch.int32, torch.int64)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- n-gram ids -------------------------------------------------------------------------------------
@st.composite
def hash_cases(draw):
    """A hash config and a varlen batch of EOS-heavy token streams."""
    N = draw(st.integers(2, 5))
    P = draw(st.integers(1, 4))
    V = draw(st.sampled_from([3, 17, 200, 248320]))       # 248320: the real vocab, products near 2**63
    eos = draw(st.integers(0, V - 1))
    # A few distinct ids plus EOS make windows collide and EOS cuts frequent.
    alphabet = draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=4)) + [eos, eos]
    token = st.sampled_from(alphabet)
    varlen = draw(st.booleans())
    R = draw(st.integers(0, 4)) if varlen else 1
    lens = draw(st.lists(st.integers(0, 7), min_size=R, max_size=R)) if varlen else [draw(st.integers(1, 9))]
    tokens = draw(st.lists(token, min_size=sum(lens), max_size=sum(lens)))
    ctx = draw(st.none() | st.lists(st.lists(token, min_size=N - 1, max_size=N - 1), min_size=R, max_size=R))
    config = PLEConfig(
        vocab_size=V, hidden_size=1, hc_count=1, ple_embed_dim=(N - 1) * P, ngram_size=N, heads_per_ngram=P,
        ngram_vocab_size_base=draw(st.integers(2, 400)), make_ngram_vocab_size_divisible_by=8,
        seed=draw(st.integers(0, 2**32)), eos_token_id=eos, ple_layer_ids=(1, 2, 3),
    )
    layer = draw(st.integers(0, 2))
    ids_dtype, query_start_loc_dtype, ctx_dtype = (draw(st.sampled_from(INDEX_DTYPES)) for _ in range(3))
    strided = draw(st.booleans())
    query_start_loc_list = [0]
    for n in lens:
        query_start_loc_list.append(query_start_loc_list[-1] + n)
    input_ids = torch.tensor(tokens, dtype=ids_dtype)
    if strided:                                           # a stride-2 view of a larger buffer
        buf = torch.full((2 * len(tokens),), V + 5, dtype=ids_dtype)
        buf[::2] = input_ids
        input_ids = buf[::2]
    kwargs = dict(heads_per_ngram=P, eos_token_id=eos)
    if varlen:                                            # strided: every other entry of a larger buffer
        query_start_loc = torch.tensor(query_start_loc_list, dtype=query_start_loc_dtype)
        kwargs["query_start_loc"] = (torch.stack([query_start_loc, query_start_loc + 1000], 1)[:, 0] if strided
                                     else query_start_loc)
    if ctx is not None:
        context = torch.tensor(ctx, dtype=ctx_dtype).reshape(R, N - 1)
        kwargs["ngram_context"] = torch.cat([context, context], 1)[:, ::2] if strided else context
    note(f"N={N} P={P} V={V} eos={eos} lens={lens} tokens={tokens} ctx={ctx} layer={layer} "
         f"dtypes={ids_dtype, query_start_loc_dtype, ctx_dtype} strided={strided}")
    return ref.hash_params(config, layer), input_ids, kwargs


@given(hash_cases())
def test_ngram_ids_equal_reference(case):
    params, input_ids, kwargs = case
    expected = ref.ngram_ids(input_ids, params, **kwargs)
    actual = fast_ngram_ids(input_ids, params, **kwargs)
    assert actual.dtype == torch.int64
    assert torch.equal(actual, expected), (actual, expected)


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_ngram_ids_read_index_tensors_through_their_strides(dtype):
    params, kw = tiny_hash_setup()
    tokens = torch.tensor([5, 1, 7, 7, 3, 0, 2, 9, 4, 1, 8, 6], dtype=dtype)
    strided_tokens = torch.stack([tokens, tokens + 500], 1)[:, 0]                 # stride 2
    # [0, 2, 2, 7, 12], stride 2
    query_start_loc = torch.tensor([0, 50, 2, 60, 2, 70, 7, 80, 12, 90], dtype=dtype)[::2]
    ctx = torch.arange(24, dtype=dtype).reshape(4, 6)[:, 1:5:2] % 10                # [4, 2], strides (6, 2)
    table = torch.randn(params.num_rows, 2, generator=_gen(0))
    for k in ({}, dict(ngram_context=ctx)):
        want = ref.ngram_ids(tokens, params, query_start_loc=query_start_loc.contiguous(), **kw,
                             **{n: v.contiguous() for n, v in k.items()})
        assert torch.equal(fast_ngram_ids(strided_tokens, params, query_start_loc=query_start_loc, **kw, **k), want)
        emb = ngram_embedding(table, strided_tokens, params, query_start_loc=query_start_loc, **kw, **k)
        assert torch.equal(emb, ref.embedding_lookup(table, want))


def test_ngram_ids_no_requests():
    """``query_start_loc = [0]``: no requests, no tokens."""
    params, kw = tiny_hash_setup()
    for dt in INDEX_DTYPES:
        args = (torch.zeros(0, dtype=dt), params)
        kw.update(query_start_loc=torch.zeros(1, dtype=dt), ngram_context=torch.zeros(0, 2, dtype=dt))
        out = fast_ngram_ids(*args, **kw)
        assert out.shape == (0, params.head_sizes.numel()) and out.dtype == torch.int64
        assert torch.equal(out, ref.ngram_ids(*args, **kw))


def test_ngram_ids_spec_example():
    """docs/spec.md section 3's example: eos 99, tokens [4, 5, 99, 6], N 3 (windows checked via the reference)."""
    config = PLEConfig(vocab_size=100, hidden_size=1, hc_count=1, ple_embed_dim=4, ngram_size=3,
                       heads_per_ngram=2, ngram_vocab_size_base=100, eos_token_id=99)
    params = ref.hash_params(config, 0)
    x = torch.tensor([4, 5, 99, 6])
    kw = dict(heads_per_ngram=2, eos_token_id=99)
    assert torch.equal(fast_ngram_ids(x, params, **kw), ref.ngram_ids(x, params, **kw))
    # Chunked with contexts equals whole.
    whole = fast_ngram_ids(x, params, **kw)
    tail = fast_ngram_ids(x[2:], params, query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
                          ngram_context=x[None, :2], **kw)
    assert torch.equal(tail, whole[2:])


@given(hash_cases(), st.integers(1, 5), st.sampled_from([torch.float32, torch.bfloat16]),
       st.integers(0, 2**31 - 1))
def test_ngram_embedding_fused_equals_lookup(case, D, dtype, seed):
    params, input_ids, kwargs = case
    weight = torch.randn(params.num_rows, D, generator=_gen(seed)).to(dtype).requires_grad_()
    ids = ref.ngram_ids(input_ids, params, **kwargs)
    expected = ref.embedding_lookup(weight, ids)
    actual = ngram_embedding(weight, input_ids, params, **kwargs)
    assert_bitwise_equal(actual.detach(), expected.detach(), name="ngram_embedding")
    grad = torch.randint(-3, 4, expected.shape, generator=_gen(seed + 1)).to(dtype)   # sums exact
    (g_exp,) = torch.autograd.grad(expected, weight, grad)
    (g_act,) = torch.autograd.grad(actual, weight, grad)
    assert_bitwise_equal(g_act, g_exp, name="ngram_embedding grad")
    # Without a gradient the ids are not written; the values are the same.
    assert_bitwise_equal(ngram_embedding(weight.detach(), input_ids, params, **kwargs), expected.detach())


def test_ngram_embedding_table_too_small():
    params, kw = tiny_hash_setup()
    with pytest.raises(ValueError, match="weight"):
        ngram_embedding(torch.zeros(10, 2), torch.tensor([1, 2]), params, **kw)


def _fused_case(seed=0, T=40, D=3, dtype=torch.float32):
    params, kw = tiny_hash_setup()
    g = _gen(seed)
    tokens = torch.randint(0, 2, (T,), generator=g)                   # two tokens: long runs of equal ids
    kw = dict(kw, query_start_loc=torch.tensor([0, 4, 4, T]))
    weight = torch.randn(params.num_rows, D, generator=g).to(dtype)
    scale = torch.randint(-12, 12, (T, 1), generator=g).float().exp2()  # magnitudes apart: order shows
    grad = (torch.randn(T, params.head_sizes.numel() * D, generator=g) * scale).to(dtype)
    return params, kw, tokens, weight, grad


def test_ngram_embedding_compiles_and_trains():
    """``torch.compile(fullgraph=True)`` traces the fused op and its backward (registered ops, no graph break)."""
    params, kw, tokens, weight, grad = _fused_case()
    w_c, w_r = weight.clone().requires_grad_(), weight.clone().requires_grad_()
    fn = torch.compile(lambda w: ngram_embedding(w, tokens, params, **kw, validate=False), fullgraph=True,
                       backend="aot_eager")
    out = fn(w_c)
    want = ref.embedding_lookup(w_r, ref.ngram_ids(tokens, params, **kw))
    assert_bitwise_equal(out.detach(), want.detach(), name="compiled ngram_embedding")
    out.backward(grad)
    want.backward(grad)
    w64 = weight.double().requires_grad_()
    (g_64,) = torch.autograd.grad(ref.embedding_lookup(w64, ref.ngram_ids(tokens, params, **kw)), w64, grad.double())
    assert_close(w_c.grad, w_r.grad, exact64=g_64, name="compiled ngram_embedding grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ngram_embedding_deterministic_backward(dtype, monkeypatch):
    """Deterministic mode: the fused op's table gradient uses no atomics and its bits do not depend on block sizes."""
    from ple.fast import embedding as E
    from ple.fast import hashing as Hs
    params, kw, tokens, weight, grad = _fused_case(1, dtype=dtype)
    with deterministic_algorithms():
        monkeypatch.setattr(E, "_lookup_bwd_kernel", None)                # the atomic kernel must not run
        grads = []
        for unroll, rows, block_t, block_d in ((8, 256, 64, 64), (1, 4, 1, 1), (3, 32, 4, 2)):
            monkeypatch.setattr(E, "_DET_UNROLL", unroll)
            monkeypatch.setattr(Hs, "_FUSED_ROWS", rows)
            monkeypatch.setattr(Hs, "_BLOCK_T", block_t)
            monkeypatch.setattr(Hs, "_BLOCK_D", block_d)
            monkeypatch.setattr(E, "_DET_BLOCK_D", block_d)
            w = weight.clone().requires_grad_()
            out = ngram_embedding(w, tokens, params, **kw)
            (dw,) = torch.autograd.grad(out, w, grad)
            grads.append(dw)
        for dw in grads[1:]:
            assert_bitwise_equal(dw, grads[0], name="deterministic fused grad, other block sizes")
        # Each row summed in token order, rounded once.
        ids = ref.ngram_ids(tokens, params, **kw)
        acc = grad.reshape(ids.numel(), -1).float()
        want = torch.zeros(params.num_rows, weight.shape[1])
        for i, r in enumerate(ids.reshape(-1).tolist()):
            want[r] += acc[i]
        assert_bitwise_equal(grads[0], want.to(dtype), name="token-order sum")


# ---- NF4 tables: hash + gather + unpack in one kernel ----------------------------------------------------------
def _nf4_rows(n: int, D: int, seed: int) -> torch.Tensor:
    """NF4 rows of random codes and finite float16 scales (zero, negative, subnormal and huge ones too)."""
    from ple.quant import nf4_pack
    g = _gen(seed)
    codes = torch.randint(0, 16, (n, D), generator=g, dtype=torch.uint8)
    scale = (torch.randn(n, generator=g) * 2.0 ** torch.randint(-26, 16, (n,), generator=g)).to(torch.float16)
    scale[: min(n, 4)] = torch.tensor([0.0, -0.0, 2.0**-24, 65504.0])[: min(n, 4)]
    return nf4_pack(codes, scale)


@given(hash_cases(), st.sampled_from([2, 4, 6, 8, 10, 14, 16, 160]),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.sampled_from(["plain", "offset", "odd"]),
       st.integers(0, 2**31 - 1))
def test_ngram_embedding_nf4_equals_the_reference_composition(case, D, dtype, layout, seed):
    """``ple.fast.ngram_embedding_nf4`` = ``nf4_dequantize_rows(ngram_embedding(...))`` bit for bit: every row width
    (4-, 2- and 1-byte words: D % 8 == 0, D % 4 == 2 ...), rows starting off a word, strides not a word."""
    from ple.fast import ngram_embedding_nf4
    params, input_ids, kwargs = case
    rows = _nf4_rows(params.num_rows + 1, D, seed)
    W = rows.shape[1]
    if layout == "offset":                                   # rows start 1 byte past a word: 1-byte words
        weight = rows.reshape(-1)[1:1 + params.num_rows * W].reshape(params.num_rows, W)
    elif layout == "odd":                                    # a row stride of W + 1 bytes
        buf = torch.zeros(params.num_rows, W + 1, dtype=torch.uint8)
        buf[:, :W] = rows[:-1]
        weight = buf[:, :W]
    else:
        weight = rows[:-1]
    want = ref.nf4_dequantize_rows(ref.ngram_embedding(weight, input_ids, params, **kwargs), D, dtype)
    got = ngram_embedding_nf4(weight, input_ids, params, dtype=dtype, **kwargs)
    assert got.dtype == dtype
    assert_bitwise_equal(got, want, name=f"ngram_embedding_nf4 D={D} {layout}")


def test_ngram_embedding_nf4_word_sizes():
    """The kernel reads 4-byte words where the rows allow (the model's D = 160: 84-byte rows), else 2 or 1."""
    from ple.fast.hashing import _nf4_words
    assert _nf4_words(_nf4_rows(3, 160, 0))[1] == 4                   # 84 bytes
    assert _nf4_words(_nf4_rows(3, 4, 0))[1] == 2                     # 6 bytes
    assert _nf4_words(_nf4_rows(3, 6, 0))[1] == 1                     # 7 bytes
    assert _nf4_words(_nf4_rows(4, 160, 0)[1:])[1] == 4               # rows from the second: offset 84
    assert _nf4_words(_nf4_rows(3, 160, 0).reshape(-1)[2:2 + 168].reshape(2, 84))[1] == 2


def test_ngram_embedding_nf4_refuses_bad_arguments():
    from ple.fast import ngram_embedding_nf4
    params, kw = tiny_hash_setup()
    tokens = torch.tensor([1, 2])
    with pytest.raises(TypeError, match="^weight: expected NF4 rows"):          # float rows: the wrong dtype
        ngram_embedding_nf4(torch.zeros(params.num_rows, 6), tokens, params, dtype=torch.float32, **kw)
    with pytest.raises(ValueError, match="^weight: expected NF4 rows"):
        ngram_embedding_nf4(torch.zeros(params.num_rows, 4, dtype=torch.uint8), tokens, params,
                            dtype=torch.float32, **kw)
    with pytest.raises(TypeError, match="^dtype: "):
        ngram_embedding_nf4(_nf4_rows(params.num_rows, 4, 0), tokens, params, dtype=torch.int32, **kw)
    with pytest.raises(ValueError, match="weight"):                   # too few rows for the hash
        ngram_embedding_nf4(_nf4_rows(10, 4, 0), tokens, params, dtype=torch.float32, **kw)


def test_the_layer_runs_an_nf4_table_through_the_fused_kernel(monkeypatch):
    """A triton layer with an NF4 table in memory hashes, gathers and unpacks in ``ngram_embedding_nf4`` (the ids
    are never looked up apart), and gives the reference layer's bits."""
    import ple.fast
    from ple.testing.layers import random_layer
    cfg = PLEConfig.preset("tiny")
    calls = []
    fused = ple.fast.ngram_embedding_nf4

    def spy(*a, **k):
        calls.append(k["dtype"])
        return fused(*a, **k)

    monkeypatch.setattr(ple.fast, "ngram_embedding_nf4", spy)
    monkeypatch.setattr(ple.fast, "embedding_lookup", None)          # the unfused path would fail
    layers = {b: random_layer(cfg, 0, torch.bfloat16, seed=3, backend=b) for b in ("reference", "triton")}
    for layer in layers.values():
        layer.ple_embedding.quantize_("nf4")
    g = _gen(4)
    h = torch.randn(2, 5, cfg.hc_hidden_size, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=g)
    with torch.no_grad():
        assert_bitwise_equal(layers["triton"](h, ids), layers["reference"](h, ids), name="NF4 layer")
    assert calls == [torch.bfloat16]
