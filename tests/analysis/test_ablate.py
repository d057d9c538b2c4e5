"""``ple.analysis.table.ablate``: the layer's lookups read zeros, their head's mean row, or a permutation of their
head's rows, on every backend and placement, forward and serving step; the layer bit for bit as before on exit."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from _helpers import reads_not_counted
from analysis._placements import PLACEMENTS, TINY, head_spans, inputs, placed, serve, table_values, twin
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ple.analysis.table import ablate
from ple.io.disk_table.table import DiskTable
from ple.table import Table
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

analysis_table = importlib.import_module("ple.analysis.table")

MODES = ["zero", "mean", "shuffle"]


def backend_cases() -> list:
    """(mode, backend, dtype) of every mode on every backend: the interpreted Triton ones cost seconds each, so
    the quick tier keeps one (shuffle in float32, which hashes and looks up the ids it moves) and the deep tier
    has the rest."""
    cases = []
    for mode in MODES:
        for dtype in (torch.float32, torch.bfloat16):
            quick = mode == "shuffle" and dtype == torch.float32
            triton = [pytest.mark.interpreter] + ([] if quick else [pytest.mark.deep])
            for backend, marks in (("reference", []), ("torch", []), ("triton", triton)):
                cases.append(pytest.param(mode, backend, dtype, marks=marks, id=f"{mode}-{backend}-{str(dtype)[6:]}"))
    return cases


def expected_values(layer, mode: str, seed: int = 0) -> torch.Tensor:
    """The table ``mode`` makes the lookups read, computed directly from every row's value (float64)."""
    values = table_values(layer)
    if mode == "zero":
        return torch.zeros_like(values)
    if mode == "mean":
        out = torch.zeros_like(values)                   # padding rows after the last head: no head, zeros
        for off, size in head_spans(layer):
            out[off:off + size] = values[off:off + size].mean(dim=0)
        return out
    with ablate(layer, "shuffle", seed=seed) as a:
        source = a.source_rows(torch.arange(layer.table.num_rows))
    return values[source]


def assert_ablated_like_twin(layer, mode: str, *, seed: int = 0) -> None:
    """Inside ``ablate(layer, mode)`` forward and serving equal those of a layer holding the ablated table."""
    other = twin(layer, expected_values(layer, mode, seed))
    dtype = layer.key_proj.weight.dtype
    h, ids = inputs(1, dtype)
    with torch.no_grad():
        before = layer(h, ids)
        with ablate(layer, mode, seed=seed):
            got = layer(h, ids)
            parts = layer(h, ids, return_intermediates=True)
            served = serve(layer)
        assert_bitwise_equal(got, other(h, ids), name=f"{mode} forward")
        assert_bitwise_equal(parts.output, got, name=f"{mode} forward, intermediates")
        assert_bitwise_equal(served, serve(other), name=f"{mode} serving steps")
        assert_bitwise_equal(layer(h, ids), before, name="after the block")
    assert not torch.equal(got, before)


# ---- each mode against the layer with that table --------------------------------------------------------------
@pytest.mark.parametrize("mode, backend, dtype", backend_cases())
def test_modes_equal_a_layer_holding_that_table(mode, backend, dtype):
    layer = random_layer(TINY, 0, dtype, seed=3, backend=backend)
    assert_ablated_like_twin(layer, mode, seed=5)


@pytest.mark.parametrize("placement", [p for p in PLACEMENTS if p != "dense"])
@pytest.mark.parametrize("mode", MODES)
def test_every_placement(mode, placement, tmp_path):
    layer = placed(random_layer(TINY, 0, torch.float32, seed=4, backend="torch"), placement, tmp_path)
    assert_ablated_like_twin(layer, mode, seed=1)


@pytest.mark.interpreter
@pytest.mark.parametrize("placement, mode", [("nf4", "mean"),             # NF4 in memory: Triton's fused path
                                             pytest.param("nf4", "shuffle", marks=pytest.mark.deep),
                                             pytest.param("disk-int8", "zero", marks=pytest.mark.deep),
                                             pytest.param("disk-int8", "shuffle", marks=pytest.mark.deep)])
def test_quantized_and_disk_tables_on_triton(placement, mode, tmp_path):
    layer = placed(random_layer(TINY, 0, torch.float32, seed=6, backend="triton"), placement, tmp_path)
    assert_ablated_like_twin(layer, mode, seed=2)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_a_host_table_under_a_cuda_layer(mode):
    """The host-offloaded placement proper: rows gathered on the host, copied to the layer's GPU (prefetched too)."""
    layer = random_layer(TINY, 0, torch.float32, seed=3, backend="torch").to("cuda")
    layer.table.offload_()
    assert layer.table.weight.device.type == "cpu"
    other = twin(layer, expected_values(layer, mode, 2)).to("cuda")
    h, ids = (t.to("cuda") for t in inputs(1, torch.float32))
    with torch.no_grad():
        before = layer(h, ids)
        with ablate(layer, mode, seed=2):
            got = layer(h, ids)
            layer.start_prefetch(ids.reshape(-1), torch.arange(3, device="cuda") * ids.shape[1])
            prefetched = layer(h, ids)
        assert_bitwise_equal(got, other(h, ids), name=f"{mode} with the table on the host")
        assert_bitwise_equal(prefetched, got, name=f"{mode} prefetched")
        assert_bitwise_equal(layer(h, ids), before, name="after the block")


# ---- shuffle: a permutation within each head, fixed by the seed --------------------------------------------------
def test_shuffle_permutes_each_head_fixed_by_seed():
    layer = random_layer(TINY, 0, torch.float32, seed=3)
    rows = torch.arange(layer.table.num_rows)
    maps = {}
    for seed in (0, 1, 0):
        a = ablate(layer, "shuffle", seed=seed)
        got = a.source_rows(rows)
        for off, size in head_spans(layer):
            head = got[off:off + size]
            assert torch.equal(torch.sort(head).values, rows[off:off + size]), "a bijection of the head's rows"
            assert not torch.equal(head, rows[off:off + size])
        end = sum(head_spans(layer)[-1])
        assert torch.equal(got[end:], rows[end:])                         # padding rows: no head, unmoved
        assert torch.equal(a.source_rows(rows.to(torch.int32)), got.to(torch.int32))
        if seed in maps:
            assert torch.equal(maps[seed], got)                           # fixed by the seed
        maps[seed] = got
    assert not torch.equal(maps[0], maps[1])
    # the lookups inside read the source rows, values and all
    ids = torch.randint(0, layer.table.num_rows, (7, TINY.num_ngram_heads), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), ablate(layer, "shuffle", seed=1):
        inside = layer.embed(ids, torch.float32)
    assert torch.equal(inside, layer.embed(maps[1][ids], torch.float32))


def test_shuffle_prefetch_fetches_the_shuffled_rows(tmp_path):
    layer = placed(random_layer(TINY, 0, torch.bfloat16, seed=8, backend="torch"), "disk", tmp_path)
    other = twin(layer, expected_values(layer, "shuffle", 4))
    h, ids = inputs(2, torch.bfloat16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")                      # a prefetch of other ids than the lookup's would warn
        with ablate(layer, "shuffle", seed=4):
            layer.start_prefetch(ids.reshape(-1), torch.arange(3) * ids.shape[1])
            assert layer.table.pending_prefetch is not None
            got = layer(h, ids)
            assert layer.table.pending_prefetch is None     # used
    assert_bitwise_equal(got, other(h, ids), name="prefetched shuffle")


# ---- nothing the size of the table ---------------------------------------------------------------------------
class LargestNew(TorchDispatchMode):
    """Records the most elements of a tensor an op made in new memory (views of its inputs not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().data_ptr() not in given:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("placement", ["dense", "nf4", "disk"])
@pytest.mark.parametrize("mode", MODES)
def test_nothing_the_size_of_the_table_is_made(mode, placement, tmp_path, monkeypatch):
    layer = placed(random_layer(TINY, 0, torch.float32, seed=3, backend="torch"), placement, tmp_path)
    monkeypatch.setattr(analysis_table, "BLOCK_BYTES", 1024)       # 32 rows a block: the table is 192 blocks
    h, ids = inputs(0, torch.float32)
    rows = layer.table.num_rows
    seen = LargestNew()
    if isinstance(layer.table, DiskTable):
        layer.table.reset_stats()
        reads_not_counted(monkeypatch, seen, rows - 1, "the table holds, less one")   # scratch of the rows read
    with torch.no_grad(), seen:
        with ablate(layer, mode, seed=2):
            layer(h, ids)
            layer(h, ids, return_intermediates=True)
            serve(layer)
    assert 0 < seen.largest < rows, f"an op made {seen.largest} elements (the table: {rows} rows)"
    if isinstance(layer.table, DiskTable):
        stats = layer.table.stats()
        if mode == "shuffle":
            assert stats["rows"] > 0
        else:                                                      # zero and mean read no row in a lookup
            assert stats["gathers"] == stats["rows"] == 0, stats


# ---- leaving: bit for bit as before ------------------------------------------------------------------------
def snapshot(layer) -> tuple:
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    return state, set(vars(layer)), set(vars(layer.table))


def assert_as_before(layer, snap: tuple) -> None:
    state, attrs, table_attrs = snap
    now = layer.state_dict()
    assert now.keys() == state.keys()
    for k, v in state.items():
        assert_bitwise_equal(now[k], v, name=k)
    assert set(vars(layer)) == attrs and set(vars(layer.table)) == table_attrs
    assert "rows" not in vars(layer.table) and "hashed_rows" not in vars(layer)


@pytest.mark.parametrize("mode", MODES)
def test_an_exception_leaves_the_layer_as_before(mode, tmp_path):
    layer = placed(random_layer(TINY, 0, torch.bfloat16, seed=3, backend="torch"), "int8", tmp_path)
    h, ids = inputs(0, torch.bfloat16)
    with torch.no_grad():
        before = layer(h, ids)
        snap = snapshot(layer)
        with pytest.raises(KeyError, match="planted"), ablate(layer, mode):
            layer(h, ids)
            raise KeyError("planted")
        assert_as_before(layer, snap)
        assert_bitwise_equal(layer(h, ids), before, name="forward after the exception")
        assert_bitwise_equal(layer(h, ids, return_intermediates=True).output, before, name="op by op after")


def test_nested_ablations_unwind_in_order():
    layer = random_layer(TINY, 0, torch.float32, seed=3, backend="torch")
    h, ids = inputs(0, torch.float32)
    snap = snapshot(layer)
    with torch.no_grad():
        before = layer(h, ids)
        outer = ablate(layer, "shuffle", seed=3)
        with outer:
            shuffled = layer(h, ids)
            with ablate(layer, "zero"):
                zero = layer(h, ids)
            assert_bitwise_equal(layer(h, ids), shuffled, name="the outer ablation again")
            with pytest.raises(RuntimeError, match="active"), outer:
                pass
        assert_bitwise_equal(zero, twin(layer, torch.zeros(layer.table.num_rows, layer.table.dim))(h, ids),
                             name="zero inside shuffle")
        assert_bitwise_equal(layer(h, ids), before, name="after both")
        with outer:                                              # entered again after it was left
            assert_bitwise_equal(layer(h, ids), shuffled, name="re-entered")
    assert_as_before(layer, snap)


# ---- errors ------------------------------------------------------------------------------------------------
def test_bad_arguments():
    layer = random_layer(TINY, 0, torch.float32, seed=3)
    snap = snapshot(layer)
    with pytest.raises(ValueError, match="^mode: .*'zero', 'mean', 'shuffle'.*'random'"):
        ablate(layer, "random")
    with pytest.raises(TypeError, match="^mode: "):
        ablate(layer, 0)
    with pytest.raises(TypeError, match="^layer: "):
        ablate(layer.table, "zero")
    with pytest.raises(ValueError, match="^seed: "):
        ablate(layer, "shuffle", seed=-1)
    with pytest.raises(TypeError, match="^seed: "):
        ablate(layer, "shuffle", seed=1.0)
    with pytest.raises(ValueError, match="^mode: .*source_rows"):
        ablate(layer, "mean").source_rows(torch.arange(3))
    assert_as_before(layer, snap)


def test_a_sharded_table_is_refused(monkeypatch):
    layer = random_layer(TINY, 0, torch.float32, seed=3)
    monkeypatch.setattr(Table, "is_dtensor", property(lambda self: True))   # as a DTensor table answers
    for mode in ("zero", "mean", "shuffle"):
        with pytest.raises(ValueError, match="^table: .*sharded"):
            ablate(layer, mode)
