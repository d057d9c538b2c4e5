"""``ple.io`` for the Engram family (docs/spec.md 14: "``ple.io.save`` / ``load_layer`` (its ``config.json`` keeps
the family), the disk table, quantized tables, sharding").

An Engram layer saved and loaded is the same layer bit for bit (every parameter and buffer, ``state_dict``, the
forward) whole or sharded, separate or merged projections, in memory, in host memory and on disk, float or
quantized (FP8, int8, NF4; by ``save``'s ``table_dtype`` or ``convert``); the checkpoint keeps the family, its
``engram_vocab_size`` and ``token_map``, the projections' biases, and the family's prefix ``layers.{i}.engram.``
(0-based layer ids). A row optimizer saved and resumed gives the bits of a run never stopped; training through the
disk table's overlay gives the bits of training in memory, resumes, and merges. ``inspect`` names the family and
says transformers cannot load it. Broken checkpoints (a bias missing, another config) are ``ValueError``s naming
the key. The sharded (DTensor) table: ``tests/distributed/test_engram_sharded.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import ple.io as pio
import ple.optim as O
from ple import PLEConfig, PLELayer
from ple.__main__ import main
from ple.io.disk_table.overlay.store import OverlayStore
from ple.io.disk_table.table import DiskTable
from ple.io.files import Checkpoint
from ple.io.policy import ENGRAM_PROBLEM
from ple.reference import hash_params
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

# C = 12 (hc_count 2 x hidden 6), E = 16, D = 4 (even: NF4), K = 3; layer ids 0 and 3 (0-based, as the demo's);
# a token map folding the 50 token ids onto 17.
CFG = PLEConfig.engram(vocab_size=50, hidden_size=6, hc_count=2, engram_vocab_size=[23, 31], max_ngram_size=3,
                       n_embed_per_ngram=8, n_head_per_ngram=2, layer_ids=[0, 3], pad_id=2, seed=5, kernel_size=3,
                       token_map=[(7 * t) % 17 for t in range(50)]).replace(split_ngram_parts=3)
C, H = CFG.hc_hidden_size, CFG.hidden_size
PFX = ["layers.0.engram.", "layers.3.engram."]
SCHEMES = ["fp8", "int8", "nf4"]


def layers(dtype=torch.float32, seed=1, **kw) -> list[PLELayer]:
    """Both PLE layers, every parameter random (biases and norms too)."""
    return [random_layer(CFG, i, dtype, seed + i, **kw) for i in range(CFG.num_ple_layers)]


def inputs(seed: int, dtype=torch.float32, B: int = 2, L: int = 9):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, C, generator=g).to(dtype), torch.randint(0, CFG.vocab_size, (B, L), generator=g)


def assert_same_layer(got: PLELayer, want: PLELayer, *, table: bool = True) -> None:
    """Every parameter and buffer (the token map too) and the ``state_dict`` (the demo's keys) bit for bit, and the
    forward; ``table=False``: the table left out of the tensor comparison (a disk table holds none)."""
    def tensors(layer):
        out = dict(layer.named_parameters()) | dict(layer.named_buffers())
        return {k: v for k, v in out.items() if table or "ngram_embedding" not in k}

    a, b = tensors(got), tensors(want)
    assert sorted(a) == sorted(b)
    for k in b:
        assert_bitwise_equal(a[k], b[k], name=k)
    sa, sb = got.state_dict(), want.state_dict()
    if not table:                                  # a disk table's state: at most its FP8 scale
        sa, sb = ({k: v for k, v in d.items() if not k.startswith("multi_head_embedding.embedding.")
                   or (k.endswith("weight_scale") and k in sa and k in sb)} for d in (sa, sb))
    assert sorted(sa) == sorted(sb)
    for k in sb:
        assert_bitwise_equal(sa[k], sb[k], name=f"state_dict {k}")
    assert got.config == want.config and got.config.family == "engram"
    h, ids = inputs(7, want.key_proj.weight.dtype)
    with torch.no_grad():
        assert_bitwise_equal(got(h, ids), want(h, ids), name="forward")


# ---- the checkpoint ---------------------------------------------------------------------------------------------
def test_the_checkpoint_keeps_the_family_its_prefix_and_the_biases(tmp_path):
    mem = layers()
    pio.save(mem, tmp_path / "ck")
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert config["family"] == "engram" and config["engram_vocab_size"] == [23, 31]
    assert config["token_map"] == list(CFG.token_map) and config["ple_layer_ids"] == [0, 3]
    assert config["ple_only"] == [ENGRAM_PROBLEM]                        # marked: transformers cannot load it
    assert PLEConfig.from_dict(config) == CFG
    ckpt = Checkpoint.open(tmp_path / "ck")
    assert PLEConfig.from_dict(json.loads(ckpt.metadata["ple.config"])) == CFG
    assert pio.find_layers(ckpt) == PFX == [pio.model_prefix(CFG, i) for i in range(2)]
    keys = set(ckpt.keys())
    for pfx, layer in zip(PFX, mem, strict=True):
        assert ckpt.info(pfx + "key_proj.bias").shape == (C,) and ckpt.info(pfx + "value_proj.bias").shape == (H,)
        assert {f"{pfx}ple_embedding.ngram_embedding.shard_{k}.weight" for k in range(3)} <= keys
        assert_bitwise_equal(ckpt.read(pfx + "key_proj.bias"), layer.key_proj.bias, name="key bias")
        assert_bitwise_equal(ckpt.read(pfx + "value_proj.bias"), layer.value_proj.bias, name="value bias")
        p = hash_params(CFG, layer.ple_layer_index)
        assert ckpt.read(pfx + "ple_embedding.layer_multipliers").tolist() == p.multipliers.tolist()
    assert not any("multi_head_embedding" in k or "key_projs" in k for k in keys)   # ple's names, not the demo's
    plan = pio.plan_layer(ckpt, CFG, 1, PFX[1])
    assert plan.biases and not plan.unknown and all(b.status == "match" for b in plan.buffers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts, merged_kv", [(None, False), (0, False), (2, True), (0, True)])
def test_save_load_round_trip(tmp_path, parts, merged_kv, dtype):
    mem = layers(dtype)
    pio.save(mem, tmp_path / "ck", parts=parts, merged_kv=merged_kv, max_file_bytes=3000)
    keys = set(Checkpoint.open(tmp_path / "ck").keys())
    assert (PFX[0] + "kv_proj.bias" in keys) == merged_kv == (PFX[0] + "key_proj.bias" not in keys)
    for i, want in enumerate(mem):
        got, report = pio.load_layer(tmp_path / "ck", ple_layer_index=i, return_report=True)     # the saved config
        assert report.prefix == PFX[i] and report.merged_kv == merged_kv and not report.skipped
        assert_same_layer(got, want)
    assert [la.ple_layer_index for la in pio.load_layers(tmp_path / "ck")] == [0, 1]


def test_a_custom_prefix_and_a_single_file(tmp_path):
    mem = layers()
    pio.save(mem, tmp_path / "m.safetensors", prefix="model.layers.{i}.engram_{index}.")
    assert pio.find_layers(Checkpoint.open(tmp_path / "m.safetensors")) == ["model.layers.0.engram_0.",
                                                                              "model.layers.3.engram_1."]
    for i, want in enumerate(mem):
        assert_same_layer(pio.load_layer(tmp_path / "m.safetensors", ple_layer_index=i), want)


@pytest.mark.parametrize("offload", [True, "host", "disk"])
def test_offloaded_loads_equal_the_layer(tmp_path, offload):
    mem = layers(torch.bfloat16)
    pio.save(mem, tmp_path / "ck", parts=2)
    for i, want in enumerate(mem):
        got = pio.load_layer(tmp_path / "ck", ple_layer_index=i, offload=offload, cache_bytes=None if
                             offload != "disk" else 200)
        disk = offload == "disk"
        assert isinstance(got.table, DiskTable) == disk
        assert_same_layer(got, want, table=not disk)
        ids = torch.arange(got.table.num_rows).view(-1, 1)
        with torch.no_grad():                                          # every row, as its lookups read it
            assert_bitwise_equal(got.table.lookup(ids, torch.float32, ops=got.ops),
                                 want.table.lookup(ids, torch.float32, ops=want.ops), name="rows")
        if disk:
            got.table.close()


# ---- quantized tables --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["save", "convert"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_tables(tmp_path, scheme, how):
    """``save(table_dtype=...)`` or ``convert`` of a float save: the layer quantized in memory, bit for bit, in
    memory and on disk (no ``ple_only`` needed: an Engram checkpoint is marked as such anyway)."""
    mem = layers(torch.bfloat16)
    if how == "save":
        pio.save(mem, tmp_path / "q", table_dtype=scheme, parts=2)
    else:
        pio.save(mem, tmp_path / "f", parts=2)
        pio.convert(tmp_path / "f", tmp_path / "q", table_dtype=scheme, parts=3)
        assert json.loads((tmp_path / "q" / "config.json").read_text())["family"] == "engram"
    for layer in mem:
        layer.ple_embedding.quantize_(scheme)
    for i, want in enumerate(mem):
        got = pio.load_layer(tmp_path / "q", ple_layer_index=i)
        assert got.table.quantized and got.table.weight.dtype == want.table.weight.dtype
        assert_same_layer(got, want)
        disk = pio.load_layer(tmp_path / "q", ple_layer_index=i, offload="disk", cache_bytes=100)
        assert_same_layer(disk, want, table=False)
        disk.table.close()


@pytest.mark.parametrize("merged_kv", [True, False])
def test_convert_merges_and_splits_the_biases_with_the_projections(tmp_path, merged_kv):
    mem = layers()
    pio.save(mem, tmp_path / "a", merged_kv=not merged_kv, parts=0)
    pio.convert(tmp_path / "a", tmp_path / "b", merged_kv=merged_kv)
    keys = set(Checkpoint.open(tmp_path / "b").keys())
    assert (PFX[1] + "kv_proj.bias" in keys) == merged_kv
    assert (PFX[1] + "key_proj.bias" in keys) == (PFX[1] + "value_proj.bias" in keys) == (not merged_kv)
    for i, want in enumerate(mem):
        assert_same_layer(pio.load_layer(tmp_path / "b", ple_layer_index=i), want)


# ---- broken checkpoints ------------------------------------------------------------------------------------------
def test_a_missing_bias_or_another_config_is_named(tmp_path):
    pio.save(layers()[0], tmp_path / "ck", parts=0)
    sd = load_file(tmp_path / "ck" / "model.safetensors")
    for key, shape in (("key_proj.bias", [C]), ("value_proj.bias", [H])):
        bad = tmp_path / f"no-{key}"
        bad.mkdir()
        save_file({k: v for k, v in sd.items() if k != PFX[0] + key}, bad / "model.safetensors")
        with pytest.raises(ValueError, match=rf"^{PFX[0]}{key}: missing .*{shape}"):
            pio.load_layer(bad, CFG)
    wrong = tmp_path / "wrong-shape"
    wrong.mkdir()
    save_file({**sd, PFX[0] + "value_proj.bias": torch.zeros(C)}, wrong / "model.safetensors")
    with pytest.raises(ValueError, match=rf"^{PFX[0]}value_proj.bias: expected shape \[{H}\]"):
        pio.load_layer(wrong, CFG)
    with pytest.raises(ValueError, match=rf"^{PFX[0]}ple_embedding.layer_multipliers: does not match"):
        pio.load_layer(tmp_path / "ck", CFG.replace(seed=6))               # another seed: other multipliers
    qwen = PLEConfig(vocab_size=50, hidden_size=6, hc_count=2, eos_token_id=2, ple_embed_dim=16,
                     ple_conv_kernel_size=3, ngram_size=3, heads_per_ngram=2, ple_layer_ids=(1,))
    with pytest.raises(ValueError, match=r"^layers.0.engram.ple_embedding"):     # the Qwen4Exp family's hash
        pio.load_layer(tmp_path / "ck", qwen, prefix=PFX[0])
    tiny = PLEConfig.preset("tiny")                        # a Qwen4Exp checkpoint with a bias: not dropped silently
    pio.save(random_layer(tiny, 0, torch.float32), tmp_path / "qwen", parts=0)
    qsd = load_file(tmp_path / "qwen" / "model.safetensors")
    qpfx = pio.model_prefix(tiny, 0)
    save_file({**qsd, qpfx + "key_proj.bias": torch.zeros(tiny.hc_hidden_size)},
              tmp_path / "qwen" / "model.safetensors")
    with pytest.raises(ValueError, match=rf"^{qpfx}key_proj.bias: a projection bias, but the config is of the "
                                         rf"Qwen4Exp family"):
        pio.load_layer(tmp_path / "qwen")


# ---- inspect ---------------------------------------------------------------------------------------------------
def test_inspect_names_the_family_and_says_transformers_cannot_load_it(tmp_path, capsys):
    pio.save(layers(), tmp_path / "ck", table_dtype="int8", merged_kv=True)
    report = pio.inspect(tmp_path / "ck")
    assert report["family"] == "engram" and report["ple_only"] == [ENGRAM_PROBLEM] and report["ple_only_marked"]
    assert [la["prefix"] for la in report["layers"]] == PFX
    assert [la["ple_layer_index"] for la in report["layers"]] == [0, 1]
    assert all(la["error"] is None and la["table"]["biases"] and la["table"]["scheme"] == "int8"
               for la in report["layers"])
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    text = capsys.readouterr().out
    assert "family: engram" in text and "layer_ids=[0, 3]" in text and "17 ids" not in text
    assert "token_map=50 ids -> 17" in text and "merged kv_proj with biases" in text
    assert "transformers: cannot load it (marked so in the checkpoint)" in text and "Qwen4Exp" in text
    assert "loads these PLE layers as they are" not in text


# ---- training: a row optimizer saved and resumed; the disk table's overlay ---------------------------------------
def _batch(seed: int, dtype=torch.float32):
    return inputs(seed, dtype, B=2, L=7)


def _train(layer, opt, dense, seeds, dtype=torch.float32):
    for seed in seeds:
        h, ids = _batch(seed, dtype)
        (layer(h, ids).float() * torch.linspace(-1, 1, C)).sum().backward()
        for o in (opt, dense):
            if o is not None:
                o.step()
                o.zero_grad()


def test_row_optimizer_saved_and_resumed_gives_the_bits_of_a_run_never_stopped(tmp_path):
    def fresh():
        layer = random_layer(CFG, 1, torch.float32, seed=30, backend="torch")
        return layer, O.RowwiseAdagrad(layer, lr=0.05), torch.optim.Adam(O.other_parameters(layer), lr=1e-3)

    whole, opt_w, dense_w = fresh()
    _train(whole, opt_w, dense_w, (1, 2, 3, 4))
    first, opt_f, dense_f = fresh()
    _train(first, opt_f, dense_f, (1, 2))
    pio.save(first, tmp_path / "ck", parts=2, optimizer=opt_f)
    torch.save(dense_f.state_dict(), tmp_path / "dense.pt")
    resumed = pio.load_layer(tmp_path / "ck", ple_layer_index=1, backend="torch")
    assert resumed.ple_layer_index == 1 and resumed.key_proj.bias is not None
    opt_r = O.RowwiseAdagrad(resumed, lr=123.0)                     # its hyperparameters come from the file
    dense_r = torch.optim.Adam(O.other_parameters(resumed), lr=1e-3)
    dense_r.load_state_dict(torch.load(tmp_path / "dense.pt"))
    pio.load_optimizer(opt_r, tmp_path / "ck")
    assert opt_r.param_groups[0]["lr"] == 0.05
    _train(resumed, opt_r, dense_r, (3, 4))
    assert_same_layer(resumed, whole)
    for name, t in opt_w.state[whole.table.weight].items():
        got = opt_r.state[resumed.table.weight][name]
        assert (torch.equal(got, t) if isinstance(t, torch.Tensor) else got == t), name


def _rows(layer, dtype):
    ids = torch.arange(layer.table.num_rows).view(-1, 1)
    with torch.no_grad():
        return layer.table.lookup(ids, dtype, ops=layer.ops).view(layer.table.num_rows, -1)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_training_through_the_overlay_equals_in_memory_resumes_and_merges(tmp_path, backend):
    """A bfloat16 base (table sharded in 2, over two files): RowwiseAdagrad on the table through the overlay (a
    budget of a few rows: they spill) equals the same training in memory, every row, state and the forward; flushed,
    closed and loaded again with ``load_optimizer`` it trains on to the same bits; ``merge`` writes the trained
    table; the base's files are never written."""
    base = tmp_path / "base"
    pio.save(layers(torch.bfloat16, seed=3), base, parts=2, max_file_bytes=2000)
    before = {p.name: p.read_bytes() for p in base.iterdir() if p.is_file()}
    ov = tmp_path / "ov"
    mem = pio.load_layer(base, ple_layer_index=1, backend=backend)
    disk = pio.load_layer(base, ple_layer_index=1, backend=backend, offload="disk", overlay=ov, overlay_bytes=300,
                          cache_bytes=100)
    opt_m, opt_d = O.RowwiseAdagrad(mem, lr=0.1), O.RowwiseAdagrad(disk, lr=0.1)
    for s in (1, 2):
        _train(mem, opt_m, None, [s], torch.bfloat16)
        _train(disk, opt_d, None, [s], torch.bfloat16)
    assert disk.table.overlay.stats()["spilled_rows"] > 0
    assert_bitwise_equal(_rows(disk, torch.bfloat16), mem.table.weight.detach(), name="rows")
    assert_same_layer(disk, mem, table=False)
    disk.table.flush()
    disk.table.close()

    again = pio.load_layer(base, ple_layer_index=1, backend=backend, offload="disk", overlay=ov, overlay_bytes=300)
    opt_a = O.RowwiseAdagrad(again, lr=7.0)
    pio.load_optimizer(opt_a, ov)
    for s in (3, 4):
        _train(mem, opt_m, None, [s], torch.bfloat16)
        _train(again, opt_a, None, [s], torch.bfloat16)
    assert_bitwise_equal(_rows(again, torch.bfloat16), mem.table.weight.detach(), name="rows, resumed")
    hit, got = again.table.overlay.read(torch.arange(again.table.num_rows))
    assert hit.any()
    assert_bitwise_equal(got["state.sum"], opt_m.state[mem.table.trained]["sum"], name="adagrad sum")
    assert_same_layer(again, mem, table=False)
    again.table.flush()
    again.table.close()

    summary = pio.merge(base, ov, tmp_path / "merged")
    assert summary["overlays"][0] is None and summary["overlays"][1]["rows"] > 0
    merged = pio.load_layer(tmp_path / "merged", ple_layer_index=1, backend=backend)
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["family"] == "engram"
    assert_same_layer(merged, mem)
    assert_same_layer(pio.load_layer(tmp_path / "merged", ple_layer_index=0), pio.load_layer(base, ple_layer_index=0))
    assert {p.name: p.read_bytes() for p in base.iterdir() if p.is_file()} == before


def test_a_quantized_base_trains_through_the_overlay(tmp_path):
    """An NF4 Engram base: rows never updated read as the base's dequantized rows, the trained ones move."""
    base = tmp_path / "nf4"
    pio.save(layers(torch.bfloat16), base, table_dtype="nf4", parts=0)
    ref = pio.load_layer(base)
    disk = pio.load_layer(base, offload="disk", overlay=tmp_path / "ov")
    opt = O.RowwiseAdagrad(disk, lr=0.1)
    _train(disk, opt, None, [5], torch.bfloat16)
    after, start = _rows(disk, torch.bfloat16), _rows(ref, torch.bfloat16)
    hit, _ = disk.table.overlay.read(torch.arange(disk.table.num_rows), [])
    assert hit.any() and (after[hit] != start[hit]).any(1).all()
    assert_bitwise_equal(after[~hit], start[~hit], name="untouched rows")
    disk.table.close()


def test_an_overlay_of_another_token_map_is_refused_and_the_manifest_holds_its_digest(tmp_path):
    """The overlay's base fingerprint keeps the config's token map as a SHA-256 (the demo's map has 129280 ids, and
    every flush rewrites the manifest): a base of another map is a ``ValueError`` naming the overlay."""
    other = CFG.replace(token_map=[(5 * t) % 17 for t in range(50)])
    pio.save(layers(torch.bfloat16), tmp_path / "a", parts=0)
    pio.save([random_layer(other, i, torch.bfloat16, 1 + i) for i in range(2)], tmp_path / "b", parts=0)
    with pio.load_layer(tmp_path / "a", offload="disk", overlay=tmp_path / "ov") as disk:
        _train(disk, O.RowwiseAdagrad(disk, lr=0.1), None, [1], torch.bfloat16)
    manifest = OverlayStore.manifest(tmp_path / "ov")
    assert manifest["base"]["config"]["token_map"].startswith("sha256:")
    assert manifest["base"]["config"]["family"] == "engram"
    with pytest.raises(ValueError, match=r"^overlay: .*ov.* another base.*token_map"):
        pio.load_layer(tmp_path / "b", offload="disk", overlay=tmp_path / "ov")
    with pytest.raises(ValueError, match=r"^overlay: .*ov.* another base"):
        pio.merge(tmp_path / "b", tmp_path / "ov", tmp_path / "out")
