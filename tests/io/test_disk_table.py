"""``ple.io.disk_table.table``: a table read in place from its files (``load_layer(..., offload="disk")``).

Bits equal to the in-memory table (forward, serving, prefetched or not, whole or sharded, float, FP8, int8);
the row cache against a model of its policy; the counters; files truncated or changed after loading; the
resident memory of a process serving a stream (a small table here, about 1 GiB in the deep tier).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _helpers import assert_cuda_lookups, assert_prefetched_forward, assert_same_serving, with_prefetch

import ple.io as pio
from ple import PLEConfig
from ple.io.disk_table.table import DiskTable, RowCache
from ple.io.files import Checkpoint
from ple.io.layout import plan_layer
from ple.offload import is_offloaded, offload_table
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal
from ple.testing.serving import random_script

TINY = PLEConfig.preset("tiny")          # 6128 rows of D = 4, two PLE layers
PFX0 = "model.language_model.layers.0.ple."


def save(path: Path, scheme: str | None = None, parts: int = 0, *, table_dtype: str | None = None,
         seed: int = 3, **kw) -> Path:
    layers = [random_layer(TINY, i, torch.bfloat16, seed + i) for i in range(TINY.num_ple_layers)]
    for layer in layers:
        if scheme is not None:
            layer.ple_embedding.quantize_(scheme)
    pio.save(layers, path, parts=parts, table_dtype=table_dtype, ple_only=scheme is not None, **kw)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One two-layer checkpoint per (scheme, parts), saved once: sharded ones split over several files."""
    root = tmp_path_factory.mktemp("disk")
    out = {}
    for scheme in (None, "fp8", "int8"):
        for parts in (0, 3):
            kw = {"max_file_bytes": 20_000} if parts else {}
            out[scheme, parts] = save(root / f"{scheme}-{parts}", scheme, parts, **kw)
    return out


def inputs(seed: int, B: int = 2, L: int = 9):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(B, L, TINY.hc_hidden_size, generator=gen).to(torch.bfloat16)
    return h, torch.randint(0, TINY.vocab_size, (B, L), generator=gen)


# ---- bits: the in-memory table's ------------------------------------------------------------------------
@pytest.mark.parametrize("parts", [0, 3])
@pytest.mark.parametrize("scheme", [None, "fp8", "int8"])
def test_forward_equals_in_memory(checkpoints, scheme, parts):
    path = checkpoints[scheme, parts]
    mem = pio.load_layer(path, ple_layer_index=1)
    disk, report = pio.load_layer(path, ple_layer_index=1, offload="disk", cache_bytes=2000, return_report=True)
    table = disk.table
    assert isinstance(table, DiskTable) and is_offloaded(disk)
    assert len(table.files) == (1 if not parts else len({Checkpoint.open(path).info(p.key).file
                                                          for p in table._pieces}))
    assert table.weight.device.type == "meta" and table.weight.shape == mem.table.weight.shape
    assert table.weight.dtype == mem.table.weight.dtype and table.quantized == mem.table.quantized
    assert "ple_embedding.ngram_embedding.weight" not in disk.state_dict()
    with torch.no_grad():
        for seed in (1, 1, 2):                                             # the repeat is served from the cache
            h, ids = inputs(seed)
            assert_bitwise_equal(disk(h, ids), mem(h, ids), name=f"forward, seed {seed}")
        h, ids = inputs(4)
        assert_prefetched_forward(disk, mem, h, ids, name="prefetched forward")
    hashed = mem.ops.ngram_ids(ids.reshape(-1), mem.ple_embedding.hash_params(),
                               heads_per_ngram=TINY.heads_per_ngram, eos_token_id=TINY.eos_token_id)
    for dtype in (torch.float32, torch.bfloat16):
        assert_bitwise_equal(disk.embed(hashed, dtype), mem.embed(hashed, dtype), name=f"embed {dtype}")
    s = table.stats()
    assert s["hits"] > 0 and s["misses"] > 0 and s["evictions"] > 0 and s["cached_rows"] <= s["capacity_rows"]


def test_a_float32_table_in_a_bfloat16_layer(tmp_path):
    """A float table is cast to the layer's dtype first, as the in-memory one is at load, then to the asked dtype."""
    path = save(tmp_path / "f32", table_dtype="float32")
    mem = pio.load_layer(path)
    disk = pio.load_layer(path, offload="disk")
    assert disk.table.stored_dtype == torch.float32 and disk.table.weight.dtype == mem.table.weight.dtype
    ids = torch.randint(0, disk.table.num_rows, (11, TINY.num_ngram_heads))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert_bitwise_equal(disk.embed(ids, dtype), mem.embed(ids, dtype), name=f"rows as {dtype}")
    disk.to(torch.float32)
    mem.to(torch.float32)                      # the in-memory table's bf16 values, widened; the disk table's too
    assert disk.table.weight.dtype == torch.float32
    assert_bitwise_equal(disk.embed(ids, torch.float32), mem.embed(ids, torch.float32), name="after .to(float32)")


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("scheme, parts, cache_bytes", [(None, 0, 0), (None, 3, 1500), ("fp8", 0, 1500),
                                                        ("fp8", 3, 10**6), ("int8", 3, 700)])
def test_serving_stream_equals_in_memory(checkpoints, scheme, parts, cache_bytes, prefetch):
    path = checkpoints[scheme, parts]
    plain = pio.load_layers(path)
    disk = pio.load_layers(path, offload="disk", cache_bytes=cache_bytes)
    if prefetch:
        disk = [with_prefetch(layer) for layer in disk]
    script = random_script(random.Random(parts + cache_bytes), vocab_size=TINY.vocab_size,
                           eos_token_id=TINY.eos_token_id, num_requests=6, max_live=3, max_prompt=14, max_chunk=6,
                           max_generate=6, num_spec_tokens=2)
    assert_same_serving((plain, disk), script, seed=7)
    s = disk[0].table.stats()
    assert s["gathers"] > 5 and s["misses"] > 0 and s["cached_rows"] <= s["capacity_rows"]
    assert (s["hits"] > 0) == (cache_bytes > 0)


# ---- the cache -------------------------------------------------------------------------------------------
class ModelCache:
    """The policy `RowCache` implements, written plainly: set ``hash(id) % sets`` of ``ways`` slots; a gather's
    distinct ids (sorted) mark their hits used, then each set's misses (in id order, at most ``ways``) take the
    set's slots least recently used first (ties: lower slot first), all stamped with the gather's number."""

    def __init__(self, capacity: int, ways: int) -> None:
        self.ways = min(ways, capacity)
        self.sets = capacity // self.ways
        self.keys = [[-1] * self.ways for _ in range(self.sets)]
        self.stamps = [[-1] * self.ways for _ in range(self.sets)]
        self.clock = 0

    def gather(self, ids: list[int]) -> tuple[int, int]:
        self.clock += 1
        hits = 0
        misses: dict[int, list[int]] = collections.defaultdict(list)
        for r in sorted(set(ids)):
            s = (r * 0x9E3779B1) % self.sets
            if r in self.keys[s]:
                self.stamps[s][self.keys[s].index(r)] = self.clock
                hits += 1
            else:
                misses[s].append(r)
        for s, new in misses.items():
            oldest = sorted(range(self.ways), key=lambda w: (self.stamps[s][w], w))
            for w, r in zip(oldest, new[: self.ways], strict=False):
                self.keys[s][w], self.stamps[s][w] = r, self.clock
        return hits, sum(len(v) for v in misses.values())


@pytest.mark.parametrize("capacity, ways", [(24, 4), (40, 16), (5, 16), (7, 1)])
def test_row_cache_follows_its_policy(capacity, ways):
    rng = random.Random(capacity)
    rows = torch.arange(500 * 3, dtype=torch.int64).view(500, 3)           # row r's data: 3r, 3r+1, 3r+2
    cache, model = RowCache(capacity, 3, torch.int64, ways=ways), ModelCache(capacity, ways)
    assert cache.capacity == model.sets * model.ways <= capacity
    for _ in range(60):
        ids = [min(int(rng.paretovariate(0.8)) - 1, 499) for _ in range(rng.randrange(1, 30))]
        uniq = torch.tensor(sorted(set(ids)))
        sets, slots = cache.find(uniq)
        hit = slots >= 0
        assert_bitwise_equal(cache.store[slots[hit]], rows[uniq[hit]], name="cached rows")
        miss = (~hit).nonzero().squeeze(1)
        cache.update(slots[hit], uniq[miss], sets[miss], rows[uniq[miss]])
        assert (int(hit.sum()), miss.numel()) == model.gather(ids)
        assert cache.keys.tolist() == model.keys and cache.stamps.tolist() == model.stamps
        assert len(cache) <= cache.capacity


def test_one_set_is_exact_lru():
    cache = RowCache(4, 1, torch.int64, ways=4)

    def gather(*ids):
        uniq = torch.tensor(sorted(ids))
        sets, slots = cache.find(uniq)
        hit = slots >= 0
        miss = (~hit).nonzero().squeeze(1)
        cache.update(slots[hit], uniq[miss], sets[miss], uniq[miss][:, None])
        return sorted(uniq[hit].tolist())

    assert gather(1, 2) == [] and gather(3, 4) == [] and gather(1) == [1]
    assert gather(5) == [] and sorted(cache.keys.view(-1).tolist()) == [1, 3, 4, 5]        # 2: least recent
    assert gather(2, 3) == [3] and sorted(cache.keys.view(-1).tolist()) == [1, 2, 3, 5]    # then 4


def test_stats_and_the_cache_bound(checkpoints):
    path = checkpoints["fp8", 3]
    row_bytes = TINY.ngram_head_dim                                         # FP8: one byte a value
    table = pio.load_layer(path, offload="disk", cache_bytes=10_000).table
    assert isinstance(table, DiskTable)
    cache = table.cache
    assert cache is not None and cache.capacity == 10_000 // (row_bytes + 16) // 16 * 16
    assert cache.nbytes <= 10_000
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, table.num_rows, (9, TINY.num_ngram_heads), generator=gen)
    ids[1] = ids[0]                                                         # repeats are read once
    n, u = ids.numel(), ids.unique().numel()
    table.rows(ids, torch.bfloat16, ops=None)
    s = table.stats()
    assert (s["gathers"], s["rows"], s["unique_rows"], s["hits"], s["misses"]) == (1, n, u, 0, u)
    assert s["rows_read"] == u and s["bytes_read"] == u * row_bytes and s["hit_rate"] == 0.0
    assert s["cached_rows"] == u and s["capacity_rows"] == cache.capacity and s["cache_bytes"] == 10_000
    table.prefetch(ids, torch.device("cpu"))                                # a prefetch counts too: all hits
    table.rows(ids, torch.bfloat16, ops=None)
    s = table.stats()
    assert (s["gathers"], s["hits"], s["misses"], s["bytes_read"]) == (2, u, u, u * row_bytes)
    assert s["hit_rate"] == 0.5
    for _ in range(20):                                                     # many more rows than fit
        table.rows(torch.randint(0, table.num_rows, (40, TINY.num_ngram_heads), generator=gen), torch.bfloat16,
                   ops=None)
    s = table.stats()
    assert s["cached_rows"] <= s["capacity_rows"] and s["evictions"] > 0
    assert s["hits"] + s["misses"] == s["unique_rows"] and s["bytes_read"] == s["misses"] * row_bytes
    table.reset_stats()
    assert table.stats()["misses"] == 0 and table.stats()["cached_rows"] == s["cached_rows"]
    table.clear_cache()
    assert table.stats()["cached_rows"] == 0
    none = pio.load_layer(path, offload="disk", cache_bytes=0).table
    assert isinstance(none, DiskTable) and none.cache is None
    none.rows(ids, torch.bfloat16, ops=None)
    none.rows(ids, torch.bfloat16, ops=None)
    assert none.stats()["misses"] == 2 * u and none.stats()["hits"] == 0


# ---- nothing read whole, nothing written -------------------------------------------------------------------
def test_the_table_is_never_read_whole_and_never_written(checkpoints, monkeypatch):
    path = checkpoints["int8", 3]
    before = {f: hashlib.sha256(f.read_bytes()).hexdigest() for f in path.glob("*.safetensors")}
    reads = []
    original = Checkpoint.read

    def spy(self, key, start=None, stop=None):
        reads.append(key)
        return original(self, key, start, stop)

    monkeypatch.setattr(Checkpoint, "read", spy)
    layer = pio.load_layer(path, offload="disk")
    assert reads and not [k for k in reads if "ngram_embedding" in k and k.endswith(".weight")]   # scales only
    with torch.no_grad():
        layer(*inputs(3))
    table = layer.table
    assert isinstance(table, DiskTable)
    with pytest.raises(TypeError):
        table._files[0].map[0] = 1                                         # mapped read only
    assert {f: hashlib.sha256(f.read_bytes()).hexdigest() for f in path.glob("*.safetensors")} == before
    assert table.stats()["bytes_read"] < table.num_rows * table.dim


# ---- files changed after loading -------------------------------------------------------------------------------
def test_a_truncated_file_is_a_clear_error(tmp_path):
    path = save(tmp_path / "ck", "fp8", parts=0)
    file = path / "model.safetensors"
    layer = pio.load_layer(path, offload="disk", cache_bytes=10**6)
    mem = pio.load_layer(path)
    h, ids = inputs(1)
    with torch.no_grad():
        expected = layer(h, ids)
        os.truncate(file, file.stat().st_size // 2)
        # The layers' own tensors are copies, not views of the library's mapping of the file.
        assert_bitwise_equal(mem(h, ids), expected, name="the in-memory layer after the truncation")
        assert_bitwise_equal(layer(h, ids), expected, name="rows from the cache: nothing read")
        before = layer.table.stats()
        h2, ids2 = inputs(2)
        with pytest.raises(ValueError, match=r"ngram_embedding\.weight: .*model\.safetensors is \d+ bytes now"):
            layer(h2, ids2)
        assert layer.table.stats() == before                               # nothing counted or cached
        layer.start_prefetch(ids2.reshape(-1), torch.arange(3) * ids2.shape[1])
        with pytest.raises(ValueError, match="truncated or rewritten"):   # raised where the rows are used
            layer(h2, ids2)
    with pytest.raises(ValueError, match="truncated"):                      # and at load, by the checkpoint
        pio.load_layer(path, offload="disk")


def test_a_changed_file_is_detected(tmp_path):
    path = save(tmp_path / "ck", None, parts=3)
    file = path / "model.safetensors"
    layer = pio.load_layer(path, offload="disk", cache_bytes=0)
    h, ids = inputs(1)
    with torch.no_grad():
        layer(h, ids)
        st = file.stat()
        with open(file, "r+b") as fh:                                      # same size, one byte changed
            fh.seek(st.st_size - 1)
            fh.write(b"\x01")
        # File times have the kernel's coarse clock: make the change visible even if it fell in the same tick.
        os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        with pytest.raises(ValueError, match=r"model\.safetensors was modified after it was mapped"):
            layer(h, ids)


@pytest.mark.parametrize("change", ["truncated", "modified"])
def test_a_later_file_of_several_changed_after_loading_is_named(tmp_path, change):
    """A table over several files, one after the first changed after loading: reads of the files that did not
    change go on (bits of the in-memory table); the next read touching the changed one, alone or with rows of
    the first file, is a ``ValueError`` naming that file, and reads, counts and caches nothing."""
    path = save(tmp_path / "ck", None, parts=3, max_file_bytes=20_000)
    mem = pio.load_layer(path)
    disk = pio.load_layer(path, offload="disk", cache_bytes=10**6)
    table = disk.table
    files = [p.file.path for p in table._pieces]                           # the file of each piece, in row order
    assert len(set(files)) == len(files) >= 3
    starts = [p.start for p in table._pieces]                               # each piece's first row
    NH = TINY.num_ngram_heads
    first, later = starts[0], starts[-1]                                   # the first rows of the first, last piece

    def ids(*row_starts):
        return torch.tensor([[r + i for i in range(NH)] for r in row_starts])

    victim = files[-1]
    with torch.no_grad():
        assert_bitwise_equal(disk.embed(ids(first), torch.float32), mem.embed(ids(first), torch.float32),
                             name="rows of the first file")
        st = victim.stat()
        if change == "truncated":                                          # rows near its start stay mapped
            os.truncate(victim, st.st_size - 4 * table.dim * 2)
        else:                                                              # same size, one byte changed
            with open(victim, "r+b") as fh:
                fh.seek(st.st_size - 1)
                fh.write(b"\x01")
            os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # past the coarse file clock
        assert_bitwise_equal(disk.embed(ids(first + NH), torch.float32),
                             mem.embed(ids(first + NH), torch.float32), name="the first file after the change")
        for rows in (ids(later), ids(first + 2 * NH, later)):
            before = table.stats()
            with pytest.raises(ValueError, match=rf"{victim.name}"):
                disk.embed(rows, torch.float32)
            assert table.stats() == before                                 # nothing read, counted or cached
        middle = ids(starts[1])                                            # a file between them: unchanged
        assert_bitwise_equal(disk.embed(middle, torch.float32), mem.embed(middle, torch.float32),
                             name="rows of an unchanged later file")


def test_the_header_is_checked_when_mapped(tmp_path):
    path = save(tmp_path / "ck", None, parts=2)
    ckpt = Checkpoint.open(path)
    plan = plan_layer(ckpt, TINY, 0, PFX0)
    save(tmp_path / "other", None, parts=4)                                 # rewritten with other shards
    shutil.copy(tmp_path / "other" / "model.safetensors", path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        DiskTable.from_checkpoint(ckpt, plan)
    save(tmp_path / "ck", None, parts=2, overwrite=True)
    ckpt = Checkpoint.open(path)
    plan = plan_layer(ckpt, TINY, 0, PFX0)
    file = path / "model.safetensors"
    os.truncate(file, file.stat().st_size - 8)
    with pytest.raises(ValueError, match=r"model\.safetensors is \d+ bytes and its header describes"):
        DiskTable.from_checkpoint(ckpt, plan)


def test_a_disk_table_garbage_collected_unclosed_gives_its_file_descriptors_back(tmp_path):
    """A ``DiskTable`` dropped without ``close()`` (a notebook cell run again) leaks no descriptor: each mapped
    file's descriptor is closed when the file object is collected; ``close()`` still closes it at once, once."""
    import gc

    from ple.io.disk_table.mapped import MappedFile

    path = save(tmp_path / "ck", None, parts=2)

    def open_fds() -> set[str]:
        return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")}

    files = sorted(str(p.resolve()) for p in path.glob("*.safetensors"))
    ckpt = Checkpoint.open(path)
    table = DiskTable.from_checkpoint(ckpt, plan_layer(ckpt, TINY, 0, PFX0))
    assert set(files) <= open_fds()
    del table, ckpt
    gc.collect()
    assert not set(files) & open_fds(), "a collected disk table still holds its files open"
    mapped = MappedFile(Path(files[0]))
    mapped.close()
    mapped.close()                                                          # a second close: nothing more
    assert files[0] not in open_fds()


# ---- arguments, placement --------------------------------------------------------------------------------------
def test_bad_arguments(checkpoints):
    path = checkpoints[None, 0]
    with pytest.raises(ValueError, match="offload: expected"):
        pio.load_layer(path, offload="ssd")
    with pytest.raises(ValueError, match="cache_bytes: .*offload='disk'"):
        pio.load_layer(path, offload="host", cache_bytes=10)
    with pytest.raises(ValueError, match="cache_bytes"):
        pio.load_layer(path, offload="disk", cache_bytes=-1)
    with pytest.raises(TypeError, match="cache_bytes"):
        pio.load_layer(path, offload="disk", cache_bytes=1.5)
    layer = pio.load_layer(path, offload="disk")
    with pytest.raises(ValueError, match=r"ids: rows must lie in \[0, 6128\)"):
        layer.embed(torch.tensor([[0, 6128]]), torch.bfloat16)
    with pytest.raises(ValueError, match="ids: rows must lie"):
        layer.embed(torch.tensor([[-1, 3]]), torch.bfloat16)
    with pytest.raises(TypeError, match="ids"):
        layer.embed(torch.tensor([[0.0, 1.0]]), torch.bfloat16)
    assert layer.table.stats()["gathers"] == 0
    assert offload_table(layer) is layer and isinstance(layer.table, DiskTable)          # already off the device
    with pytest.raises(ValueError, match="table: cannot quantize a table whose values are not in memory"):
        layer.ple_embedding.quantize_("fp8")
    assert isinstance(layer.table, DiskTable)
    with pytest.raises(ValueError, match="layers: a table whose values are not in memory"):
        pio.save(layer, checkpoints[None, 0].parent / "never_written")
    assert not (checkpoints[None, 0].parent / "never_written").exists()
    layer.table.close()
    with pytest.raises(RuntimeError, match="closed"):
        layer.embed(torch.tensor([[0, 1]]), torch.bfloat16)


def test_moving_the_layer_moves_the_fp8_scale_only(checkpoints):
    layer = pio.load_layer(checkpoints["fp8", 0], offload="disk")
    scale = layer.table.scale.clone()
    layer.to(torch.float32)                                                 # a cast leaves the scale's bits
    assert layer.key_proj.weight.dtype == torch.float32
    assert layer.table.weight.dtype == torch.float8_e4m3fn and torch.equal(layer.table.scale, scale)
    mem = pio.load_layer(checkpoints["fp8", 0]).to(torch.float32)
    with torch.no_grad():
        h, ids = inputs(1)
        assert_bitwise_equal(layer(h.float(), ids), mem(h.float(), ids), name="float32 layer, fp8 table")


def test_in_a_patched_transformers_model(tmp_path):
    """A patched model whose PLE tables are read from disk: the logits of the patched model with its tables in
    memory, bit for bit, and the same generated tokens."""
    pytest.importorskip("transformers")
    from transformers import Qwen4ExpForCausalLM

    from ple.integrations.transformers import TransformersPLELayer, patch, tiny_config

    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(tiny_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ple" in name and ("norm" in name or "conv" in name):
                p.normal_(0, 0.3)                                          # the model starts them at zero
        ids = torch.randint(3, 64, (2, 11))
        patch(model, backend="reference")
        want, tokens = model(ids).logits, model.generate(ids, max_new_tokens=4, do_sample=False)
        layers = [m for m in model.modules() if isinstance(m, TransformersPLELayer)]
        pio.save(layers, tmp_path / "ck")
        for layer in layers:
            layer.ple_embedding.ngram_embedding = pio.load_layer(tmp_path / "ck", layer.config, layer.ple_layer_index,
                                                                 offload="disk", cache_bytes=2000).table
        assert_bitwise_equal(model(ids).logits, want, name="logits")
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), tokens)
    assert all(layer.table.stats()["gathers"] > 0 for layer in layers)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [None, "fp8", "int8"])
@pytest.mark.parametrize("ids_on", ["cpu", "cuda"])
def test_disk_prefetch_on_cuda(checkpoints, scheme, ids_on):
    """Table on disk, layer on the GPU: prefetched and plain lookups equal the all-GPU layer bit for bit."""
    dev = torch.device("cuda")
    path = checkpoints[scheme, 3]
    ref = pio.load_layer(path, device=dev)
    layer = pio.load_layer(path, device=dev, offload="disk", cache_bytes=3000)
    assert_cuda_lookups(ref, layer, ids_on)


# ---- resident memory ---------------------------------------------------------------------------------------------
_SERVE = textwrap.dedent("""
    import ctypes, json, sys, torch
    import ple.io as pio
    from ple.state import Decode, PLECache, Prefill

    def rss_anon():
        # Memory freed but kept by the allocator (a step's working memory, in each thread's arena) is handed
        # back first: what is measured is what the process holds.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    path, cache_bytes, tokens, B, prompt = sys.argv[1], *map(int, sys.argv[2:6])
    torch.manual_seed(0)
    # Zipfian tokens (s = 1.1): the stream a text would give, hot n-grams and a long tail.
    def serve(layer, tokens):
        cfg = layer.config
        weights = 1.0 / torch.arange(1, cfg.vocab_size + 1, dtype=torch.float64) ** 1.1
        draw = lambda n: torch.multinomial(weights, n, replacement=True).tolist()
        cache = PLECache(cfg, B + 1, dtype=torch.bfloat16)
        slots = [cache.allocate() for _ in range(B)]

        def step(items):
            batch = cache.schedule(items)
            layer.start_prefetch(batch.input_ids, batch.query_start_loc, batch.ngram_context)
            h = torch.randn(batch.num_tokens, cfg.hc_hidden_size, dtype=torch.bfloat16)
            with torch.no_grad():
                layer.step(h, batch, cache)

        done = 0
        while done < tokens:
            step([Prefill(s, draw(prompt)) for s in slots])
            done += B * prompt
            for _ in range(16):
                step([Decode(s, t) for s, t in zip(slots, draw(B))])
                done += B

    # Warm-up, on another layer with a tiny cache: libraries, thread pools and a step's working memory (the
    # allocator keeps what a step frees) are in place before the baseline, taken once the measured layer is
    # loaded; only what that layer keeps (its cache) can grow after it.
    start = rss_anon()
    serve(pio.load_layer(path, offload="disk", cache_bytes=64 << 10), 2 * B * (prompt + 16))
    layer = pio.load_layer(path, offload="disk", cache_bytes=cache_bytes)
    base = rss_anon()
    serve(layer, tokens)
    print(json.dumps({"growth": rss_anon() - base, "warm_up": base - start, **layer.table.stats()}))
""")


def serve_in_a_fresh_process(tmp_path, base: int, cache_bytes: int, tokens: int, requests: int,
                             prompt: int) -> tuple[dict, int]:
    """Save a one-layer checkpoint with a table of ``16 * ~base`` rows of D = 160 (bfloat16), serve ``tokens``
    Zipfian tokens from it in a new process (``requests`` at a time: a prefill of ``prompt`` tokens each, then
    16 decode steps, over and over); returns that process's report and the table's bytes."""
    cfg = PLEConfig(vocab_size=32_000, hidden_size=32, hc_count=1, eos_token_id=0, ple_embed_dim=2560,
                    ngram_vocab_size_base=base, ple_layer_ids=(1,), split_ngram_parts=8)
    layer = random_layer(cfg, 0, torch.bfloat16, 0)
    table_bytes = layer.table.weight.nbytes
    pio.save(layer, tmp_path / "big")
    del layer
    args = [str(tmp_path / "big"), *map(str, (cache_bytes, tokens, requests, prompt))]
    out = subprocess.run([sys.executable, "-c", _SERVE, *args], capture_output=True, text=True, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), table_bytes


def check_resident(report: dict, table_bytes: int, cache_bytes: int) -> None:
    assert report["cached_rows"] > 0.99 * report["capacity_rows"] and report["evictions"] > 0     # full, turning over
    assert report["bytes_read"] > cache_bytes
    # + 4 MiB: the 64 reader threads' malloc arenas keep some of what they free (the small table's growth measured
    # 16.7-20.5 MB with them, 17.5 MB with the 8 mapped readers before, 16.1 MB with MALLOC_ARENA_MAX=1)
    assert report["growth"] < cache_bytes * 1.25 + (4 << 20), (report, table_bytes)
    print(f"table {table_bytes / 2**20:.0f} MiB, cache {cache_bytes / 2**20:.0f} MiB: RssAnon grew by "
          f"{report['growth'] / 2**20:.1f} MiB serving {report['rows']} rows ({report['bytes_read'] / 2**20:.0f} MiB "
          f"read, hit rate {report['hit_rate']:.3f}); the warm-up took {report['warm_up'] / 2**20:.1f} MiB")


def test_resident_memory_small(tmp_path):
    """A 64 MiB table served with a 16 MiB cache: the process's anonymous memory grows by less than 24 MiB."""
    cache_bytes = 16 << 20
    report, table_bytes = serve_in_a_fresh_process(tmp_path, 13_100, cache_bytes, 7_000, 8, 32)
    assert 60 << 20 < table_bytes < 70 << 20
    check_resident(report, table_bytes, cache_bytes)


@pytest.mark.deep
def test_resident_memory_one_gib(tmp_path):
    """A 1 GiB table served with a 64 MiB cache: the anonymous memory grows by less than 84 MiB."""
    cache_bytes = 64 << 20
    report, table_bytes = serve_in_a_fresh_process(tmp_path, 210_000, cache_bytes, 60_000, 16, 64)
    assert table_bytes > 1 << 30
    check_resident(report, table_bytes, cache_bytes)


@pytest.mark.deep
def test_benchmark_smoke(tmp_path, monkeypatch):
    """``benchmarks/bench_disk_table.py --smoke`` runs end to end (its memory/disk comparison included)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    sys.modules.pop("bench_disk_table", None)
    import bench_disk_table

    threads = torch.get_num_threads()
    try:
        assert bench_disk_table.main(["--smoke", "--dir", str(tmp_path), "--json", str(tmp_path / "r.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report["modes"]) == {"decode", "prefill"} and "memory" in report["modes"]["decode"]
    assert not list(tmp_path.glob("fp8-*"))                                # the checkpoint deleted


@pytest.mark.deep
def test_benchmark_smoke_table_dtypes(tmp_path, monkeypatch):
    """``bench_disk_table.py --smoke --table-dtypes bfloat16,fp8,nf4``: the dtypes side by side in one run, on the
    same streams (so a cold decode pass reads the same rows of each: bytes in the ratio of their row widths)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    sys.modules.pop("bench_disk_table", None)
    import bench_disk_table

    threads = torch.get_num_threads()
    try:
        assert bench_disk_table.main(["--smoke", "--table-dtypes", "bfloat16,fp8,nf4", "--dir", str(tmp_path),
                                      "--json", str(tmp_path / "r.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "r.json").read_text())
    schemes = report["schemes"]
    assert report["table_dtypes"] == ["bfloat16", "fp8", "nf4"] and list(schemes) == report["table_dtypes"]
    for s in schemes.values():
        assert set(s["modes"]) == {"decode", "prefill"}
        for mode in s["modes"].values():
            assert {"memory", "disk, cold", "disk, warm", "disk, again"} <= set(mode)
    cold = {n: s["modes"]["decode"]["disk, cold"] for n, s in schemes.items()}
    for other in ("bfloat16", "fp8"):                                     # NF4 against each, from the same run
        assert cold["nf4"]["ratios"][other] == pytest.approx(
            cold["nf4"]["tokens_per_s"] / cold[other]["tokens_per_s"])
    rows_read = {n: c["stats"]["rows_read"] for n, c in cold.items()}
    assert len(set(rows_read.values())) == 1 and rows_read["nf4"] > 0      # the same stream for each
    assert [c["stats"]["bytes_read"] // rows_read[n] for n, c in cold.items()] == [320, 160, 84]
    assert not list(tmp_path.glob("*-*"))                                  # the checkpoints deleted
