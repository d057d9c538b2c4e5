"""The overlay's index off the heap (``ple.io.disk_table.overlay._index`` and its use by
``ple.io.disk_table.overlay``): the hash index of the rows in memory, the bitmap of the ids on disk, the fences and
the search of a segment's mapped ids, the streaming k-way merge; and the store through them: shadowing across
segments, ids in no segment, ids at fence boundaries, merges of many segments in small chunks, compaction,
reopening, a read-only snapshot beside a writer, and an overlay written by the earlier version of the store."""

from __future__ import annotations

import base64
import io
import json
import tarfile

import pytest
import torch

from ple.io.disk_table.overlay import _files as ofiles
from ple.io.disk_table.overlay import _index as oindex
from ple.io.disk_table.overlay._index import IdBitmap, SlotIndex, fences_of, find_sorted, merge_sorted
from ple.io.disk_table.overlay.store import SLOT_OVERHEAD, OverlayStore

D = 4
STATE = {"sum": ((), torch.float32)}
ROW_BYTES = 2 * D + 4


def open_store(d, memory_rows: int = 0, **kw) -> OverlayStore:
    budget = memory_rows * (ROW_BYTES + SLOT_OVERHEAD)
    return OverlayStore.open(d, base={"b": 1}, dim=D, state=STATE, memory_bytes=budget, **kw)


class Model:
    """What the store should hold: id -> (row, sum); rows drawn from ``(id, version)``."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[torch.Tensor, float]] = {}
        self.version = 0

    def update(self, store: OverlayStore, ids: torch.Tensor) -> None:
        self.version += 1
        rows = (ids[:, None] * 8 + torch.arange(D)[None] + self.version / 4).to(torch.bfloat16)
        sums = torch.full((ids.numel(),), float(self.version))
        store.update(ids, rows, {"sum": sums})
        for i, k in enumerate(ids.tolist()):
            self.rows[k] = (rows[i], float(self.version))

    def check(self, store: OverlayStore, probe: torch.Tensor | None = None) -> None:
        known = sorted(self.rows)
        ids = torch.tensor(known + ([] if probe is None else probe.tolist()), dtype=torch.int64)
        hit, rows = store.lookup(ids)
        hit2, states = store.state_rows(ids)
        want_hit = torch.tensor([i in self.rows for i in ids.tolist()], dtype=torch.bool)
        assert torch.equal(hit, want_hit) and torch.equal(hit2, want_hit)
        for j, i in enumerate(ids.tolist()):
            if i in self.rows:
                assert torch.equal(rows[j], self.rows[i][0]), i
                assert float(states["sum"][j]) == self.rows[i][1], i
            else:
                assert not rows[j].any() and float(states["sum"][j]) == 0
        assert store.num_rows == len(known)
        assert sum(s.live for s in store._segments.values()) == store._on_disk.count        # live rows: exact
        got = [(c[0], c[1], c[2]["sum"]) for c in store.items(chunk_rows=37)]
        assert all(c[0].numel() == 37 for c in got[:-1])
        seen = torch.cat([c[0] for c in got]).tolist() if got else []
        assert seen == known
        if got:
            assert torch.equal(torch.cat([c[1] for c in got]), torch.stack([self.rows[k][0] for k in known]))
            assert torch.cat([c[2] for c in got]).tolist() == [self.rows[k][1] for k in known]


# ---- the pieces ----------------------------------------------------------------------------------------
def test_slot_index_against_a_dict():
    """Inserts and removes over many rounds (tombstones, rebuilds) give the dict's answers."""
    g = torch.Generator().manual_seed(0)
    index, model = SlotIndex(300), {}
    for _ in range(60):
        present = torch.tensor(sorted(model), dtype=torch.int64)
        if present.numel():
            k = int(torch.randint(0, 120, (1,), generator=g))
            gone = present[torch.randperm(present.numel(), generator=g)[:k]]
            index.remove(gone)
            for k in gone.tolist():
                del model[k]
        room = 300 - len(model)
        cand = torch.unique(torch.randint(0, 5000, (room,), generator=g))
        new = cand[~torch.isin(cand, torch.tensor(sorted(model), dtype=torch.int64))]
        slots = torch.randint(0, 300, (new.numel(),), generator=g)
        index.insert(new, slots)
        model.update(zip(new.tolist(), slots.tolist(), strict=True))
        q = torch.cat([torch.randint(-3, 5000, (400,), generator=g), new])
        assert index.find(q).tolist() == [model.get(k, -1) for k in q.tolist()]
        assert index.live == len(model)
    assert index.size == 601


def test_bitmap():
    bm = IdBitmap(10)
    assert bm.add(torch.tensor([0, 7, 8, 9])) == 4 and bm.count == 4
    assert bm.add(torch.tensor([7, 9, 100, 1000])) == 2 and bm.count == 6       # grows past its rows
    q = torch.tensor([0, 1, 7, 8, 9, 10, 99, 100, 1000, 1001, -1, 2**62, 7])
    assert bm.test(q).tolist() == [True, False, True, True, True, False, False, True, True, False, False, False, True]
    assert IdBitmap(320_001_536).nbytes == 40_000_192                            # the real table: 40 MB


@pytest.mark.parametrize("every", [1, 4, 7])
def test_find_sorted_at_fence_boundaries(every):
    g = torch.Generator().manual_seed(every)
    ids = torch.unique(torch.randint(0, 400, (150,), generator=g)) * 2 + 1        # odd: the evens miss
    fences = fences_of(ids, every, 3 * every)
    assert torch.equal(fences, ids[::every])
    q = torch.arange(-2, 805)
    want = torch.full_like(q, -1)
    pos = torch.searchsorted(ids, q)
    inside = pos < ids.numel()
    found = inside.clone()
    found[inside] = ids[pos[inside]] == q[inside]
    want[found] = pos[found]
    assert torch.equal(find_sorted(ids, fences, every, q), want)
    edges = ids[torch.arange(0, ids.numel(), every)]                          # the fences themselves, and beside
    for e in (edges, edges - 1, edges + 1, ids[-1:], ids[:1]):
        r = find_sorted(ids, fences, every, e)
        assert torch.equal(r, want[e + 2])
    assert find_sorted(ids[:0], fences[:0], every, q).eq(-1).all()


def test_fences_refuse_unsorted_ids():
    with pytest.raises(ValueError, match="seg-x: its ids are not sorted"):
        fences_of(torch.tensor([1, 5, 5, 9]), 2, 2, name="seg-x")
    with pytest.raises(ValueError, match="not sorted"):
        fences_of(torch.tensor([1, 5, 9, 2]), 2, 2)                          # across chunks
    with pytest.raises(ValueError, match="not sorted"):
        fences_of(torch.tensor([-4, 5]), 2, 2)


@pytest.mark.parametrize("chunk", [1, 5, 64, 10_000])
def test_merge_sorted_later_runs_win(chunk):
    g = torch.Generator().manual_seed(chunk)
    runs = [torch.unique(torch.randint(0, 300, (n,), generator=g)) for n in (100, 0, 40, 250, 3)]
    want = {}
    for r, run in enumerate(runs):
        for j, k in enumerate(run.tolist()):
            want[k] = (r, j)
    got = list(merge_sorted(runs, chunk))
    ids = torch.cat([c[0] for c in got])
    assert ids.tolist() == sorted(want)
    assert list(zip(torch.cat([c[1] for c in got]).tolist(), torch.cat([c[2] for c in got]).tolist(),
                    strict=True)) == [want[k] for k in sorted(want)]
    assert max(c[0].numel() for c in got) <= max(16, chunk // 5) * 5
    assert list(merge_sorted([], chunk)) == [] and list(merge_sorted([runs[1]], chunk)) == []


# ---- the store through them ----------------------------------------------------------------------------
def test_shadowing_across_segments(tmp_path):
    """Flushes of nested ranges, each holding fewer live rows than the one before (no merge): a row is read
    from the newest segment that holds it; each segment's live rows count the rows no later one replaces."""
    model = Model()
    ranges = ((0, 1000), (200, 450), (300, 400), (350, 380), (360, 365), (999, 1003))
    with open_store(tmp_path / "ov") as store:
        for a, b in ranges:
            model.update(store, torch.arange(a, b))
            store.flush()
        assert [s.live for s in store._segments.values()] == [749, 150, 70, 25, 5, 4]
        model.check(store, torch.tensor([-1, 1003, 5000, 2**40]))
        st = store.stats()
        assert st["live_bytes"] == 1003 * ROW_BYTES and st["rows"] == 1003 and st["merges"] == 0
        assert st["dead_bytes"] == (sum(b - a for a, b in ranges) - 1003) * ROW_BYTES
    listed = ofiles.read_manifest(tmp_path / "ov")["segments"]
    assert [s["live"] for s in listed] == [749, 150, 70, 25, 5, 4]                # kept: no recount at open
    with open_store(tmp_path / "ov") as store:                                  # reopen after flush
        assert [s.live for s in store._segments.values()] == [749, 150, 70, 25, 5, 4]
        model.check(store)


def test_ids_in_no_segment_are_not_searched(tmp_path, monkeypatch):
    """The bitmap filters out ids no segment holds before any search; ids between a segment's ids are
    searched and missed."""
    model = Model()
    with open_store(tmp_path / "ov", table_rows=10_000) as store:
        model.update(store, torch.arange(0, 2000, 2))
        store.flush()
        calls = []
        real = oindex.find_sorted
        monkeypatch.setattr("ple.io.disk_table.overlay._segments.find_sorted",
                            lambda *a: calls.append(a[3]) or real(*a))
        hit, rows = store.lookup(torch.arange(1, 2000, 2))
        assert not hit.any() and not rows.any() and calls == []
        hit, _ = store.lookup(torch.tensor([4, 5, 9999, 10_000, 10**9]))
        assert hit.tolist() == [True, False, False, False, False] and calls[0].tolist() == [4]
        model.check(store, torch.arange(1, 2100, 2))


def test_fence_boundaries_in_the_store(tmp_path, monkeypatch):
    """Small fences (every 4th id) and rows at, before and after each: found in the right segment."""
    monkeypatch.setattr(OverlayStore, "fence_every", 4)
    model = Model()
    with open_store(tmp_path / "ov") as store:
        model.update(store, torch.arange(0, 400, 3))
        store.flush()
        model.update(store, torch.arange(0, 400, 12))                           # every 4th of the first's
        store.flush()
        model.update(store, torch.arange(1, 400, 12))
        store.flush()
        model.check(store, torch.arange(-1, 410))
    with open_store(tmp_path / "ov") as store:
        model.check(store, torch.arange(-1, 410))


def test_merges_of_many_segments_in_small_chunks(tmp_path, monkeypatch):
    """Spills past a budget of 50 rows pile up segments, merged in chunks of a few rows (the k-way merge over
    many runs), also inside steps once over ``max_segments``; overlapping updates shadow one another."""
    monkeypatch.setattr(OverlayStore, "chunk_bytes", 40 * (ROW_BYTES + 64))
    monkeypatch.setattr(OverlayStore, "max_segments", 6)
    g = torch.Generator().manual_seed(3)
    model = Model()
    with open_store(tmp_path / "ov", memory_rows=50) as store:
        for step in range(40):
            model.update(store, torch.unique(torch.randint(0, 900, (90,), generator=g)))
            assert store.stats()["segments"] <= 7
            if step % 13 == 12:
                store.flush()
                model.check(store, torch.arange(890, 910))
        st = store.stats()
        assert st["merges"] + st["compactions"] >= 3 and st["spilled_rows"] > 500
        store.flush()
        model.check(store)
    with open_store(tmp_path / "ov", memory_rows=50) as store:
        model.check(store)


def test_compaction_in_small_chunks(tmp_path, monkeypatch):
    """The same rows rewritten flush after flush: compactions stream, and leave no dead row."""
    monkeypatch.setattr(OverlayStore, "chunk_bytes", 30 * (ROW_BYTES + 64))
    g = torch.Generator().manual_seed(4)
    model = Model()
    with open_store(tmp_path / "ov", memory_rows=20) as store:
        model.update(store, torch.arange(300))
        store.flush()
        for _ in range(12):
            model.update(store, torch.randperm(300, generator=g)[:200])
            store.flush()
            st = store.stats()
            assert st["dead_bytes"] <= st["live_bytes"]
        assert st["compactions"] > 0
        model.check(store)
    with open_store(tmp_path / "ov") as store:
        model.check(store)


def test_readonly_snapshot_beside_a_writer(tmp_path):
    """A reader opened beside a writer reads the writer's last flushed generation, while the writer spills,
    merges and flushes on (retiring the files the reader mapped)."""
    model = Model()
    d = tmp_path / "ov"
    with open_store(d, memory_rows=30) as w:
        model.update(w, torch.arange(200))
        w.flush()
        model.update(w, torch.arange(50, 120))
        w.flush()
        snap = dict(model.rows)
        reader = open_store(d, readonly=True)
        for k in range(6):
            model.update(w, torch.arange(10 * k, 10 * k + 150))
            w.flush()
        frozen = Model()
        frozen.rows = snap
        frozen.check(reader, torch.arange(200, 260))
        reader.close()
        model.check(w)


# An overlay written by the store before its index moved off the heap (ple at commit cfff33a):
# OverlayStore.open(DIR, base={"old": 1}, dim=4, state={"sum": ((), torch.float32)}, memory_bytes=0), then for
# (a, b, g) in OLD_GENS: rows ids [a, b) = (id * 10 + g + [0, .25, .5, .75]) in bfloat16, sum g, flush(meta={"gen": g}).
# Three segments (40, 25 and 15 rows), ten of their rows shadowed.
OLD_GENS = [(0, 40, 1), (10, 30, 2), (35, 60, 3), (5, 8, 4), (58, 70, 5)]
OLD_OVERLAY = (
    "H4sIAAAAAAAAA+2XS2zcRBjHF9pACbSB0tIHhW7dNKXUWWzP+LGhsPEMVOJ9AQmIwsptvM2iZLdaOy0lrBTgwoWHEJQLh/AQ"
    "QgWhIkFBRYIeygVBuXCACyrl0gNcEBSEKsR49u9NNmyyW2kTqcLfT87PntnPns/rnYnHvVKx4Adh5vGgXEotTmgiLEqlRcy1"
    "but2vF9r1w3DoKm0tkjjaYiJIPQq6XSqUi6HC32uVf9FGpPdaWVvZS8xlIG0QQgxshYxqSpax/FkiA7xobRSKFfGvehI2T/m"
    "Z8oH/MqYd0hRoy6xHxTLJdGny+N9fsmveGGtyZRNJf+JMB/4laI3Jtoc2TZSHBf7tLYfHtrvRyffUxgre6Fu1c4svpzQxwjE"
    "0USUMBTtp4eGVWlFfl6MPzoaFn+qMnGPF8zklcdGorHVO8f90Kt3isFGo6x3Bv6+cb8UBvGVJnGZ4pgcn+jux4NKMoFX8EO/"
    "FJQrgYLh1GskaKiUD0bnolr8geKT0Yl0rd4S3//aldLKqO+N+JXoC6FZx84aFqEquooj0bkM3aIWsR3HitvlfcrU7g8xqEU1"
    "appG3Ish2I5u2RY1Ndlcjf7KkhcokS5YIm0s0TAbS7RbV0h1h+qaXb8XcYWEUMfSHJs2r5BQy9Z0kjXnVEgN27CJYVhO+yXa"
    "C5ZoN5aozynRbF0ioST6RmxLbyxRNyxdt7Oir1mJRlZUb5k0q88p0bBtW7McU7NmldgtH/1qd/WCf//zPc6dnGNazP+GYM78"
    "T6hBkvl/KeIsPKnk89G0OOKFXj6vDEzW5/uG6b6q1p7eyXjCVu6yqKIqwagXHQ1RbVhV5DnKhULgR7PokKYSQxsWmbOe75n8"
    "3eJXs3C+yFapI89Q+w3MJLPd0UIxK1ul/80Xuaqjifyq+KnEdV8CXwovg5fDXfBl8OXwCvgKuBu+Er4KXgmvgnvgq+Fr4NXw"
    "tfAaeC18HbwOXg9vgDfC18Ob4BvgG+HNcBreAivwVrgX3gb3wdtTcUzl2ttSg53d2rvuVG46dyJ3Oqe51HXcXe677hH3ffcD"
    "9y/3b/e8+4/by7axPrad3cvuY/ezB1jIJtgBdpC9IHiRvcTeFLzF3mbHBJ+wT9nXgm/YKXZa8BM7w34X/MHOseU8oouvkvTw"
    "9ZINXJFs5aqkn1sSmw9KXH635B7+oOQh/pgkz0clRV6RBPwpSZU/C54Dz4OXwWH+muR1MM3fkLwDjvD3JEfBR/xjyXHwOf9C"
    "chKkkvhfxXz/63XyGq3e/8hMX339J8n735JEh9d/w2y2/htau+t/s3yRrRKtnfVfvIA0Wf9FrmrG63+769xN8A74ZngnrML9"
    "cAa+BY6fXR02YAJT2IQt2IYdOAsPwLem4hgcXOztKP9Qcgwc559JToCT/EvJV+AU/1byHfie/yD5EZzhP0vOgl/4r5LfwDn+"
    "p+Q8SN1RYxnoAitAN1gJesBqsAakkpg35nsR7uQ1Ws3/Gmky/yfvf0sSHZ7/9abzv972+1+zfJGt6m29/+lN53+RW1s/ovl/"
    "vve6ufPrLvg2+HY4Bw/CLszg+B/oeNK5s36npwZntukL2h5mj7BH2RCbEjzNnmGvCF5lh1k8z60F68BGsAlsBltAL+gDO8BO"
    "kAEtH54kkkgiiSSSSCKJJJJIIokkkkjiooh/ATRVaXEAKAAA"
)


def test_an_overlay_of_the_earlier_version_opens(tmp_path):
    d = tmp_path / "old"
    d.mkdir()
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode("".join(OLD_OVERLAY))), mode="r:gz") as tar:
        tar.extractall(d, filter="data")
    assert len(json.loads((d / ofiles.MANIFEST).read_text())["manifest"]["segments"]) == 3
    model = Model()
    for a, b, g in OLD_GENS:
        ids = torch.arange(a, b)
        rows = (ids[:, None] * 10 + g + torch.arange(D)[None] * 0.25).to(torch.bfloat16)
        for i, k in enumerate(ids.tolist()):
            model.rows[k] = (rows[i], float(g))
    with OverlayStore.open(d, base={"old": 1}, dim=None, memory_bytes=0) as store:
        assert store.generation == 5 and store.meta == {"gen": 5}
        model.check(store, torch.arange(70, 90))
        assert store.stats()["dead_bytes"] == 10 * ROW_BYTES
        model.version = 5
        model.update(store, torch.arange(60, 80))
        store.flush()
    with OverlayStore.open(d, base={"old": 1}, dim=None, memory_bytes=0) as store:
        model.check(store)


def test_a_segment_with_unsorted_ids_is_named(tmp_path):
    """Ids out of order (not written by this library) are a ValueError naming the file, not wrong reads."""
    d = tmp_path / "ov"
    with open_store(d) as store:
        Model().update(store, torch.arange(10))
        store.flush()
    body = ofiles.read_manifest(d)
    layout = ofiles.parse_layout(body, d / ofiles.MANIFEST)
    ids = torch.tensor([3, 1, 2])
    info = ofiles.write_segment(d, 99, layout, 3, [(ids, {"rows": torch.zeros(3, D, dtype=torch.bfloat16),
                                                          "state.sum": torch.zeros(3)})])
    body["segments"].append(info)
    ofiles.write_manifest(d, {k: v for k, v in body.items() if k not in ("format", "version")})
    with pytest.raises(ValueError, match="seg-00000099.safetensors: its ids are not sorted"):
        open_store(d)
