"""``ple.io.read_table_rows``, the one reader of a layer's table rows, and the errors a new user meets
opening a checkpoint: another config's file, a missing last shard, a file cut short, a torch.save
file, the path of the index file itself."""

from __future__ import annotations

import re

import pytest
import torch

import ple.io as pio
from ple import PLEConfig
from ple.__main__ import main
from ple.io.files import Checkpoint, Entry, write_file
from ple.io.load import BLOCK_BYTES
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

TINY = PLEConfig.preset("tiny")                      # 6128 rows of D = 4, two PLE layers, split_ngram_parts 4
PFX0 = "model.language_model.layers.0.ple."
SHARD = PFX0 + "ple_embedding.ngram_embedding.shard_{}.{}"
ROWS = 6128


def saved(tmp_path, scheme=None, parts=5, seed=3):
    """PLE layer 0 saved by ple.io (config in the metadata): ``(its table module, the checkpoint's path)``."""
    layer = random_layer(TINY, 0, seed=seed)
    if scheme:
        layer.ple_embedding.quantize_(scheme)
    path = tmp_path / f"ck-{scheme}-{parts}"
    pio.save(layer, path, parts=parts, ple_only=True)   # tables may be quantized
    return layer.ple_embedding.ngram_embedding, path


def rewrite(path, dest, drop=(), **replace):
    """The checkpoint at ``path`` written again by safetensors, less the keys ``drop``."""
    from safetensors.torch import save_file

    ckpt = Checkpoint.open(path)
    sd = {k: ckpt.read(k) for k in ckpt.keys() if k not in drop}
    dest.mkdir(parents=True)
    save_file(sd, str(dest / "model.safetensors"), metadata=ckpt.metadata)
    return dest


def table_reads(monkeypatch) -> list:
    """Every table read through `Checkpoint.read` from now on: ``(shard_k.weight..., start, stop)``."""
    reads = []
    original = Checkpoint.read

    def spy(self, key, start=None, stop=None):
        if "ngram_embedding" in key:
            reads.append((key.removeprefix(PFX0 + "ple_embedding.ngram_embedding."), start, stop))
        return original(self, key, start, stop)

    monkeypatch.setattr(Checkpoint, "read", spy)
    return reads


# ---- read_table_rows -----------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme, parts", [(None, 5), (None, 0), ("int8", 3), ("fp8", 4)])
def test_read_table_rows_are_the_tables_rows(tmp_path, scheme, parts):
    """Any range, across shard and block boundaries: the table's own bits and dtype, its scales by the
    ple.quant conventions (none, per row [n, 1], per tensor [1]); the default range is read_table's."""
    table, path = saved(tmp_path, scheme, parts)
    weight = table.weight.detach()
    for start, end in [(2000, 3000), (0, ROWS), (1226, 2452), (7, 7), (ROWS - 1, ROWS), (0, 1), (ROWS, ROWS)]:
        for block_bytes in (BLOCK_BYTES, 1000):
            rows, scale = pio.read_table_rows(path, start=start, end=end, block_bytes=block_bytes)
            assert_bitwise_equal(rows, weight[start:end], name=f"rows [{start}, {end})")
            if scheme is None:
                assert scale is None
            elif scheme == "int8":
                assert_bitwise_equal(scale, table.weight_scale.detach()[start:end], name="row scales")
            else:
                assert_bitwise_equal(scale, table.weight_scale.detach().reshape(1), name="tensor scale")
    ckpt = Checkpoint.open(path)
    whole = pio.read_table_rows(ckpt, TINY)
    expected = pio.read_table(ckpt, pio.plan_layer(ckpt, TINY, 0, PFX0))
    assert_bitwise_equal(whole[0], expected[0], name="whole table")
    assert (whole[1] is None) == (expected[1] is None) == (scheme is None)


def test_read_table_rows_reads_only_the_overlapping_rows(tmp_path, monkeypatch):
    """Rows 2000..3000 of 5 shards of 1226 rows: rows 774..1226 of shard 1 and 0..548 of shard 2 (and
    their scales), nothing else; an empty range reads no table row."""
    table, path = saved(tmp_path, "int8", parts=5)
    reads = table_reads(monkeypatch)
    rows, scale = pio.read_table_rows(path, start=2000, end=3000)
    assert reads == [("shard_1.weight", 774, 1226), ("shard_1.weight_scale", 774, 1226),
                     ("shard_2.weight", 0, 548), ("shard_2.weight_scale", 0, 548)]
    assert_bitwise_equal(rows, table.weight.detach()[2000:3000], name="int8 rows")
    reads.clear()
    rows, scale = pio.read_table_rows(path, start=7, end=7)
    assert reads == [] and rows.shape == (0, 4) and rows.dtype == torch.int8
    assert scale.shape == (0, 1) and scale.dtype == torch.float32
    rows, scale = pio.read_table_rows(path, start=5, end=9, block_bytes=8)     # two int8 rows a block
    assert reads == [(f"shard_0.{what}", a, a + 2) for a in (5, 7) for what in ("weight", "weight_scale")]


def test_read_table_rows_range_and_argument_errors(tmp_path):
    _, path = saved(tmp_path)
    for start, end in [(0, ROWS + 1), (5, 4), (-1, 3)]:
        with pytest.raises(ValueError, match=rf"start, end: expected 0 <= start <= end <= {ROWS} \(the "
                                             rf"table's rows\), got {start}, {end}"):
            pio.read_table_rows(path, start=start, end=end)
    for start, end in [(1.0, 3), (0, True)]:
        with pytest.raises(TypeError, match="start, end: expected ints"):
            pio.read_table_rows(path, start=start, end=end)
    with pytest.raises(ValueError, match="prefix: no key starts with 'nope.'"):
        pio.read_table_rows(path, start=0, end=1, prefix="nope.")
    with pytest.raises(ValueError, match="ple_layer_index: the config has 2"):
        pio.read_table_rows(path, TINY, 2, start=0, end=1)


def test_read_table_rows_refuses_another_configs_checkpoint(tmp_path):
    """The hash buffers are checked against the config before a row is read (the sharded table's old
    reader returned the rows of any checkpoint); without buffers, the table's shape is."""
    _, path = saved(tmp_path)
    same_rows = PLEConfig.preset("tiny", seed=7)                           # other multipliers, 6128 rows
    with pytest.raises(ValueError, match=re.escape(PFX0) + r"ple_embedding\.layer_multipliers: does not "
                                                          r"match the config \(PLE index 0\)"):
        pio.read_table_rows(path, same_rows, start=0, end=10)
    other_rows = PLEConfig.preset("tiny", ngram_vocab_size_base=1100)
    with pytest.raises(ValueError, match=r"ngram_heads_vocab_sizes: does not match"):
        pio.read_table_rows(path, other_rows, start=0, end=10)
    bare = rewrite(path, tmp_path / "nobuf", drop={PFX0 + "ple_embedding." + b for b in
                                                  ("layer_multipliers", "ngram_heads_vocab_sizes",
                                                   "ngram_heads_offsets")})
    with pytest.raises(ValueError, match=r"shard_0\.weight: expected shape \[1348, 4\] \(rows \[0, 1348\) of "
                                         r"the 6736-row table"):
        pio.read_table_rows(bare, other_rows, start=0, end=10)
    with pytest.raises(ValueError, match=r"key_proj\.weight: missing"):                # the whole layer
        pio.read_table_rows(rewrite(path, tmp_path / "noproj", drop={PFX0 + "key_proj.weight"}), start=0, end=1)


# ---- a missing last shard ------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme, parts, drop", [(None, 4, [3]), ("int8", 4, [3]), (None, 7, [6]),
                                                 (None, 7, [5, 6]), ("fp8", 4, [2, 3])])
def test_missing_last_shard_is_named(tmp_path, scheme, parts, drop):
    """Shards 0..k-1 of a split into more parts (the config's split_ngram_parts, 4, or any other): the
    first missing shard is named, not a size mismatch of shard 0."""
    _, path = saved(tmp_path, scheme, parts)
    keys = {SHARD.format(k, what) for k in drop for what in ("weight", "weight_scale")}
    bad = rewrite(path, tmp_path / "bad", drop=keys)
    message = rf"{re.escape(SHARD.format(drop[0], 'weight'))}: missing: shards 0\.\.{drop[0] - 1} hold"
    with pytest.raises(ValueError, match=message):
        pio.load_layer(bad)
    with pytest.raises(ValueError, match=message):
        pio.read_table_rows(bad, start=0, end=10)
    assert main(["inspect", str(bad)]) == 1


# ---- files cut short, files that are not safetensors, the index file ------------------------------------
def test_truncated_file_names_the_tensor_cut_off(tmp_path):
    pio.save(random_layer(TINY), tmp_path / "layer.safetensors", parts=4)
    data = (tmp_path / "layer.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-3])
    with pytest.raises(ValueError, match=r"cut\.safetensors is not a readable safetensors file .*truncated "
                                         r"file\?\): the data of " + re.escape(PFX0) + r"\S+ ends past the end"):
        pio.load_layer(tmp_path / "cut.safetensors", TINY)


@pytest.mark.parametrize("mapped", [True, False], ids=["mmap", "pread"])
def test_file_cut_after_opening_names_file_and_key(tmp_path, monkeypatch, mapped):
    """A file truncated after the checkpoint was opened (its memory map already made): a ValueError naming
    the file and the key, on both read paths, never a crash or a raw safetensors error."""
    if not mapped:
        monkeypatch.setattr(Checkpoint, "_handle", lambda self, file: None)
    pio.save(random_layer(TINY), tmp_path / "ck", parts=4)
    ckpt = Checkpoint.open(tmp_path / "ck")
    key = SHARD.format(3, "weight")
    assert ckpt.read(key, 0, 2).shape == (2, 4)                          # the file is mapped now
    file = ckpt.info(key).file
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    for k in (key, PFX0 + "conv1d.weight", PFX0 + "ple_embedding.layer_multipliers"):
        with pytest.raises(ValueError, match=re.escape(k) + r": .*ck/model\.safetensors is \d+ bytes now"):
            ckpt.read(k)
    with pytest.raises(ValueError, match=re.escape(PFX0) + r"\S+: .*model\.safetensors is \d+ bytes now"):
        pio.read_table_rows(ckpt, TINY, start=0, end=10)


@pytest.mark.parametrize("zipfile, kind", [(True, "a zip archive"), (False, "a pickle")])
def test_torch_save_file_is_named_as_one(tmp_path, zipfile, kind):
    layer = random_layer(TINY)
    bin_path = tmp_path / "pytorch_model.bin"
    torch.save(layer.state_dict(), bin_path, _use_new_zipfile_serialization=zipfile)
    message = rf"pytorch_model\.bin is a torch\.save/pickle file \({kind}\), not safetensors; load it with torch"
    with pytest.raises(ValueError, match=message):
        pio.load_layer(bin_path, TINY)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "model.safetensors").write_bytes(bin_path.read_bytes())       # misnamed
    with pytest.raises(ValueError, match=r"model\.safetensors is a torch\.save/pickle file"):
        pio.read_table_rows(tmp_path / "d", TINY, start=0, end=1)
    assert main(["inspect", str(bin_path)]) == 2


def test_safetensors_starting_like_a_pickle_still_reads(tmp_path):
    """A header 640 bytes long starts the file with the bytes of a pickle's opening (0x80 0x02)."""
    path = tmp_path / "x.safetensors"
    t = torch.arange(6, dtype=torch.float32)
    for pad in range(700):
        write_file(path, [Entry("t", t.dtype, (6,), lambda: iter([t]))], {"pad": "x" * pad})
        if path.read_bytes()[:2] == b"\x80\x02":
            break
    assert path.read_bytes()[:2] == b"\x80\x02"
    assert torch.equal(Checkpoint.open(path).read("t"), t)


def test_index_file_path_opens_its_folder(tmp_path):
    layers = [random_layer(TINY, i, seed=20 + i) for i in range(2)]
    pio.save(layers, tmp_path / "ck", parts=3, max_file_bytes=30_000)
    index = tmp_path / "ck" / "model.safetensors.index.json"
    assert len(Checkpoint.open(index).files) > 1
    assert Checkpoint.open(index).files == Checkpoint.open(tmp_path / "ck").files
    loaded = pio.load_layer(index, ple_layer_index=1)
    for k, v in layers[1].state_dict().items():
        assert_bitwise_equal(loaded.state_dict()[k], v, name=k)
    rows, _ = pio.read_table_rows(index, ple_layer_index=1, start=100, end=3000)
    assert_bitwise_equal(rows, layers[1].ple_embedding.ngram_embedding.weight.detach()[100:3000], name="rows")
    assert main(["inspect", str(index)]) == 0
    # An index of another name, the folder's only one: used (a stale file beside it is not read).
    index.rename(tmp_path / "ck" / "ple.safetensors.index.json")
    pio.save(layers[0], tmp_path / "ck" / "stale.safetensors")
    assert_bitwise_equal(pio.read_table_rows(tmp_path / "ck", start=0, end=5)[0],
                         layers[0].ple_embedding.ngram_embedding.weight.detach()[:5], name="rows")
    assert Checkpoint.open(tmp_path / "ck" / "ple.safetensors.index.json").files == \
        Checkpoint.open(tmp_path / "ck").files
    (tmp_path / "ck" / "bad.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"bad\.safetensors\.index\.json is not a safetensors index"):
        Checkpoint.open(tmp_path / "ck" / "bad.safetensors.index.json")
