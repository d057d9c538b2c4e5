"""Quantized tables (``ple.quant`` math, ``ple.table.QuantizedTable``): error bounds, lookups, the layer.

NF4's bytes, unpacking and refusals are in ``tests/test_nf4.py``; the properties here cover every scheme.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from ple import PLEConfig, PLELayer
from ple.backends import triton_available
from ple.quant import SCHEMES, dequantize, dequantize_rows, error_bound, quantize, reference_lookup
from ple.reference import embedding_lookup
from ple.table import QuantizedTable, gather_raw
from ple.testing.layers import random_layer as _random_layer
from ple.testing.numerics import assert_bitwise_equal

TINY = PLEConfig.preset("tiny")
SCALED = ["fp8", "int8"]                  # the schemes with a weight_scale (NF4's scales are in its rows)


def width(D: int, scheme: str) -> int:
    """A row width the scheme takes: NF4 packs two values a byte, so its D is even."""
    return D + D % 2 if scheme == "nf4" else D


def random_layer(cfg=TINY, index=0, dtype=torch.bfloat16, seed=0) -> PLELayer:
    return _random_layer(cfg, index, dtype, seed)


def table_of(gen, rows, D, *, magnitude=1.0, dtype=torch.bfloat16):
    """A normal table with a few exact zeros, a zero row and an outlier, in ``dtype``."""
    t = torch.randn(rows, D, generator=gen) * magnitude
    t[torch.rand(rows, D, generator=gen) < 0.05] = 0.0
    if rows > 2:
        t[1] = 0.0
        t[2, 0] *= 20
    return t.to(dtype)



# ---- quantization ----------------------------------------------------------------------------------
@given(scheme=st.sampled_from(sorted(SCHEMES)), rows=st.integers(1, 40), D=st.integers(1, 17),
       log_mag=st.integers(-12, 12), out=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**31 - 1))
def test_dequantized_table_within_documented_bound(scheme, rows, D, log_mag, out, seed):
    gen = torch.Generator().manual_seed(seed)
    D = width(D, scheme)
    if scheme == "nf4":                  # its float16 scales hold rows of rms up to ~77,000 (the outlier is x20)
        log_mag = min(log_mag, 8)
    w = table_of(gen, rows, D, magnitude=2.0 ** log_mag)
    q, s = quantize(w, scheme)
    assert q.dtype == SCHEMES[scheme].dtype
    if scheme == "nf4":
        assert s is None and q.shape == (rows, D // 2 + 4)
    else:
        assert s is not None and s.dtype == torch.float32 and s.shape == ((rows, 1) if scheme == "int8" else (1,))
    err = (dequantize(q, s, out).double() - w.double()).abs()
    bound = error_bound(w, scheme, out_dtype=out).double()
    note(f"worst excess {float((err - bound).max()):.3g}")
    assert bool((err <= bound).all()), f"error {float(err.max()):.3g} past the documented bound"
    if rows > 2:
        assert torch.equal(dequantize(q, s, out)[1], torch.zeros(D, dtype=out))   # a zero row stays zero


def test_error_report(capsys):
    """Measured error of each scheme against a bfloat16 normal(0, 1) table of the real row width (D = 160).

    Dequantized to float32 the error is the quantization's own; to bfloat16 the output
    rounding (up to 2**-8 relative) comes on top.
    """
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(4096, 160, generator=gen)).to(torch.bfloat16)
    x = w.float()
    lines = []
    for scheme in ("fp8", "int8"):
        q, s = quantize(w, scheme)
        for out, extra in ((torch.float32, 1e-6), (torch.bfloat16, 2**-8)):
            err = (dequantize(q, s, out).float() - x).abs()
            if scheme == "fp8":
                normal = x.abs() >= 2**-6 * s                # values in e4m3's normal range
                rel = err[normal] / x.abs()[normal]
                assert float(rel.max()) <= 2**-4 + extra     # 3 mantissa bits: half an ulp is 2**-4
                lines.append(f"fp8 e4m3 per-tensor -> {str(out)[6:]:>8}: max rel {float(rel.max()):.4f} "
                             f"(bound 2^-4 = 0.0625), mean rel {float(rel.mean()):.4f}, "
                             f"max abs {float(err.max()):.4f}")
            else:
                ratio = err / x.abs().amax(dim=1, keepdim=True)
                assert float(ratio.max()) <= 1 / 254 + extra   # half a step of max|row| / 127
                lines.append(f"int8 per-row        -> {str(out)[6:]:>8}: max err / max|row| "
                             f"{float(ratio.max()):.5f} "
                             f"(bound 1/254 = 0.00394), mean abs {float(err.mean()):.5f}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="scheme"):
        quantize(torch.zeros(2, 2), "int4")
    with pytest.raises(ValueError, match="table"):
        quantize(torch.zeros(2, 2, dtype=torch.int8), "fp8")
    with pytest.raises(ValueError, match="scale"):
        quantize(torch.zeros(2, 2), "int8", scale=torch.ones(1))
    with pytest.raises(ValueError, match="weight_scale"):
        QuantizedTable(torch.zeros(3, 2, dtype=torch.int8), torch.ones(1))
    with pytest.raises(ValueError, match="weight"):
        QuantizedTable(torch.zeros(3, 2), torch.ones(1))


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_quantized_lookup_equals_reference(scheme, out):
    """Gathering quantized rows then dequantizing gives the bits of dequantize-whole-table-then-look-up."""
    gen = torch.Generator().manual_seed(1)
    D = width(5, scheme)
    w = table_of(gen, 97, D)
    q, s = quantize(w, scheme)
    ids = torch.randint(0, 97, (13, 6), generator=gen)
    expected = reference_lookup(q, s, ids, out)
    rows, row_scale = gather_raw(q, s, ids, embedding_lookup)
    assert rows.dtype == q.dtype
    assert_bitwise_equal(dequantize_rows(rows, row_scale, out, dim=D), expected, name="quantized lookup")


@pytest.mark.interpreter
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_fast_quantized_lookup_equals_reference(scheme):
    """The fast path: ple.fast.embedding_lookup gathers the raw quantized bytes."""
    if not triton_available():
        pytest.skip("Triton cannot run here")
    from ple.fast import embedding_lookup as fast_lookup

    gen = torch.Generator().manual_seed(2)
    D = width(7, scheme)
    w = table_of(gen, 61, D)
    q, s = quantize(w, scheme)
    ids = torch.randint(0, 61, (9, 4), generator=gen)
    rows, row_scale = gather_raw(q, s, ids, fast_lookup)
    assert_bitwise_equal(dequantize_rows(rows, row_scale, torch.bfloat16, dim=D),
                         reference_lookup(q, s, ids, torch.bfloat16), name="fast quantized lookup")


@pytest.mark.parametrize("scheme", SCALED)
def test_quantized_layer(scheme):
    """A quantized layer equals a float layer holding the dequantized table; casts keep the quantized bits."""
    layer = random_layer(seed=3)
    table = layer.ple_embedding.ngram_embedding.weight.detach().clone()
    layer.ple_embedding.quantize_(scheme)
    qt = layer.ple_embedding.ngram_embedding
    assert isinstance(qt, QuantizedTable) and qt.weight.dtype == SCHEMES[scheme].dtype
    sd = layer.state_dict()
    assert "ple_embedding.ngram_embedding.weight_scale" in sd
    assert "ple_embedding.ngram_embedding.weight" not in dict(layer.named_parameters())

    twin = random_layer(seed=3)
    with torch.no_grad():
        deq = dequantize(qt.weight, qt.weight_scale, torch.bfloat16)
        twin.ple_embedding.ngram_embedding.weight.copy_(deq)
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(2, 11, TINY.hc_hidden_size, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, TINY.vocab_size, (2, 11), generator=gen)
    with torch.no_grad():
        assert_bitwise_equal(layer(h, ids), twin(h, ids), name="quantized layer output")
        err = (dequantize(qt.weight, qt.weight_scale, torch.float32) - table.float()).abs()
        assert bool((err <= error_bound(table, scheme)).all())

    w_bits, s_bits = qt.weight.clone(), qt.weight_scale.clone()
    layer.to(torch.float32)                                         # a dtype cast leaves the table alone
    assert qt.weight.dtype == w_bits.dtype and qt.weight_scale.dtype == torch.float32
    assert_bitwise_equal(qt.weight, w_bits, name="weight")
    assert_bitwise_equal(qt.weight_scale, s_bits, name="weight_scale")
    assert layer.key_proj.weight.dtype == torch.float32

    fresh = random_layer(seed=9)
    fresh.ple_embedding.ngram_embedding = QuantizedTable.empty(qt.num_rows, qt.dim,
                                                                   scheme)
    fresh.load_state_dict(sd)
    assert_bitwise_equal(fresh.ple_embedding.ngram_embedding.weight, w_bits, name="loaded weight")
