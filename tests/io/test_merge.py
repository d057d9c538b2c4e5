"""``ple.io.merge`` and ``python -m ple merge``: a checkpoint of a base and its trained overlay rows (docs/spec.md 12).

A disk layer trained through an overlay (``load_layer(..., offload="disk", overlay=DIR)``) and merged: the merged
table holds, bit for bit, what the trained layer's lookups return (and what in-memory training of the same steps
saves), whole or sharded, from a float or an FP8 base, for one overlay or a ``load_layers`` folder of them; rows
written by hand at every shard and block boundary; the refusals (another base, a damaged file, ``out`` over the
base or the overlay); the memory it holds; the command line; transformers loading the merged float checkpoint.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from _helpers import reads_not_counted
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import ple
import ple.io as pio
from ple import PLEConfig
from ple.io import _pipeline
from ple.io.disk_table.overlay.store import OverlayStore
from ple.io.disk_table.table import DiskTable
from ple.io.disk_table.training import SAMPLE_ROWS, base_fingerprint
from ple.io.files import Checkpoint
from ple.quant import dequantize, quantize
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

TINY = PLEConfig.preset("tiny")          # 6128 rows of D = 4, two PLE layers
ROWS, D = 6128, 4


def save_base(path: Path, scheme: str | None = None, parts: int = 0, seed: int = 3, **kw) -> Path:
    layers = [random_layer(TINY, i, torch.bfloat16, seed + i) for i in range(TINY.num_ple_layers)]
    for layer in layers:
        if scheme is not None:
            layer.ple_embedding.quantize_(scheme)
    pio.save(layers, path, parts=parts, ple_only=scheme is not None, **kw)
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    return path


def train(layers, steps: int = 3, seed: int = 0) -> None:
    """``steps`` steps of RowwiseAdagrad on the layers' tables (nothing else trains)."""
    opt = ple.optim.RowwiseAdagrad(layers, lr=0.1)
    cfg, dtype = layers[0].config, layers[0].key_proj.weight.dtype
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        h = torch.randn(2, 9, cfg.hc_hidden_size, generator=gen).to(dtype)
        ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=gen)
        sum(layer(h, ids).float().square().mean() for layer in layers).backward()
        opt.step()
        opt.zero_grad()


def looked_up(layer, dtype: torch.dtype) -> torch.Tensor:
    """Every row of the layer's table as its lookups return them ``[rows, D]``."""
    with torch.no_grad():
        rows = layer.table.lookup(torch.arange(layer.table.num_rows).view(-1, 1), dtype, ops=ple.vectorized)
    return rows.view(layer.table.num_rows, -1)


def train_on_disk(base: Path, overlay: Path, index: int = 0, **kw) -> torch.Tensor:
    """Train PLE layer ``index`` of ``base`` through ``overlay`` (spilling: a small budget), flush, close: its
    lookups (in the overlay's dtype)."""
    layer = pio.load_layer(base, ple_layer_index=index, offload="disk", overlay=overlay, overlay_bytes=2000, **kw)
    train([layer])
    layer.table.flush()
    rows = looked_up(layer, layer.table._overlay.dtype)
    assert layer.table.overlay.stats()["spilled_rows"] > 0
    layer.table.close()
    return rows


def table_of(path: Path, index: int = 0, **kw) -> torch.Tensor:
    return pio.load_layer(path, ple_layer_index=index, **kw).table.weight.detach()


def base_rows(path: Path, index: int = 0) -> torch.Tensor:
    return pio.read_table_rows(path, ple_layer_index=index)[0]


def stored_dtypes(path: Path) -> list[str]:
    """The dtype of each layer's table as stored in the checkpoint's files."""
    ckpt = Checkpoint.open(path)
    return [str(pio.plan_layer(ckpt, TINY, i, p).table_dtype).removeprefix("torch.")
            for i, p in enumerate(pio.find_layers(ckpt))]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per base kind: the base, an overlay trained on its layer 0, the lookups after training."""
    root = tmp_path_factory.mktemp("merge")
    out = {}
    for name, scheme, parts, kw in [("whole", None, 0, {}), ("sharded", None, 3, {"max_file_bytes": 20_000}),
                                    ("fp8", "fp8", 0, {})]:
        base = save_base(root / f"base-{name}", scheme, parts, **kw)
        out[name] = (base, root / f"ov-{name}", train_on_disk(base, root / f"ov-{name}"))
    return out


# ---- the merged table ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlapped", [False, True], ids=["inline", "overlapped"])
@pytest.mark.parametrize("name", ["whole", "sharded"])
def test_merged_float_table_is_the_trained_layers_and_the_in_memory_trainings(trained, tmp_path, name, overlapped,
                                                                             monkeypatch):
    """(``overlapped``: the files written as a large one is, ``ple.io._pipeline``: the blocks made in a thread
    of their own, one ahead of the one being written.)"""
    if overlapped:
        monkeypatch.setattr(_pipeline, "PIPELINE_BYTES", 0)
    base, overlay, rows = trained[name]
    if name == "sharded":
        assert len(Checkpoint.open(base).files) > 1
    out = tmp_path / "out"
    summary = pio.merge(base, overlay, out)
    merged = table_of(out)
    assert_bitwise_equal(merged, rows, name="merged table")
    before = base_rows(base)
    changed = (merged != before).any(1)
    assert 0 < int(changed.sum()) < ROWS // 4                        # untouched rows are the base's
    assert_bitwise_equal(merged[~changed], before[~changed])
    assert_bitwise_equal(table_of(out, 1), base_rows(base, 1), name="layer 1 (not trained)")
    assert summary["overlays"][0]["rows"] >= int(changed.sum()) and summary["overlays"][1] is None
    assert summary["tables"][0] == ("3 shards, bfloat16" if name == "sharded" else "whole, bfloat16")
    assert stored_dtypes(out) == ["bfloat16", "bfloat16"]

    mem = pio.load_layer(base)                                       # the same steps in memory, saved
    train([mem])
    pio.save(mem, tmp_path / "mem", parts=3 if name == "sharded" else 0)
    want, got = load_file(tmp_path / "mem" / "model.safetensors"), {}
    for f in Checkpoint.open(out).files:
        got |= load_file(f)
    for key, t in want.items():                                      # every tensor of layer 0, bit for bit
        assert_bitwise_equal(got[key], t, name=key)
    base_tensors = {}
    for f in Checkpoint.open(base).files:
        base_tensors |= load_file(f)
    assert sorted(got) == sorted(base_tensors)                         # the same keys, the rest copied as is
    for key, t in base_tensors.items():
        if key not in want:
            assert_bitwise_equal(got[key], t, name=key)
    assert (out / "tokenizer.json").read_text() == (base / "tokenizer.json").read_text()


@pytest.mark.parametrize("base_parts", [0, 3])
def test_rows_at_every_shard_and_block_boundary(tmp_path, base_parts):
    """Overlay rows written by hand at the first and last row, around every shard boundary of 3, 5 and 7 shards
    and of the base's; merged into 0, 3, 5 and 7 shards through blocks of 13 rows."""
    base = save_base(tmp_path / "base", None, base_parts)
    layer = pio.load_layer(base, offload="disk", overlay=tmp_path / "ov")
    edges = {0, ROWS - 1} | {b + d for p in (3, 5, 7) for a, b in pio.shard_rows(ROWS, p) for d in (-1, 0, 1)}
    ids = torch.tensor(sorted(e for e in edges if 0 <= e < ROWS))
    values = torch.randn(ids.numel(), D, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16) + 10
    layer.table.overlay.update(ids, values, {})
    layer.table.overlay.flush()
    layer.table.close()
    want = base_rows(base)
    want[ids] = values
    for parts in (0, 3, 5, 7):
        summary = pio.merge(base, tmp_path / "ov", tmp_path / f"out{parts}", parts=parts, block_bytes=13 * D * 4)
        assert summary["overlays"][0]["rows"] == ids.numel()
        assert_bitwise_equal(table_of(tmp_path / f"out{parts}"), want, name=f"{parts} shards")
    one = tmp_path / "one.safetensors"                                # one file out
    pio.merge(base, tmp_path / "ov", one, parts=0)
    assert_bitwise_equal(table_of(one, config=TINY), want)


def test_fp8_base(trained, tmp_path):
    """table_dtype None: written in the overlay's bfloat16, every row as the trained layer looks it up;
    "fp8": the merged float32 values quantized as ple.quant does (scale from the whole merged table)."""
    base, overlay, rows = trained["fp8"]
    assert rows.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="^table_dtype: transformers would load"):   # layer 1 stays FP8
        pio.merge(base, overlay, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    summary = pio.merge(base, overlay, tmp_path / "bf16", ple_only=True)
    assert summary["tables"] == ["whole, bfloat16", "whole, float8_e4m3fn"]
    assert stored_dtypes(tmp_path / "bf16") == ["bfloat16", "float8_e4m3fn"]
    assert_bitwise_equal(table_of(tmp_path / "bf16"), rows)
    assert_bitwise_equal(pio.load_layer(tmp_path / "bf16", ple_layer_index=1).table.weight,
                         pio.load_layer(base, ple_layer_index=1).table.weight, name="layer 1 (fp8, untouched)")

    layer = pio.load_layer(base, offload="disk", overlay=overlay)    # the lookups in float32
    rows32 = looked_up(layer, torch.float32)
    layer.table.close()
    assert_bitwise_equal(rows32.to(torch.bfloat16), rows)
    pio.merge(base, overlay, tmp_path / "fp8", table_dtype="fp8", ple_only=True)
    got = pio.load_layer(tmp_path / "fp8").table
    weight, scale = quantize(rows32, "fp8")
    assert_bitwise_equal(got.weight, weight, name="fp8 rows")
    assert_bitwise_equal(got.scale, scale, name="fp8 scale")
    summary = pio.merge(base, overlay, tmp_path / "f32", table_dtype="float32", ple_only=True)
    assert_bitwise_equal(table_of(tmp_path / "f32", dtype=torch.float32), rows32)
    assert summary["tables"] == ["whole, float32", "whole, float32"]
    assert stored_dtypes(tmp_path / "f32") == ["float32", "float32"]

    layer = pio.load_layer(base, offload="disk", overlay=tmp_path / "big")      # a row beyond the base's largest
    layer.table.overlay.update(torch.tensor([17]), torch.full((1, D), -100.0), {})
    layer.table.overlay.flush()
    rows32 = looked_up(layer, torch.float32)
    layer.table.close()
    pio.merge(base, tmp_path / "big", tmp_path / "fp8-big", table_dtype="fp8", ple_only=True)
    got = pio.load_layer(tmp_path / "fp8-big").table
    weight, scale = quantize(rows32, "fp8")
    assert_bitwise_equal(got.weight, weight, name="fp8 rows")
    assert_bitwise_equal(got.scale, torch.tensor([100.0 / 448]), name="fp8 scale")


def test_an_overlay_in_float32_over_a_bfloat16_base(trained, tmp_path):
    """table_dtype None: the base's bfloat16, the overlay's rows rounded as a bfloat16 lookup rounds them;
    "float32": the overlay's rows exact, the base's widened (a float32 lookup)."""
    base = trained["whole"][0]
    rows32 = train_on_disk(base, tmp_path / "ov", overlay_dtype=torch.float32)
    assert rows32.dtype == torch.float32
    assert not torch.equal(rows32, rows32.to(torch.bfloat16).float())           # rows bfloat16 cannot hold
    summary = pio.merge(base, tmp_path / "ov", tmp_path / "bf16")
    assert summary["overlays"][0]["dtype"] == "float32" and stored_dtypes(tmp_path / "bf16")[0] == "bfloat16"
    assert_bitwise_equal(table_of(tmp_path / "bf16"), rows32.to(torch.bfloat16))
    pio.merge(base, tmp_path / "ov", tmp_path / "f32", table_dtype="float32")
    assert stored_dtypes(tmp_path / "f32") == ["float32", "float32"]
    assert_bitwise_equal(table_of(tmp_path / "f32", dtype=torch.float32), rows32)


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_int8_and_nf4_bases(tmp_path, scheme):
    """Written in the overlay's bfloat16: the base's rows dequantized (NF4 rows unpacked) as lookups do, the
    overlay's rows over them. (The overlay is written with the store: ``load_layer(..., overlay=)`` of an int8 /
    NF4 base fails today, its meta weight cannot require grad.)"""
    base = save_base(tmp_path / "base", scheme, 3)
    ckpt = Checkpoint.open(base)
    plan = pio.plan_layer(ckpt, TINY, 0, pio.find_layers(ckpt)[0])
    table = DiskTable.from_checkpoint(ckpt, plan, cache_bytes=0)
    fingerprint = base_fingerprint(ckpt, plan, table)
    table.close()
    ids = torch.tensor([0, 2042, 2043, ROWS - 1])
    with OverlayStore.open(tmp_path / "ov", base=fingerprint, dim=D, memory_bytes=1 << 20) as store:
        store.update(ids, torch.full((4, D), 3.0), {})
        store.flush()
    pio.merge(base, tmp_path / "ov", tmp_path / "out", ple_only=True)
    assert stored_dtypes(tmp_path / "out") == ["bfloat16", "int8" if scheme == "int8" else "uint8"]
    want = dequantize(*pio.read_table_rows(base), torch.bfloat16)
    want[ids] = 3.0
    assert_bitwise_equal(table_of(tmp_path / "out"), want)


def test_a_load_layers_folder_of_overlays(tmp_path):
    base = save_base(tmp_path / "base", None, 3)
    layers = pio.load_layers(base, offload="disk", overlay=tmp_path / "ov", overlay_bytes=2000)
    train(layers)
    rows = []
    for layer in layers:
        layer.table.flush()
        rows.append(looked_up(layer, torch.bfloat16))
        layer.table.close()
    assert sorted(p.name for p in (tmp_path / "ov").iterdir()) == ["ple_layer_0", "ple_layer_1"]
    summary = pio.merge(base, tmp_path / "ov", tmp_path / "out")
    for i in range(2):
        assert_bitwise_equal(table_of(tmp_path / "out", i), rows[i], name=f"layer {i}")
        assert not torch.equal(rows[i], base_rows(base, i))
        assert summary["overlays"][i]["path"] == str(tmp_path / "ov" / f"ple_layer_{i}")
    one = pio.merge(base, tmp_path / "ov" / "ple_layer_1", tmp_path / "one")     # one of them, found by its base
    assert one["overlays"][0] is None and one["overlays"][1]["rows"] == summary["overlays"][1]["rows"]
    assert_bitwise_equal(table_of(tmp_path / "one", 1), rows[1])
    assert_bitwise_equal(table_of(tmp_path / "one", 0), base_rows(base, 0))


def test_other_files_copied_but_not_the_bases_optimizer_state_nor_an_overlay_inside_it(tmp_path):
    base = save_base(tmp_path / "base", None, 0)
    (base / "optimizer").mkdir()                                      # a base's state: not the merged training's
    (base / "optimizer" / "model.safetensors").write_bytes(b"state")
    (base / "extra").mkdir()
    (base / "extra" / "notes.txt").write_text("kept")
    layer = pio.load_layer(base, offload="disk", overlay=base / "runs" / "ov")
    layer.table.overlay.update(torch.tensor([5]), torch.ones(1, D), {})
    layer.table.overlay.flush()
    layer.table.close()
    pio.merge(base, base / "runs" / "ov", tmp_path / "out")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["config.json", "extra", "model.safetensors", "tokenizer.json"], names
    assert (tmp_path / "out" / "extra" / "notes.txt").read_text() == "kept"
    assert_bitwise_equal(table_of(tmp_path / "out")[5], torch.ones(D, dtype=torch.bfloat16))
    pio.merge(base, base / "runs" / "ov", base / "runs" / "merged")                # out inside the base's folder
    assert sorted(p.name for p in (base / "runs" / "merged").iterdir()) == names


# ---- refusals ---------------------------------------------------------------------------------------------
def test_an_overlay_of_another_base_is_refused_naming_it(trained, tmp_path):
    base, overlay, _ = trained["whole"]
    other = save_base(tmp_path / "other", None, 0, seed=11)            # same config, other rows
    with pytest.raises(ValueError, match=f"^overlay: {re.escape(str(overlay))} was made on another base.*sample"):
        pio.merge(other, overlay, tmp_path / "out")
    sharded = trained["sharded"][0]                                   # same rows, other files
    with pytest.raises(ValueError, match=r"^overlay: .*another base.*files"):
        pio.merge(sharded, overlay, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="^overlay: .* holds no overlay"):
        pio.merge(base, tmp_path, tmp_path / "out")


@pytest.mark.parametrize("where", ["rows", "header"])
def test_a_damaged_overlay_file_is_a_value_error_naming_it(trained, tmp_path, where):
    base, overlay, _ = trained["whole"]
    shutil.copytree(overlay, tmp_path / "ov", ignore=shutil.ignore_patterns("overlay.lock"))
    seg = sorted((tmp_path / "ov").glob("seg-*.safetensors"))[-1]
    data = bytearray(seg.read_bytes())
    data[-1 if where == "rows" else 20] ^= 0x40                     # the last bytes are rows; 20: the JSON header
    seg.write_bytes(bytes(data))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"old")
    with pytest.raises(ValueError, match=f"^overlay: {re.escape(str(seg))}.*checksum"):
        pio.merge(base, tmp_path / "ov", tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"old"     # checked before out is touched


def test_out_over_the_base_or_the_overlay_is_refused(trained, tmp_path):
    base, overlay, _ = trained["whole"]
    before = base_rows(base)
    for out in (base, base / "merged.safetensors", base / "model.safetensors", overlay, overlay / "x.safetensors"):
        with pytest.raises(ValueError, match="^out: "):
            pio.merge(base, overlay, out, overwrite=True)
    assert_bitwise_equal(base_rows(base), before)
    assert sorted(p.name for p in overlay.glob("*.safetensors")) == sorted(
        p.name for p in overlay.iterdir() if p.name.startswith("seg-"))
    pio.merge(base, overlay, tmp_path / "out")
    with pytest.raises(ValueError, match="^path: .* already holds a checkpoint"):
        pio.merge(base, overlay, tmp_path / "out")
    pio.merge(base, overlay, tmp_path / "out", overwrite=True)


def test_the_base_mapping_is_not_written_into(trained, tmp_path):
    """Blocks read from the base (a view of the checkpoint's mapping when no cast is needed) are copied before the
    overlay's rows go in: the caller's `Checkpoint` still reads the base."""
    base, overlay, rows = trained["whole"]
    ckpt = Checkpoint.open(base)
    key = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding.weight"
    pio.merge(ckpt, overlay, tmp_path / "out")
    assert_bitwise_equal(ckpt.read(key), base_rows(base))
    assert_bitwise_equal(table_of(tmp_path / "out"), rows)


# ---- memory -------------------------------------------------------------------------------------------------
class LargestTensor(TorchDispatchMode):
    """Records the most elements of a tensor an op makes in memory (factories, copies, casts, gathers): its
    outputs that alias no input (not views, in-place results or tensors over a file's mapping), not on "meta"."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.op, self.paused = 0, None, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        outs = out if isinstance(out, (tuple, list)) and len(func._schema.returns) > 1 else (out,)
        for ret, o in zip(func._schema.returns, outs, strict=False):
            for t in tree_flatten(o)[0]:
                if ret.alias_info is None and isinstance(t, torch.Tensor) and t.device.type != "meta" \
                        and t.numel() > self.numel:
                    self.numel, self.op = t.numel(), (func, tuple(t.shape))
        return out


@pytest.mark.parametrize("table_dtype", [None, "fp8", "int8"])
def test_memory_is_a_few_blocks(trained, tmp_path, table_dtype, monkeypatch):
    """Blocks of 64 rows (256 values): no tensor of a quarter of the table's values is ever made. The base's
    fingerprint reads ``SAMPLE_ROWS`` rows through the disk table's positional reads, whose scratch holds the
    pages of their coalesced runs (at this tiny table, the whole file; at a real one, a page or two a row): a
    constant of the sample, not of the table, so it is not counted, and only that sample may be read so."""
    base, overlay, rows = trained["sharded"]
    mode = LargestTensor()
    reads_not_counted(monkeypatch, mode, SAMPLE_ROWS, "the fingerprint's sample")
    with mode:
        pio.merge(base, overlay, tmp_path / "out", parts=0, table_dtype=table_dtype, block_bytes=64 * D * 4,
                  ple_only=True)
    assert 0 < mode.numel < ROWS * D // 4, mode.op
    got = pio.load_layer(tmp_path / "out").table
    if table_dtype is None:
        assert_bitwise_equal(got.weight, rows)
    else:
        assert_bitwise_equal(got.weight, quantize(rows.float(), table_dtype)[0])


# ---- the command line ------------------------------------------------------------------------------------------
def test_command_line(trained, tmp_path, capsys):
    from ple.__main__ import main

    base, overlay, rows = trained["sharded"]
    assert main(["merge", str(base), str(overlay), str(tmp_path / "out"), "--parts", "0"]) == 0
    printed = capsys.readouterr().out
    assert "layers.0.ple.: table whole, bfloat16;" in printed and "trained rows from" in printed
    assert "layers.1.ple.: table whole, bfloat16; not trained" in printed
    assert f"wrote {tmp_path / 'out' / 'model.safetensors'}" in printed
    assert_bitwise_equal(table_of(tmp_path / "out"), rows)
    assert main(["merge", str(base), str(overlay), str(tmp_path / "q"), "--table-dtype", "int8"]) == 2
    assert capsys.readouterr().err.startswith("error: table_dtype: transformers would load")
    assert main(["merge", str(base), str(overlay), str(tmp_path / "q"), "--table-dtype", "int8", "--ple-only"]) == 0
    assert "table whole" not in capsys.readouterr().out                # as the base: 3 shards
    assert main(["merge", str(trained["whole"][0]), str(overlay), str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith("error: overlay: ")
    assert main(["merge", str(tmp_path / "nothing"), str(overlay), str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith("error: path: ")
    layer = pio.load_layer(base, offload="disk", overlay=overlay)     # held by a trainer: its last flush is merged
    try:
        store = layer.table.overlay
        state = {name: torch.zeros(1, *shape) for name, shape, _ in store.layout.state}
        store.update(torch.tensor([0]), torch.full((1, store.layout.dim), 7.0), state)   # not flushed: not merged
        assert main(["merge", str(base), str(overlay), str(tmp_path / "y"), "--parts", "0"]) == 0
        assert_bitwise_equal(table_of(tmp_path / "y"), rows)
    finally:
        layer.table.close()


def test_command_line_help(capsys):
    from ple.__main__ import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "merge" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    text = capsys.readouterr().out
    for line in text.split("options:")[1].split("\n  -")[1:]:        # every option has its help
        assert len(line.split()) > 1, line


# ---- transformers ----------------------------------------------------------------------------------------------
def test_transformers_loads_the_merged_float_checkpoint(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Qwen4ExpForCausalLM

    from ple.integrations.transformers import tiny_config

    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(tiny_config()).eval()
    src = tmp_path / "model"
    model.save_pretrained(src)                                        # float32, tables in 3 shards
    layers = pio.load_layers(src, offload="disk", overlay=tmp_path / "ov")
    train(layers, steps=2)
    rows = []
    for layer in layers:
        layer.table.flush()
        rows.append(looked_up(layer, torch.float32))
        layer.table.close()
    pio.merge(src, tmp_path / "ov", tmp_path / "out")
    assert (tmp_path / "out" / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    hf = Qwen4ExpForCausalLM.from_pretrained(tmp_path / "out").eval()
    ple_tables = {}
    for (name, p), (name0, p0) in zip(hf.named_parameters(), model.named_parameters(), strict=True):
        assert name == name0
        if "ngram_embedding" in name:
            ple_tables[name] = p
        else:
            assert_bitwise_equal(p.detach(), p0.detach(), name=name)
    for i, decoder in enumerate((0, 2)):                            # PLE on decoder layers 1 and 3
        table = hf.model.layers[decoder].ple.ple_embedding.ngram_embedding.weight.detach()
        assert_bitwise_equal(table, rows[i], name=f"PLE layer {i}")
        assert not torch.equal(table, model.model.layers[decoder].ple.ple_embedding.ngram_embedding.weight)
    assert ple_tables
