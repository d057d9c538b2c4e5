"""The rows an `~ple.io.disk_table.overlay.OverlayStore` holds in memory: `update`, the budget's slots, their
eviction to spill files (a mixin of the store; its state and constants live there, see ``ple.io.disk_table.overlay``).

A slot holds a row's values and state, its id, its last update (a clock tick) and a dirty flag (changed since
last written to a segment); `SlotIndex` finds a row's slot by id. A row in memory shadows its copies on disk;
a dirty one is written to a new (the newest) segment when evicted, so a clean row's newest disk copy is its
value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._heap import release_freed
from . import _files as ofiles
from ._index import SlotIndex
from ._segments import SegmentFiles

__all__ = ["MemoryRows"]


class MemoryRows(SegmentFiles):
    """The store's rows in memory (see the module docstring)."""

    _memory_bytes: int
    slot_overhead: int
    _mem_only: int

    def _check_open(self, write: bool = False) -> None:
        """(The store's: a ``ValueError`` where it is closed, or read only and ``write``.)"""
        raise NotImplementedError

    def _held_between(self, start: int, stop: int, source: int) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """``[(ids sorted, source, slots)]`` of the rows in memory with ids in ``[start, stop)`` (none: ``[]``)."""
        held = (self._slot_id[: self._used] >= 0).nonzero().squeeze(1)
        ids = self._slot_id.index_select(0, held)
        inside = ((ids >= start) & (ids < stop)).nonzero().squeeze(1)
        if not inside.numel():
            return []
        ids, order = torch.sort(ids.index_select(0, inside))            # slots are in no order
        return [(ids, source, held.index_select(0, inside).index_select(0, order))]

    def _reset_memory(self) -> None:
        """The budget's slots, unallocated (`_take` allocates them at once, when the first row comes)."""
        self.capacity = self._memory_bytes // (self.layout.row_bytes + self.slot_overhead)
        self._mem = {key: torch.empty((0, *shape), dtype=dt) for key, dt, shape in self.layout.fields}
        self._slot_id, self._slot_stamp = torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
        self._slot_dirty = torch.empty(0, dtype=torch.bool)      # updated since last written to a segment
        self._slots = SlotIndex(0)                       # id -> slot of the rows in memory
        self._used, self._clock, self._free = 0, 0, torch.empty(0, dtype=torch.int64)     # slots: used, free

    # ---- updating -----------------------------------------------------------------------------------------
    def update(self, ids: torch.Tensor, rows: torch.Tensor, states: dict[str, torch.Tensor] | None = None) -> None:
        """Insert or overwrite rows ``ids`` (distinct) with ``rows`` ``[n, dim]`` (converted to the store's
        dtype) and their state ``{name: [n, *shape]}`` (every name of the store's ``state``)."""
        self._check_open(write=True)
        ids = ofiles.as_ids(ids)
        vals = self.layout.values(ids.numel(), rows, states or {})
        if not ids.numel():
            return
        ids, order = torch.sort(ids)
        if bool((ids[1:] == ids[:-1]).any()) or int(ids[0]) < 0:
            raise ValueError("ids: must be distinct in one update (a row was given twice), and >= 0")
        vals = {k: v[order] for k, v in vals.items()}
        self._clock += 1
        slot = self._slots.find(ids)
        res = slot >= 0
        at = slot[res]                                   # rows in memory: overwritten there
        self._slot_stamp.index_fill_(0, at, self._clock)
        self._slot_dirty.index_fill_(0, at, True)
        for key, v in vals.items():
            self._mem[key].index_copy_(0, at, v[res])
        out = (~res).nonzero().squeeze(1)
        room = self.capacity - at.numel()                # slots this update's resident rows leave
        put, over = out[:room], out[room:]
        if put.numel():
            slots = self._take(put.numel())
            for key, v in vals.items():
                self._mem[key].index_copy_(0, slots, v.index_select(0, put))
            pid = ids.index_select(0, put)
            self._slot_id[slots], self._slot_stamp[slots], self._slot_dirty[slots] = pid, self._clock, True
            self._slots.insert(pid, slots)
            self._mem_only += int((~self._on_disk.test(pid)).sum())
        if over.numel():                                 # more than the budget holds: straight to a spill file
            self._spill(ids[over], lambda a, b: {key: v[over[a:b]] for key, v in vals.items()}, memory=False)

    def _allocate(self) -> None:
        """The whole budget at once (never a copy of it beside itself): its pages are backed as rows are written."""
        cap = self.capacity
        self._mem = {key: m.new_empty((cap, *m.shape[1:])) for key, m in self._mem.items()}
        self._slot_id = torch.full((cap,), -1, dtype=torch.int64)
        self._slot_stamp = torch.zeros(cap, dtype=torch.int64)
        self._slot_dirty = torch.zeros(cap, dtype=torch.bool)
        self._slots = SlotIndex(cap)

    def _take(self, k: int) -> torch.Tensor:
        """``k`` free memory slots: free ones, new ones up to the budget, then the least recently updated
        rows' (evicted: written to a spill file if changed since last written), an eighth of the budget at a
        time."""
        fresh = min(k - self._free.numel(), self.capacity - self._used)
        if fresh > 0:
            if not self._slot_id.numel():
                self._allocate()
            self._free = torch.cat([self._free, torch.arange(self._used, self._used + fresh)])
            self._used += fresh
        if k > self._free.numel():
            stamps = self._slot_stamp[: self._used].clone()
            stamps[self._slot_id[: self._used] < 0] = self._clock + 1          # free slots are not evicted
            evictable = int((stamps < self._clock).sum())
            victims = torch.topk(stamps, min(evictable, max(k - self._free.numel(), self.capacity // 8)),
                                 largest=False).indices
            del stamps
            dirty = victims[self._slot_dirty.index_select(0, victims)]
            if dirty.numel():
                vid, order = torch.sort(self._slot_id.index_select(0, dirty))
                dirty = dirty[order]
                self._spill(vid, lambda a, b: {key: m.index_select(0, dirty[a:b]) for key, m in self._mem.items()},
                            memory=True)
            self._slots.remove(self._slot_id.index_select(0, victims))
            self._slot_id[victims] = -1
            self._slot_dirty[victims] = False
            self._free = torch.cat([self._free, victims])
        slots, self._free = self._free[:k], self._free[k:]
        return slots

    def _spill(self, ids: torch.Tensor, values: Callable[[int, int], dict[str, torch.Tensor]], memory: bool) -> None:
        """Write rows ``ids`` (sorted, distinct) as a new segment, their values ``values(a, b)`` for rows
        ``[a, b)`` (read a chunk at a time); ``memory``: they are rows in memory (which no longer count as
        memory-only once on disk)."""
        n, step = ids.numel(), self._chunk_rows
        new = self._write_new(ids, ((ids[a: a + step], values(a, min(n, a + step))) for a in range(0, n, step)))
        if memory:
            self._mem_only -= new
        self._counts["spilled_rows"] += n
        if len(self._segments) > self.max_segments:      # else merged at the next flush, not inside a step
            self._maybe_merge()
        release_freed()                                  # the spill's chunks: freed heap back to the kernel

