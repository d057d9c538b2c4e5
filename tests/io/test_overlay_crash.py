"""Crashes inside the overlay's streamed merges (``ple.io.disk_table.overlay``, index off the heap): spills past a small
budget pile up segments, merged inside steps (past ``max_segments``) and at the flush, a few rows at a time
(small ``chunk_bytes``, small fences), with rows shadowed across segments. A crash at any file operation (a
`FaultInjector`), or a kill -9 at any moment, leaves the directory loadable as of the last flush or the new
one, exactly: every row, through lookups (the fences and the bitmap rebuilt at open) and ``items``."""

from __future__ import annotations

import random
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from _overlay_helpers import Crash, FaultInjector, check_flush_order, watched_child

from ple.io.disk_table.overlay import _files as ofiles
from ple.io.disk_table.overlay.store import SLOT_OVERHEAD, OverlayStore

D = 4
STATE = {"sum": ((), torch.float32)}
IDS = 600
MEMORY = 40 * (2 * D + 4 + SLOT_OVERHEAD)


def small_pieces(m: pytest.MonkeyPatch | None = None) -> None:
    """Chunks of about 20 rows, a fence every 4 ids, a merge inside a step past 4 segments."""
    for name, value in (("chunk_bytes", 20 * (2 * D + 4 + 64)), ("fence_every", 4), ("max_segments", 4)):
        if m is None:
            setattr(OverlayStore, name, value)
        else:
            m.setattr(OverlayStore, name, value)


def open_store(d: Path) -> OverlayStore:
    return OverlayStore.open(d, base={"b": 2}, dim=D, state=STATE, memory_bytes=MEMORY, table_rows=IDS)


def updates(seed: int, gen: int, n: int = 5):
    """The updates of generation ``gen``: ``n`` of random rows, contents drawn from ``(seed, gen)``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + gen)
    for k in range(n):
        m = int(torch.randint(1, 160, (1,), generator=g))
        ids = torch.randperm(IDS, generator=g)[:m]
        yield ids, (ids[:, None] + torch.arange(D)[None] / 8 + gen).to(torch.bfloat16), torch.full((m,), 10. * gen + k)


def expected(seed: int, gen: int, n: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = torch.zeros(IDS, D, dtype=torch.bfloat16)
    sums = torch.full((IDS,), -1.0)
    for g in range(1, gen + 1):
        for ids, r, s in updates(seed, g, n):
            rows[ids], sums[ids] = r, s
    present = sums >= 0
    return present.nonzero().squeeze(1), rows[present], sums[present]


def check(store: OverlayStore, seed: int, gen: int, n: int = 5) -> None:
    ids, rows, sums = expected(seed, gen, n)
    got = list(store.items(chunk_rows=53))
    got_ids = torch.cat([c[0] for c in got]) if got else torch.empty(0, dtype=torch.int64)
    assert torch.equal(got_ids, ids)
    probe = torch.arange(-1, IDS + 5)
    hit, looked = store.lookup(probe)
    _, st = store.state_rows(probe)
    assert torch.equal(hit[1:IDS + 1].nonzero().squeeze(1), ids) and not hit[0] and not hit[IDS + 1:].any()
    assert torch.equal(looked[ids + 1], rows) and torch.equal(st["sum"][ids + 1], sums)
    if got:
        assert torch.equal(torch.cat([c[1] for c in got]), rows)
        assert torch.equal(torch.cat([c[2]["sum"] for c in got]), sums)
    assert store.num_rows == ids.numel()
    assert sum(s.live for s in store._segments.values()) == store._on_disk.count == ids.numel()


# ---- injected crashes ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def template(tmp_path_factory):
    d = tmp_path_factory.mktemp("template") / "ov"
    with pytest.MonkeyPatch.context() as m:
        small_pieces(m)
        with open_store(d) as store:
            for ids, rows, sums in updates(0, 1):
                store.update(ids, rows, {"sum": sums})
            store.flush(meta={"gen": 1})
    return d


def run_crash(tmp_path: Path, template: Path, at: int, monkeypatch) -> FaultInjector:
    d = tmp_path / f"crash{at}"
    shutil.copytree(template, d)
    opened = []
    with monkeypatch.context() as m:
        small_pieces(m)
        inj = FaultInjector(m, at)
        try:
            store = open_store(d)
            opened.append(store)
            for ids, rows, sums in updates(0, 2):
                store.update(ids, rows, {"sum": sums})
            store.flush(meta={"gen": 2})
            store.close()
        except Crash:
            pass
        for store in opened:                                        # a dead process's lock goes with it
            if store._lock is not None:
                store._lock.release()
                store._lock = None
        with open_store(d) as store:
            gen = store.meta["gen"]
            assert gen in (1, 2), (at, gen)
            assert gen == 2 or inj.count >= at, "the flush did not happen but nothing failed"
            check(store, 0, gen)
    shutil.rmtree(d)
    return inj


def test_merges_order_their_file_operations(tmp_path, template, monkeypatch):
    inj = run_crash(tmp_path, template, -1, monkeypatch)
    durable = {s["file"] for s in ofiles.read_manifest(template)["segments"]}
    order = check_flush_order(inj.log, tmp_path / "crash-1", durable)
    assert order["manifests"] == 1
    with monkeypatch.context() as m:                               # the scenario merges, inside steps too
        small_pieces(m)
        d = tmp_path / "count"
        shutil.copytree(template, d)
        with open_store(d) as store:
            for ids, rows, sums in updates(0, 2):
                store.update(ids, rows, {"sum": sums})
            before = store.stats()
            store.flush(meta={"gen": 2})
            after = store.stats()
    assert before["merges"] + before["compactions"] >= 1 and before["spilled_rows"] > 100
    assert after["merges"] + after["compactions"] > before["merges"] + before["compactions"]


def test_injected_crashes_in_merges_quick(tmp_path, template, monkeypatch):
    n = run_crash(tmp_path, template, -1, monkeypatch).count
    assert n > 20
    for at in sorted(set(range(n - 12, n + 1)) | set(range(1, n, max(1, n // 30)))):
        run_crash(tmp_path, template, at, monkeypatch)


@pytest.mark.deep
def test_injected_crashes_in_merges_every_operation(tmp_path, template, monkeypatch):
    n = run_crash(tmp_path, template, -1, monkeypatch).count
    for at in range(1, n + 1):
        assert run_crash(tmp_path, template, at, monkeypatch).count >= at


# ---- killed --------------------------------------------------------------------------------------------
def kill_child(d: str, seed: int) -> None:
    small_pieces()
    with open_store(Path(d)) as store:
        start = store.meta.get("gen", 0)
        print("ready", start, flush=True)
        for gen in range(start + 1, start + 100_000):
            for ids, rows, sums in updates(seed, gen, 3):
                store.update(ids, rows, {"sum": sums})
            store.flush(meta={"gen": gen})
            print(gen, flush=True)


def kill_rounds(tmp_path: Path, seed: int, rounds: int) -> list[int]:
    d = tmp_path / f"kill{seed}"
    rng = random.Random(seed)
    durable, gens = 0, []
    for r in range(rounds):
        with watched_child(__file__, d, seed) as (child, start):
            assert start == durable
            first = child.stdout.readline().split() if r == rounds - 1 or rng.random() < 0.7 else []
            time.sleep(rng.uniform(0.0, 0.5))
            child.kill()
            out, _ = child.communicate()
        last = max([durable] + [int(x) for x in first + out.split()])
        with pytest.MonkeyPatch.context() as m:
            small_pieces(m)
            with open_store(d) as store:
                gen = store.meta.get("gen", 0)
                assert gen in (last, last + 1), (gen, last)
                check(store, seed, gen, 3)
        durable = gen
        gens.append(gen)
    return gens


def test_killed_in_merges_quick(tmp_path):
    assert kill_rounds(tmp_path, seed=0, rounds=2)[-1] > 0


@pytest.mark.deep
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_killed_in_merges(tmp_path, seed):
    gens = kill_rounds(tmp_path, seed=seed, rounds=5)
    assert gens[-1] > gens[0]


if __name__ == "__main__":
    kill_child(sys.argv[1], int(sys.argv[2]))
