"""``ple.io.disk_table.training``: a disk table trained through an overlay (docs/spec.md 12, ``load_layer(...,
overlay=DIR)``).

Bits: training through the overlay equals the same training on the in-memory table (bfloat16 and float32
tables; every rule, fused or not, micro-batches, a memory budget so small that rows spill, lookups
prefetched or not, each backend), every row and every row's optimizer state. Resuming (flush, close, load
again, ``load_optimizer``) equals never stopping; updates after the last flush are lost. A quantized base
(FP8, int8, NF4) trains: a row's first update starts from its dequantized value, and rows never updated read
as the base's. The checkpoint's files are never written. Errors name their argument and change nothing: an
overlay without ``offload="disk"``, one made on another base, damaged overlay files, two writers, an
optimizer of another rule, a wrong path. The kill test is ``test_disk_train_kill.py``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from _tier import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import ple
import ple.io as pio
import ple.quant
from ple import PLEConfig
from ple.io.disk_table.overlay._files import MANIFEST
from ple.io.disk_table.table import DiskTable
from ple.optim.rowwise import STATE_NAMES
from ple.table import DenseTable
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

TINY = PLEConfig.preset("tiny")          # 6128 rows of D = 4, two PLE layers
OPTS = {"sgd": ple.optim.SparseSGD, "adagrad": ple.optim.RowwiseAdagrad, "adam": ple.optim.RowwiseAdam}
B, L = 2, 9
ROW = 2 * 4 + 4 * 4 + 4 + 24             # bytes of an Adam row (bfloat16, D = 4) in the overlay's memory


def save(path: Path, *, dtype: torch.dtype = torch.bfloat16, seed: int = 3, scheme: str | None = None,
         config: PLEConfig = TINY, **kw) -> Path:
    layers = [random_layer(config, i, dtype, seed + i) for i in range(config.num_ple_layers)]
    for layer in layers:
        if scheme is not None:
            layer.ple_embedding.quantize_(scheme)
    pio.save(layers, path, ple_only=scheme is not None, **kw)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Checkpoints saved once: float tables (bfloat16; float32; float32 stored under a bfloat16 layer),
    another seed and another config of the same shape (other bases), and quantized ones."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {"bf16": save(root / "bf16"), "f32": save(root / "f32", dtype=torch.float32),
           "f32-stored": save(root / "f32-stored", table_dtype="float32"),
           "other-seed": save(root / "other-seed", seed=11),
           "other-config": save(root / "other-config", config=replace(TINY, seed=99)),
           "sharded": save(root / "sharded", parts=3)}
    for scheme in ("fp8", "int8", "nf4"):
        out[scheme] = save(root / scheme, scheme=scheme)
    return out


def batch(step: int, micro: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro`` of step ``step``: the same for every run. Odd steps draw their tokens from four,
    so that rows are looked up many times in a step (the order their gradients are summed in shows)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    h = torch.randn(B, L, TINY.hc_hidden_size, generator=g).to(dtype)
    return h, (torch.randint(3, 7, (B, L), generator=g) if step % 2 else
               torch.randint(0, TINY.vocab_size, (B, L), generator=g))


def file_digests(path: Path) -> dict[str, tuple[str, int]]:
    """Every file of a checkpoint: its SHA-256 and modification time."""
    return {str(p.relative_to(path)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file()}


def dir_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file() and p.name != "overlay.lock"}


@dataclass
class Run:
    """A layer, its row optimizer, and (``dense``) an SGD on its other parameters; ``prefetch``: look the
    rows up through ``layer.start_prefetch``, started before the previous micro-batch's backward."""

    layer: ple.PLELayer
    opt: ple.optim.RowOptimizer
    dense: torch.optim.Optimizer | None = None
    prefetch: bool = False
    touched: list[torch.Tensor] = field(default_factory=list)     # ids of the rows the optimizer was given

    def __post_init__(self) -> None:
        accept = self.opt._accept

        def recording(table, ids, grad, ops):
            self.touched.append(ids.reshape(-1).clone())
            accept(table, ids, grad, ops)

        self.opt._accept = recording


def make_run(layer: ple.PLELayer, rule: str, *, fused: bool = False, lr: float = 0.05, weight_decay: float = 0.0,
             dense: bool = True, prefetch: bool = False) -> Run:
    opt = OPTS[rule](layer, lr=lr, weight_decay=weight_decay, fused=fused)
    sgd = torch.optim.SGD(ple.optim.other_parameters(layer), lr=1e-2) if dense else None
    return Run(layer, opt, sgd, prefetch)


def train(runs: list[Run], steps: range, micro: int = 1, lr_decay: float = 1.0) -> None:
    """Train every run on the same data: steps ``steps``, ``micro`` backward calls each (the loss: the mean
    square of the output), then ``step()`` and ``zero_grad()``. ``lr_decay``: the rows' lr is scaled by it
    before each step (as an LR scheduler would)."""
    seq = [(k, m) for k in steps for m in range(micro)]
    for run in runs:
        dtype = run.layer.key_proj.weight.dtype
        if run.prefetch and seq:
            run.layer.start_prefetch(batch(*seq[0], dtype)[1].reshape(-1), torch.arange(B + 1) * L)
        for i, (k, m) in enumerate(seq):
            h, ids = batch(k, m, dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("error")                          # a prefetch not used would warn
                out = run.layer(h, ids)
            if run.prefetch:
                assert run.layer.table.pending_prefetch is None          # consumed
                if i + 1 < len(seq):                                     # the next one, before this backward
                    run.layer.start_prefetch(batch(*seq[i + 1], dtype)[1].reshape(-1), torch.arange(B + 1) * L)
            out.float().square().mean().backward()
            if m == micro - 1:
                for group in run.opt.param_groups:
                    group["lr"] *= lr_decay
                for o in (run.opt, run.dense):
                    if o is not None:
                        o.step()
                        o.zero_grad()


def all_ids(layer: ple.PLELayer) -> torch.Tensor:
    return torch.arange(layer.table.num_rows)


def disk_rows(layer: ple.PLELayer, dtype: torch.dtype) -> torch.Tensor:
    """Every row of a disk table as its lookups read it, ``[rows, D]``."""
    with torch.no_grad():
        return layer.table.lookup(all_ids(layer).view(-1, 1), dtype, ops=layer.ops).view(-1, layer.table.dim)


def assert_same(disk: Run, mem: Run, rule: str, what: str = "") -> None:
    """The disk run's rows (every one, as looked up), overlay rows and state, step count and forward equal
    the in-memory run's bit for bit; the overlay holds exactly the rows the optimizer was given."""
    w = mem.layer.table.weight.detach()
    assert_bitwise_equal(disk_rows(disk.layer, w.dtype), w, name=f"{what}rows")
    store = disk.layer.table.overlay
    hit, got = store.read(all_ids(disk.layer))
    touched = torch.zeros(w.shape[0], dtype=torch.bool)
    if mem.touched:
        touched[torch.cat(mem.touched)] = True
    assert torch.equal(hit, touched), f"{what}the overlay's rows are not the rows trained"
    assert_bitwise_equal(got["rows"][hit].to(w.dtype), w[hit], name=f"{what}overlay rows")
    mem_state = mem.opt.state[mem.layer.table.trained]
    for name in STATE_NAMES[rule]:
        assert_bitwise_equal(got[f"state.{name}"], mem_state[name], name=f"{what}state {name}")
    assert disk.opt.state[disk.layer.table.trained]["step"] == mem_state["step"]
    h, ids = batch(10**6, 0, mem.layer.key_proj.weight.dtype)
    with torch.no_grad():
        assert_bitwise_equal(disk.layer(h, ids), mem.layer(h, ids), name=f"{what}forward")


def disk_layer(path: Path, overlay: Path, backend: str = "reference", **kw) -> ple.PLELayer:
    return pio.load_layer(path, backend=backend, offload="disk", overlay=overlay, **kw)


# ---- bits: the in-memory table's --------------------------------------------------------------------------
def bits_case(ckpts, tmp: Path, *, base: str, backend: str, rule: str, fused: bool, micro: int,
              overlay_bytes: int | None, prefetch: bool, steps: int = 3, lr: float = 0.05, weight_decay: float = 0.0,
              flush_at: int | None = None, cache_bytes: int | None = None) -> None:
    path = ckpts[base]
    before = file_digests(path)
    mem = make_run(pio.load_layer(path, backend=backend), rule, fused=fused, lr=lr, weight_decay=weight_decay)
    layer = disk_layer(path, tmp / "ov", backend, overlay_bytes=overlay_bytes, cache_bytes=cache_bytes)
    try:
        assert isinstance(layer.table, DiskTable) and layer.table.overlay is not None
        assert layer.table.overlay.layout.dtype == mem.layer.table.weight.dtype
        disk = make_run(layer, rule, fused=fused, lr=lr, weight_decay=weight_decay, prefetch=prefetch)
        done = flush_at if flush_at is not None else steps
        train([mem, disk], range(done), micro)
        if flush_at is not None:                    # a flush changes nothing the training sees
            layer.table.flush()
            train([mem, disk], range(done, steps), micro)
        assert_same(disk, mem, rule)
        if overlay_bytes is not None and overlay_bytes < 20 * ROW:
            assert layer.table.overlay.stats()["spilled_rows"] > 0
        layer.table.flush()
    finally:
        layer.table.close()
    assert file_digests(path) == before, "the checkpoint's files changed"


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
def test_training_equals_in_memory(ckpts, tmp_path, rule, backend, fused):
    """Every rule, fused or not, on each backend; two micro-batches a step; rows spilled past a budget of
    a few rows; a bfloat16 table unfused and prefetched, a float32 one fused."""
    bits_case(ckpts, tmp_path, base="f32" if fused else "bf16", backend=backend, rule=rule, fused=fused, micro=2,
              overlay_bytes=5 * ROW, prefetch=not fused)


@settings(max_examples=examples(10))
@given(data=st.data())
def test_training_equals_in_memory_property(ckpts, data):
    """Any mix of base, backend, rule, fusion, micro-batches, budget, prefetch, lr, weight decay, cache and a
    flush in between."""
    base = data.draw(st.sampled_from(["bf16", "f32", "f32-stored", "sharded"]), label="base")
    kw = dict(backend=data.draw(st.sampled_from(["reference", "torch"]), label="backend"),
              rule=data.draw(st.sampled_from(sorted(OPTS)), label="rule"),
              fused=data.draw(st.booleans(), label="fused"),
              micro=data.draw(st.integers(1, 3), label="micro"),
              overlay_bytes=data.draw(st.one_of(st.none(), st.just(0), st.integers(1, 40 * ROW)), label="bytes"),
              prefetch=data.draw(st.booleans(), label="prefetch"),
              steps=data.draw(st.integers(1, 4), label="steps"),
              lr=data.draw(st.sampled_from([0.05, 1.0]), label="lr"),
              weight_decay=data.draw(st.sampled_from([0.0, 0.1]), label="weight_decay"),
              cache_bytes=data.draw(st.sampled_from([None, 0, 500]), label="cache_bytes"))
    kw["flush_at"] = data.draw(st.one_of(st.none(), st.integers(0, kw["steps"])), label="flush_at")
    with tempfile.TemporaryDirectory() as tmp:
        bits_case(ckpts, Path(tmp), base=base, **kw)


@pytest.mark.deep
@pytest.mark.interpreter
@pytest.mark.parametrize("rule, fused", [("adagrad", False), ("adam", True)])
def test_training_equals_in_memory_triton(ckpts, tmp_path, rule, fused):
    """The Triton backend (interpreted on the CPU: slow, so two cases of two steps)."""
    bits_case(ckpts, tmp_path, base="bf16", backend="triton", rule=rule, fused=fused, micro=2,
              overlay_bytes=5 * ROW, prefetch=not fused, steps=2)


def test_moving_the_layer_keeps_training(ckpts, tmp_path):
    """``layer.to(...)`` (device, or the dtype it has) before and after the optimizer is made: the tensor the
    optimizer holds (``table.trained``) stays, and still requires grad, so training is unchanged."""
    path = ckpts["bf16"]
    mem = pio.load_layer(path)
    layer = disk_layer(path, tmp_path / "ov")
    for m in (mem, layer):
        m.to("cpu")
    runs = [make_run(mem, "adam"), make_run(layer, "adam")]
    trained = layer.table.trained
    for m in (mem, layer):
        m.to("cpu", torch.bfloat16)
    assert layer.table.trained is trained and trained.requires_grad
    train(runs, range(2))
    assert_same(runs[1], runs[0], "adam")
    layer.table.close()


# ---- resuming -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("rule", ["adagrad", "adam"])
def test_resume_equals_never_stopping(ckpts, tmp_path, rule, fused):
    """Train 3 steps, flush, train one more and close without flushing (lost), load again with the same overlay
    and ``load_optimizer``: the rows, state, step count and lr are the flush's, and training on to step 6 gives
    the bits of a run never stopped. Only the table trains (the other parameters are the checkpoint's on
    reload); the lr decays every step, so the lr the flush kept matters, and so does Adam's step count."""
    path, ov = ckpts["bf16"], tmp_path / "ov"
    before = file_digests(path)
    mem = make_run(pio.load_layer(path), rule, fused=fused, dense=False)
    first = make_run(disk_layer(path, ov, overlay_bytes=8 * ROW), rule, fused=fused, dense=False)
    train([mem, first], range(3), micro=2, lr_decay=0.7)
    first.layer.table.flush()
    flushed_lr = first.opt.param_groups[0]["lr"]
    train([first], range(3, 4), micro=2, lr_decay=0.7)                 # after the flush: lost
    first.layer.table.close()

    layer = disk_layer(path, ov, overlay_bytes=8 * ROW)
    assert layer.table.overlay.meta["optimizer"]["step"] == (6 if fused else 3)
    second = make_run(layer, rule, fused=fused, dense=False)
    second.touched = mem.touched                         # the rows trained, in either life
    pio.load_optimizer(second.opt, ov)
    assert second.opt.param_groups[0]["lr"] == flushed_lr
    assert_same(second, mem, rule, "resumed: ")
    train([mem, second], range(3, 6), micro=2, lr_decay=0.7)
    assert_same(second, mem, rule, "trained on: ")
    layer.table.close()
    assert file_digests(path) == before


def test_resume_without_load_optimizer_differs(ckpts, tmp_path):
    """The control of the test above: Adam resumed with its step count at 0 (no ``load_optimizer``) does not
    give the bits of a run never stopped (so the test above measures the step count's round trip)."""
    path, ov = ckpts["bf16"], tmp_path / "ov"
    mem = make_run(pio.load_layer(path), "adam", dense=False)
    first = make_run(disk_layer(path, ov), "adam", dense=False)
    train([mem, first], range(3))
    first.layer.table.flush()
    first.layer.table.close()
    second = make_run(disk_layer(path, ov), "adam", dense=False)
    train([mem, second], range(3, 5))
    with pytest.raises(AssertionError, match="rows"):
        assert_bitwise_equal(disk_rows(second.layer, torch.bfloat16), mem.layer.table.weight.detach(), name="rows")
    second.layer.table.close()


def test_close_without_flush_loses_everything_since(ckpts, tmp_path):
    """An overlay never flushed leaves nothing: loaded again, every row is the base's and there is no
    optimizer state to load (``load_optimizer`` is a ValueError naming ``path``)."""
    path, ov = ckpts["bf16"], tmp_path / "ov"
    base = pio.load_layer(path).table.weight.detach()
    run = make_run(disk_layer(path, ov, overlay_bytes=0), "adagrad")          # spills: files written, not durable
    train([run], range(2))
    assert run.layer.table.overlay.num_rows > 0
    run.layer.table.close()
    layer = disk_layer(path, ov)
    assert layer.table.overlay.num_rows == 0
    assert_bitwise_equal(disk_rows(layer, torch.bfloat16), base, name="rows")
    opt = ple.optim.RowwiseAdagrad(layer, lr=0.1)
    with pytest.raises(ValueError, match="^path: "):
        pio.load_optimizer(opt, ov)
    layer.table.close()


def test_two_layers_one_optimizer(ckpts, tmp_path):
    """``load_layers(..., overlay=DIR)``: one overlay per layer (``DIR/ple_layer_{i}``), one optimizer over both
    tables, resumed with ``load_optimizer(opt, DIR)``."""
    path, ov = ckpts["bf16"], tmp_path / "ov"
    mems = pio.load_layers(path)
    om = ple.optim.RowwiseAdam(mems, lr=0.05)
    disks = pio.load_layers(path, offload="disk", overlay=ov, overlay_bytes=3 * ROW)
    assert [Path(d.table.overlay.directory) for d in disks] == [ov / "ple_layer_0", ov / "ple_layer_1"]
    od = ple.optim.RowwiseAdam(disks, lr=0.05)

    def train_both(layers, opt, steps):
        for k in steps:
            h, ids = batch(k, 0, torch.bfloat16)
            for layer in layers:
                h = layer(h, ids)
            h.float().square().mean().backward()
            opt.step()
            opt.zero_grad()

    train_both(mems, om, range(2))
    train_both(disks, od, range(2))
    for d in disks:
        d.table.flush()
        d.table.close()
    disks = pio.load_layers(path, offload="disk", overlay=ov)
    od = ple.optim.RowwiseAdam(disks, lr=0.05)
    pio.load_optimizer(od, ov)
    train_both(mems, om, range(2, 4))
    train_both(disks, od, range(2, 4))
    for m, d in zip(mems, disks, strict=True):
        assert_bitwise_equal(disk_rows(d, torch.bfloat16), m.table.weight.detach(), name="rows")
        hit, got = d.table.overlay.read(all_ids(d))
        for name in STATE_NAMES["adam"]:
            assert_bitwise_equal(got[f"state.{name}"], om.state[m.table.trained][name], name=name)
        d.table.close()


# ---- a quantized base ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("scheme", ["fp8", "int8", "nf4"])
def test_quantized_base_trains(ckpts, tmp_path, scheme, backend):
    """A row's first update starts from its dequantized value in bfloat16 (the overlay's default dtype):
    training equals the in-memory training of a bfloat16 table holding the dequantized values; rows never
    updated still read as the quantized base's, and the base files are unchanged."""
    path = ckpts[scheme]
    before = file_digests(path)
    q = pio.load_layer(path, backend=backend)                   # the quantized table, in memory
    deq = ple.quant.dequantize(q.table.weight, q.table.scale, torch.bfloat16)
    float_table = DenseTable(q.table.num_rows, q.table.dim, dtype=torch.bfloat16)
    with torch.no_grad():
        float_table.weight.copy_(deq)
    mem_layer = pio.load_layer(path, backend=backend)
    mem_layer.ple_embedding.ngram_embedding = float_table
    rule = {"fp8": "adam", "int8": "adagrad", "nf4": "sgd"}[scheme]
    fused = backend == "torch"
    mem = make_run(mem_layer, rule, fused=fused)
    layer = disk_layer(path, tmp_path / "ov", backend, overlay_bytes=6 * ROW)
    assert layer.table.quantized and layer.table.overlay.layout.dtype == torch.bfloat16
    disk = make_run(layer, rule, fused=fused, prefetch=True)
    train([mem, disk], range(3), micro=2)
    assert_same(disk, mem, rule)
    hit = layer.table.overlay.read(all_ids(layer))[0]
    with torch.no_grad():
        base = q.table.lookup(all_ids(q).view(-1, 1), torch.bfloat16, ops=q.ops).view(-1, q.table.dim)
    got = disk_rows(layer, torch.bfloat16)
    assert 0 < int(hit.sum()) < hit.numel()
    assert_bitwise_equal(got[~hit], base[~hit], name="rows never updated")
    assert not torch.equal(got[hit], base[hit])
    layer.table.flush()
    layer.table.close()
    assert file_digests(path) == before


def test_quantized_base_overlay_dtype(ckpts, tmp_path):
    """``overlay_dtype=torch.float32`` on an FP8 base: a row's first update dequantizes it to float32."""
    path = ckpts["fp8"]
    q = pio.load_layer(path)
    float_table = DenseTable(q.table.num_rows, q.table.dim, dtype=torch.float32)
    with torch.no_grad():
        float_table.weight.copy_(ple.quant.dequantize(q.table.weight, q.table.scale, torch.float32))
    mem_layer = pio.load_layer(path, dtype=torch.float32)
    mem_layer.ple_embedding.ngram_embedding = float_table
    mem = make_run(mem_layer, "adagrad")
    layer = disk_layer(path, tmp_path / "ov", overlay_dtype=torch.float32, dtype=torch.float32)
    assert layer.table.overlay.layout.dtype == torch.float32
    disk = make_run(layer, "adagrad")
    train([mem, disk], range(3))
    assert_same(disk, mem, "adagrad")
    layer.table.close()


def test_quantized_table_without_overlay_does_not_train(ckpts):
    layer = pio.load_layer(ckpts["fp8"], offload="disk")
    with pytest.raises(ValueError, match="^params: .*quantized"):
        ple.optim.RowwiseAdagrad(layer, lr=0.1)
    layer.table.close()


# ---- errors: named, and nothing changed -------------------------------------------------------------------
def trained_overlay(path: Path, ov: Path, rule: str = "adagrad", flushes: int = 2, **kw) -> None:
    """An overlay of ``rule`` flushed ``flushes`` times (a step before each), closed."""
    run = make_run(disk_layer(path, ov, **kw), rule)
    for k in range(flushes):
        train([run], range(k, k + 1))
        run.layer.table.flush()
    run.layer.table.close()


def test_argument_errors(ckpts, tmp_path):
    path, ov = ckpts["bf16"], tmp_path / "ov"
    for offload in (False, True, "host"):
        with pytest.raises(ValueError, match="^overlay: .*offload='disk'"):
            pio.load_layer(path, offload=offload, overlay=ov)
    with pytest.raises(ValueError, match="^overlay_bytes, overlay_dtype: "):
        pio.load_layer(path, offload="disk", overlay_bytes=1000)
    with pytest.raises(ValueError, match="^overlay_bytes, overlay_dtype: "):
        pio.load_layer(path, offload="disk", overlay_dtype=torch.float32)
    with pytest.raises(TypeError, match="^overlay: "):
        pio.load_layer(path, offload="disk", overlay=3)
    with pytest.raises(ValueError, match="^overlay_bytes"):
        pio.load_layer(path, offload="disk", overlay=ov, overlay_bytes=-1)
    with pytest.raises(TypeError, match="^overlay_dtype: "):
        pio.load_layer(path, offload="disk", overlay=ov, overlay_dtype=torch.int8)
    assert not ov.exists()
    plain = pio.load_layer(path, offload="disk")
    with pytest.raises(ValueError, match="^flush: "):
        plain.table.flush()
    assert plain.table.overlay is None
    plain.table.close()


@pytest.mark.parametrize("other", ["other-seed", "other-config", "sharded"])
def test_overlay_of_another_base(ckpts, tmp_path, other):
    """Another checkpoint of the same config and shape, another config, the same rows in other files: a
    ValueError naming ``overlay``; the overlay's files are unchanged and it still loads on its own base. A
    copy of the base elsewhere is the same base."""
    path, ov = ckpts["bf16"], tmp_path / "ov"
    trained_overlay(path, ov)
    files = dir_bytes(ov)
    with pytest.raises(ValueError, match=f"^overlay: {re.escape(str(ov))} was made on another base"):
        disk_layer(ckpts[other], ov)
    assert dir_bytes(ov) == files
    moved = shutil.copytree(path, tmp_path / "moved")
    layer = disk_layer(moved, ov)
    assert layer.table.overlay.num_rows > 0
    layer.table.close()


def test_overlay_dtype_of_an_existing_overlay(ckpts, tmp_path):
    path, ov = ckpts["bf16"], tmp_path / "ov"
    trained_overlay(path, ov)
    files = dir_bytes(ov)
    with pytest.raises(ValueError, match="^overlay_dtype: .*bfloat16"):
        disk_layer(path, ov, overlay_dtype=torch.float32)
    assert dir_bytes(ov) == files
    layer = disk_layer(path, ov, overlay_dtype=torch.bfloat16)           # its own: fine
    layer.table.close()


def test_second_writer_refused(ckpts, tmp_path):
    """A second ``load_layer`` on an overlay open for training (a notebook's cell run again) is a RuntimeError
    saying that this process holds it and how to let go (``layer.table.close()``); the first trains on."""
    path, ov = ckpts["bf16"], tmp_path / "ov"
    mem = make_run(pio.load_layer(path), "adagrad")
    run = make_run(disk_layer(path, ov), "adagrad")
    train([mem, run], range(1))
    run.layer.table.flush()
    with pytest.raises(RuntimeError, match=f"^overlay: {re.escape(str(ov))} is held by this process: .*"
                                           r"Release it with layer\.table\.close\(\)"):
        disk_layer(path, ov)
    train([mem, run], range(1, 2))
    run.layer.table.flush()
    assert_same(run, mem, "adagrad")
    run.layer.table.close()
    disk_layer(path, ov).table.close()                        # released with the first


def test_a_layer_dropped_releases_its_overlay(ckpts, tmp_path):
    """A layer (and its optimizer) deleted without ``close`` releases the overlay's lock once garbage-collected:
    loading again works, as of the last flush (the unflushed rows' spill files are deleted then)."""
    path, ov = ckpts["bf16"], tmp_path / "ov"
    run = make_run(disk_layer(path, ov, overlay_bytes=0), "adagrad", dense=False)
    train([run], range(1))
    run.layer.table.flush()
    flushed = dir_bytes(ov)
    train([run], range(1, 2))                                  # spilled, not flushed
    assert set(dir_bytes(ov)) > set(flushed)
    layer, opt = run.layer, run.opt
    del run, layer, opt
    gc.collect()
    again = disk_layer(path, ov, overlay_bytes=0)
    assert again.table.overlay.meta["optimizer"]["step"] == 1
    assert dir_bytes(ov) == flushed
    again.table.close()


def test_with_block_flushes_then_closes(ckpts, tmp_path):
    """``with load_layer(..., overlay=DIR) as layer:``: leaving the block flushes (the optimizer's step count
    too) and closes (the lock released, the table's lookups refused after); leaving it by an exception closes
    without flushing (the overlay as of its last flush). A disk layer without an overlay is closed; a layer in
    memory is left as it was."""
    path, ov = ckpts["bf16"], tmp_path / "ov"
    mem = make_run(pio.load_layer(path, backend="torch"), "adagrad", dense=False)
    with disk_layer(path, ov, "torch", overlay_bytes=1 << 16) as layer:
        run = make_run(layer, "adagrad", dense=False)
        train([mem, run], range(2))
    with pytest.raises(RuntimeError, match="closed"):
        disk_rows(layer, torch.bfloat16)
    flushed = dir_bytes(ov)
    with pytest.raises(KeyError), disk_layer(path, ov, "torch", overlay_bytes=1 << 16) as layer:
        run = make_run(layer, "adagrad", dense=False)
        pio.load_optimizer(run.opt, ov)
        train([run], range(2, 3))
        raise KeyError("a cell's error")
    assert dir_bytes(ov) == flushed                            # not flushed; the lock released
    with disk_layer(path, ov, "torch", overlay_bytes=1 << 16) as layer:
        resumed = make_run(layer, "adagrad", dense=False)
        resumed.touched = mem.touched
        pio.load_optimizer(resumed.opt, ov)
        assert_same(resumed, mem, "adagrad")
    flushed = dir_bytes(ov)
    with disk_layer(path, ov, "torch", overlay_bytes=1 << 16) as layer:
        layer.table.close()                                    # closed in the block: nothing to flush at its end
    assert dir_bytes(ov) == flushed
    with pio.load_layer(path, offload="disk") as served:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        disk_rows(served, torch.bfloat16)
    with mem.layer as same:
        assert same is mem.layer
    h, ids = batch(7, 0, torch.bfloat16)
    with torch.no_grad():
        assert mem.layer(h, ids).shape == h.shape               # still usable


def test_casting_to_another_dtype_than_the_overlays_is_refused(ckpts, tmp_path):
    """``layer.to(dtype)`` over an overlay of other rows is a ValueError naming ``dtype``, and nothing changed
    (before it, training wrote the overlay's dtype under a layer of another); a cast to the overlay's dtype,
    and casts of a quantized base (whose rows the overlay's dtype never followed), are fine."""
    path, ov = ckpts["bf16"], tmp_path / "ov"
    layer = disk_layer(path, ov, overlay_bytes=0)
    for cast in (lambda m: m.to(torch.float32), lambda m: m.to("cpu", torch.float64), lambda m: m.half(),
                 lambda m: m.float()):
        with pytest.raises(ValueError, match=r"^dtype: .*overlay of torch\.bfloat16 rows"):
            cast(layer)
        assert {p.dtype for p in layer.parameters()} == {torch.bfloat16} and layer.table.weight.dtype == torch.bfloat16
    layer.to(torch.bfloat16)
    layer.table.close()
    f32 = disk_layer(path, tmp_path / "ov32", overlay_dtype=torch.float32, overlay_bytes=0)
    f32.to(torch.float32)                                     # the overlay's dtype: taken
    assert f32.table.weight.dtype == torch.float32 and f32.key_proj.weight.dtype == torch.float32
    f32.table.close()
    q = disk_layer(ckpts["fp8"], tmp_path / "ovq", overlay_bytes=0)
    q.to(torch.float32)
    assert q.key_proj.weight.dtype == torch.float32 and q.table.overlay.layout.dtype == torch.bfloat16
    q.table.close()


def test_optimizer_of_another_rule(ckpts, tmp_path):
    """Adam on an overlay trained with Adagrad: a ValueError naming ``params``, and the table is free for an
    Adagrad after."""
    path, ov = ckpts["bf16"], tmp_path / "ov"
    trained_overlay(path, ov, "adagrad")
    layer = disk_layer(path, ov)
    for Opt in (ple.optim.RowwiseAdam, ple.optim.SparseSGD):
        with pytest.raises(ValueError, match="^params: .*'sum'"):
            Opt(layer, lr=0.1)
        assert layer.table.row_optimizer is None
    opt = ple.optim.RowwiseAdagrad(layer, lr=0.1)
    pio.load_optimizer(opt, ov)
    assert opt.state[layer.table.trained]["step"] == 2
    layer.table.close()


def test_load_optimizer_wrong_path(ckpts, tmp_path):
    path, ov = ckpts["bf16"], tmp_path / "ov"
    trained_overlay(path, ov)
    layer = disk_layer(path, ov)
    opt = ple.optim.RowwiseAdagrad(layer, lr=0.1)
    for wrong in (tmp_path / "elsewhere", path, tmp_path.parent):       # .parent: an ancestor, not its folder
        with pytest.raises(ValueError, match="^path: "):
            pio.load_optimizer(opt, wrong)
    assert opt.state[layer.table.trained]["step"] == 0
    layer.table.close()


def _span(path: Path, key: str) -> tuple[int, int]:
    """Where tensor ``key`` of a safetensors file lies, in bytes."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    a, b = json.loads(data[8: 8 + n])[key]["data_offsets"]
    return 8 + n + a, 8 + n + b


def _segments(ov: Path) -> list[Path]:
    body = json.loads((ov / MANIFEST).read_text())["manifest"]
    return [ov / s["file"] for s in body["segments"]]


@pytest.mark.parametrize("damage", ["truncate", "rows", "state.sum", "ids", "manifest", "delete"])
def test_damaged_overlay_named(ckpts, tmp_path, damage):
    """A damaged overlay file: a ValueError naming it, at load or at the first lookup or update touching it;
    never a wrong row."""
    path, ov = ckpts["bf16"], tmp_path / "ov"
    trained_overlay(path, ov, overlay_bytes=4 * ROW)
    target = ov / MANIFEST if damage == "manifest" else _segments(ov)[0]
    if damage == "truncate":
        os.truncate(target, target.stat().st_size - 5)
    elif damage == "delete":
        target.unlink()
    elif damage == "manifest":
        target.write_text(target.read_text().replace('"generation": 2', '"generation": 3'))
    else:
        a, b = _span(target, damage)
        data = bytearray(target.read_bytes())
        data[(a + b) // 2] ^= 0x10
        target.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(str(target))):
        layer = disk_layer(path, ov)
        try:
            disk_rows(layer, torch.bfloat16)                          # every row: the damaged segment's too
            run = make_run(layer, "adagrad")
            train([run], range(5))
        finally:
            layer.table.close()


def test_damage_leaves_other_rows_readable(ckpts, tmp_path):
    """Rows flipped in one segment: lookups of rows not in the overlay still read; a lookup of one of its
    rows is refused."""
    path, ov = ckpts["bf16"], tmp_path / "ov"
    trained_overlay(path, ov)
    layer = disk_layer(path, ov)
    in_overlay = torch.cat([ids for ids, _, _ in layer.table.overlay.items()])
    layer.table.close()
    seg = _segments(ov)[0]
    a, b = _span(seg, "rows")
    data = bytearray(seg.read_bytes())
    data[a + 1] ^= 0x01
    seg.write_bytes(bytes(data))
    layer = disk_layer(path, ov)
    outside = torch.ones(layer.table.num_rows, dtype=torch.bool)
    outside[in_overlay] = False
    base = pio.load_layer(path).table.weight.detach()
    with torch.no_grad():
        got = layer.table.lookup(outside.nonzero().view(-1, 1), torch.bfloat16, ops=layer.ops)
        assert_bitwise_equal(got.view(-1, 4), base[outside], name="rows outside the overlay")
        with pytest.raises(ValueError, match=re.escape(str(seg))):
            layer.table.lookup(in_overlay.view(-1, 1), torch.bfloat16, ops=layer.ops)
    layer.table.close()


@pytest.mark.parametrize("n", [1, 2, 256, 257, 258, 2**24 + 1, 320_001_536, 2**40 + 3])
def test_fingerprint_samples_lie_in_the_table(n):
    """The sampled rows are inside ``[0, n)``, the first and the last included, distinct and sorted, at the
    real table's row count too (a float32 linspace gave row ``n`` there)."""
    from ple.io.disk_table.training import SAMPLE_ROWS, sample_ids

    ids = sample_ids(n)
    assert ids.dtype == torch.int64 and int(ids[0]) == 0 and int(ids[-1]) == n - 1
    assert ids.numel() == min(n, SAMPLE_ROWS) and bool((ids[1:] > ids[:-1]).all())
