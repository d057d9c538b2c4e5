"""`PLELayer` on whole sequences (docs/spec.md sections 4, 5, 7): checkpoint names, init, wiring, masks, autograd."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note
from hypothesis import strategies as st
from torch.func import functional_call

import ple
from ple import PLEConfig, PLELayer
from ple.backends import triton_compiled_available
from ple.reference import hash_params, ngram_ids, ple_gate

TINY = PLEConfig.preset("tiny")
# Small enough for gradcheck over every parameter, table included (12 rows of width 2).
GRAD = PLEConfig(ple_layer_ids=[1], vocab_size=20, hidden_size=3, hc_count=2, eos_token_id=1, ple_embed_dim=4,
                 ple_conv_kernel_size=3, ngram_size=3, heads_per_ngram=1, ngram_vocab_size_base=5,
                 make_ngram_vocab_size_divisible_by=4)


def randomise(layer: PLELayer, seed: int, scale: float = 0.3) -> PLELayer:
    """Non-zero norms and conv, so every path of the layer matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
        for proj in (layer.key_proj, layer.value_proj):  # keys and values of order 1
            proj.weight.div_(math.sqrt(proj.weight.shape[1]))
        for norm in (layer.norm_key, layer.norm_query, layer.norm_conv):
            norm.weight.mul_(scale)
        layer.conv1d.weight.mul_(scale)
    return layer


def token_batch(cfg: PLEConfig, B: int, L: int, seed: int) -> torch.Tensor:
    """Random tokens with EOS sprinkled in."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, L), generator=gen)
    return torch.where(torch.rand(B, L, generator=gen) < 0.2, cfg.eos_token_id, ids)


# ---- an independent composition of docs/spec.md sections 3-5 --------------------------------------------
def spec_forward(layer: PLELayer, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The layer's output in float64, from docs/spec.md's formulas (ids from the tested ``ngram_ids``)."""
    cfg = layer.config
    B, L, C = hidden.shape
    H, eps = cfg.hidden_size, cfg.rms_norm_eps
    sd = {k: v.detach().double() if v.is_floating_point() else v for k, v in layer.state_dict().items()}
    ids = ngram_ids(
        input_ids.reshape(-1),
        hash_params(cfg, layer.ple_layer_index),
        heads_per_ngram=cfg.heads_per_ngram,
        eos_token_id=cfg.eos_token_id,
        query_start_loc=torch.arange(B + 1) * L,
    )
    e = sd["ple_embedding.ngram_embedding.weight"][ids].reshape(B, L, -1)  # [B, L, E]
    key, value = e @ sd["key_proj.weight"].T, e @ sd["value_proj.weight"].T

    def norm(x, w):
        g = x.reshape(B, L, C // H, H)
        return (g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + eps)).reshape(B, L, C) * (1 + w)

    kn = norm(key, sd["norm_key.weight"]).reshape(B, L, -1, H)
    qn = norm(hidden.double(), sd["norm_query.weight"]).reshape(B, L, -1, H)
    s = (kn * qn).sum(-1) / math.sqrt(H)
    g = torch.sigmoid(torch.sign(s) * torch.sqrt(s.abs().clamp_min(1e-6)))
    gated = (g[..., None] * value[:, :, None, :]).reshape(B, L, C)
    u = norm(gated, sd["norm_conv.weight"])
    w = sd["conv1d.weight"]  # [C, 1, K]
    S = (cfg.ple_conv_kernel_size - 1) * cfg.conv_dilation
    y = F.silu(F.conv1d(F.pad(u.transpose(1, 2), (S, 0)), w, dilation=cfg.conv_dilation, groups=C)).transpose(
        1, 2
    )
    return hidden.double() + gated + y


# ---- checkpoint names -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg, index", [(TINY, 0), (PLEConfig.preset("tiny", ple_layer_ids=[7, 3]), 1), (GRAD, 0)]
)
def test_state_dict_keys_shapes_and_hash_buffers(cfg, index):
    layer = PLELayer(cfg, index)
    p = hash_params(cfg, index)
    C, H, E, K = cfg.hc_hidden_size, cfg.hidden_size, cfg.ple_embed_dim, cfg.ple_conv_kernel_size
    N, NH, D = cfg.ngram_size, cfg.num_ngram_heads, cfg.ngram_head_dim
    sd = layer.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == {
        "ple_embedding.ngram_embedding.weight": (p.num_rows, D),
        "ple_embedding.layer_multipliers": (N,),
        "ple_embedding.ngram_heads_vocab_sizes": (NH,),
        "ple_embedding.ngram_heads_offsets": (NH,),
        "key_proj.weight": (C, E),
        "value_proj.weight": (H, E),
        "norm_key.weight": (C,),
        "norm_query.weight": (C,),
        "norm_conv.weight": (C,),
        "conv1d.weight": (C, 1, K),
    }
    assert torch.equal(sd["ple_embedding.layer_multipliers"], p.multipliers)
    assert torch.equal(sd["ple_embedding.ngram_heads_vocab_sizes"], p.head_sizes)
    assert torch.equal(sd["ple_embedding.ngram_heads_offsets"], p.head_offsets)
    assert layer.config is cfg


def test_ple_index_is_the_position_in_ple_layer_ids():
    cfg = PLEConfig.preset("tiny", ple_layer_ids=[9, 4])
    second = PLELayer(cfg, 1).state_dict()["ple_embedding.layer_multipliers"]
    assert torch.equal(second, hash_params(cfg, 1).multipliers)
    assert not torch.equal(second, PLELayer(cfg, 0).state_dict()["ple_embedding.layer_multipliers"])


def test_float64_layer_keeps_int64_hash_buffers():
    layer = PLELayer(TINY, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in layer.parameters())
    assert all(b.dtype == torch.int64 for b in layer.buffers())


def test_load_state_dict_strict_round_trip():
    src = randomise(PLELayer(TINY), 1)
    dst = randomise(PLELayer(TINY), 2)
    hidden = torch.randn(2, 9, TINY.hc_hidden_size, generator=torch.Generator().manual_seed(3))
    ids = token_batch(TINY, 2, 9, 4)
    assert not torch.equal(src(hidden, ids), dst(hidden, ids))
    result = dst.load_state_dict(src.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    assert torch.equal(src(hidden, ids), dst(hidden, ids))


def test_loaded_hash_buffers_are_used():
    # The layer hashes with its buffers, so a checkpoint's multipliers take effect.
    layer = randomise(PLELayer(TINY), 5)
    hidden = torch.randn(1, 6, TINY.hc_hidden_size, generator=torch.Generator().manual_seed(6))
    ids = token_batch(TINY, 1, 6, 7)
    before = layer(hidden, ids)
    sd = layer.state_dict()
    sd["ple_embedding.layer_multipliers"] = hash_params(TINY, 1).multipliers
    layer.load_state_dict(sd, strict=True)
    assert not torch.allclose(layer(hidden, ids), before)


# ---- initial state and wiring -----------------------------------------------------------------
def test_initial_norms_and_conv_are_zero_so_output_is_hidden_plus_gated():
    layer = PLELayer(TINY)
    for name in ("norm_key", "norm_query", "norm_conv", "conv1d"):
        assert torch.count_nonzero(getattr(layer, name).weight) == 0, name
    table = layer.ple_embedding.ngram_embedding.weight.detach()
    assert abs(float(table.mean())) < 0.05 and abs(float(table.std()) - 1) < 0.05  # normal(0, 1)
    B, L, C = 2, 7, TINY.hc_hidden_size
    hidden = torch.randn(B, L, C, generator=torch.Generator().manual_seed(0))
    ids = token_batch(TINY, B, L, 1)
    out = layer(hidden, ids)
    hp = hash_params(TINY, 0)
    rows = ngram_ids(
        ids.reshape(-1),
        hp,
        heads_per_ngram=TINY.heads_per_ngram,
        eos_token_id=TINY.eos_token_id,
        query_start_loc=torch.tensor([0, L, 2 * L]),
    )
    e = table[rows].reshape(B * L, -1)
    zeros = torch.zeros(C)
    gated, _ = ple_gate(
        e @ layer.key_proj.weight.T,
        e @ layer.value_proj.weight.T,
        hidden.reshape(B * L, C),
        zeros,
        zeros,
        zeros,
        TINY.rms_norm_eps,
    )
    torch.testing.assert_close(out, hidden + gated.reshape(B, L, C), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, spec_forward(layer, hidden, ids).float(), rtol=1e-5, atol=1e-5)


@given(
    B=st.integers(1, 3),
    L=st.sampled_from([1, 2, 7, 12]),
    seed=st.integers(0, 2**31),
    cfg=st.sampled_from(
        [TINY, GRAD, PLEConfig.preset("tiny", ngram_size=2, heads_per_ngram=6, ple_conv_kernel_size=3)]
    ),
)
def test_forward_matches_spec_composition(B, L, seed, cfg):
    layer = randomise(PLELayer(cfg, dtype=torch.float64), seed)
    hidden = torch.randn(
        B, L, cfg.hc_hidden_size, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64
    )
    ids = token_batch(cfg, B, L, seed + 2)
    out = layer(hidden, ids)
    assert out.shape == hidden.shape and out.dtype == torch.float64
    torch.testing.assert_close(out, spec_forward(layer, hidden, ids), rtol=1e-9, atol=1e-9)
    # Float32 layer with the same weights.
    layer32 = randomise(PLELayer(cfg), seed)
    torch.testing.assert_close(
        layer32(hidden.float(), ids).double(),
        spec_forward(layer32, hidden.float(), ids),
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.parametrize("B, L", [(0, 4), (2, 0), (0, 0)])
def test_empty_batches(B, L):
    layer = PLELayer(TINY)
    hidden = torch.zeros(B, L, TINY.hc_hidden_size)
    ids = torch.zeros(B, L, dtype=torch.int64)
    assert layer(hidden, ids).shape == (B, L, TINY.hc_hidden_size)
    assert layer(hidden, ids, attention_mask=torch.ones(B, L, dtype=torch.bool)).shape == (
        B,
        L,
        TINY.hc_hidden_size,
    )


def test_backend_auto_picks_what_can_run():
    layer = PLELayer(TINY, backend="auto")
    assert layer.backend == ("triton" if triton_compiled_available() else "torch")
    assert PLELayer(TINY).backend == "reference"


# ---- attention_mask -----------------------------------------------------------------------------
@given(lens=st.lists(st.integers(0, 9), min_size=1, max_size=3), data=st.data(), seed=st.integers(0, 2**31))
def test_padding_does_not_change_real_tokens(lens, data, seed):
    cfg = TINY
    gen = torch.Generator().manual_seed(seed)
    layer = randomise(PLELayer(cfg), seed)
    B, C = len(lens), cfg.hc_hidden_size
    sides = [data.draw(st.sampled_from(["left", "right", "both"]), label=f"side{b}") for b in range(B)]
    L = max(lens) + data.draw(st.integers(0, 3), label="extra pad")
    if L == 0:
        L = 1
    hidden = torch.randn(B, L, C, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (B, L), generator=gen)  # pad positions hold garbage tokens
    mask = torch.zeros(B, L, dtype=torch.int64)
    real_ids = [token_batch(cfg, 1, n, seed + b)[0] for b, n in enumerate(lens)]
    spans = []
    for b, n in enumerate(lens):
        start = {"left": L - n, "right": 0, "both": (L - n) // 2}[sides[b]]
        mask[b, start : start + n] = 1
        ids[b, start : start + n] = real_ids[b]
        spans.append((start, start + n))
    mask_dtype = data.draw(st.sampled_from([torch.bool, torch.int32, torch.int64, torch.float32, torch.bfloat16]),
                           label="mask dtype")                   # non-zero keeps, as in transformers
    note(dict(lens=lens, sides=sides, L=L, mask=mask.tolist()))
    out = layer(hidden, ids, attention_mask=mask.to(mask_dtype))
    for b, (a, e) in enumerate(spans):
        if e > a:
            alone = layer(hidden[b : b + 1, a:e], ids[b : b + 1, a:e])
            torch.testing.assert_close(out[b, a:e], alone[0], rtol=1e-5, atol=1e-5)
        # Masked positions with only masked positions before them: no gated value and a zero conv.
        assert torch.equal(out[b, :a], hidden[b, :a])
    # A mask of ones changes nothing.
    assert torch.equal(
        layer(hidden, ids, attention_mask=torch.ones(B, L, dtype=mask_dtype)), layer(hidden, ids)
    )


def test_masked_tokens_hash_as_eos():
    # The token after a masked one sees EOS there: same output as an explicit EOS (mask on the real
    # tokens only, so that gating of the masked position differs but not the n-gram of its successor).
    cfg = TINY
    layer = randomise(PLELayer(cfg), 11)
    with torch.no_grad():
        layer.conv1d.weight.zero_()  # isolate the n-gram path
    hidden = torch.randn(1, 5, cfg.hc_hidden_size, generator=torch.Generator().manual_seed(12))
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    masked = layer(hidden, ids, attention_mask=torch.tensor([[1, 1, 0, 1, 1]]))
    eos = layer(hidden, torch.tensor([[10, 11, cfg.eos_token_id, 13, 14]]))
    plain = layer(hidden, ids)
    torch.testing.assert_close(masked[0, 3:], eos[0, 3:], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(masked[0, 3:], plain[0, 3:])
    assert torch.equal(masked[0, 2], hidden[0, 2])  # zero gated value, zero conv


# ---- autograd and low precision ---------------------------------------------------------------
def aligned_hidden(layer: PLELayer, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Hidden states whose every stream is +-(key + noise): the gate scores stay far from the clamp."""
    cfg = layer.config
    B, L = ids.shape
    rows = ngram_ids(
        ids.reshape(-1),
        hash_params(cfg, 0),
        heads_per_ngram=cfg.heads_per_ngram,
        eos_token_id=cfg.eos_token_id,
        query_start_loc=torch.arange(B + 1) * L,
    )
    with torch.no_grad():
        key = layer.ple_embedding.ngram_embedding.weight[rows].reshape(B * L, -1) @ layer.key_proj.weight.T
    gen = torch.Generator().manual_seed(seed)
    M, H = cfg.hc_count, cfg.hidden_size
    sign = torch.where(torch.rand(B * L, M, 1, generator=gen) < 0.5, -1.0, 1.0).double()
    noise = 0.2 * torch.randn(B * L, M, H, generator=gen, dtype=torch.float64)
    return (sign * (key.reshape(B * L, M, H) + noise)).reshape(B, L, M * H)


@pytest.mark.parametrize("seed, masked", [(0, False), (1, True), (2, False)])
def test_layer_gradcheck_hidden_and_every_parameter(seed, masked):
    cfg = GRAD
    layer = randomise(PLELayer(cfg, dtype=torch.float64), seed, scale=0.5)
    B, L = 2, 6
    ids = token_batch(cfg, B, L, seed)
    mask = None
    if masked:
        mask = torch.ones(B, L, dtype=torch.bool)
        mask[0, :2] = False
        mask[1, -1] = False
    hidden = aligned_hidden(layer, torch.where(mask, ids, cfg.eos_token_id) if masked else ids, seed)
    hidden.requires_grad_()
    names = [n for n, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_() for _, p in layer.named_parameters()]
    assert layer.ple_embedding.ngram_embedding.weight.numel() <= 32

    def f(h, *ps):
        return functional_call(layer, dict(zip(names, ps, strict=True)), (h, ids), {"attention_mask": mask})

    assert torch.autograd.gradcheck(f, (hidden, *params), eps=1e-6, atol=1e-6, rtol=1e-4)
    # Every parameter receives gradient (the table only at the rows the batch addresses).
    out = f(hidden, *params)
    grads = torch.autograd.grad(out.pow(2).sum(), (hidden, *params))
    for name, g in zip(["hidden_states", *names], grads, strict=True):
        assert g is not None and torch.count_nonzero(g) > 0, name


@given(seed=st.integers(0, 2**31), L=st.sampled_from([1, 7, 16]))
def test_layer_bfloat16_close_to_its_float64_run(seed, L):
    cfg = TINY
    layer = randomise(PLELayer(cfg, dtype=torch.bfloat16), seed)
    exact_layer = PLELayer(cfg, dtype=torch.float64)
    exact_layer.load_state_dict(layer.state_dict())  # the same (bf16-rounded) weights
    ids = token_batch(cfg, 2, L, seed)
    # Gate scores away from 0, where sign(s) sqrt|s| makes any rounding of s an O(sqrt(eps)) change.
    hidden = aligned_hidden(exact_layer, ids, seed).bfloat16()
    mask = torch.ones(2, L, dtype=torch.bool)
    mask[1, : L // 2] = False
    out = layer(hidden, ids, attention_mask=mask)
    exact = exact_layer(hidden.double(), ids, attention_mask=mask)
    assert out.dtype == torch.bfloat16
    # hidden + gated + y: terms of order 1, each through a few bf16 roundings (2^-9 relative).
    err = (out.double() - exact).abs().max().item()
    assert err <= 2**-5 * exact.abs().max().item() + 2**-6, f"max error {err:.3g}"


@pytest.mark.parametrize("backend", ["reference", "torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_sparse_table_gradient_equals_dense(backend):
    config = ple.PLEConfig.preset("tiny")
    torch.manual_seed(0)
    dense = ple.PLELayer(config, backend=backend)
    sparse = ple.PLELayer(config, backend=backend, sparse_table_grad=True)
    sparse.load_state_dict(dense.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 9))
    ids[:, 4] = config.eos_token_id                     # repeated windows: repeated rows must add up
    x = torch.randn(2, 9, config.hc_hidden_size)
    for layer in (dense, sparse):
        layer(x, torch.cat([ids[:, :5], ids[:, :4]], dim=1)).square().sum().backward()
    g_dense = dense.ple_embedding.ngram_embedding.weight.grad
    g_sparse = sparse.ple_embedding.ngram_embedding.weight.grad
    assert g_sparse.is_sparse and not g_dense.is_sparse
    assert g_sparse._nnz() == 2 * 9 * config.num_ngram_heads        # only the rows looked up
    torch.testing.assert_close(g_sparse.to_dense(), g_dense, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(dense.named_parameters(), sparse.parameters()):
        if "ngram_embedding" not in name:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)
    opt = torch.optim.SparseAdam([sparse.ple_embedding.ngram_embedding.weight], lr=0.1)
    before = sparse.ple_embedding.ngram_embedding.weight.detach().clone()
    opt.step()
    changed = (sparse.ple_embedding.ngram_embedding.weight != before).any(dim=1)
    assert changed.any()
    assert set(changed.nonzero().flatten().tolist()) <= set(g_sparse.coalesce().indices()[0].tolist())


def test_auto_backend_follows_the_weights_device():
    layer = PLELayer(PLEConfig.preset("tiny"), backend="auto")
    assert layer.backend == "torch"              # CPU weights: the torch backend, even where CUDA exists
    assert layer.ops is ple.vectorized
