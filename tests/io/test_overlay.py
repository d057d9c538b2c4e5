"""``ple.io.disk_table.overlay``: the durable store of a trainable disk table's changed rows and their optimizer state.

Rows and states bit for bit (random bits: NaNs, infinities and subnormals included) in memory, spilled past
the memory budget, flushed and reopened; the base fingerprint and layout checks; one writer at a time (in this
process and from another); damaged files (truncated, a byte changed, deleted) named in a ``ValueError``; a
flush's cost (bytes written) against the rows it changes, and the disk the overlay holds under compaction.

Crashes, two ways. Injected: every file operation (write, fsync, rename, delete) of a run of updates and a
flush is made to fail in turn (a write torn halfway), and the directory must reopen as the flush before or
the flush in progress, exactly. Killed: a child process (this file run as a script) updates rows with
contents known per generation and flushes, printing each generation once its flush returned; the parent
kills it (SIGKILL) at random moments, reopens the directory and checks it holds exactly one flushed
generation, the last one printed or the one after. Ordered: the file operations of the flush checked against
what makes it durable on a power loss too, which no kill can show (``tests/_overlay_helpers.py``).
"""

from __future__ import annotations

import gc
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _overlay_helpers import Crash, FaultInjector, check_flush_order, watched_child

from ple.io.disk_table.overlay import _files as ofiles
from ple.io.disk_table.overlay._files import LOCK, MANIFEST
from ple.io.disk_table.overlay.store import SLOT_OVERHEAD, OverlayStore

D = 8
BASE = {"config": {"dim": D, "rows": 100_000}, "files": {"model.safetensors": [123456, 1700000000]}}
ADAM = {"exp_avg": ((D,), torch.float32), "exp_avg_sq": ((), torch.float32)}
ROOT = Path(__file__).resolve().parents[2]


def open_store(path: Path, *, dtype: torch.dtype = torch.bfloat16, state: dict | None = ADAM,
               memory_bytes: int = 1 << 20, base: dict = BASE, **kw) -> OverlayStore:
    return OverlayStore.open(path, base=base, dim=D, dtype=dtype, state=state, memory_bytes=memory_bytes, **kw)


def row_bytes(dtype: torch.dtype = torch.bfloat16, state: dict | None = ADAM) -> int:
    return D * dtype.itemsize + sum(dt.itemsize * (s[0] if s else 1) for s, dt in (state or {}).values())


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Values of ``dtype`` from random bit patterns (NaN payloads, infinities, subnormals, -0.0 included)."""
    bits = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max, shape, dtype=torch.int64, generator=g).to(bits).view(dtype)


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


class Model:
    """What the store should hold: id -> (row, {name: state})."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, state: dict | None = ADAM) -> None:
        self.dtype, self.state, self.rows = dtype, state or {}, {}

    def update(self, store: OverlayStore, ids: torch.Tensor, g: torch.Generator) -> None:
        rows = random_bits((ids.numel(), D), self.dtype, g)
        states = {n: random_bits((ids.numel(), *s), dt, g) for n, (s, dt) in self.state.items()}
        store.update(ids, rows, states)
        for i, k in enumerate(ids.tolist()):
            self.rows[k] = (rows[i], {n: v[i] for n, v in states.items()})

    def check(self, store: OverlayStore, extra_misses: int = 50) -> None:
        """Every row and state bit for bit through `lookup`, `state_rows` and `items`; misses read zeros."""
        known = sorted(self.rows)
        misses = [k for k in range(10**6, 10**6 + extra_misses)] + [-1, 2**62]
        ids = torch.tensor(known + misses, dtype=torch.int64)
        hit, rows = store.lookup(ids)
        hit2, states = store.state_rows(ids)
        n = len(known)
        assert hit[:n].all() and not hit[n:].any() and torch.equal(hit, hit2)
        assert store.num_rows == n
        assert sum(s.live for s in store._segments.values()) == store._on_disk.count    # the index's counts agree
        if n:
            assert torch.equal(bits_of(rows[:n]), bits_of(torch.stack([self.rows[k][0] for k in known])))
            for name in self.state:
                want = torch.stack([self.rows[k][1][name] for k in known])
                assert torch.equal(bits_of(states[name][:n]), bits_of(want)), name
        assert not rows[n:].any() and all(not v[n:].any() for v in states.values())
        spans = [(-5, 2**62), (0, 0), (7, 3)]
        if n:
            spans += [(known[0], known[0] + 1), (known[n // 3], known[2 * n // 3]), (known[-1], known[-1] + 1),
                      (known[n // 2] + 1, known[-1])]
        for lo, hi in spans:                                   # read_range: the rows in [lo, hi), sorted
            got_ids, got = store.read_range(lo, hi)
            want_ids = [k for k in known if lo <= k < hi]
            assert got_ids.tolist() == want_ids, (lo, hi)
            want = [self.rows[k] for k in want_ids]
            assert torch.equal(bits_of(got["rows"]), bits_of(torch.stack([w[0] for w in want])
                                                             if want else got["rows"]))
            for name in self.state:
                assert torch.equal(bits_of(got[f"state.{name}"]), bits_of(torch.stack([w[1][name] for w in want])
                                                                          if want else got[f"state.{name}"]))
        seen = []
        for chunk_ids, chunk_rows, chunk_states in store.items(chunk_rows=97):
            assert chunk_ids.numel() <= 97
            seen += chunk_ids.tolist()
            want = [self.rows[k] for k in chunk_ids.tolist()]
            assert torch.equal(bits_of(chunk_rows), bits_of(torch.stack([w[0] for w in want])))
            for name, v in chunk_states.items():
                assert torch.equal(bits_of(v), bits_of(torch.stack([w[1][name] for w in want])))
        assert seen == known


def dir_files(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()}


def manifest_files(path: Path) -> set[str]:
    return {s["file"] for s in json.loads((path / MANIFEST).read_text())["manifest"]["segments"]}


# ---- round trips ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_bit_for_bit(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    model = Model(dtype)
    with open_store(tmp_path / "ov", dtype=dtype) as store:
        assert store.num_rows == 0 and store.generation == 0 and store.meta == {}
        model.check(store)
        for _ in range(4):
            model.update(store, torch.randperm(400, generator=g)[:150], g)
        model.check(store)                                     # from memory
        store.flush(meta={"step": 4, "lr": 0.01})
        model.check(store)
        model.update(store, torch.randperm(400, generator=g)[:50], g)
        store.flush()                                          # meta kept
        assert store.generation == 2
    assert dir_files(tmp_path / "ov") == manifest_files(tmp_path / "ov") | {MANIFEST, LOCK}
    with open_store(tmp_path / "ov", dtype=dtype) as store:
        assert store.generation == 2 and store.meta == {"step": 4, "lr": 0.01}
        assert store.stats()["rows_in_memory"] == 0
        model.check(store)                                     # from the files
        model.update(store, torch.randperm(400, generator=g)[:50], g)   # rows on disk overwritten
        model.check(store)


def test_no_state_and_conversions(tmp_path):
    """A store without optimizer state (SGD); rows given in float32 are rounded to the store's bfloat16."""
    with open_store(tmp_path / "ov", state=None) as store:
        rows = torch.randn(5, D)
        store.update(torch.arange(5, dtype=torch.int32), rows)
        hit, got = store.lookup(torch.tensor([4, 0, 9]))
        assert hit.tolist() == [True, True, False]
        assert torch.equal(got[:2], rows[[4, 0]].to(torch.bfloat16))
        assert store.state_rows(torch.tensor([1]))[1] == {}
        store.flush()
        ids, r, st = next(store.items())
        assert ids.tolist() == list(range(5)) and st == {}


def test_many_ids_across_index_growth(tmp_path):
    """Ids anywhere in int64 (>= 0), many at once: the index grows and probes; lookups with repeats."""
    g = torch.Generator().manual_seed(2)
    model = Model(torch.float32, None)
    with open_store(tmp_path / "ov", dtype=torch.float32, state=None, memory_bytes=8 << 20) as store:
        for _ in range(3):
            ids = torch.unique(torch.randint(0, 2**62, (7000,), generator=g))
            model.update(store, torch.cat([ids, torch.arange(3000 * _, 3000 * _ + 3000)]), g)
        model.check(store)
        q = torch.tensor(sorted(model.rows))[torch.randint(0, len(model.rows), (5000,), generator=g)]
        hit, rows = store.lookup(q)
        assert hit.all()
        assert torch.equal(bits_of(rows), bits_of(torch.stack([model.rows[k][0] for k in q.tolist()])))


def test_update_checks(tmp_path):
    with open_store(tmp_path / "ov") as store:
        with pytest.raises(ValueError, match="^ids:"):
            store.update(torch.tensor([1, 2, 1]), torch.zeros(3, D), {"exp_avg": torch.zeros(3, D),
                                                                      "exp_avg_sq": torch.zeros(3)})
        with pytest.raises(ValueError, match="^ids:"):
            store.update(torch.tensor([-3]), torch.zeros(1, D), {"exp_avg": torch.zeros(1, D),
                                                                 "exp_avg_sq": torch.zeros(1)})
        with pytest.raises(ValueError, match="^rows:"):
            store.update(torch.tensor([1]), torch.zeros(1, D + 1), {"exp_avg": torch.zeros(1, D),
                                                                    "exp_avg_sq": torch.zeros(1)})
        with pytest.raises(ValueError, match="^states:"):
            store.update(torch.tensor([1]), torch.zeros(1, D), {"exp_avg": torch.zeros(1, D)})
        with pytest.raises(TypeError, match="^ids:"):
            store.lookup(torch.zeros(2, 2, dtype=torch.int64))
        with pytest.raises(ValueError, match="^meta:"):
            store.flush(meta={"x": object()})
        assert store.num_rows == 0
    with pytest.raises(ValueError, match="closed"):
        store.lookup(torch.tensor([1]))
    with pytest.raises(ValueError, match="^memory_bytes:"):
        open_store(tmp_path / "ov2", memory_bytes=-1)
    with pytest.raises(ValueError, match="^state:"):
        open_store(tmp_path / "ov2", state={"sum": ((), "float32")})


# ---- memory budget -------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget_rows", [0, 40])
def test_spill_and_read_back(tmp_path, budget_rows):
    """Past the budget the least recently updated rows go to spill files; lookups read them back, flush
    makes them durable, and the rows in memory never exceed the budget."""
    budget = budget_rows * (row_bytes() + SLOT_OVERHEAD)
    g = torch.Generator().manual_seed(3)
    model = Model()
    with open_store(tmp_path / "ov", memory_bytes=budget) as store:
        for step in range(12):
            model.update(store, torch.randperm(300, generator=g)[:60], g)
            st = store.stats()
            assert st["rows_in_memory"] <= budget_rows and st["memory_bytes"] <= budget
            if step == 6:
                model.check(store)
                store.flush(meta={"step": step})
        assert store.stats()["spilled_rows"] > 0
        model.check(store)                                     # flushed, spilled and in-memory rows together
        store.flush()
        model.check(store)
    with open_store(tmp_path / "ov", memory_bytes=budget) as store:
        model.check(store)


def test_unflushed_updates_are_dropped(tmp_path):
    """Closing without a flush leaves the last flushed generation (spill files deleted)."""
    g = torch.Generator().manual_seed(4)
    model = Model()
    with open_store(tmp_path / "ov", memory_bytes=30 * (row_bytes() + SLOT_OVERHEAD)) as store:
        model.update(store, torch.arange(100), g)
        store.flush(meta={"n": 1})
        saved = dict(model.rows)
        for _ in range(5):
            model.update(store, torch.randperm(300, generator=g)[:80], g)
        assert store.stats()["spilled_rows"] > 0
    assert dir_files(tmp_path / "ov") == manifest_files(tmp_path / "ov") | {MANIFEST, LOCK}
    model.rows = saved
    with open_store(tmp_path / "ov") as store:
        assert store.generation == 1 and store.meta == {"n": 1}
        model.check(store)


# ---- opening: the base, the layout, the lock -------------------------------------------------------------
def test_other_base_or_layout_refused(tmp_path):
    with open_store(tmp_path / "ov") as store:
        store.update(torch.tensor([1]), torch.ones(1, D), {"exp_avg": torch.ones(1, D), "exp_avg_sq": torch.ones(1)})
        store.flush()
    other = json.loads(json.dumps(BASE))
    other["files"]["model.safetensors"][1] += 1
    with pytest.raises(ValueError, match=r"^overlay: .*another base.*files\.model\.safetensors"):
        open_store(tmp_path / "ov", base=other)
    with pytest.raises(ValueError, match=r"^overlay: .*another base.*config\.rows"):
        open_store(tmp_path / "ov", base={**BASE, "config": {"dim": D, "rows": 7}})
    for kw in ({"dtype": torch.float32}, {"state": {"sum": ((), torch.float32)}}, {"state": None}):
        with pytest.raises(ValueError, match="^overlay: .*holds rows of"):
            open_store(tmp_path / "ov", **kw)
    with pytest.raises(ValueError, match="^overlay: .*holds rows of"):
        OverlayStore.open(tmp_path / "ov", base=BASE, dim=D + 1, state=ADAM, memory_bytes=0)
    with open_store(tmp_path / "ov") as store:                 # the refusals took no lock and changed nothing
        assert store.num_rows == 1


def test_create_false_and_readonly(tmp_path):
    with pytest.raises(ValueError, match="^overlay: "):
        open_store(tmp_path / "none", create=False)
    assert not (tmp_path / "none").exists()
    with open_store(tmp_path / "ov") as store:
        pass                                                   # nothing durable before a flush
    assert dir_files(tmp_path / "ov") == {LOCK}
    with pytest.raises(ValueError, match="no overlay"):
        open_store(tmp_path / "ov", readonly=True)
    with open_store(tmp_path / "ov") as store:
        store.update(torch.tensor([3]), torch.ones(1, D), {"exp_avg": torch.ones(1, D), "exp_avg_sq": torch.ones(1)})
        store.flush()
        store.update(torch.tensor([4]), torch.ones(1, D), {"exp_avg": torch.ones(1, D), "exp_avg_sq": torch.ones(1)})
        with open_store(tmp_path / "ov", readonly=True) as snap:   # beside a writer: its last flush, no lock
            assert snap.num_rows == 1 and snap.generation == 1 and snap.lookup(torch.tensor([3]))[0].all()
    with open_store(tmp_path / "ov", readonly=True) as r1, open_store(tmp_path / "ov", readonly=True) as r2:
        assert r1.lookup(torch.tensor([3]))[0].all() and r2.num_rows == 1
        with pytest.raises(ValueError, match="read only"):
            r1.flush()
        with pytest.raises(RuntimeError, match="held by this process"):
            open_store(tmp_path / "ov")                        # readers exclude a writer


def test_reader_beside_a_writer_follows_its_flushes(tmp_path, monkeypatch):
    """A reader opened while a writer holds the overlay reads the last flushed generation; files the writer
    deletes later stay readable to it; a flush that deletes the files of the manifest it just read (a race)
    makes it read the newer manifest, and a manifest naming a missing file with no newer one is damage."""
    import ple.io.disk_table.overlay._files as ofiles

    g = torch.Generator().manual_seed(5)
    d = tmp_path / "ov"
    with open_store(d, memory_bytes=0) as w:
        def put(ids: list[int]) -> None:
            ids_t = torch.tensor(ids)
            w.update(ids_t, torch.randn(len(ids), D, generator=g), {"exp_avg": torch.randn(len(ids), D, generator=g),
                                                                      "exp_avg_sq": torch.rand(len(ids), generator=g)})
            w.flush()

        put([1, 2])
        put([3])
        stale = ofiles.read_manifest(d)                        # two segments
        want = w.read(torch.tensor([1, 2, 3]))
        with open_store(d, readonly=True) as r:
            put([4, 5, 6])                                     # merges: the files r mapped are deleted
            assert not any((d / seg["file"]).exists() for seg in stale["segments"])
            got = r.read(torch.tensor([1, 2, 3]))
            assert all(torch.equal(bits_of(got[1][k]), bits_of(want[1][k])) for k in want[1])
        calls = []
        real = ofiles.read_manifest

        def racing(directory):                                 # the first read sees the manifest before the flush
            calls.append(1)
            return stale if len(calls) == 1 else real(directory)

        monkeypatch.setattr(ofiles, "read_manifest", racing)
        with open_store(d, readonly=True) as r:
            assert r.generation == real(d)["generation"] and r.num_rows == 6 and len(calls) >= 2
        monkeypatch.setattr(ofiles, "read_manifest", lambda directory: stale)    # no newer one: damage
        with pytest.raises(ValueError, match="cannot be read"):
            open_store(d, readonly=True)


_SECOND = """
import sys, time
from ple.io.disk_table.overlay.store import OverlayStore
try:
    OverlayStore.open(sys.argv[1], base={}, dim=4, memory_bytes=0)
except RuntimeError as e:
    print("refused:", e, flush=True)
sys.stdin.readline()                                  # the first writer has closed: take the lock and hold it
s = OverlayStore.open(sys.argv[1], base={}, dim=4, memory_bytes=0)
print("holding", flush=True)
time.sleep(60)
"""


def test_second_writer_refused(tmp_path):
    """One writer at a time: a second store in this process, or in another, is refused; a killed holder's
    lock goes with it."""
    d = tmp_path / "ov"
    store = OverlayStore.open(d, base={}, dim=4, memory_bytes=0)
    with pytest.raises(RuntimeError, match=f"^overlay: {re.escape(str(d))} is held by this process: .*"
                                           r"Release it with layer\.table\.close\(\) \(store\.close\(\)"):
        OverlayStore.open(d, base={}, dim=4, memory_bytes=0)
    other = subprocess.Popen([sys.executable, "-c", _SECOND, str(d)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = other.stdout.readline()
        assert line.startswith(f"refused: overlay: {d} is held by another process"), other.stderr.read()
        store.close()
        other.stdin.write("go\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "holding", other.stderr.read()
        with pytest.raises(RuntimeError, match="another process"):
            OverlayStore.open(d, base={}, dim=4, memory_bytes=0)
    finally:
        other.kill()
        other.communicate()
    OverlayStore.open(d, base={}, dim=4, memory_bytes=0).close()   # released with the process


def test_a_store_dropped_unclosed_releases_its_lock(tmp_path):
    """A store garbage-collected without `close` (a layer deleted in a notebook) releases the directory; its
    spill files, never flushed, are left to the next open, which deletes them."""
    d = tmp_path / "ov"
    store = open_store(d, memory_bytes=0)
    Model().update(store, torch.arange(10), torch.Generator().manual_seed(1))
    assert len(dir_files(d)) > 1                               # spilled
    del store
    gc.collect()
    with open_store(d) as again:
        assert again.num_rows == 0 and again.generation == 0
    assert dir_files(d) == {LOCK}


# ---- damaged files -------------------------------------------------------------------------------------
def _span(path: Path, key: str) -> tuple[int, int]:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    if key == "header":
        return 8, 8 + n
    a, b = json.loads(data[8: 8 + n])[key]["data_offsets"]
    return 8 + n + a, 8 + n + b


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _two_flushes(d: Path, seed: int, first: torch.Tensor, second: torch.Tensor) -> Model:
    """An overlay in ``d`` of rows ``first``, flushed, then ``second``, flushed (a segment each); closed."""
    g = torch.Generator().manual_seed(seed)
    model = Model()
    with open_store(d) as store:
        for ids in (first, second):
            model.update(store, ids, g)
            store.flush()
    return model


DAMAGE = ["truncate", "append", "delete", "header", "ids", "rows", "state.exp_avg", "state.exp_avg_sq",
          "manifest", "manifest-truncated"]


@pytest.mark.parametrize("reads", ["preadv", "pread"])
@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_file_named(tmp_path, damage, reads, monkeypatch):
    """A missing, truncated or altered file is a ValueError naming it, at open or before any row of it is
    returned; never a crash or a wrong row. The checksums read 7 bytes at a time into one buffer (a file's
    parts end mid-buffer), through ``os.preadv`` or, where it is missing, ``os.pread``."""
    monkeypatch.setattr(ofiles, "_READ", 7)
    if reads == "pread":
        monkeypatch.delattr(os, "preadv", raising=False)
    d = tmp_path / "ov"
    model = _two_flushes(d, 5, torch.arange(200), torch.arange(150, 170))
    segs = sorted(manifest_files(d))
    assert len(segs) == 2
    target = d / (MANIFEST if damage.startswith("manifest") else segs[0])
    if damage == "truncate":
        os.truncate(target, target.stat().st_size - 3)
    elif damage == "append":
        with open(target, "ab") as fh:
            fh.write(b"\0")
    elif damage == "delete":
        target.unlink()
    elif damage == "manifest":                                 # still JSON, not the manifest's checksum
        target.write_text(target.read_text().replace('"generation": 2', '"generation": 3'))
    elif damage == "manifest-truncated":
        os.truncate(target, target.stat().st_size // 2)
    else:
        a, b = _span(target, damage)
        _flip(target, (a + b) // 2)
    with pytest.raises(ValueError, match=re.escape(str(target))):
        with open_store(d) as store:
            model.check(store)
            store.verify()


@pytest.mark.parametrize("reads", ["preadv", "pread"])
def test_an_intact_overlay_passes_its_checksums_read_in_pieces(tmp_path, reads, monkeypatch):
    """The checksums read 7 bytes at a time (a part's last piece short, the buffer holding the previous one's
    bytes past it) match on an intact overlay, through either read."""
    monkeypatch.setattr(ofiles, "_READ", 7)
    if reads == "pread":
        monkeypatch.delattr(os, "preadv", raising=False)
    d = tmp_path / "ov"
    model = _two_flushes(d, 5, torch.arange(200), torch.arange(150, 170))
    with open_store(d) as store:
        store.verify()
        model.check(store)


def test_damage_found_after_open(tmp_path):
    """A segment whose rows changed after the store was opened: the first lookup of one of its rows checks
    the segment and refuses; rows of other segments still read."""
    d = tmp_path / "ov"
    _two_flushes(d, 6, torch.arange(100), torch.arange(100, 120))
    first = d / sorted(manifest_files(d))[0]
    with open_store(d) as store:
        a, b = _span(first, "rows")
        st = first.stat()
        with open(first, "r+b") as fh:                         # same size, and the mtime put back
            fh.seek(a + 5)
            fh.write(b"\x7f")
        os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert store.lookup(torch.tensor([110]))[0].all()
        with pytest.raises(ValueError, match=re.escape(str(first))):
            store.lookup(torch.tensor([5]))


def test_leftovers_of_a_killed_writer_are_cleaned(tmp_path):
    g = torch.Generator().manual_seed(7)
    model = Model()
    d = tmp_path / "ov"
    with open_store(d) as store:
        model.update(store, torch.arange(50), g)
        store.flush()
    (d / "seg-99999999.safetensors").write_bytes(b"half a segment")
    (d / (MANIFEST + ".tmp")).write_text("{half a manifest")
    (d / "notes.txt").write_text("not ours")
    with open_store(d) as store:
        model.check(store)
    assert dir_files(d) == manifest_files(d) | {MANIFEST, LOCK, "notes.txt"}


# ---- cost and disk -------------------------------------------------------------------------------------
def test_flush_cost_follows_the_changed_rows(tmp_path):
    """A flush writes the rows changed since the last one (and merges, amortised), whatever the overlay's size."""
    rb = row_bytes()
    costs = {}
    for total in (20_000, 80_000):
        g = torch.Generator().manual_seed(8)
        with open_store(tmp_path / f"ov{total}", memory_bytes=64 << 20) as store:
            ones = torch.ones(total, D)
            store.update(torch.arange(total), ones, {"exp_avg": ones, "exp_avg_sq": ones[:, 0]})
            store.flush()
            for changed in (10, 300):
                before = store.stats()["bytes_written"]
                ids = torch.randperm(total, generator=g)[:changed]
                store.update(ids, ones[:changed], {"exp_avg": ones[:changed], "exp_avg_sq": ones[:changed, 0]})
                store.flush()
                costs[total, changed] = store.stats()["bytes_written"] - before
            before = store.stats()["bytes_written"]
            for _ in range(30):                                 # many small flushes: merges stay amortised
                ids = torch.randperm(total, generator=g)[:50]
                store.update(ids, ones[:50], {"exp_avg": ones[:50], "exp_avg_sq": ones[:50, 0]})
                store.flush()
            costs[total, "30x50"] = store.stats()["bytes_written"] - before
    for total in (20_000, 80_000):
        assert costs[total, 10] < 10 * rb + 8192
        assert 300 * rb < costs[total, 300] < 3 * 310 * rb + 8192          # its rows, and a merge with the 10
        assert costs[total, "30x50"] < 8 * 30 * 50 * rb
        for key in (10, 300, "30x50"):
            assert costs[total, key] < 1.3 * costs[20_000, key] + 256, key       # not 4 times: the overlay's size


def test_compaction_bounds_the_disk(tmp_path):
    """Rewriting the same rows again and again: dead rows are compacted away, the directory holds the
    manifest's files only, and its size stays within about twice the live rows."""
    g = torch.Generator().manual_seed(9)
    model = Model()
    d = tmp_path / "ov"
    with open_store(d, memory_bytes=100 * (row_bytes() + SLOT_OVERHEAD)) as store:
        model.update(store, torch.arange(1000), g)
        store.flush()
        for _ in range(25):
            model.update(store, torch.randperm(1000, generator=g)[:300], g)
            store.flush()
            st = store.stats()
            assert dir_files(d) == manifest_files(d) | {MANIFEST, LOCK}
            assert st["dead_bytes"] <= st["live_bytes"]
            assert st["bytes_on_disk"] <= 2 * st["live_bytes"] + 4096 * (st["segments"] + 2)
        assert st["compactions"] + st["merges"] > 0
        model.check(store)


def test_segments_stay_few(tmp_path):
    """New rows at every flush (nothing dead to compact): segments are merged as they pile up, about log2 of
    the flushes, each row rewritten a few times at most."""
    g = torch.Generator().manual_seed(12)
    model = Model()
    d = tmp_path / "ov"
    with open_store(d, memory_bytes=1 << 20) as store:
        for step in range(32):
            model.update(store, torch.arange(50 * step, 50 * step + 50), g)
            store.flush()
            assert store.stats()["segments"] <= 7
        st = store.stats()
        assert dir_files(d) == manifest_files(d) | {MANIFEST, LOCK}
        assert st["bytes_written"] < (2 + 5) * 32 * 50 * row_bytes() + 64 * 4096      # log2(32) rewrites
        model.check(store)


def test_a_flush_after_many_spills_writes_each_row_about_once(tmp_path):
    """Rows spilled past a small budget pile up as segments between flushes (a step waits on no merge); the
    flush merges them in one rewrite, not once per segment (which wrote each row as often as there were
    segments after it)."""
    g = torch.Generator().manual_seed(13)
    model = Model()
    rb = row_bytes()
    with open_store(tmp_path / "ov", memory_bytes=100 * (rb + SLOT_OVERHEAD)) as store:
        for step in range(24):                                 # 24 x 100 new rows: about 23 spill segments
            model.update(store, torch.arange(100 * step, 100 * step + 100), g)
        st = store.stats()
        assert st["segments"] >= 16 and st["merges"] == 0
        before = st["bytes_written"]
        store.flush()
        written = store.stats()["bytes_written"] - before
        assert written < 1.5 * 2400 * rb + 64 * 4096           # each row about once (pairwise: about 12 times)
        assert store.stats()["segments"] <= 2
        model.check(store)


# ---- crashes: injected ---------------------------------------------------------------------------------
def _crash_scenario(d: Path, model: Model, g: torch.Generator, opened: list) -> OverlayStore:
    """Updates past the memory budget (rows spill), overwriting most of the template's rows, and a flush:
    dead rows outnumber live ones, so the flush compacts, retiring the template's durable segments."""
    store = open_store(d, memory_bytes=40 * (row_bytes() + SLOT_OVERHEAD))
    opened.append(store)
    for _ in range(3):
        model.update(store, torch.randperm(400, generator=g)[:200], g)
    store.flush(meta={"gen": 2})
    return store


def _run_crash(tmp_path: Path, template: Path, at: int, monkeypatch) -> FaultInjector:
    """Crash at the ``at``-th file operation of the scenario; check the directory reopens as generation 1
    or 2, exactly. Returns the injector (its ``count``: the operations done, to the crash; its ``log``)."""
    d = tmp_path / f"crash{at}"
    shutil.copytree(template, d)
    model, g = Model(), torch.Generator().manual_seed(11)
    model.rows = dict(_TEMPLATE_ROWS)
    before = dict(model.rows)
    opened: list[OverlayStore] = []
    with monkeypatch.context() as m:
        inj = FaultInjector(m, at)
        try:
            _crash_scenario(d, model, g, opened).close()
        except Crash:
            pass
    for store in opened:                                        # a dead process's lock goes with it
        if store._lock is not None:
            store._lock.release()
            store._lock = None
    with open_store(d) as store:
        gen = store.generation
        assert gen in (1, 2), (at, gen)
        assert gen == 2 or inj.count >= at, "the flush did not happen but nothing failed"
        if gen == 1:
            model.rows = before
        model.check(store)
    shutil.rmtree(d)
    return inj


_TEMPLATE_ROWS: dict = {}


@pytest.fixture(scope="module")
def crash_template(tmp_path_factory):
    d = tmp_path_factory.mktemp("template") / "ov"
    model, g = Model(), torch.Generator().manual_seed(10)
    with open_store(d, memory_bytes=40 * (row_bytes() + SLOT_OVERHEAD)) as store:
        for _ in range(3):
            model.update(store, torch.randperm(400, generator=g)[:90], g)
        store.flush(meta={"gen": 1})
    _TEMPLATE_ROWS.clear()
    _TEMPLATE_ROWS.update(model.rows)
    return d


def test_flush_orders_its_file_operations(tmp_path, crash_template, monkeypatch):
    """What a kill cannot show (it leaves the page cache): every segment the new manifest names is fsynced, and
    the directory after its creation, before the manifest's rename; no segment a manifest that may be the one
    on disk names is deleted before the rename is made durable (`check_flush_order`). The scenario spills,
    compacts and retires every durable segment of the template, so the crash tests land inside that merge."""
    inj = _run_crash(tmp_path, crash_template, -1, monkeypatch)
    order = check_flush_order(inj.log, tmp_path / "crash-1", manifest_files(crash_template))
    assert order["manifests"] == 1 and order["retired"] == len(manifest_files(crash_template)) > 1
    written = [p for op, p, _ in inj.log if op == "create" and Path(p).name.startswith("seg-")]
    assert len(written) > 3                                    # spills, the flush's segment and the compaction's


def test_injected_crashes_quick(tmp_path, crash_template, monkeypatch):
    """A crash at sampled file operations of updates (spills) and a flush, and at each of the flush's last
    ones (the compaction's writes, the manifest's switch, the deletions)."""
    n = _run_crash(tmp_path, crash_template, -1, monkeypatch).count
    assert n > 20
    for at in sorted(set(range(n - 16, n + 1)) | set(range(1, n, max(1, n // 25)))):     # the flush's end: all
        _run_crash(tmp_path, crash_template, at, monkeypatch)


@pytest.mark.deep
def test_injected_crashes_every_operation(tmp_path, crash_template, monkeypatch):
    n = _run_crash(tmp_path, crash_template, -1, monkeypatch).count
    for at in range(1, n + 1):
        assert _run_crash(tmp_path, crash_template, at, monkeypatch).count >= at


# ---- crashes: killed -----------------------------------------------------------------------------------
KILL_IDS = 3000
KILL_STATE = {"sum": ((), torch.float32)}
KILL_MEMORY = 150 * (2 * D + 4 + SLOT_OVERHEAD)       # about 150 rows in memory: spills and merges between flushes


def kill_updates(seed: int, gen: int):
    """The updates of generation ``gen``: three of random rows, contents drawn from ``(seed, gen)``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + gen)
    for k in range(3):
        m = int(torch.randint(1, 400, (1,), generator=g))
        ids = torch.randperm(KILL_IDS, generator=g)[:m]
        yield ids, random_bits((m, D), torch.bfloat16, g), torch.full((m,), float(10 * gen + k))


def open_kill_store(d) -> OverlayStore:
    return OverlayStore.open(d, base=BASE, dim=D, state=KILL_STATE, memory_bytes=KILL_MEMORY)


def kill_child(d: str, seed: int) -> None:
    """The killed process: update and flush generation after generation, printing each once durable."""
    with open_kill_store(d) as store:
        start = store.meta.get("gen", 0)
        print("ready", start, flush=True)
        for gen in range(start + 1, start + 100_000):
            for ids, rows, sums in kill_updates(seed, gen):
                store.update(ids, rows, {"sum": sums})
            store.flush(meta={"gen": gen})
            print(gen, flush=True)


def _expected(seed: int, gen: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = torch.zeros(KILL_IDS, D, dtype=torch.bfloat16)
    sums = torch.full((KILL_IDS,), -1.0)
    for g in range(1, gen + 1):
        for ids, r, s in kill_updates(seed, g):
            rows[ids], sums[ids] = r, s
    present = sums >= 0
    return present.nonzero().squeeze(1), rows[present], sums[present]


def _kill_rounds(tmp_path: Path, seed: int, rounds: int) -> list[int]:
    d = tmp_path / f"kill{seed}"
    rng = random.Random(seed)
    durable, gens = 0, []
    for r in range(rounds):
        with watched_child(__file__, d, seed) as (child, start):
            assert start == durable
            first = []
            if r == rounds - 1 or rng.random() < 0.7:         # mostly past a first flush: progress on a busy machine
                first = child.stdout.readline().split()
            time.sleep(rng.uniform(0.0, 0.6))
            child.kill()
            out, _ = child.communicate()
        last = max([durable] + [int(x) for x in first + out.split()])
        with open_kill_store(d) as store:
            gen = store.meta.get("gen", 0)
            assert gen in (last, last + 1), (gen, last)        # exactly one flushed generation, not older
            ids, rows, sums = _expected(seed, gen)
            got = list(store.items())
            got_ids = torch.cat([c[0] for c in got]) if got else torch.empty(0, dtype=torch.int64)
            assert torch.equal(got_ids, ids)
            if got:
                assert torch.equal(bits_of(torch.cat([c[1] for c in got])), bits_of(rows))
                assert torch.equal(torch.cat([c[2]["sum"] for c in got]), sums)
        durable = gen
        gens.append(gen)
    return gens


def test_killed_writer_quick(tmp_path):
    gens = _kill_rounds(tmp_path, seed=0, rounds=2)
    assert gens[-1] > 0


@pytest.mark.deep
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_killed_writer(tmp_path, seed):
    gens = _kill_rounds(tmp_path, seed=seed, rounds=6)
    assert gens[-1] > gens[0]


if __name__ == "__main__":
    kill_child(sys.argv[1], int(sys.argv[2]))
