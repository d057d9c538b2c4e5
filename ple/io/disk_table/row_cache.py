"""`RowCache`: a bounded cache of table rows, for `ple.io.DiskTable`.

The cache (`RowCache`): ``cache_bytes`` bounds its memory, rows and bookkeeping together (16
bytes a row: its id and its last use); rows are kept in the table's stored dtype (an FP8 row
is 160 bytes). It is set associative, like a CPU cache: a row can be in one of 16 slots (its
set, chosen by a hash of its id), and a miss replaces the least recently used row of its set.
Every step of it is a few tensor operations over the step's distinct rows, never a Python loop
over rows (a dictionary entry per row would cost more memory than the row itself). On token
streams drawn like text it hits as often as an exact LRU cache of the same size (within 0.1 %
in ``benchmarks/bench_disk_table.py``). ``table.stats()`` counts what happened.
"""

from __future__ import annotations

import torch

__all__ = ["RowCache", "CACHE_WAYS", "SLOT_OVERHEAD"]

CACHE_WAYS = 16
"""Slots a row may occupy in the cache (its set); a miss evicts the least recently used of them."""

SLOT_OVERHEAD = 16
"""Bytes of bookkeeping a cached row costs: its id and its last use (int64 each)."""

_HASH = 0x9E3779B1              # Knuth's multiplicative hash; ids below 2**31 keep the product in int64


class RowCache:
    """A bounded cache of table rows: ``capacity`` rows in ``sets`` sets of ``ways`` slots, LRU within a set.

    Rows are held as ``[units]`` tensors of ``unit`` (the row's bytes); ``keys`` and ``stamps``
    (``[sets, ways]`` int64) say which row each slot holds (-1: none) and when it was last used
    (the gather count; -1: never). Row ``r`` lives in set ``hash(r) % sets``. Not thread safe:
    `DiskTable` holds a lock around it.
    """

    def __init__(self, capacity: int, units: int, unit: torch.dtype, *, ways: int = CACHE_WAYS,
                 small_ids: bool = True) -> None:
        self.ways = max(1, min(ways, capacity))
        self.sets = capacity // self.ways
        self.capacity = self.sets * self.ways
        self.keys = torch.full((self.sets, self.ways), -1, dtype=torch.int64)
        self.stamps = torch.full((self.sets, self.ways), -1, dtype=torch.int64)
        self.store = torch.empty((self.capacity, units), dtype=unit)
        self.clock = 0
        self._small_ids = small_ids                  # ids < 2**31: the multiplicative hash cannot overflow

    @property
    def nbytes(self) -> int:
        return self.store.nbytes + self.keys.nbytes + self.stamps.nbytes

    def set_of(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids * _HASH if self._small_ids else ids) % self.sets

    def find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sets, slots)`` of distinct row ids: each one's set, and its slot (``set * ways + way``) or -1."""
        sets = self.set_of(ids)
        match = self.keys.index_select(0, sets) == ids[:, None]                     # [n, ways]
        way = match.to(torch.int8).argmax(1)
        return sets, torch.where(match.any(1), sets * self.ways + way, -1)

    def update(self, hit_slots: torch.Tensor, miss_ids: torch.Tensor, miss_sets: torch.Tensor,
               miss_rows: torch.Tensor) -> int:
        """Mark ``hit_slots`` used, then put the misses in: each evicts the least recently used slot of its
        set (hits of this gather are the most recent). Of more than ``ways`` misses in one set, the first
        ``ways`` (in id order) are kept. Returns how many cached rows were evicted."""
        self.clock += 1
        flat_stamps = self.stamps.view(-1)
        flat_stamps.index_fill_(0, hit_slots, self.clock)
        if not miss_ids.numel():
            return 0
        order = torch.argsort(miss_sets, stable=True)                    # misses grouped by set, ids in order
        s = miss_sets.index_select(0, order)
        rank = torch.arange(s.numel()) - torch.searchsorted(s, s)        # position within its set's group
        keep = rank < self.ways
        if not bool(keep.all()):
            order, s, rank = order[keep], s[keep], rank[keep]
        oldest_first = torch.argsort(self.stamps.index_select(0, s), dim=1, stable=True)      # [k, ways]
        slot = s * self.ways + oldest_first.gather(1, rank[:, None]).squeeze(1)
        flat_keys = self.keys.view(-1)
        evicted = int((flat_keys.index_select(0, slot) >= 0).sum())
        flat_keys.index_copy_(0, slot, miss_ids.index_select(0, order))
        flat_stamps.index_fill_(0, slot, self.clock)
        self.store.index_copy_(0, slot, miss_rows.index_select(0, order))
        return evicted

    def clear(self) -> None:
        self.keys.fill_(-1)
        self.stamps.fill_(-1)

    def __len__(self) -> int:
        return int((self.keys >= 0).sum())
