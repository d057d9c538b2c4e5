"""``ple.fast`` n-gram ids, fused n-gram embedding, lookup and gate against ``ple.reference``.

Every test runs Triton kernels (compiled on a GPU, under ``TRITON_INTERPRET=1`` on the
CPU), so shapes are small. Hypothesis draws sizes, cuts, dtypes and a seed; tensor
values come from a seeded ``torch.Generator`` and ``note()`` records the case. Fresh
buffers are poisoned (``torch.empty`` fills NaN, or -7 for integers) so an output
element a kernel never writes shows up as a mismatch.

* ``ngram_ids``: equal to the reference exactly (N 2..5, P 1..4, EOS-heavy streams,
  varlen cuts with empty requests, contexts, int32/int64 index tensors, strided ids).
* ``ngram_embedding`` (fused hash + gather): equal bit for bit to
  ``embedding_lookup(weight, ngram_ids(...))``; its table gradient equals the lookup's.
* ``embedding_lookup``: forward bit for bit; backward with repeated ids equal bit for
  bit on integer-valued gradients, and within tolerance on random ones.
* ``ple_gate``: forward and all six gradients against the reference (float32 within
  ``ple.testing.numerics`` tolerances, bfloat16 judged against a float64 reference run),
  rows crafted so the score is exactly 0, and ``gradcheck`` in float64.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st

from ple import PLEConfig
from ple import reference as ref
from ple.fast import embedding_lookup as fast_lookup  # public ops: torch.library custom ops
from ple.fast import ngram_embedding
from ple.fast import ngram_ids as fast_ngram_ids
from ple.fast import ple_gate as fast_gate
from ple.testing.numerics import assert_bitwise_equal, assert_close

pytestmark = pytest.mark.interpreter

INDEX_DTYPES = (torch.int32, torch.int64)


# ---- NaN poison -------------------------------------------------------------------------------------
_real_empty, _real_empty_like = torch.empty, torch.empty_like


def _poison(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype in INDEX_DTYPES:
            t.fill_(-7)
    return t


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """Fresh buffers hold NaN (floats) or -7 (ints): an element no kernel writes is caught."""
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(_real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(_real_empty_like(*a, **k)))
    assert torch.isnan(torch.empty(2)).all()


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
    ids_dtype, qsl_dtype, ctx_dtype = (draw(st.sampled_from(INDEX_DTYPES)) for _ in range(3))
    strided = draw(st.booleans())
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    input_ids = torch.tensor(tokens, dtype=ids_dtype)
    if strided:                                           # a stride-2 view of a larger buffer
        buf = torch.full((2 * len(tokens),), V + 5, dtype=ids_dtype)
        buf[::2] = input_ids
        input_ids = buf[::2]
    kwargs = dict(heads_per_ngram=P, eos_token_id=eos)
    if varlen:                                            # strided: every other entry of a larger buffer
        qsl = torch.tensor(starts, dtype=qsl_dtype)
        kwargs["query_start_loc"] = torch.stack([qsl, qsl + 1000], 1)[:, 0] if strided else qsl
    if ctx is not None:
        context = torch.tensor(ctx, dtype=ctx_dtype).reshape(R, N - 1)
        kwargs["ngram_context"] = torch.cat([context, context], 1)[:, ::2] if strided else context
    note(f"N={N} P={P} V={V} eos={eos} lens={lens} tokens={tokens} ctx={ctx} layer={layer} "
         f"dtypes={ids_dtype, qsl_dtype, ctx_dtype} strided={strided}")
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
    params, kw = _hash_setup()
    tokens = torch.tensor([5, 1, 7, 7, 3, 0, 2, 9, 4, 1, 8, 6], dtype=dtype)
    strided_tokens = torch.stack([tokens, tokens + 500], 1)[:, 0]                 # stride 2
    qsl = torch.tensor([0, 50, 2, 60, 2, 70, 7, 80, 12, 90], dtype=dtype)[::2]     # [0, 2, 2, 7, 12], stride 2
    ctx = torch.arange(24, dtype=dtype).reshape(4, 6)[:, 1:5:2] % 10                # [4, 2], strides (6, 2)
    table = torch.randn(params.num_rows, 2, generator=_gen(0))
    for k in ({}, dict(ngram_context=ctx)):
        want = ref.ngram_ids(tokens, params, query_start_loc=qsl.contiguous(), **kw,
                             **{n: v.contiguous() for n, v in k.items()})
        assert torch.equal(fast_ngram_ids(strided_tokens, params, query_start_loc=qsl, **kw, **k), want)
        emb = ngram_embedding(table, strided_tokens, params, query_start_loc=qsl, **kw, **k)
        assert torch.equal(emb, ref.embedding_lookup(table, want))


def test_ngram_ids_no_requests():
    """``query_start_loc = [0]``: no requests, no tokens."""
    params, kw = _hash_setup()
    for dt in INDEX_DTYPES:
        args = (torch.zeros(0, dtype=dt), params)
        kw.update(query_start_loc=torch.zeros(1, dtype=dt), ngram_context=torch.zeros(0, 2, dtype=dt))
        out = fast_ngram_ids(*args, **kw)
        assert out.shape == (0, params.head_sizes.numel()) and out.dtype == torch.int64
        assert torch.equal(out, ref.ngram_ids(*args, **kw))


def test_ngram_ids_spec_example():
    """SPEC section 3's example: eos 99, tokens [4, 5, 99, 6], N 3 (windows checked via the reference)."""
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


# ---- embedding lookup -------------------------------------------------------------------------------
@given(rows=st.integers(1, 9), T=st.integers(0, 11), NH=st.integers(1, 4), D=st.integers(1, 9),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
       ids_dtype=st.sampled_from(INDEX_DTYPES), strided=st.booleans(),  # others: TypeError (test_errors)
       seed=st.integers(0, 2**31 - 1))
def test_embedding_lookup_fwd_bwd(rows, T, NH, D, dtype, ids_dtype, strided, seed):
    note(f"rows={rows} T={T} NH={NH} D={D} {dtype} {ids_dtype} strided={strided} seed={seed}")
    g = _gen(seed)
    weight = torch.randn(rows, D, generator=g).to(dtype)
    ids = torch.randint(0, rows, (T, NH), generator=g).to(ids_dtype)       # rows < T*NH: repeats
    if strided:
        ids = ids.t().contiguous().t()                                      # column-major view
    w_ref, w_fast = weight.clone().requires_grad_(), weight.clone().requires_grad_()
    expected, actual = ref.embedding_lookup(w_ref, ids), fast_lookup(w_fast, ids)
    assert_bitwise_equal(actual.detach(), expected.detach(), name="lookup")
    # Integer-valued gradients: every accumulation order gives the same sums.
    grad = torch.randint(-4, 5, expected.shape, generator=g).to(dtype)
    (g_exp,) = torch.autograd.grad(expected, w_ref, grad, retain_graph=True)
    (g_act,) = torch.autograd.grad(actual, w_fast, grad, retain_graph=True)
    assert_bitwise_equal(g_act, g_exp, name="lookup grad (integer-valued)")
    # Random gradients: within tolerance (bfloat16 judged against a float64 run).
    grad = torch.randn(expected.shape, generator=g).to(dtype)
    (g_exp,) = torch.autograd.grad(expected, w_ref, grad)
    (g_act,) = torch.autograd.grad(actual, w_fast, grad)
    w64 = weight.double().requires_grad_()
    (g_64,) = torch.autograd.grad(ref.embedding_lookup(w64, ids), w64, grad.double())
    assert_close(g_act, g_exp, exact64=g_64, name="lookup grad")


# ---- gate -------------------------------------------------------------------------------------------
GATE_INPUTS = ("key", "value", "hidden_states", "norm_key_weight", "norm_query_weight", "norm_conv_weight")


def _gate_inputs(T, M, H, dtype, seed, *, zero_rows=0, strided=False):
    """Random gate inputs (float32 values cast to ``dtype``); some groups zeroed so ``s == 0`` exactly."""
    g = _gen(seed)
    C = M * H
    key = torch.randn(T, C, generator=g) * 2
    value = torch.randn(T, H, generator=g)
    hidden = torch.randn(T, C, generator=g)
    weights = [0.5 * torch.randn(C, generator=g) for _ in range(3)]
    for _ in range(zero_rows):
        t, m, which = (int(torch.randint(0, n, (1,), generator=g)) for n in (T, M, 3))
        if which == 0:
            key[t, m * H:(m + 1) * H] = 0
        elif which == 1:
            hidden[t, m * H:(m + 1) * H] = 0
        else:
            value[t] = 0
    tensors = [x.to(dtype) for x in (key, value, hidden, *weights)]
    if strided:   # column-major key and hidden, weights as a stride-2 view
        tensors[0] = tensors[0].t().contiguous().t()
        tensors[2] = tensors[2].t().contiguous().t()
        tensors[3] = torch.stack([tensors[3], tensors[3]], 1)[:, 0]
    return tensors


def _run_gate(fn, tensors, grads, eps):
    leaves = [t.detach().requires_grad_() for t in tensors]      # same storage and strides
    outs = fn(*leaves, eps)
    ins = torch.autograd.grad(outs, leaves, grads)
    return [o.detach() for o in outs], list(ins)


def _check_gate(tensors, seed, eps=1e-6):
    dt = tensors[0].dtype
    T, C = tensors[0].shape
    g = _gen(seed + 7)
    grads = [torch.randn(T, C, generator=g).to(dt) for _ in range(2)]
    exp_out, exp_in = _run_gate(ref.ple_gate, tensors, grads, eps)
    act_out, act_in = _run_gate(fast_gate, tensors, grads, eps)
    e64_out, e64_in = [None] * 2, [None] * 6
    if dt != torch.float64:
        e64_out, e64_in = _run_gate(ref.ple_gate, [t.double() for t in tensors], [x.double() for x in grads],
                                    eps)
    for name, a, e, x in zip(("gated", "conv_input"), act_out, exp_out, e64_out, strict=True):
        assert_close(a, e, exact64=x, name=name)
    for name, a, e, x in zip(GATE_INPUTS, act_in, exp_in, e64_in, strict=True):
        assert_close(a, e, exact64=x, name=f"grad {name}")


@given(T=st.integers(1, 5), M=st.integers(1, 4), H=st.sampled_from([1, 3, 5, 8, 24]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       zero_rows=st.integers(0, 2),
       strided=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_ple_gate_fwd_bwd(T, M, H, dtype, zero_rows, strided, seed):
    note(f"T={T} M={M} H={H} {dtype} zero_rows={zero_rows} strided={strided} seed={seed}")
    tensors = _gate_inputs(T, M, H, dtype, seed, zero_rows=zero_rows, strided=strided)
    if dtype != torch.float64:
        # H = 1: the conv norm's backward is a cancellation (1 - xh^2 with xh = +-1 nearly),
        # amplified by r_x ~ 1/|x|; reference and kernel differ by ~1e-7 r_x. Left to float64.
        assume(H > 1)
        # Where 0 < |s| << 1 the gate's slope ~ 1/sqrt|s| amplifies the rounding of s, and the
        # low-precision reference itself is off by far more than the tolerance (seen in float32:
        # s = 9e-5 put the reference's key gradient 8e-5 from float64, the kernel's 5e-6).
        # Such draws are left to float64 here, test_ple_gate_zero_score and gradcheck.
        s = _scores(tensors, H)
        assume(bool(((s == 0) | (s.abs() > 0.05)).all()))
    _check_gate(tensors, seed)


def _scores(tensors, H, eps=1e-6):
    """``s[t, m]`` in float64."""
    key, _, hidden, wk, wq, _ = (t.double() for t in tensors)
    kn = ref.grouped_rms_norm(key, wk, H, eps).unflatten(1, (-1, H))
    qn = ref.grouped_rms_norm(hidden, wq, H, eps).unflatten(1, (-1, H))
    return (kn * qn).sum(-1) / H**0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ple_gate_zero_score(dtype):
    """Zero key / hidden groups give s = 0 exactly: g = 1/2 and no gradient through the score."""
    T, M, H = 3, 2, 5
    key, value, hidden, wk, wq, wc = _gate_inputs(T, M, H, dtype, 11)
    key[0, :H] = 0          # token 0, stream 0: zero key
    hidden[1, H:] = 0       # token 1, stream 1: zero hidden
    value[2] = 0            # token 2: zero value (conv norm of zeros)
    tensors = [key, value, hidden, wk, wq, wc]
    gated, _ = fast_gate(*tensors, 1e-6)
    assert torch.equal(gated[0, :H], 0.5 * value[0])
    assert torch.equal(gated[1, H:], 0.5 * value[1])
    _check_gate(tensors, 11)
    # The key of the zero-score group gets no gradient from the gate (torch autograd gives 0 as well).
    _, grads = _run_gate(fast_gate, tensors, [torch.ones(T, M * H, dtype=dtype)] * 2, 1e-6)
    assert torch.equal(grads[0][0, :H], torch.zeros(H, dtype=dtype))
    assert torch.equal(grads[2][1, H:], torch.zeros(H, dtype=dtype))


def test_ple_gate_gradcheck_float64():
    tensors = [t.requires_grad_() for t in _gate_inputs(2, 2, 3, torch.float64, 5)]
    assert torch.autograd.gradcheck(lambda *x: fast_gate(*x, 1e-6), tensors, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_ple_gate_empty_batch():
    tensors = [t.requires_grad_() for t in _gate_inputs(0, 2, 3, torch.float32, 0)]
    gated, conv_input = fast_gate(*tensors, 1e-6)
    assert gated.shape == conv_input.shape == (0, 6)
    grads = torch.autograd.grad((gated.sum() + conv_input.sum(),), tensors)
    assert torch.equal(grads[3], torch.zeros(6))


# ---- errors -----------------------------------------------------------------------------------------
def _hash_setup():
    config = PLEConfig.preset("tiny")
    return ref.hash_params(config, 0), dict(heads_per_ngram=config.heads_per_ngram,
                                            eos_token_id=config.eos_token_id)


def _bad_calls():
    params, kw = _hash_setup()
    ids = torch.tensor([1, 2, 3])
    gate = _gate_inputs(2, 2, 3, torch.float32, 0)
    yield "float input_ids", "ngram_ids", (ids.float(), params), kw
    yield "token out of range", "ngram_ids", (torch.tensor([1, 5000]), params), kw
    yield "query_start_loc end", "ngram_ids", (ids, params), {**kw, "query_start_loc": torch.tensor([0, 2])}
    yield "context shape", "ngram_ids", (ids, params), {**kw, "ngram_context": torch.zeros(1, 5).long()}
    yield "heads_per_ngram", "ngram_ids", (ids, params), {**kw, "heads_per_ngram": 2}
    yield "row out of range", "embedding_lookup", (torch.zeros(4, 2), torch.tensor([[0, 4]])), {}
    yield "float ids", "embedding_lookup", (torch.zeros(4, 2), torch.zeros(1, 2)), {}
    yield "value dtype", "ple_gate", (gate[0], gate[1].double(), *gate[2:], 1e-6), {}
    yield "value shape", "ple_gate", (gate[0], torch.zeros(2, 4), *gate[2:], 1e-6), {}
    yield "eps", "ple_gate", (*gate, 0.0), {}


FAST = {"ngram_ids": fast_ngram_ids, "embedding_lookup": fast_lookup, "ple_gate": fast_gate}


@pytest.mark.parametrize("case", list(_bad_calls()), ids=lambda c: c[0])
def test_errors_match_reference(case):
    _, op, args, kwargs = case
    with pytest.raises((ValueError, TypeError)) as expected:
        getattr(ref, op)(*args, **kwargs)
    with pytest.raises(expected.type) as actual:
        FAST[op](*args, **kwargs)
    assert str(actual.value) == str(expected.value)


def test_ngram_embedding_table_too_small():
    params, kw = _hash_setup()
    with pytest.raises(ValueError, match="weight"):
        ngram_embedding(torch.zeros(10, 2), torch.tensor([1, 2]), params, **kw)
