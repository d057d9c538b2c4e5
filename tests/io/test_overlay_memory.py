"""The overlay's memory: its own (anonymous) memory stays within its budget + the stated constants
(``ple.io.disk_table.overlay``: ``memory_bytes`` + the bitmap + the fences + ``FIXED_BYTES``) while it trains far more
rows than its budget holds, through spills, flushes, merges and compactions, and grows by at most 2 bytes
per extra row trained (the fences: 1/16 byte a row). Measured in a fresh process (``RssAnon`` of
/proc/self/status), steps like a training's: a read of the step's rows, then an update of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _memory import Sampler, rss_anon

from ple.io.disk_table.overlay.store import FENCE_EVERY, FIXED_BYTES, OverlayStore

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc/self/status")

D = 16
STATE = {"sum": ((), torch.float32)}


def child(directory: str, budget: int, step_rows: int, steps: int, flush_every: int, marks: list[int]) -> dict:
    """Train ``steps`` steps of ``step_rows`` rows, a quarter drawn from those trained and the rest new; return
    the peak RssAnon (less the baseline taken before the store opened, sampled throughout, untrimmed) and at
    the marks (rows trained) ``(rows, RssAnon trimmed, RssAnon)``."""
    g = torch.Generator().manual_seed(0)
    table_rows = steps * step_rows
    rows = torch.zeros(step_rows, D, dtype=torch.bfloat16)
    sums = torch.zeros(step_rows)
    base = rss_anon(trim=True)
    sampler = Sampler()
    at_marks, trained = {}, 0
    kw = {"table_rows": table_rows} if "table_rows" in OverlayStore.open.__kwdefaults__ else {}
    with OverlayStore.open(directory, base={}, dim=D, state=STATE, memory_bytes=budget, **kw) as store:
        for step in range(steps):
            old = torch.randint(0, max(trained, 1), (step_rows // 4,), generator=g) if trained else \
                torch.empty(0, dtype=torch.int64)
            new = torch.arange(trained, trained + step_rows - old.numel())
            ids = torch.unique(torch.cat([old, new]))
            hit, got = store.read(ids)
            n = ids.numel()
            store.update(ids, rows[:n] + 1, {"sum": sums[:n] + step})
            trained += new.numel()
            if (step + 1) % flush_every == 0 or step == steps - 1:
                store.flush(meta={"step": step})
            del hit, got
            for m in marks:
                if m not in at_marks and store.num_rows >= m:
                    untrimmed = rss_anon() - base
                    at_marks[m] = (store.num_rows, rss_anon(trim=True) - base, untrimmed)
        stats = store.stats()
        store.flush()
    peak = sampler.stop() - base
    return {"peak": peak, "marks": {str(k): v for k, v in at_marks.items()}, "stats": stats, "trained": trained}


def run_child(tmp_path: Path, **kw) -> dict:
    here = Path(__file__).parent
    code = (f"import json, sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; "
            f"import test_overlay_memory as t; print(json.dumps(t.child({str(tmp_path / 'ov')!r}, **{kw!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def check(result: dict, budget: int, table_rows: int, lo: int, hi: int) -> None:
    st = result["stats"]
    allowed = budget + table_rows // 8 + 8 * (st["rows"] * 2) // FENCE_EVERY + FIXED_BYTES
    assert result["peak"] <= allowed, (result["peak"], allowed)
    (n0, m0, _), (n1, m1, _) = result["marks"][str(lo)], result["marks"][str(hi)]
    assert (m1 - m0) / (n1 - n0) <= 2.0, result["marks"]
    assert st["spilled_rows"] > 0 and st["merges"] + st["compactions"] > 0


def test_overlay_memory_quick(tmp_path):
    """An 8 MiB budget (about 90k rows) and 740k rows trained."""
    budget, step_rows, steps = 8 << 20, 16384, 60
    r = run_child(tmp_path, budget=budget, step_rows=step_rows, steps=steps, flush_every=16,
                  marks=[200_000, 700_000])
    check(r, budget, step_rows * steps, 200_000, 700_000)


@pytest.mark.deep
def test_overlay_memory_millions_of_rows(tmp_path):
    """A 64 MiB budget (about 730k rows) and 4.3M rows trained: between 1M and 4M rows, at most 2 bytes a row."""
    budget, step_rows, steps = 64 << 20, 16384, 350
    r = run_child(tmp_path, budget=budget, step_rows=step_rows, steps=steps, flush_every=64,
                  marks=[1_000_000, 4_000_000])
    check(r, budget, step_rows * steps, 1_000_000, 4_000_000)


if __name__ == "__main__":                       # python tests/io/test_overlay_memory.py DIR BUDGET_MIB STEPS
    print(json.dumps(child(sys.argv[1], int(sys.argv[2]) << 20, 16384, int(sys.argv[3]), 64,
                           [1_000_000, 2_000_000, 3_000_000, 4_000_000]), indent=1))


def test_spills_and_flushes_hand_freed_heap_back(tmp_path, monkeypatch):
    """Each spill and each flush hands the allocator's freed heap back (``_heap.release_freed``): without it the
    process's RssAnon grew with the rows trained (freed chunks pinned under small live blocks; the real table's
    run, docs/disk.md)."""
    from ple.io.disk_table import _heap
    from ple.io.disk_table.overlay import _memory, store

    assert _heap.release_freed() is (_heap._TRIM is not None)
    calls = []
    for module in (_memory, store):
        monkeypatch.setattr(module, "release_freed", lambda: calls.append(1) or True)
    with OverlayStore.open(tmp_path / "ov", base={}, dim=D, state=STATE, memory_bytes=200 * (D * 2 + 4 + 96),
                           table_rows=10_000) as ov:
        for step in range(6):
            ids = torch.arange(step * 150, step * 150 + 150)
            ov.update(ids, torch.ones(150, D, dtype=torch.bfloat16), {"sum": torch.zeros(150)})
        spills = ov.stats()["spilled_rows"] and len(calls)
        ov.flush()
        assert spills >= 2 and len(calls) == spills + 1, (spills, calls)
