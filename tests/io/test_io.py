"""``ple.io``: checkpoints in the model's layout, sharded and quantized tables, bad files, the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _helpers import random_entries
from hypothesis import given, note, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ple.io as pio
from ple import PLEConfig, PLELayer
from ple.__main__ import main
from ple.io.files import Checkpoint, Entry, write_file
from ple.io.layout import shard_rows
from ple.quant import dequantize, error_bound, quantize
from ple.table import QuantizedTable
from ple.testing.layers import random_layer as _random_layer
from ple.testing.numerics import assert_bitwise_equal

TINY = PLEConfig.preset("tiny")                      # 6128 rows of D = 4, two PLE layers, split_ngram_parts 4
PFX0 = "model.language_model.layers.0.ple."          # ple_layer_ids (1, 2) -> decoder layers 0 and 1
TABLE = "ple_embedding.ngram_embedding.weight"


def random_layer(cfg=TINY, index=0, dtype=torch.bfloat16, seed=0) -> PLELayer:
    return _random_layer(cfg, index, dtype, seed)


def assert_same_layer(a: PLELayer, b: PLELayer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert_bitwise_equal(sb[k], sa[k], name=k)


def tensors(path) -> dict:
    """Every tensor of a checkpoint, by key (for building bad files)."""
    ckpt = Checkpoint.open(path)
    return {k: ckpt.read(k) for k in ckpt.keys()}


def write(path, sd: dict, config: PLEConfig | None = TINY):
    """A checkpoint written by safetensors itself (not by ple.io), with the config beside it as the model
    ships it (nested under text_config)."""
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    if config is not None:
        model_config = {"model_type": "qwen4_exp", "text_config": config.to_dict()}
        (path / "config.json").write_text(json.dumps(model_config))
    return path


# ---- layout --------------------------------------------------------------------------------------------
@given(rows=st.integers(0, 300), parts=st.integers(1, 40))
def test_shard_rows_cover_the_table(rows, parts):
    ranges = shard_rows(rows, parts)
    size = math.ceil(rows / parts)
    assert len(ranges) == parts and ranges[0][0] == 0 and ranges[-1][1] == rows
    for k, (a, b) in enumerate(ranges):
        assert a == min(k * size, rows) and a <= b and b - a <= size
        if k:
            assert a == ranges[k - 1][1]


# ---- round trips -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("parts, merged_kv", [(None, False), (0, False), (1, True), (7, False), (4, True)])
def test_save_load_round_trip(tmp_path, parts, merged_kv):
    layer = random_layer(seed=1)
    pio.save(layer, tmp_path / "ck", parts=parts, merged_kv=merged_kv, ple_only=merged_kv)
    keys = set(Checkpoint.open(tmp_path / "ck").keys())
    n = TINY.split_ngram_parts if parts is None else parts
    shard_keys = {f"{PFX0}ple_embedding.ngram_embedding.shard_{k}.weight" for k in range(n)}
    assert (shard_keys <= keys) and (PFX0 + TABLE in keys) == (n == 0)
    assert (PFX0 + "kv_proj.weight" in keys) == merged_kv and (PFX0 + "key_proj.weight" in keys) != merged_kv
    loaded, report = pio.load_layer(tmp_path / "ck", return_report=True)      # config from the checkpoint
    assert_same_layer(layer, loaded)
    assert report.prefix == PFX0 and report.merged_kv == merged_kv and not report.skipped
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(2, 7, TINY.hc_hidden_size, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, TINY.vocab_size, (2, 7), generator=gen)
    with torch.no_grad():
        assert_bitwise_equal(loaded(h, ids), layer(h, ids), name="forward after load")


@settings(max_examples=8)
@given(parts=st.integers(1, 9), rows_per_block=st.integers(1, 3000),
       scheme=st.sampled_from([None, "fp8", "int8"]))
def test_round_trip_any_sharding_and_block_size(tmp_path_factory, parts, rows_per_block, scheme):
    """Shard boundaries and read blocks at any offsets, float or quantized tables: the same bits come back."""
    layer = random_layer(seed=parts)
    if scheme:
        layer.ple_embedding.quantize_(scheme)
    path = tmp_path_factory.mktemp("ck") / "layer.safetensors"
    pio.save(layer, path, parts=parts, block_bytes=rows_per_block * 4, ple_only=scheme is not None)
    loaded = pio.load_layer(path, block_bytes=rows_per_block * 4)
    note(f"rows per block {rows_per_block}")
    assert_same_layer(layer, loaded)


def test_several_layers_prefixes_and_files(tmp_path):
    cfg = PLEConfig.preset("tiny", ple_layer_ids=[11, 3])       # decoder layers 2 and 10: sorted as numbers
    layers = [random_layer(cfg, i, seed=10 + i) for i in range(2)]
    files = pio.save(layers, tmp_path / "ck", parts=3, max_file_bytes=30_000)
    assert len(files) > 1 and (tmp_path / "ck" / "model.safetensors.index.json").exists()
    ckpt = Checkpoint.open(tmp_path / "ck")
    assert pio.find_layers(ckpt) == ["model.language_model.layers.2.ple.",
                                     "model.language_model.layers.10.ple."]
    for i, loaded in enumerate(pio.load_layers(tmp_path / "ck")):
        assert_same_layer(layers[i], loaded)
    # Any prefix: a bare layer and a custom one; loaded by index, by prefix, or as the only layer.
    pio.save(layers[1], tmp_path / "bare.safetensors", prefix="", parts=0)
    assert_same_layer(layers[1], pio.load_layer(tmp_path / "bare.safetensors", ple_layer_index=1))
    pio.save(layers, tmp_path / "custom.safetensors", prefix="decoder.{index}.engram.")
    assert_same_layer(layers[0], pio.load_layer(tmp_path / "custom.safetensors", prefix="decoder.0.engram."))
    assert_same_layer(layers[1], pio.load_layer(tmp_path / "custom.safetensors", ple_layer_index=1))


def test_loads_the_models_own_layout(tmp_path):
    """A file in the model's layout written by safetensors itself: prefixed, 128-style shards (here 5),
    an FP8 table with a 0-d weight_scale, a merged FP8 kv_proj with a scale per part, the config nested
    under text_config, and other modules' tensors around it."""
    layer = random_layer(seed=4)
    q, s = quantize(layer.ple_embedding.ngram_embedding.weight, "fp8")
    p = "model.language_model.layers.1.ple."
    sd = {"model.language_model.embed_tokens.weight": torch.randn(10, 3),
          "model.language_model.layers.1.mlp.up_proj.weight": torch.randn(4, 3)}
    for k, (a, b) in enumerate(shard_rows(q.shape[0], 5)):
        sd[f"{p}ple_embedding.ngram_embedding.shard_{k}.weight"] = q[a:b]
    sd[p + "ple_embedding.ngram_embedding.weight_scale"] = s.reshape(())
    kv = torch.cat([layer.key_proj.weight, layer.value_proj.weight]).detach().float()   # FP8, scale per part
    kv_scale = torch.tensor([kv[:48].abs().max() / 448, kv[48:].abs().max() / 448])
    kv_q = torch.cat([kv[:48] / kv_scale[0], kv[48:] / kv_scale[1]]).to(torch.float8_e4m3fn)
    sd[p + "kv_proj.weight"], sd[p + "kv_proj.weight_scale"] = kv_q, kv_scale
    for k, v in layer.state_dict().items():
        if "ngram_embedding" not in k and "proj" not in k:
            sd[p + k] = v
    loaded = pio.load_layer(write(tmp_path / "model", sd))
    t = loaded.ple_embedding.ngram_embedding
    assert isinstance(t, QuantizedTable) and torch.equal(t.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(t.weight_scale, s)
    assert loaded.key_proj.weight.dtype == torch.bfloat16                    # the norms' dtype
    assert torch.equal(loaded.key_proj.weight, (kv_q[:48].float() * kv_scale[0]).to(torch.bfloat16))
    assert torch.equal(loaded.value_proj.weight, (kv_q[48:].float() * kv_scale[1]).to(torch.bfloat16))
    report = pio.inspect(tmp_path / "model")
    assert report["other"]["count"] == 2 and report["layers"][0]["prefix"] == p


# ---- bad files -------------------------------------------------------------------------------------------
@pytest.fixture()
def good(tmp_path):
    """A good sharded checkpoint of PLE layer 0 (the model's prefix), as a dict of tensors."""
    pio.save(random_layer(seed=5), tmp_path / "good", parts=4)
    return tensors(tmp_path / "good")


def _mutate(sd, key, value=None):
    sd = dict(sd)
    if value is None:
        del sd[PFX0 + key]
    else:
        sd[PFX0 + key] = value
    return sd


BAD = [
    ("wrong shape", lambda sd: _mutate(sd, "key_proj.weight", torch.zeros(48, 25)),
     r"key_proj\.weight: expected shape \[48, 24\], got \[48, 25\]"),
    ("wrong shard rows",
     lambda sd: _mutate(sd, "ple_embedding.ngram_embedding.shard_2.weight", torch.zeros(5, 4)),
     r"shard_2\.weight: expected shape \[1532, 4\]"),
    ("missing key", lambda sd: _mutate(sd, "norm_conv.weight"), r"norm_conv\.weight: missing"),
    ("missing shard", lambda sd: _mutate(sd, "ple_embedding.ngram_embedding.shard_1.weight"),
     r"shard_1\.weight: missing"),
    ("whole and sharded", lambda sd: _mutate(sd, TABLE, torch.zeros(6128, 4)), r"both whole and as 4 shards"),
    ("wrong multipliers", lambda sd: _mutate(sd, "ple_embedding.layer_multipliers",
                                             sd[PFX0 + "ple_embedding.layer_multipliers"] + 2),
     r"layer_multipliers: does not match the config \(PLE index 0\)"),
    ("float buffer", lambda sd: _mutate(sd, "ple_embedding.ngram_heads_offsets", torch.zeros(6)),
     r"ngram_heads_offsets: expected int64"),
    ("kv and key", lambda sd: _mutate(sd, "kv_proj.weight", torch.zeros(72, 24)),
     r"kv_proj\.weight: found together"),
    ("mixed shard dtypes", lambda sd: _mutate(sd, "ple_embedding.ngram_embedding.shard_0.weight",
                                             sd[PFX0 + "ple_embedding.ngram_embedding.shard_0.weight"]
                                             .to(torch.float8_e4m3fn)),
     r"all shards must share one dtype"),
    ("int table", lambda sd: {k: (v.to(torch.int16) if "shard" in k else v) for k, v in sd.items()},
     r"expected a float, float8_e4m3fn, int8 or uint8 \(NF4\) table"),
    ("stray scale", lambda sd: _mutate(sd, "ple_embedding.ngram_embedding.weight_scale", torch.ones(1)),
     r"weight_scale: a scale for a bfloat16 table"),
    ("fp8 projection without scale",
     lambda sd: _mutate(sd, "value_proj.weight", sd[PFX0 + "value_proj.weight"].to(torch.float8_e4m3fn)),
     r"value_proj\.weight_scale: an FP8 value_proj\.weight needs a float32 scale"),
    ("no table", lambda sd: {k: v for k, v in sd.items() if "ngram_embedding" not in k}, r"weight: missing"),
]


@pytest.mark.parametrize("name, mutate, message", BAD, ids=[b[0] for b in BAD])
def test_bad_file_is_a_clear_error(tmp_path, good, name, mutate, message):
    path = write(tmp_path / "bad", mutate(good))
    with pytest.raises(ValueError, match=message):
        pio.load_layer(path)
    assert main(["inspect", str(path)]) == 1                        # inspect reports the same problem


def test_fp8_and_int8_tables_need_their_scales(tmp_path):
    cases = (("fp8", "ple_embedding.ngram_embedding.weight_scale", "per-tensor"),
             ("int8", "ple_embedding.ngram_embedding.shard_3.weight_scale", "per-row"))
    for scheme, scale_key, message in cases:
        layer2 = random_layer(seed=6)
        layer2.ple_embedding.quantize_(scheme)
        pio.save(layer2, tmp_path / scheme, parts=4, ple_only=True)
        sd = tensors(tmp_path / scheme)
        del sd[PFX0 + scale_key]
        with pytest.raises(ValueError, match=message):
            pio.load_layer(write(tmp_path / f"{scheme}-bad", sd))


def test_truncated_file(tmp_path):
    path = tmp_path / "layer.safetensors"
    pio.save(random_layer(), path)
    data = path.read_bytes()
    for cut in (len(data) - 3, 100, 5):
        (tmp_path / "cut.safetensors").write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"cut\.safetensors is not a readable safetensors.*truncated"):
            pio.load_layer(tmp_path / "cut.safetensors", TINY)
    assert main(["inspect", str(tmp_path / "cut.safetensors")]) == 2


def test_config_mismatch_and_missing_config(tmp_path, good):
    path = write(tmp_path / "ck", good, config=None)
    with pytest.raises(ValueError, match="config: not given"):
        pio.load_layer(path)
    other = PLEConfig.preset("tiny", ngram_vocab_size_base=1100)         # other primes: another row count
    with pytest.raises(ValueError, match=r"ngram_heads_vocab_sizes: does not match"):
        pio.load_layer(path, other)
    sd = {k: v for k, v in good.items() if "heads" not in k}     # without the buffers: the table's shape
    with pytest.raises(ValueError, match=r"shard_0\.weight: expected shape \[1684, 4\]"):
        pio.load_layer(write(tmp_path / "nobuf", sd, config=None), other)
    with pytest.raises(ValueError, match="layer_multipliers: does not match"):
        pio.load_layer(path, PLEConfig.preset("tiny", seed=7))
    with pytest.raises(ValueError, match="layer_multipliers: does not match the config \\(PLE index 1\\)"):
        pio.load_layer(path, TINY, 1)                                   # the only layer is PLE index 0
    with pytest.raises(ValueError, match="ple_layer_index"):
        pio.load_layer(path, TINY, 2)
    with pytest.raises(ValueError, match="prefix: no key starts with"):
        pio.load_layer(path, TINY, prefix="model.layers.0.")


def test_config_json_of_another_model(tmp_path, good, capsys):
    path = write(tmp_path / "ck", good, config=None)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10, "hidden_size": 4}))
    with pytest.raises(ValueError, match="config: .*config.json is not a PLE model config"):
        pio.load_layer(path)
    assert main(["inspect", str(path)]) == 0                          # lists the tensors, checks nothing
    out = capsys.readouterr().out
    assert "hash buffers not checked" in out and "shard_{0..3}" in out


def test_index_naming_a_missing_file(tmp_path):
    layers = [random_layer(TINY, i) for i in range(2)]
    pio.save(layers, tmp_path / "ck", max_file_bytes=30_000)
    next(iter((tmp_path / "ck").glob("model-00002-*"))).unlink()
    with pytest.raises(ValueError, match="lists files that do not exist"):
        pio.load_layer(tmp_path / "ck")


def test_unknown_keys_and_missing_buffers_are_reported(tmp_path, good):
    sd = dict(good)
    sd[PFX0 + "ple_embedding.legacy_gate.weight"] = torch.zeros(3)
    for k in ("layer_multipliers", "ngram_heads_offsets"):
        del sd[PFX0 + "ple_embedding." + k]
    path = write(tmp_path / "ck", sd)
    with pytest.warns(UserWarning) as record:
        loaded, report = pio.load_layer(path, return_report=True)
    text = " ".join(str(w.message) for w in record)
    assert "legacy_gate" in text and "computed from the config" in text
    assert report.skipped == [PFX0 + "ple_embedding.legacy_gate.weight"]
    assert report.computed_buffers == ["ple_embedding.layer_multipliers", "ple_embedding.ngram_heads_offsets"]
    expected = PLELayer(TINY, 0).ple_embedding
    assert torch.equal(loaded.ple_embedding.layer_multipliers, expected.layer_multipliers)
    assert torch.equal(loaded.ple_embedding.ngram_heads_offsets, expected.ngram_heads_offsets)


def test_refuses_to_overwrite(tmp_path):
    layer = random_layer()
    pio.save(layer, tmp_path / "ck")
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        pio.save(layer, tmp_path / "ck")
    pio.save(layer, tmp_path / "ck", overwrite=True, parts=2)
    assert len(list((tmp_path / "ck").glob("*.safetensors"))) == 1
    with pytest.raises(ValueError, match="would overwrite the source"):
        pio.convert(tmp_path / "ck", tmp_path / "ck", overwrite=True)


# ---- memory: tables move in blocks ------------------------------------------------------------------------
def test_tables_are_read_in_blocks_and_inspect_reads_none(tmp_path, monkeypatch):
    layer = random_layer()
    pio.save(layer, tmp_path / "ck", parts=3)
    reads = []
    original = Checkpoint.read

    def spy(self, key, start=None, stop=None):
        out = original(self, key, start, stop)
        reads.append((key, start, out.shape[0] if out.dim() else 0))
        return out

    monkeypatch.setattr(Checkpoint, "read", spy)
    pio.inspect(tmp_path / "ck")
    assert reads and not [r for r in reads if "ngram_embedding" in r[0]]        # headers + int64 buffers only
    reads.clear()
    block = 500                                                                # rows of D = 4 bfloat16 values
    pio.load_layer(tmp_path / "ck", block_bytes=block * 4 * 2)
    table_reads = [r for r in reads if "ngram_embedding" in r[0]]
    assert table_reads and all(start is not None and n <= block for _, start, n in table_reads)
    assert sum(n for *_, n in table_reads) == layer.ple_embedding.ngram_embedding.weight.shape[0]
    reads.clear()
    pio.convert(tmp_path / "ck", tmp_path / "fp8", parts=2, table_dtype="fp8", block_bytes=block * 4 * 4,
                ple_only=True)
    table_reads = [r for r in reads if "ngram_embedding" in r[0] and r[0].endswith("weight")]
    assert all(start is not None and n <= block for _, start, n in table_reads)


def test_reads_without_a_memory_map(tmp_path, monkeypatch):
    """Where safe_open cannot map a file (address-space limits), positioned reads give the same tensors."""
    layer = random_layer(seed=15)
    layer.ple_embedding.quantize_("int8")
    pio.save(layer, tmp_path / "ck", parts=3, ple_only=True)
    monkeypatch.setattr(Checkpoint, "_handle", lambda self, file: None)
    assert_same_layer(layer, pio.load_layer(tmp_path / "ck", block_bytes=1000))
    ckpt = Checkpoint.open(tmp_path / "ck")
    key = PFX0 + "ple_embedding.ngram_embedding.shard_1.weight"
    assert torch.equal(ckpt.read(key, 5, 9), load_file(str(ckpt.info(key).file))[key][5:9])


@settings(max_examples=10)
@given(data=st.data())
def test_streaming_writer_matches_safetensors(tmp_path_factory, data):
    """write_file (blocks of any size) gives files safetensors reads back exactly, in every dtype."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8, torch.int64,
              torch.uint8, torch.bool]
    tensors_, entries = random_entries(data, dtypes, max_dim=6)
    path = tmp_path_factory.mktemp("w") / "x.safetensors"
    write_file(path, entries, {"k": "v"})
    back = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"k": "v"}
    for k, t in tensors_.items():
        assert_bitwise_equal(back[k], t, name=k)


def test_the_same_tensors_and_metadata_make_the_same_bytes(tmp_path):
    """The metadata's order does not change the file: a merge or convert reads the base's metadata through
    safetensors, which gives it in a different order in each process, and its output stays byte for byte."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    meta = {f"key{i}": str(i) for i in range(8)}
    for name, m in (("a", meta), ("b", dict(reversed(list(meta.items()))))):
        write_file(tmp_path / f"{name}.safetensors", [Entry("t", t.dtype, tuple(t.shape), lambda: iter([t]))], m)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


# ---- CLI --------------------------------------------------------------------------------------------------
def test_inspect_cli(tmp_path, capsys):
    pio.save([random_layer(TINY, i) for i in range(2)], tmp_path / "ck", merged_kv=True, ple_only=True)
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    for text in ("PLE layer 0: prefix 'model.language_model.layers.0.ple.'", "PLE layer 1",
                 "ple_embedding.ngram_embedding.shard_{0..3}.weight", "[1532, 4]", "bfloat16", "(4 shards)",
                 "kv_proj.weight", "[72, 24]", "ple_embedding.layer_multipliers: matches the config", "KiB",
                 "for ple only (marked so in the checkpoint): transformers would load it wrong"):
        assert text in out, text
    assert main(["inspect", str(tmp_path / "ck"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [b["status"] for b in report["layers"][1]["buffers"]] == ["match"] * 3
    rows = {r["key"]: r for r in report["layers"][0]["tensors"]}
    assert rows["kv_proj.weight"]["shape"] == [72, 24]                          # shapes are lists, not text
    shards = rows["ple_embedding.ngram_embedding.shard_{0..3}.weight"]
    assert shards["shape"] == [1532, 4] and shards["shapes"] == [[1532, 4]] * 4
    assert report["ple_only"] == ["merged kv_proj: transformers would leave key_proj and value_proj randomly "
                                  "initialised"] and report["ple_only_marked"]
    # Buffers against another config: a mismatch, reported (exit status 1).
    cfg = tmp_path / "other.json"
    cfg.write_text(json.dumps(PLEConfig.preset("tiny", seed=99).to_dict()))
    assert main(["inspect", str(tmp_path / "ck"), "--config", str(cfg)]) == 1
    assert "layer_multipliers: MISMATCH" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "inspect" in capsys.readouterr().out


def test_saved_resharded_fp8_pipeline_meets_the_bound(tmp_path, capsys):
    """Done-when: a layer saved, re-sharded, converted to FP8 (by the CLI) and loaded back is within the
    documented error bound of the bfloat16 table, and its quantization is exactly ple.quant's."""
    layer = random_layer(seed=12)
    table = layer.ple_embedding.ngram_embedding.weight.detach()
    pio.save(layer, tmp_path / "a")
    assert main(["convert", str(tmp_path / "a"), str(tmp_path / "b"), "--parts", "3"]) == 0
    assert main(["convert", str(tmp_path / "b"), str(tmp_path / "c"), "--table-dtype", "fp8", "--ple-only",
                 "--kv", "merged", "--block-size", "4KiB"]) == 0
    out = capsys.readouterr().out
    assert "3 shards, float8_e4m3fn" in out
    loaded = pio.load_layer(tmp_path / "c")
    t = loaded.ple_embedding.ngram_embedding
    q, s = quantize(table, "fp8")
    assert torch.equal(t.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(t.weight_scale, s)
    for out_dtype in (torch.float32, torch.bfloat16):
        err = (dequantize(t.weight, t.weight_scale, out_dtype).double() - table.double()).abs()
        assert bool((err <= error_bound(table, "fp8", out_dtype=out_dtype)).all())
    # Everything but the table is unchanged, and the layer's output moves by about the table's error.
    for k, v in layer.state_dict().items():
        if "ngram_embedding" not in k:
            assert torch.equal(loaded.state_dict()[k], v), k
    gen = torch.Generator().manual_seed(13)
    h = torch.randn(2, 16, TINY.hc_hidden_size, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, TINY.vocab_size, (2, 16), generator=gen)
    with torch.no_grad():
        ref, got = layer(h, ids).double() - h.double(), loaded(h, ids).double() - h.double()
    rel = float((got - ref).norm() / ref.norm())
    with capsys.disabled():
        print(f"\nfp8 table: relative change of the layer's contribution (output - input): {rel:.4f}")
    assert rel < 0.1
    # Back to bfloat16 and unsharded: within the bound again (the bits of dequantize).
    assert main(["convert", str(tmp_path / "c"), str(tmp_path / "d.safetensors"), "--table-dtype", "bfloat16",
                 "--parts", "0", "--kv", "separate"]) == 0
    back = pio.load_layer(tmp_path / "d.safetensors")
    assert torch.equal(back.ple_embedding.ngram_embedding.weight, dequantize(q, s, torch.bfloat16))
    assert torch.equal(back.key_proj.weight, layer.key_proj.weight)


def test_convert_to_int8_and_back(tmp_path):
    layer = random_layer(seed=14)
    table = layer.ple_embedding.ngram_embedding.weight.detach()
    pio.save(layer, tmp_path / "a", parts=5)
    pio.convert(tmp_path / "a", tmp_path / "b", table_dtype="int8", parts=2, block_bytes=1000, ple_only=True)
    keys = Checkpoint.open(tmp_path / "b").keys()
    assert PFX0 + "ple_embedding.ngram_embedding.shard_1.weight_scale" in keys
    loaded = pio.load_layer(tmp_path / "b")
    q, s = quantize(table, "int8")
    assert torch.equal(loaded.ple_embedding.ngram_embedding.weight, q)
    assert torch.equal(loaded.ple_embedding.ngram_embedding.weight_scale, s)
    pio.convert(tmp_path / "b", tmp_path / "c", parts=0, ple_only=True)     # int8 stays int8, re-sharded
    again = pio.load_layer(tmp_path / "c")
    assert_same_layer(loaded, again)


def test_save_refuses_what_transformers_would_load_wrong_unless_ple_only(tmp_path):
    """An FP8 / int8 table or a merged kv_proj: ValueError naming the argument, nothing written; with
    ple_only=True it is written and marked in config.json and the file metadata."""
    layer = random_layer(TINY, 0)
    for kwargs, arg in (({"table_dtype": "fp8"}, "table_dtype"), ({"merged_kv": True}, "merged_kv")):
        with pytest.raises(ValueError, match=f"^{arg}: transformers would load this checkpoint wrong"):
            pio.save(layer, tmp_path / arg, **kwargs)
        assert not (tmp_path / arg).exists()
        pio.save(layer, tmp_path / arg, **kwargs, ple_only=True)
        assert json.loads((tmp_path / arg / "config.json").read_text())["ple_only"]
        assert pio.inspect(tmp_path / arg)["ple_only_marked"]
    layer.ple_embedding.quantize_("int8")                             # a quantized layer kept as it is
    with pytest.raises(ValueError, match="^table_dtype: .*int8 table"):
        pio.save(layer, tmp_path / "int8.safetensors")
    pio.save(layer, tmp_path / "float", table_dtype="float32")        # dequantized: loadable, not marked
    assert "ple_only" not in json.loads((tmp_path / "float" / "config.json").read_text())
    assert pio.inspect(tmp_path / "float")["ple_only"] == []
