"""The Engram family's hash (docs/spec.md section 15) on every backend: ``HashParams.token_map`` and
``HashParams.eos_rule`` False.

* An oracle of the demo's hash, written here with numpy the demo's way (the ids compressed by a table lookup,
  each shift ``np.pad`` with the mapped pad id, XOR of int64 products, ``%`` per head, the head offsets added),
  against ``ple.reference.ngram_ids`` for random ``PLEConfig.engram`` configs, with and without a token map.
* Chunked requests with their ``ngram_context`` give the whole sequence's ids.
* ``ple.vectorized`` and ``ple.fast`` (Triton; interpreted on a CPU) equal the reference bit for bit for both
  families: ``ngram_ids``, ``ngram_embedding`` forward and backward, and the fused NF4 gather.
* An EOS / pad token inside the text is an ordinary token; the checks of the family's fields; the kit draws
  the family and catches an op that ignores it; ``torch.compile(fullgraph=True)`` traces the mapped hash.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from _tier import examples
from hypothesis import given, note, settings
from hypothesis import strategies as st

import ple
from ple import PLEConfig
from ple import reference as ref
from ple.testing.numerics import assert_bitwise_equal
from ple.testing.strategies import configs, varlen_batches

BOTH = ("qwen4exp", "engram")


# ---- the oracle: the demo's hash in numpy --------------------------------------------------------------------
def demo_rows(config: PLEConfig, params: ref.HashParams, input_ids: np.ndarray) -> np.ndarray:
    """The demo's ``NgramHashMapping.hash`` plus ``MultiHeadEmbedding``'s offsets, for a batch ``[B, T]`` of
    sequences from their start: ``[B, T, NH]`` table rows."""
    lookup = (np.arange(config.vocab_size, dtype=np.int64) if config.token_map is None
              else np.asarray(config.token_map, dtype=np.int64))
    x = lookup[np.asarray(input_ids, dtype=np.int64)]                       # the compressed tokenizer
    pad = int(lookup[config.pad_id])
    B, T = x.shape
    N, P = config.ngram_size, config.heads_per_ngram
    mult = params.multipliers.numpy()
    sizes, offsets = params.head_sizes.numpy(), params.head_offsets.numpy()
    shifts = [x] + [np.pad(x, ((0, 0), (k, 0)), mode="constant", constant_values=pad)[:, :T] for k in range(1, N)]
    heads = []
    with np.errstate(over="ignore"):
        for n in range(2, N + 1):
            mix = shifts[0] * mult[0]
            for k in range(1, n):
                mix = np.bitwise_xor(mix, shifts[k] * mult[k])
            for j in range(P):
                h = (n - 2) * P + j
                heads.append(mix % int(sizes[h]) + int(offsets[h]))
    return np.stack(heads, axis=2)


@st.composite
def engram_configs(draw, *, max_vocab: int = 60, mapped: bool | None = None) -> PLEConfig:
    """Small Engram configs: N 2..4, P 1..3, a random pad, head sizes from random starts, and a token map onto
    fewer ids (``mapped``; None: half the time)."""
    V = draw(st.integers(3, max_vocab))
    N, P = draw(st.integers(2, 4)), draw(st.integers(1, 3))
    token_map = None
    if mapped or (mapped is None and draw(st.booleans())):
        V2 = draw(st.integers(1, V))
        token_map = draw(st.lists(st.integers(0, V2 - 1), min_size=V, max_size=V))
    lo = draw(st.integers(0, 30))
    return PLEConfig.engram(vocab_size=V, hidden_size=2, hc_count=1,
                            engram_vocab_size=draw(st.lists(st.integers(2, 5000), min_size=N - 1, max_size=N - 1)),
                            max_ngram_size=N, n_embed_per_ngram=P, n_head_per_ngram=P,
                            layer_ids=(lo, lo + draw(st.integers(1, 20))), pad_id=draw(st.integers(0, V - 1)),
                            seed=draw(st.integers(0, 2**31)), token_map=token_map)


def kw_of(config: PLEConfig, **more) -> dict:
    return dict(heads_per_ngram=config.heads_per_ngram, eos_token_id=config.eos_token_id, **more)


@settings(max_examples=examples(40))
@given(config=engram_configs(), L=st.integers(0, 1), data=st.data())
def test_the_reference_is_the_demos_hash(config, L, data):
    """``ple.reference.ngram_ids`` of an Engram config = the demo's numpy hash, pad-heavy sequences included."""
    params = ref.hash_params(config, L)
    assert params.eos_rule is False and (params.token_map is None) == (config.token_map is None)
    B, T = data.draw(st.integers(1, 3)), data.draw(st.integers(0, 30))
    token = st.sampled_from([config.pad_id]) | st.integers(0, config.vocab_size - 1)
    x = np.array(data.draw(st.lists(st.lists(token, min_size=T, max_size=T), min_size=B, max_size=B)),
                 dtype=np.int64).reshape(B, T)
    note(f"config={config} token_map={config.token_map} x={x.tolist()}")
    want = demo_rows(config, params, x)
    # One sequence per call, and all B at once as a varlen batch.
    for b in range(B):
        got = ref.ngram_ids(torch.from_numpy(x[b]), params, **kw_of(config))
        assert got.tolist() == want[b].tolist()
    qsl = torch.arange(B + 1) * T
    got = ref.ngram_ids(torch.from_numpy(x.reshape(-1)), params, **kw_of(config, query_start_loc=qsl))
    assert got.tolist() == want.reshape(B * T, config.num_ngram_heads).tolist()


def test_the_demo_preset_hashes_as_the_demo():
    """The ``engram-demo`` preset with a token map (V' far below V): the demo's rows, products near 2**63."""
    g = torch.Generator().manual_seed(0)
    base = PLEConfig.preset("engram-demo")
    tmap = torch.randint(0, 1000, (base.vocab_size,), generator=g)
    config = base.replace(token_map=tmap)
    x = torch.randint(0, base.vocab_size, (2, 40), generator=g)
    x[:, ::7] = config.pad_id
    for L in (0, 1):
        params = ref.hash_params(config, L)
        assert params.token_map is not None and params.token_map.dtype == torch.int64
        want = demo_rows(config, params, x.numpy())
        for b in range(2):
            for ops in (ref, ple.vectorized):
                assert ops.ngram_ids(x[b], params, **kw_of(config)).tolist() == want[b].tolist()


# ---- chunks equal the whole --------------------------------------------------------------------------------------
def _chunk_batch(seqs: list[list[int]], cuts: list[list[int]], config: PLEConfig):
    """Every sequence cut into chunks at ``cuts``, all chunks laid end to end as one batch: the tokens,
    ``query_start_loc``, ``ngram_context`` (the N-1 original tokens before each chunk, the pad before the
    sequence) and, per chunk, (its sequence, its start)."""
    ctx_len, pad = config.context_len, config.pad_id
    tokens, qsl, ctx, where = [], [0], [], []
    for s, (seq, cut) in enumerate(zip(seqs, cuts, strict=True)):
        bounds = [0, *sorted(set(c for c in cut if 0 < c < len(seq))), len(seq)]
        for a, b in zip(bounds, bounds[1:], strict=False):
            before = ([pad] * ctx_len + seq[:a])[-ctx_len:] if ctx_len else []
            tokens += seq[a:b]
            qsl.append(len(tokens))
            ctx.append(before)
            where.append((s, a))
    return (torch.tensor(tokens, dtype=torch.int64), torch.tensor(qsl),
            torch.tensor(ctx, dtype=torch.int64).reshape(len(ctx), ctx_len), where)


def _chunked(config, data, index):
    """Sequences drawn with pads inside, cut into chunks at drawn places: (params, tokens, query_start_loc,
    contexts, the ids of each chunk's tokens hashed within their whole sequence)."""
    params = ref.hash_params(config, index)
    token = st.sampled_from([config.pad_id]) | st.integers(0, config.vocab_size - 1)
    seqs = data.draw(st.lists(st.lists(token, min_size=1, max_size=20), min_size=1, max_size=3))
    cuts = [data.draw(st.lists(st.integers(0, len(s)), max_size=4)) for s in seqs]
    tokens, qsl, ctx, where = _chunk_batch(seqs, cuts, config)
    whole = [ref.ngram_ids(torch.tensor(s), params, **kw_of(config)) for s in seqs]
    want = torch.cat([whole[s][a:a + int(qsl[i + 1] - qsl[i])] for i, (s, a) in enumerate(where)])
    return params, tokens, qsl, ctx, want


@settings(max_examples=examples(25))
@given(config=engram_configs(), data=st.data())
def test_chunks_with_their_context_equal_the_whole_sequence(config, data):
    params, tokens, qsl, ctx, want = _chunked(config, data, 0)
    for ops in (ref, ple.vectorized):
        got = ops.ngram_ids(tokens, params, **kw_of(config, query_start_loc=qsl, ngram_context=ctx))
        assert torch.equal(got, want), ops.__name__


@pytest.mark.interpreter
@settings(max_examples=examples(3))
@given(config=engram_configs(mapped=True), data=st.data())
def test_triton_chunks_with_their_context_equal_the_whole_sequence(config, data):
    from ple import fast
    params, tokens, qsl, ctx, want = _chunked(config, data, 1)
    got = fast.ngram_ids(tokens, params, **kw_of(config, query_start_loc=qsl, ngram_context=ctx))
    assert torch.equal(got, want)


# ---- the backends equal the reference, both families ------------------------------------------------------------
@st.composite
def family_cases(draw, family: str, max_requests: int = 3):
    """A config of ``family`` (Engram: with a token map two times in three), one of its layers' hash parameters
    and a varlen batch heavy in the EOS / pad token; int32 or int64 index tensors, with or without contexts."""
    if family == "engram":
        config = draw(engram_configs(mapped=draw(st.sampled_from([True, True, None]))))
    else:
        config = draw(configs(max_hidden=2))
    batch = draw(varlen_batches(config, max_requests=max_requests, max_len=24))
    idt = draw(st.sampled_from([torch.int32, torch.int64]))
    kw = kw_of(config, query_start_loc=batch.query_start_loc.to(idt))
    if draw(st.booleans()):
        kw["ngram_context"] = batch.ngram_context.to(idt)
    params = ref.hash_params(config, draw(st.integers(0, 1)))
    if config.token_map is not None and draw(st.booleans()):                # an int32 map is accepted too
        params = dataclasses.replace(params, token_map=params.token_map.to(torch.int32))
    note(f"family={config.family} token_map={config.token_map} params={params}")
    return config, params, batch.input_ids.to(idt), kw


def _embedding_both(ops, weight, ids, params, kw, up):
    w = weight.detach().clone().requires_grad_(True)
    out = ops.ngram_embedding(w, ids, params, **kw)
    (g,) = torch.autograd.grad(out, w, up)
    return out.detach(), g


def _check_backend(ops, case, D: int, dtype: torch.dtype, seed: int) -> None:
    config, params, ids, kw = case
    want = ref.ngram_ids(ids, params, **kw)
    assert_bitwise_equal(ops.ngram_ids(ids, params, **kw), want, name=f"{config.family} ngram_ids")
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(params.num_rows, D, generator=g).to(dtype)
    up = torch.randint(-3, 4, (ids.numel(), want.shape[1] * D), generator=g).to(dtype)   # sums exact
    out_r, g_r = _embedding_both(ref, weight, ids, params, kw, up)
    out_b, g_b = _embedding_both(ops, weight, ids, params, kw, up)
    assert_bitwise_equal(out_b, out_r, name=f"{config.family} ngram_embedding")
    assert_bitwise_equal(g_b, g_r, name=f"{config.family} ngram_embedding weight gradient")


@pytest.mark.parametrize("family", BOTH)
@settings(max_examples=examples(40))
@given(data=st.data(), D=st.integers(1, 5), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**31 - 1))
def test_vectorized_equals_the_reference(family, data, D, dtype, seed):
    _check_backend(ple.vectorized, data.draw(family_cases(family)), D, dtype, seed)


@pytest.mark.interpreter
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("family", BOTH)
@settings(max_examples=examples(4))
@given(data=st.data(), D=st.integers(1, 5), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**31 - 1))
def test_triton_equals_the_reference(family, data, D, dtype, seed):
    from ple import fast
    _check_backend(fast, data.draw(family_cases(family)), D, dtype, seed)


@pytest.mark.interpreter
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("family", BOTH)
@settings(max_examples=examples(3))
@given(data=st.data(), D=st.sampled_from([2, 4, 6, 16]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**31 - 1))
def test_triton_nf4_fused_gather_equals_the_reference(family, data, D, dtype, seed):
    """``ple.fast.ngram_embedding_nf4`` = ``nf4_dequantize_rows(ngram_embedding(...))`` bit for bit, both families."""
    from ple.fast import ngram_embedding_nf4
    from ple.quant import nf4_pack
    config, params, ids, kw = data.draw(family_cases(family))
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (params.num_rows, D), generator=g, dtype=torch.uint8)
    weight = nf4_pack(codes, torch.randn(params.num_rows, generator=g).to(torch.float16))
    want = ref.nf4_dequantize_rows(ref.ngram_embedding(weight, ids, params, **kw), D, dtype)
    assert_bitwise_equal(ngram_embedding_nf4(weight, ids, params, dtype=dtype, **kw), want,
                         name=f"{config.family} ngram_embedding_nf4")


# ---- no EOS rule: an EOS or pad inside the text is an ordinary token ---------------------------------------------
def _pad_inside_setup():
    tmap = [v % 7 for v in range(20)]                          # 20 ids onto 7: 3 and 10 hash alike
    config = PLEConfig.engram(vocab_size=20, hidden_size=2, hc_count=1, engram_vocab_size=[10007, 10009],
                              max_ngram_size=3, n_embed_per_ngram=2, n_head_per_ngram=2, layer_ids=[1, 4],
                              pad_id=2, seed=5, token_map=tmap)
    return config, ref.hash_params(config, 0)


BACKENDS = [pytest.param("reference"), pytest.param("torch"),
            pytest.param("triton", marks=pytest.mark.interpreter)]


def _ops(backend: str):
    if backend == "triton":
        from ple import fast
        return fast
    return {"reference": ref, "torch": ple.vectorized}[backend]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pad_inside_the_text_is_an_ordinary_token(backend):
    """Engram: the token after a pad (= the EOS argument) still sees the tokens before the pad; its windows are
    the tokens k back, the pad among them; and mapped ids (3 and 10) are one token to the hash."""
    ops = _ops(backend)
    config, params = _pad_inside_setup()
    pad = config.pad_id
    kw = kw_of(config)
    a = ops.ngram_ids(torch.tensor([5, 6, pad, 9]), params, **kw)
    b = ops.ngram_ids(torch.tensor([4, 6, pad, 9]), params, **kw)
    c = ops.ngram_ids(torch.tensor([4, 13, pad, 9]), params, **kw)           # 13 maps as 6 does
    P = config.heads_per_ngram
    assert torch.equal(a[2:, :P], b[2:, :P])                               # bigrams: the same from the pad on
    assert not torch.equal(a[1, P:], b[1, P:])                             # 6's trigram reads 5 or 4
    assert torch.equal(b, c)
    # The pad's own trigram and the one after it read through it: (5, 6, pad) and (6, pad, 9).
    want = demo_rows(config, params, np.array([[5, 6, pad, 9]]))[0]
    assert a.tolist() == want.tolist()
    # The Qwen4Exp rule would cut 9's trigram at the pad: it would read (pad, pad, 9).
    cut = ops.ngram_ids(torch.tensor([9]), params, **kw)
    assert not torch.equal(a[3], cut[0])
    assert torch.equal(a[3, :P], cut[0, :P])                               # its bigram (pad, 9) is the same
    # ... which is what eos_rule=True would give, on every backend alike.
    ruled = dataclasses.replace(params, eos_rule=True)
    assert torch.equal(ops.ngram_ids(torch.tensor([5, 6, pad, 9]), ruled, **kw)[3], cut[0])
    # The windows, in the tokens' own ids.
    win = ref.hashing.ngram_windows(torch.tensor([5, 6, pad, 9]), ngram_size=3, eos_token_id=pad, eos_rule=False)
    assert win.tolist() == [[5, pad, pad], [6, 5, pad], [pad, 6, 5], [9, pad, 6]]


def test_the_boundary_token_is_mapped():
    """Positions before a sequence read ``token_map[pad]``, not ``pad``: a map that moves the pad moves the rows of
    a sequence's first tokens."""
    config, params = _pad_inside_setup()
    other = dataclasses.replace(params, token_map=params.token_map.roll(1))     # the pad 2 -> 1 (it was 2 -> 2)
    x = torch.tensor([7])
    for ops in (ref, ple.vectorized):
        mapped = ops.ngram_ids(x, params, **kw_of(config))
        assert mapped.tolist() == demo_rows(config, params, x[None].numpy())[0].tolist()
        rolled = ops.ngram_ids(x, other, **kw_of(config))
        assert rolled.tolist() == demo_rows(config.replace(token_map=other.token_map.tolist()), other,
                                            x[None].numpy())[0].tolist()


# ---- the checks of the family's fields ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change, error, words", [
    (dict(token_map=torch.zeros(20)), TypeError, "params.token_map: expected an int32 or int64 tensor"),
    (dict(token_map=torch.zeros(20, dtype=torch.int16)), TypeError, "params.token_map"),
    (dict(token_map=torch.zeros(19, dtype=torch.int64)), ValueError, r"params.token_map: expected shape \(20,\)"),
    (dict(token_map=torch.zeros(20, 1, dtype=torch.int64)), ValueError, "params.token_map: expected 1 dim"),
    (dict(token_map=torch.zeros(20, dtype=torch.int64, device="meta")), ValueError, "params.token_map: its values"),
    (dict(token_map=[0] * 20), TypeError, "params.token_map: expected a torch.Tensor"),
    (dict(eos_rule=1), TypeError, "params.eos_rule: expected a bool"),
    (dict(eos_rule=None), TypeError, "params.eos_rule"),
])
def test_bad_family_fields_are_refused(backend, change, error, words):
    ops = _ops(backend)
    config, params = _pad_inside_setup()
    bad = dataclasses.replace(params, **change)
    x = torch.tensor([1, 2, 3])
    for validate in (True, False):                     # metadata: checked either way
        with pytest.raises(error, match=words):
            ops.ngram_ids(x, bad, **kw_of(config), validate=validate)
        with pytest.raises(error, match=words):
            ops.ngram_embedding(torch.zeros(params.num_rows, 2), x, bad, **kw_of(config), validate=validate)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_negative_mapped_id_is_refused_when_validating(backend):
    ops = _ops(backend)
    config, params = _pad_inside_setup()
    tmap = params.token_map.clone()
    tmap[11] = -4
    bad = dataclasses.replace(params, token_map=tmap)
    x = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"params.token_map: expected mapped ids >= 0, got -4"):
        ops.ngram_ids(x, bad, **kw_of(config))
    with pytest.raises(ValueError, match="params.token_map"):
        ops.ngram_embedding(torch.zeros(params.num_rows, 2), x, bad, **kw_of(config))
    # validate=False skips the value checks (undefined behaviour for a bad map; this one is not read).
    assert ops.ngram_ids(x, bad, **kw_of(config), validate=False).shape == (3, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_a_map_on_another_device_than_the_ids_is_used_there():
    """Like the multipliers, the map may live elsewhere (``hash_params`` makes CPU tensors); the op copies it."""
    config, params = _pad_inside_setup()
    x = torch.tensor([5, 6, 2, 9])
    want = ref.ngram_ids(x, params, **kw_of(config))
    assert_bitwise_equal(ple.vectorized.ngram_ids(x.cuda(), params, **kw_of(config)).cpu(), want)
    assert_bitwise_equal(ple.vectorized.ngram_ids(x, params.to("cuda"), **kw_of(config)), want)


# ---- the kit draws the family ------------------------------------------------------------------------------------
def _ignoring(field: str, value):
    def ngram_ids(input_ids, params, **kw):
        return ref.ngram_ids(input_ids, dataclasses.replace(params, **{field: value}), **kw)
    return ngram_ids


# ~5 s each (Hypothesis shrinks the failure): the rule's variant and the embedding's only add depth.
@pytest.mark.parametrize("field, value, words", [
    ("token_map", None, ["ngram_ids", "engram", "token_map onto"]),
    pytest.param("eos_rule", True, ["ngram_ids", "engram", "no EOS rule"], marks=pytest.mark.deep)])
def test_the_kit_catches_an_op_that_ignores_the_family(field, value, words):
    from ple.testing import check_ngram_ids
    with pytest.raises(AssertionError) as e:
        check_ngram_ids(_ignoring(field, value), max_examples=25)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.deep
def test_the_kit_catches_an_embedding_that_ignores_the_map():
    from ple.testing import check_ngram_embedding

    def ngram_embedding(weight, input_ids, params, **kw):
        return ref.ngram_embedding(weight, input_ids, dataclasses.replace(params, token_map=None), **kw)
    with pytest.raises(AssertionError, match="(?s)ngram_embedding.*token_map onto"):
        check_ngram_embedding(ngram_embedding, max_examples=25, schemes=())


# ---- torch.compile: the mapped hash traces whole ----------------------------------------------------------------
def test_the_mapped_hash_compiles_without_a_graph_break():
    """``torch.compile(fullgraph=True)`` of ``ple.vectorized.ngram_ids`` / ``ngram_embedding`` with a token map and
    no EOS rule (``validate=False``): no tensor value is read on the host (the boundary token mapped on the
    device)."""
    config, params = _pad_inside_setup()
    x = torch.tensor([5, 6, 2, 9, 13, 2, 2, 4])
    kw = kw_of(config, query_start_loc=torch.tensor([0, 3, 8]), ngram_context=torch.tensor([[1, 2], [2, 2]]))
    weight = torch.randn(params.num_rows, 3)
    ids = torch.compile(lambda t: ple.vectorized.ngram_ids(t, params, **kw, validate=False), fullgraph=True,
                        backend="aot_eager")(x)
    assert_bitwise_equal(ids, ref.ngram_ids(x, params, **kw))
    emb = torch.compile(lambda w: ple.vectorized.ngram_embedding(w, x, params, **kw, validate=False),
                        fullgraph=True, backend="aot_eager")(weight)
    assert_bitwise_equal(emb, ref.ngram_embedding(weight, x, params, **kw))


@pytest.mark.interpreter
def test_the_fused_triton_op_compiles_with_a_map():
    """The registered ops carry the map (an optional tensor) and the rule through ``torch.compile``."""
    from ple import fast
    config, params = _pad_inside_setup()
    x = torch.tensor([5, 6, 2, 9, 13, 2, 2, 4])
    kw = kw_of(config, query_start_loc=torch.tensor([0, 3, 8]))
    weight = torch.randn(params.num_rows, 3)
    w = weight.clone().requires_grad_()
    out = torch.compile(lambda w: fast.ngram_embedding(w, x, params, **kw, validate=False), fullgraph=True,
                        backend="aot_eager")(w)
    want = ref.ngram_embedding(weight, x, params, **kw)
    assert_bitwise_equal(out.detach(), want)
    up = torch.randint(-2, 3, out.shape).float()
    out.backward(up)
    w_r = weight.clone().requires_grad_()
    ref.ngram_embedding(w_r, x, params, **kw).backward(up)
    assert_bitwise_equal(w.grad, w_r.grad)
