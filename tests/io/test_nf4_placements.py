"""NF4 tables on every placement but sharding (docs/spec.md section 13): kept in host memory (``offload_table``,
``Table.offload_``, ``load_layer(offload=True / "host")``) and read from the checkpoint's files
(``load_layer(offload="disk")``, ``DiskTable.from_checkpoint``), whole or sharded over several files, with and
without a row cache, prefetched or not: the packed rows and the layer's outputs bit for bit those of the in-memory
NF4 table; the disk table's reads, cache and counters in packed bytes (``D/2 + 4`` a row); a damaged row scale
found as the row is read. The tiny config: 6128 rows of D = 4, so an NF4 row is 6 bytes.
"""

from __future__ import annotations

import random
import re
import struct
from pathlib import Path

import pytest
import torch
from _helpers import assert_cuda_lookups, assert_prefetched_forward, assert_same_serving, unpacker_calls, with_prefetch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ple.io as pio
from ple import PLEConfig
from ple.io.disk_table.table import DiskTable
from ple.io.files import Checkpoint
from ple.io.layout import model_prefix, plan_layer
from ple.offload import is_offloaded, offload_table
from ple.quant import SCHEMES, gather_raw
from ple.reference import embedding_lookup
from ple.reference.hashing import hash_params
from ple.table import QuantizedTable
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal
from ple.testing.serving import random_script

TINY = PLEConfig.preset("tiny")
D = TINY.ngram_head_dim
W = SCHEMES["nf4"].weight_width(D)                 # bytes of a packed row: D/2 + 4
NH = TINY.num_ngram_heads
BACKENDS = ["reference", "torch"]
OUT_DTYPES = [torch.float32, torch.bfloat16]
ROWS = min(hash_params(TINY, i).num_rows for i in range(TINY.num_ple_layers))


def nf4_layer(backend: str = "torch", dtype: torch.dtype = torch.float32, seed: int = 11, index: int = 0):
    layer = random_layer(TINY, index, dtype, seed=seed, backend=backend)
    layer.ple_embedding.quantize_("nf4")
    return layer


def inputs(seed: int, dtype: torch.dtype = torch.bfloat16, B: int = 2, L: int = 9):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(B, L, TINY.hc_hidden_size, generator=gen).to(dtype)
    return h, torch.randint(0, TINY.vocab_size, (B, L), generator=gen)


def random_ids(seed: int, T: int = 11) -> torch.Tensor:
    """Hash ids ``[T, NH]`` valid in every layer's table (the smallest has ``ROWS`` rows)."""
    return torch.randint(0, ROWS, (T, NH), generator=torch.Generator().manual_seed(seed))


def packed_rows_seen(monkeypatch, table) -> list[torch.Tensor]:
    """Record the stored rows each lookup of ``table`` turns into values (``Table._values_on``)."""
    seen = []
    original = type(table)._values_on

    def spy(self, ops, rows, scale, dtype):
        seen.append(rows)
        return original(self, ops, rows, scale, dtype)

    monkeypatch.setattr(type(table), "_values_on", spy)
    return seen


# ---- host memory ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_host_offload_equals_in_memory(backend, dtype, monkeypatch):
    mem = nf4_layer(backend, dtype)
    off = offload_table(nf4_layer(backend, dtype), pin=False)
    assert isinstance(off.table, QuantizedTable) and off.table._packed and off.table.scale is None
    assert off.table.dim == D and off.table.weight.shape == (off.table.num_rows, W)
    assert off.table.weight.device.type == "cpu" and not off.table.weight.is_pinned()
    assert_bitwise_equal(off.table.weight, mem.table.weight, name="offloaded packed rows")
    assert off.table.offload_(pin=False) is off.table                     # the method, again: nothing changes
    ids = random_ids(1)
    seen = packed_rows_seen(monkeypatch, off.table)
    for out in OUT_DTYPES:
        assert_bitwise_equal(off.embed(ids, out), mem.embed(ids, out), name=f"{backend} rows as {out}")
    assert all(r.dtype == torch.uint8 and r.shape == (ids.shape[0], NH * W) for r in seen)   # unpacked after
    with torch.no_grad():
        for seed in (1, 2):
            h, tokens = inputs(seed, dtype)
            assert_bitwise_equal(off(h, tokens), mem(h, tokens), name=f"{backend} forward, seed {seed}")
        h, tokens = inputs(3, dtype)
        assert_prefetched_forward(off, mem, h, tokens, name=f"{backend} prefetched forward")


def test_host_offloaded_serving_with_prefetch_equals_in_memory():
    plain = [nf4_layer("torch", torch.bfloat16, seed=5 + i, index=i) for i in range(TINY.num_ple_layers)]
    off = [offload_table(nf4_layer("torch", torch.bfloat16, seed=5 + i, index=i), pin=False)
           for i in range(TINY.num_ple_layers)]
    off = [with_prefetch(layer) for layer in off]
    script = random_script(random.Random(3), vocab_size=TINY.vocab_size, eos_token_id=TINY.eos_token_id,
                           num_requests=5, max_live=3, max_prompt=14, max_chunk=6, max_generate=5, num_spec_tokens=2)
    assert_same_serving((plain, off), script, seed=3)


# ---- checkpoints: host and disk ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A two-layer NF4 checkpoint per layout, saved once from bfloat16 layers with ``table_dtype="nf4"``: whole
    (one file), and in 3 shards split over several files."""
    root = tmp_path_factory.mktemp("nf4")
    out = {}
    for parts in (0, 3):
        layers = [random_layer(TINY, i, torch.bfloat16, 3 + i) for i in range(TINY.num_ple_layers)]
        kw = {"max_file_bytes": 12_000} if parts else {}
        pio.save(layers, root / f"nf4-{parts}", parts=parts, table_dtype="nf4", ple_only=True, **kw)
        out[parts] = root / f"nf4-{parts}"
    assert len(list(out[3].glob("*.safetensors"))) > 1
    return out


@pytest.mark.parametrize("parts", [0, 3])
@pytest.mark.parametrize("cache_bytes", [0, 600, 10**6])
def test_disk_equals_in_memory(checkpoints, parts, cache_bytes):
    path = checkpoints[parts]
    mem = pio.load_layer(path, ple_layer_index=1)
    disk, report = pio.load_layer(path, ple_layer_index=1, offload="disk", cache_bytes=cache_bytes,
                                  return_report=True)
    assert "uint8 (nf4)" in report.table
    table = disk.table
    assert isinstance(table, DiskTable) and is_offloaded(disk) and "(nf4)" in repr(table)
    assert isinstance(mem.table, QuantizedTable) and mem.table.scheme is SCHEMES["nf4"]
    assert table.weight.device.type == "meta" and table.weight.dtype == torch.uint8
    assert table.weight.shape == mem.table.weight.shape == (mem.table.num_rows, W)
    assert table.dim == D and table.scale is None and table.quantized and table._packed
    assert table.stored_dtype == torch.uint8
    assert not any(k.startswith("ple_embedding.ngram_embedding.") for k in disk.state_dict())
    # The packed rows, as gathered: the in-memory table's bytes.
    ids = random_ids(7, T=30)
    ids[1] = ids[0]
    rows, scale = table.gather(ids)
    want, _ = gather_raw(mem.table.weight, None, ids, embedding_lookup)
    assert scale is None and rows.dtype == torch.uint8 and rows.shape == (30, NH * W)
    assert_bitwise_equal(rows, want, name="packed rows read from the files")
    s = table.stats()
    assert s["misses"] == s["rows_read"] and s["bytes_read"] == s["rows_read"] * W      # packed bytes
    # Values and the layer, on both backends and both output dtypes.
    for backend in BACKENDS:
        disk.set_backend(backend)
        mem.set_backend(backend)
        for out in OUT_DTYPES:
            for seed in (2, 2, 3):                                          # the repeat is served from the cache
                assert_bitwise_equal(disk.embed(random_ids(seed), out), mem.embed(random_ids(seed), out),
                                     name=f"{backend} rows as {out}, seed {seed}")
        with torch.no_grad():
            for seed in (1, 1, 2):
                h, tokens = inputs(seed)
                assert_bitwise_equal(disk(h, tokens), mem(h, tokens), name=f"{backend} forward, seed {seed}")
            h, tokens = inputs(4)
            assert_prefetched_forward(disk, mem, h, tokens, name=f"{backend} prefetched forward")
    # The cache, in packed bytes.
    s = table.stats()
    assert s["hits"] + s["misses"] == s["unique_rows"] and s["bytes_read"] == s["misses"] * W
    if cache_bytes == 0:
        assert table.cache is None and s["hits"] == 0 and s["capacity_rows"] == 0
    else:
        cache = table.cache
        assert cache is not None and cache.store.shape[1] * cache.store.element_size() == W
        assert cache.capacity == cache_bytes // (W + 16) // cache.ways * cache.ways and cache.nbytes <= cache_bytes
        assert s["hits"] > 0 and s["cached_rows"] <= s["capacity_rows"] == cache.capacity
        assert (s["evictions"] > 0) == (cache_bytes == 600)                 # 27 rows fit: the small cache evicts


@pytest.mark.parametrize("parts", [0, 3])
@pytest.mark.parametrize("offload", [True, "host"])
def test_host_load_equals_in_memory(checkpoints, parts, offload):
    path = checkpoints[parts]
    mem = pio.load_layer(path, ple_layer_index=1)
    host = pio.load_layer(path, ple_layer_index=1, offload=offload)
    assert isinstance(host.table, QuantizedTable) and host.table.weight.device.type == "cpu"
    assert host.table.dim == D and host.table.scale is None
    assert_bitwise_equal(host.table.weight, mem.table.weight, name="packed rows in host memory")
    for out in OUT_DTYPES:
        assert_bitwise_equal(host.embed(random_ids(5), out), mem.embed(random_ids(5), out), name=f"rows as {out}")
    with torch.no_grad():
        h, tokens = inputs(6)
        assert_bitwise_equal(host(h, tokens), mem(h, tokens), name="forward")
        assert_prefetched_forward(host, mem, h, tokens, name="prefetched forward")


@pytest.mark.parametrize("cache_bytes", [0, 10**5])
def test_disk_serving_with_prefetch_equals_in_memory(checkpoints, cache_bytes):
    path = checkpoints[3]
    plain = pio.load_layers(path)
    disk = [with_prefetch(layer) for layer in pio.load_layers(path, offload="disk", cache_bytes=cache_bytes)]
    script = random_script(random.Random(cache_bytes), vocab_size=TINY.vocab_size, eos_token_id=TINY.eos_token_id,
                           num_requests=5, max_live=3, max_prompt=14, max_chunk=6, max_generate=5, num_spec_tokens=2)
    assert_same_serving((plain, disk), script, seed=7)
    s = disk[0].table.stats()
    assert s["gathers"] > 5 and s["misses"] > 0 and (s["hits"] > 0) == (cache_bytes > 0)


def test_disk_table_from_checkpoint(checkpoints):
    ckpt = Checkpoint.open(checkpoints[3])
    plan = plan_layer(ckpt, TINY, 0, model_prefix(TINY, 0))
    table = DiskTable.from_checkpoint(ckpt, plan, cache_bytes=1000)
    mem = pio.load_layer(checkpoints[3], ple_layer_index=0).table
    assert (table.num_rows, table.dim, table.weight.shape) == (mem.num_rows, D, mem.weight.shape)
    everything = torch.arange(table.num_rows).reshape(-1, 1)                 # every row once, in order
    rows, scale = table.gather(everything)
    assert scale is None
    assert_bitwise_equal(rows, mem.weight, name="every packed row")
    assert table.stats()["bytes_read"] == table.num_rows * W
    table.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["memory", "host", "disk"])
def test_each_backend_unpacks_with_its_own_unpacker(checkpoints, backend, where, monkeypatch):
    """As in memory: the reference backend unpacks gathered rows with ``ple.reference.nf4_dequantize_rows``, the
    torch backend with ``ple.quant``'s vectorised one, wherever the table is."""
    calls = unpacker_calls(monkeypatch)
    layer = pio.load_layer(checkpoints[0], backend=backend, offload={"memory": False}.get(where, where))
    layer.embed(random_ids(1, T=3), torch.float32)
    assert calls == (["reference"] if backend == "reference" else ["vectorised"])


# ---- a damaged row scale ---------------------------------------------------------------------------------------------
def damaged_checkpoint(tmp_path: Path, row: int, bad: float) -> Path:
    """A one-layer NF4 checkpoint (3 shards, one file) whose shard 1 holds a NaN / infinite scale in ``row``."""
    pio.save(random_layer(TINY, 0, torch.bfloat16, 9), tmp_path / "m", parts=3, table_dtype="nf4", ple_only=True)
    (path,) = (tmp_path / "m").glob("*.safetensors")
    tensors = load_file(path)
    with safe_open(path, "pt") as fh:
        metadata = fh.metadata()
    key = next(k for k in tensors if k.endswith("shard_1.weight"))
    bits = struct.unpack("<H", struct.pack("<e", bad))[0]
    tensors[key][row, W - 4], tensors[key][row, W - 3] = bits & 0xFF, bits >> 8
    save_file(tensors, path, metadata=metadata)
    return path


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("cache_bytes", [0, 10**5])
def test_a_nonfinite_scale_is_found_as_the_row_is_read(tmp_path, bad, cache_bytes):
    row = 37
    path = damaged_checkpoint(tmp_path, row, bad)
    with pytest.raises(ValueError, match=f"shard_1.weight: row {row}'s NF4 scale"):
        pio.load_layer(tmp_path / "m", offload="host")                      # read whole: refused at load
    layer = pio.load_layer(tmp_path / "m", offload="disk", cache_bytes=cache_bytes)   # reads no row
    table = layer.table
    assert isinstance(table, DiskTable)
    start = next(p.start for p in table._pieces if p.key.endswith("shard_1.weight"))
    good = torch.tensor([[0, 1, start + row - 1, start + row + 1]])
    table.rows(good, torch.float32, ops=None)
    before = table.stats()
    with pytest.raises(ValueError, match=rf"shard_1\.weight: row {row}'s NF4 scale is .*{re.escape(path.name)}"):
        table.rows(torch.tensor([[5, start + row, 9, 10]]), torch.float32, ops=None)
    assert table.stats() == before                                          # nothing counted, nothing cached
    assert_bitwise_equal(table.rows(good, torch.float32, ops=None),
                         pio.load_layer(tmp_path / "m", offload="disk").table.rows(good, torch.float32, ops=None),
                         name="the other rows still read")


# ---- CUDA ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("where", ["host", "disk"])
@pytest.mark.parametrize("ids_on", ["cpu", "cuda"])
def test_nf4_on_the_host_with_the_layer_on_cuda(checkpoints, where, ids_on, monkeypatch):
    """Table in pinned host memory or on disk, layer on the GPU: packed rows cross the bus, are unpacked on the
    device, and prefetched and plain lookups equal the all-GPU layer bit for bit."""
    dev = torch.device("cuda")
    path = checkpoints[3]
    ref = pio.load_layer(path, device=dev)
    layer = pio.load_layer(path, device=dev, offload=where, **({"cache_bytes": 600} if where == "disk" else {}))
    assert is_offloaded(layer)
    if where == "host":
        assert layer.table.weight.is_pinned() and layer.table.weight.dtype == torch.uint8
    seen = packed_rows_seen(monkeypatch, layer.table)
    ids = assert_cuda_lookups(ref, layer, ids_on)
    assert seen and all(r.device == ids.device and r.dtype == torch.uint8 and r.shape[1] == NH * W for r in seen)
