"""NF4 tables (docs/spec.md section 13): the bytes of every row, built here from the section's text alone; lookups
on every backend and the layer against the dequantized table, bit for bit; the error; what refuses NF4 for now.

The builder below (`spec_row_bytes`) is plain Python: float32 and float16 roundings through ``struct``, sums by
``math.fsum``, no ``ple.quant``. It follows the section's words: the row in float32; ``rms = max(sqrt(mean(w*w)),
1e-12)`` (the float32 squares' mean, rounded once to float32); for each factor in order the candidate scale
``float16(rms * factor)`` read back as float32, each value's code the first of the 15 midpoints ``>= w / scale``,
the error the sum of ``(level[code] * scale - w)^2``; the smallest error, the earlier on a tie; then the codes
two a byte (low nibble first), the scale as a little-endian float16, two zero bytes.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import struct

import pytest
import torch
from _helpers import unpacker_calls
from _tier import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import ple.io
from ple import PLEConfig, PLELayer
from ple.distributed import join_table_lookup, shard_table_
from ple.quant import SCHEMES, dequantize, dequantize_rows, error_bound, gather_raw, nf4_pack, nf4_unpack, quantize
from ple.reference import embedding_lookup, nf4_dequantize_rows
from ple.table import QuantizedTable
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

TINY = PLEConfig.preset("tiny")
BACKENDS = ["reference", "torch", pytest.param("triton", marks=pytest.mark.interpreter)]
OUT_DTYPES = [torch.float32, torch.bfloat16]

# ---- the section's text, in plain Python -----------------------------------------------------------------
SPEC_LEVELS = (-2.7326, -2.0690, -1.6181, -1.2562, -0.9424, -0.6568, -0.3881, -0.1284,
               0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326)
SPEC_FACTORS = (0.85, 0.90, 0.95, 1.00, 1.05, 1.10, 1.15)


def f32(v: float) -> float:
    """``v`` rounded to float32 (to nearest even); past the range, an infinity."""
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def f16(v: float) -> float:
    """``v`` rounded to float16 (to nearest even); past the range, an infinity."""
    try:
        return struct.unpack("<e", struct.pack("<e", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def ieee_div(a: float, b: float) -> float:
    """``a / b`` as IEEE 754 divides (Python raises on a zero divisor)."""
    if b == 0:
        if a == 0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
    return a / b


LEVELS = [f32(v) for v in SPEC_LEVELS]
MIDPOINTS = [f32(LEVELS[i] + LEVELS[i + 1]) / 2 for i in range(15)]     # a float32 sum, halved (exact)


def spec_code(q: float) -> int:
    """The index of the first midpoint ``>= q`` (15 if none is, NaN included)."""
    for i, m in enumerate(MIDPOINTS):
        if m >= q:
            return i
    return 15


def spec_candidates(row: list[float]) -> list[tuple[float, float, list[int]]]:
    """``(error, scale, codes)`` of each factor in order, for one row of float32 values."""
    D = len(row)
    rms = max(f32(math.sqrt(f32(math.fsum(f32(v * v) for v in row) / D))), f32(1e-12))
    out = []
    for factor in SPEC_FACTORS:
        scale = f16(f32(rms * f32(factor)))
        codes = [spec_code(f32(ieee_div(v, scale))) for v in row]
        diffs = [f32(f32(LEVELS[c] * scale) - v) for c, v in zip(codes, row, strict=True)]
        out.append((math.fsum(f32(d * d) for d in diffs), scale, codes))
    return out


def spec_row_bytes(row: list[float]) -> bytes | None:
    """A row's NF4 bytes by the section's text; None where its scale would overflow float16."""
    best = None
    for cand in spec_candidates(row):
        if best is None or cand[0] < best[0]:                  # strictly smaller: the earlier wins a tie
            best = cand
    assert best is not None
    _, scale, codes = best
    if math.isinf(scale):
        return None
    packed = bytes(codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(len(codes) // 2))
    return packed + struct.pack("<e", scale) + b"\x00\x00"


def spec_table_bytes(table: torch.Tensor) -> list[bytes | None]:
    return [spec_row_bytes(r) for r in table.float().tolist()]


def spec_dequantize(weight: torch.Tensor) -> torch.Tensor:
    """The float32 values of NF4 rows by the section's text: ``level[code] * float(scale)`` in float32."""
    rows = []
    for raw in weight.tolist():
        half = len(raw) - 4
        scale = struct.unpack("<e", bytes(raw[half:half + 2]))[0]
        codes = [c for b in raw[:half] for c in (b & 15, b >> 4)]
        rows.append([f32(LEVELS[c] * scale) for c in codes])
    return torch.tensor(rows, dtype=torch.float32).reshape(weight.shape[0], 2 * (weight.shape[1] - 4))


def assert_spec_bytes(weight: torch.Tensor, table: torch.Tensor) -> None:
    expected = spec_table_bytes(table)
    assert weight.dtype == torch.uint8 and weight.shape == (table.shape[0], table.shape[1] // 2 + 4)
    for r, (got, want) in enumerate(zip(weight.tolist(), expected, strict=True)):
        assert want is not None, f"row {r}: the spec's scale overflows, yet ple quantized it"
        assert bytes(got) == want, f"row {r}: got {bytes(got).hex()}, the spec gives {want.hex()}"


# ---- (a) the bytes --------------------------------------------------------------------------------------
def test_quantize_gives_the_spec_bytes_for_every_row_of_a_layer():
    layer = random_layer(TINY, 0, torch.bfloat16, seed=5)
    table = layer.table.weight.detach().clone()
    layer.ple_embedding.quantize_("nf4")
    assert isinstance(layer.table, QuantizedTable) and layer.table.scheme is SCHEMES["nf4"]
    assert layer.table.dim == TINY.ngram_head_dim and layer.table.num_rows == table.shape[0]
    assert "ple_embedding.ngram_embedding.weight_scale" not in layer.state_dict()
    assert_spec_bytes(layer.table.weight, table)
    again = PLELayer(TINY, 0, dtype=torch.bfloat16, table=QuantizedTable.from_float(table, "nf4"))
    assert torch.equal(again.table.weight, layer.table.weight)


# A row whose two candidates 0.85 (scale 2**-24, codes 13) and 1.05 (scale 2**-23, codes 10) have equal errors:
# y = 1.46585 lies halfway between 1.6181 and 2 * 0.6568 (exactly, in float32), so each value is as far from
# level 13 at the first scale as from level 10 at the second. The earlier (0.85) must win.
TIE = 1.4658499956130981 * 2.0**-24
# A row whose mean square (0x1.8ee92ep-3) has a square root that torch's float32 sqrt on the CPU rounds the wrong
# way (0x1.c3ee8cp-2; correctly rounded: 0x1.c3ee8ap-2), which moves the 1.10 candidate's float16 scale.
SQRT_ROW = [float.fromhex("0x1.f94p-5"), float.fromhex("0x1.3ep-1")]


def special_rows(D: int) -> list[list[float]]:
    """Rows at the edges of the rule, each of D values (D even)."""
    g = torch.Generator().manual_seed(D)
    normal = torch.randn(D, generator=g).tolist()
    spike = [0.0] * D
    spike[D // 2] = 3.0
    rows = [
        [0.0] * D,                                           # zero row: every scale is 0, codes 15
        [-0.0] * D,
        [1.0] * D,                                           # constant
        [(-1.0) ** i * 0.5 for i in range(D)],
        spike,                                               # one spike among zeros
        [v * 1e-7 for v in normal],                          # scales in float16's subnormals
        [v * 3e-8 for v in normal],                          # scales round to 0 or the smallest subnormal
        [v * 1e-30 for v in normal],                         # every scale 0
        [v * 1e-40 for v in normal],                         # float32 subnormal values
        [v * 5.0e4 for v in normal],                         # large: a few candidates overflow float16
        [7.6e4 * (-1.0) ** i for i in range(D)],             # rms 76,000: only 0.85 stays finite
        [v * 1e3 for v in normal],
        [TIE] * D,                                           # a tie between distinct scales
        [TIE * (-1.0) ** i for i in range(D)],
        [m * 2.0**-3 for m in (MIDPOINTS * D)[:D]],          # values on midpoints of a power-of-two scale
        SQRT_ROW * (D // 2),                                 # a correctly rounded sqrt: torch's float32 one is not
    ]
    return rows


@pytest.mark.parametrize("D", [2, 4, 6, 160])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_gives_the_spec_bytes_at_the_edges(D, dtype):
    g = torch.Generator().manual_seed(D + 1)
    rows = special_rows(D)
    if dtype != torch.float32:                             # (some overflow float16)
        rows = rows[:8] + rows[-1:]
    table = torch.cat([torch.tensor(rows, dtype=torch.float32), torch.randn(40, D, generator=g) * 2.0],
                      dim=0).to(dtype)
    weight, scale = quantize(table, "nf4")
    assert scale is None
    assert_spec_bytes(weight, table)


@settings(max_examples=examples(15))
@given(rows=st.integers(1, 12), half=st.integers(1, 12), log_mag=st.integers(-30, 14),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**31 - 1))
def test_quantize_gives_the_spec_bytes_for_random_tables(rows, half, log_mag, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(rows, 2 * half, generator=g) * 2.0**log_mag
    table[torch.rand(rows, 2 * half, generator=g) < 0.1] = 0.0
    table = table.to(dtype)
    assert_spec_bytes(quantize(table, "nf4")[0], table)


def test_the_tie_row_is_a_tie_and_the_earlier_candidate_wins():
    """The tie row is one indeed (so the byte tests above see which candidate a tie keeps)."""
    cands = spec_candidates([f32(TIE)] * 2)
    best = min(e for e, _, _ in cands)
    tied = {s for e, s, _ in cands if e == best}
    assert len(tied) == 2 and cands[0][0] == best
    weight, _ = quantize(torch.full((1, 2), TIE), "nf4")
    assert nf4_unpack(weight)[1].item() == 2.0**-24                       # 0.85's scale, not 1.05's (2**-23)


def test_zero_rows_and_the_byte_layout():
    weight, _ = quantize(torch.zeros(2, 6), "nf4")
    assert weight.tolist() == [[0xFF, 0xFF, 0xFF, 0, 0, 0, 0]] * 2        # codes 15, scale +0, padding
    # scale 1.0 (float16 0x3C00: little-endian 00 3C); codes (value 2i low nibble): 15,0 / 8,7 / 1,14
    codes = torch.tensor([[15, 0, 8, 7, 1, 14]], dtype=torch.uint8)
    packed = nf4_pack(codes, torch.tensor([1.0], dtype=torch.float16))
    assert packed.tolist() == [[0x0F, 0x78, 0xE1, 0x00, 0x3C, 0, 0]]
    back_codes, back_scale = nf4_unpack(packed)
    assert torch.equal(back_codes, codes) and back_scale.tolist() == [1.0]
    values = spec_dequantize(packed)
    assert values.tolist() == [[f32(SPEC_LEVELS[c]) for c in (15, 0, 8, 7, 1, 14)]]


def test_what_nf4_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="^table: .*even"):
        quantize(torch.randn(3, 5), "nf4")
    with pytest.raises(ValueError, match="^table: .*even"):
        quantize(torch.randn(3, 0), "nf4")
    with pytest.raises(ValueError, match="^table: .*even"):
        error_bound(torch.randn(3, 5), "nf4")
    with pytest.raises(ValueError, match="^dim: "):
        QuantizedTable.empty(10, 5, "nf4")
    with pytest.raises(ValueError, match="^table: .*NaN"):
        quantize(torch.tensor([[1.0, float("nan")]]), "nf4")
    with pytest.raises(ValueError, match="^table: .*inf"):
        quantize(torch.tensor([[1.0, float("inf")]]), "nf4")
    huge = [[8e4, -8e4]]                                   # rms 80,000: 0.85 * rms is past float16
    assert spec_row_bytes([f32(v) for v in huge[0]]) is None
    with pytest.raises(ValueError, match="^table: row 1's NF4 scale overflows"):
        quantize(torch.tensor([[1.0, 2.0]] + huge), "nf4")
    with pytest.raises(ValueError, match="^scale: "):
        quantize(torch.randn(2, 4), "nf4", scale=torch.ones(1))
    with pytest.raises(ValueError, match="^weight_scale: "):
        QuantizedTable(torch.zeros(3, 6, dtype=torch.uint8), torch.ones(3, 1))
    with pytest.raises(ValueError, match="^weight: "):
        QuantizedTable(torch.zeros(3, 4, dtype=torch.uint8))               # a row of D/2 + 4 bytes, D >= 2
    with pytest.raises(ValueError, match="^weight_scale: "):
        dequantize(torch.zeros(3, 6, dtype=torch.uint8), torch.ones(3, 1), torch.float32)
    with pytest.raises(ValueError, match="^dim: "):
        dequantize_rows(torch.zeros(3, 6, dtype=torch.uint8), None, torch.float32)
    with pytest.raises(ValueError, match="^rows: "):
        dequantize_rows(torch.zeros(3, 7, dtype=torch.uint8), None, torch.float32, dim=4)
    with pytest.raises(ValueError, match="^dim: "):
        nf4_dequantize_rows(torch.zeros(3, 6, dtype=torch.uint8), 3, torch.float32)
    with pytest.raises(ValueError, match="^codes: "):
        nf4_pack(torch.full((1, 2), 16, dtype=torch.uint8), torch.ones(1, dtype=torch.float16))
    with pytest.raises(ValueError, match="^scale: "):
        nf4_pack(torch.zeros(1, 2, dtype=torch.uint8), torch.ones(1))


# ---- (b) lookups ----------------------------------------------------------------------------------------
def random_rows(n: int, D: int, seed: int) -> torch.Tensor:
    """NF4 rows of random codes and random finite float16 scales (subnormal, zero, negative and huge ones too)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, D), generator=g, dtype=torch.uint8)
    scale = (torch.randn(n, generator=g) * 2.0 ** torch.randint(-26, 16, (n,), generator=g)).to(torch.float16)
    scale[:4] = torch.tensor([0.0, -0.0, 2.0**-24, 65504.0])
    return nf4_pack(codes, scale)


@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16, torch.float16])
def test_the_two_unpackers_and_the_spec_agree_bit_for_bit(out):
    """``ple.reference.nf4_dequantize_rows`` (readable) and ``ple.quant``'s (vectorised) against the spec's text."""
    D = 10
    rows = random_rows(600, D, seed=7)
    definition = spec_dequantize(rows).to(out)
    assert_bitwise_equal(dequantize(rows, None, out), definition, name="ple.quant.dequantize")
    gathered = rows.reshape(100, 6 * (D // 2 + 4))                     # T = 100 tokens of NH = 6 rows
    want = definition.reshape(100, 6 * D)
    assert_bitwise_equal(dequantize_rows(gathered, None, out, dim=D), want, name="ple.quant.dequantize_rows")
    assert_bitwise_equal(nf4_dequantize_rows(gathered, D, out), want, name="ple.reference.nf4_dequantize_rows")
    empty = rows[:0].reshape(0, 6 * (D // 2 + 4))
    assert nf4_dequantize_rows(empty, D, out).shape == dequantize_rows(empty, None, out, dim=D).shape == (0, 6 * D)


def nf4_layer(backend: str, dtype: torch.dtype, seed: int = 11):
    layer = random_layer(TINY, 0, dtype, seed=seed, backend=backend)
    layer.ple_embedding.quantize_("nf4")
    return layer


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("out", OUT_DTYPES)
def test_lookups_equal_the_dequantized_table(backend, out):
    layer = nf4_layer(backend, torch.float32)
    definition = spec_dequantize(layer.table.weight).to(out)              # the whole table, by the spec
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, layer.table.num_rows, (9, TINY.num_ngram_heads), generator=g)
    want = definition[ids].reshape(9, -1)
    assert_bitwise_equal(layer.embed(ids, out), want, name=f"{backend} NF4 rows")
    rows, scale = gather_raw(layer.table.weight, None, ids, embedding_lookup)
    assert scale is None and rows.dtype == torch.uint8 and rows.shape == (9, TINY.num_ngram_heads * 6)
    layer.table.prefetch(ids, torch.device("cpu"))                           # a prefetch of the same ids
    assert_bitwise_equal(layer.table.rows(ids, out, ops=layer.ops), want, name=f"{backend} prefetched NF4 rows")


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_each_backend_unpacks_with_its_own_unpacker(backend, monkeypatch):
    """The reference backend unpacks gathered rows with ``ple.reference.nf4_dequantize_rows`` (the readable one);
    the torch backend with ``ple.quant``'s vectorised one."""
    calls = unpacker_calls(monkeypatch)
    layer = nf4_layer(backend, torch.float32)
    layer.embed(torch.zeros(3, TINY.num_ngram_heads, dtype=torch.int64), torch.float32)
    assert calls == (["reference"] if backend == "reference" else ["vectorised"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_nf4_layer_equals_a_float_layer_holding_the_dequantized_table(backend, dtype):
    layer = nf4_layer(backend, dtype)
    twin = random_layer(TINY, 0, dtype, seed=11, backend=backend)
    with torch.no_grad():
        twin.table.weight.copy_(spec_dequantize(layer.table.weight).to(dtype))
    g = torch.Generator().manual_seed(13)
    h = torch.randn(2, 9, TINY.hc_hidden_size, generator=g).to(dtype)
    input_ids = torch.randint(0, TINY.vocab_size, (2, 9), generator=g)
    with torch.no_grad():
        assert_bitwise_equal(layer(h, input_ids), twin(h, input_ids), name=f"{backend} NF4 layer output")
    bits = layer.table.weight.clone()
    layer.to(torch.float64 if dtype == torch.float32 else torch.float32)   # a dtype cast leaves the table alone
    assert_bitwise_equal(layer.table.weight, bits, name="weight")
    sd = layer.state_dict()
    fresh = random_layer(TINY, 0, dtype, seed=2)
    fresh.ple_embedding.ngram_embedding = QuantizedTable.empty(layer.table.num_rows, layer.table.dim, "nf4")
    fresh.load_state_dict(sd)
    assert_bitwise_equal(fresh.table.weight, bits, name="loaded weight")


# ---- (c) the error ----------------------------------------------------------------------------------------
def test_error_report(capsys):
    """NF4 against a bfloat16 normal(0, 1) table of 4096 rows of D = 160, and the worst case (ple.quant's docstring)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 160, generator=g).to(torch.bfloat16)
    x = w.float()
    q, _ = quantize(w, "nf4")
    rms = x.double().square().mean(dim=1, keepdim=True).sqrt().float()
    lines = []
    for out in OUT_DTYPES:
        err = (dequantize(q, None, out).float() - x).abs()
        bound = error_bound(w, "nf4", out_dtype=out)
        assert bool((err <= bound).all()), f"error past the documented bound ({out})"
        rel = err / rms
        rms_rel, mean_abs = float(rel.square().mean().sqrt()), float(err.mean())
        assert rms_rel <= 0.092 and mean_abs <= 0.076 and float(rel.max()) <= 1.28    # as documented
        lines.append(f"nf4 per-row         -> {str(out)[6:]:>8}: rms err / rms(row) {rms_rel:.4f}, mean abs "
                     f"{mean_abs:.4f}, max err / rms(row) {float(rel.max()):.3f}, max err / bound "
                     f"{float((err / bound).max()):.3f}")
    spike = torch.zeros(1, 160)
    spike[0, 7] = 1.0
    qs, _ = quantize(spike, "nf4")
    err = (dequantize(qs, None, torch.float32) - spike).abs()
    assert bool((err <= error_bound(spike, "nf4")).all())
    assert float(err[0, 7]) >= 1 - 2.7326 * 1.15 * (1 + 2**-11) / math.sqrt(160)    # loses >= 75% of the spike
    lines.append(f"nf4 worst case (one spike among zeros, D = 160): the spike loses {float(err[0, 7]):.3f} of it "
                 f"(bound {float(error_bound(spike, 'nf4')[0, 7]):.3f})")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


# ---- (d) what refuses NF4 (host, disk: tests/io/test_nf4_placements.py; row sharding: tests/distributed) ------
def test_column_sharding_refuses_nf4():
    layer = nf4_layer("torch", torch.float32)
    with pytest.raises(ValueError, match="^placement: an NF4 table's rows are packed"):
        shard_table_(layer.table, None, "col")                # refused before the mesh is looked at
    with pytest.raises(ValueError, match="^layer: its table is not a DTensor"):
        join_table_lookup(layer)


# ---- (e) NF4 checkpoints ---------------------------------------------------------------------------------
def _weights(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(pathlib.Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _table_keys(tensors: dict[str, torch.Tensor], prefix: str) -> list[str]:
    return sorted((k for k in tensors if k.startswith(prefix) and ".ngram_embedding." in k),
                  key=lambda k: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)])


@pytest.mark.parametrize("parts", [0, 3, None])
def test_nf4_checkpoint_round_trip(tmp_path, parts, monkeypatch):
    """An NF4 layer saved (whole or in shards) and loaded back: the packed rows bit for bit, no weight_scale,
    the config marked ple-only, and the loaded layer computes what the saved one did."""
    layer = nf4_layer("torch", torch.float32)
    with pytest.raises(ValueError, match="^table_dtype: transformers would load this checkpoint wrong .*nf4 table"):
        ple.io.save(layer, tmp_path / "m", parts=parts)
    assert not (tmp_path / "m").exists()
    ple.io.save(layer, tmp_path / "m", parts=parts, ple_only=True, block_bytes=40)     # several blocks a shard
    D = layer.config.ngram_head_dim
    tensors = _weights(tmp_path / "m")
    pfx = ple.io.model_prefix(layer.config, 0)
    keys = _table_keys(tensors, pfx)
    n = layer.config.split_ngram_parts if parts is None else parts
    assert keys == ([pfx + "ple_embedding.ngram_embedding.weight"] if n == 0 else
                    [pfx + f"ple_embedding.ngram_embedding.shard_{k}.weight" for k in range(n)])
    assert all(tensors[k].dtype == torch.uint8 and tensors[k].shape[1] == D // 2 + 4 for k in keys)
    assert_bitwise_equal(torch.cat([tensors[k] for k in keys]), layer.table.weight, name="saved rows")
    assert not any("weight_scale" in k for k in tensors)
    marks = json.loads((tmp_path / "m" / "config.json").read_text())["ple_only"]
    assert any(m.startswith("nf4 table: ") and "packed uint8 rows" in m for m in marks)
    largest = []                                                 # bytes of each table block read
    read = ple.io.Checkpoint.read

    def spy(self, key, start=None, stop=None):
        t = read(self, key, start, stop)
        if ".ngram_embedding." in key:
            largest.append(t.numel() * t.element_size())
        return t

    monkeypatch.setattr(ple.io.Checkpoint, "read", spy)
    back, report = ple.io.load_layer(tmp_path / "m", block_bytes=40, return_report=True)
    assert 0 < max(largest) <= 40                                # streamed in blocks of at most block_bytes
    monkeypatch.undo()
    assert "uint8 (nf4)" in report.table
    assert isinstance(back.table, QuantizedTable) and back.table.scheme is SCHEMES["nf4"]
    assert back.table.dim == D and back.table.scale is None
    assert_bitwise_equal(back.table.weight, layer.table.weight, name="loaded rows")
    for name, t in layer.state_dict().items():
        assert_bitwise_equal(back.state_dict()[name], t, name=name)
    back.set_backend("torch")
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 7, TINY.hc_hidden_size, generator=g)
    ids = torch.randint(0, TINY.vocab_size, (2, 7), generator=g)
    with torch.no_grad():
        assert_bitwise_equal(back(hidden, ids), layer(hidden, ids), name="layer output")
    rows, scale = ple.io.read_table_rows(tmp_path / "m", start=3, end=11, block_bytes=7)
    assert scale is None and torch.equal(rows, layer.table.weight[3:11])


def test_saving_a_float_layer_as_nf4_gives_quantize_bytes(tmp_path):
    floats = random_layer(TINY, 0, torch.float32, seed=1)
    want = quantize(floats.table.weight.detach(), "nf4")[0]
    for i, spelled in enumerate(("nf4", torch.uint8, SCHEMES["nf4"])):
        with pytest.raises(ValueError, match="^table_dtype: transformers would load"):
            ple.io.save(floats, tmp_path / f"no{i}", table_dtype=spelled)
        ple.io.save(floats, tmp_path / f"m{i}", table_dtype=spelled, parts=2, ple_only=True, block_bytes=50)
        assert_bitwise_equal(ple.io.load_layer(tmp_path / f"m{i}").table.weight, want, name=f"{spelled}")
        assert not (tmp_path / f"no{i}").exists()


def test_convert_to_and_from_nf4(tmp_path, capsys):
    from ple.__main__ import main

    floats = random_layer(TINY, 0, torch.float32, seed=1)
    want = quantize(floats.table.weight.detach(), "nf4")[0]
    ple.io.save(floats, tmp_path / "c", parts=0)
    with pytest.raises(ValueError, match="^table_dtype: transformers would load .*nf4 table"):
        ple.io.convert(tmp_path / "c", tmp_path / "d", table_dtype="nf4")
    assert not (tmp_path / "d").exists()
    out = ple.io.convert(tmp_path / "c", tmp_path / "d", table_dtype="nf4", parts=3, ple_only=True,
                         block_bytes=30)
    assert out["tables"] == ["3 shards, uint8 (nf4)"]
    assert_bitwise_equal(ple.io.load_layer(tmp_path / "d").table.weight, want, name="converted")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["ple_only"]
    # The CLI: --table-dtype nf4 needs --ple-only; inspect shows the scheme.
    assert main(["convert", str(tmp_path / "c"), str(tmp_path / "e"), "--table-dtype", "nf4"]) == 2
    assert "error: table_dtype: transformers would load" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "c"), str(tmp_path / "e"), "--table-dtype", "nf4", "--ple-only"]) == 0
    assert "whole, uint8 (nf4)" in capsys.readouterr().out
    assert_bitwise_equal(ple.io.load_layer(tmp_path / "e").table.weight, want, name="CLI converted")
    assert main(["inspect", str(tmp_path / "e")]) == 0
    text = capsys.readouterr().out
    assert "uint8 (nf4), whole" in text and "for ple only (marked so in the checkpoint)" in text
    assert main(["inspect", str(tmp_path / "e"), "--json"]) == 0
    table = json.loads(capsys.readouterr().out)["layers"][0]["table"]
    assert table["scheme"] == "nf4" and table["dim"] == TINY.ngram_head_dim
    # Back: NF4 -> bfloat16 is the dequantized table, and the ple-only mark goes.
    ple.io.convert(tmp_path / "d", tmp_path / "f", table_dtype="bfloat16", block_bytes=30)
    tensors = _weights(tmp_path / "f")
    rows = torch.cat([tensors[k] for k in _table_keys(tensors, "")])
    assert_bitwise_equal(rows, dequantize(want, None, torch.bfloat16), name="NF4 -> bfloat16")
    assert "ple_only" not in json.loads((tmp_path / "f" / "config.json").read_text())


def _damage(tmp_path, change, parts=0):
    """An NF4 checkpoint (one file) whose tensors ``change`` edits in place; returns its file."""
    ple.io.save(nf4_layer("torch", torch.float32), tmp_path / "m", parts=parts, ple_only=True)
    (path,) = (tmp_path / "m").glob("*.safetensors")
    tensors = load_file(path)
    from safetensors import safe_open

    with safe_open(path, "pt") as fh:
        metadata = fh.metadata()
    change(tensors)
    save_file(tensors, path, metadata=metadata)
    return path


def _table(tensors, k=None):
    return next(key for key in sorted(tensors)
                if key.endswith("ngram_embedding.weight" if k is None else f"shard_{k}.weight"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("parts", [0, 2])
def test_a_nonfinite_nf4_scale_is_refused_naming_key_row_and_file(tmp_path, bad, parts):
    row = 37                                                    # past the first blocks of 8 rows
    bits = struct.unpack("<H", struct.pack("<e", bad))[0]

    def change(tensors):
        key = _table(tensors, None if parts == 0 else 1)
        W = tensors[key].shape[1]
        tensors[key][row, W - 4], tensors[key][row, W - 3] = bits & 0xFF, bits >> 8

    path = _damage(tmp_path, change, parts)
    key = "shard_1.weight" if parts else "ngram_embedding.weight"
    for call in (lambda: ple.io.load_layer(tmp_path / "m", block_bytes=8 * 6),
                 lambda: ple.io.read_table_rows(tmp_path / "m", start=0, block_bytes=8 * 6),
                 lambda: ple.io.convert(tmp_path / "m", tmp_path / "out", table_dtype="bfloat16")):
        with pytest.raises(ValueError, match=f"{key}: row {row}'s NF4 scale is .*{re.escape(path.name)}"):
            call()
    # Rows away from the damaged one still read.
    ple.io.read_table_rows(tmp_path / "m", start=0, end=8)


def test_a_damaged_nf4_layout_is_refused_naming_the_key(tmp_path):
    def wider(tensors):
        key = _table(tensors)
        tensors[key] = torch.cat([tensors[key], torch.zeros(tensors[key].shape[0], 2, dtype=torch.uint8)], 1)

    _damage(tmp_path / "a", wider)
    with pytest.raises(ValueError, match=r"ngram_embedding.weight: expected shape \[\d+, 6\] .*NF4 rows of "
                                         r"D/2 \+ 4 bytes, D = 4\), got \[\d+, 8\]"):
        ple.io.load_layer(tmp_path / "a" / "m")

    def stray_scale(tensors):
        key = _table(tensors)
        tensors[key.replace(".weight", ".weight_scale")] = torch.ones(tensors[key].shape[0], 1)

    _damage(tmp_path / "b", stray_scale)
    with pytest.raises(ValueError, match="ngram_embedding.weight_scale: a scale for a uint8 table; expected none"):
        ple.io.load_layer(tmp_path / "b" / "m")

    _damage(tmp_path / "c", lambda tensors: None)
    odd = PLEConfig.from_dict({**TINY.to_dict(), "ple_embed_dim": 30})              # D = 5
    assert odd.ngram_head_dim == 5
    with pytest.raises(ValueError, match=r"ngram_embedding.weight: a uint8 \(NF4\) table, but the config's "
                                         r"ngram_head_dim D = 5 is not even .*model.safetensors"):
        ple.io.load_layer(tmp_path / "c" / "m", config=odd)
