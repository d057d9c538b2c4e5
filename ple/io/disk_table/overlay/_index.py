"""The index of an `~ple.io.disk_table.overlay.OverlayStore`, off the heap: what it keeps in memory is bounded
by the memory budget or costs a fixed amount per *table* row, never an amount per row trained.

- `SlotIndex`: row id -> memory slot, for the rows held in memory only (an open-addressing hash table sized
  once from the budget, counted in it).
- `IdBitmap`: one bit per table row, set for the rows some segment file holds: ids in no segment are
  filtered out before any search, and its count of set bits is the number of distinct rows on disk (so the
  dead rows of the segments, a compaction's trigger, are counted without a per-row structure).
- `fences_of` / `find_sorted`: a segment's ids are sorted (each file is written sorted); an id is found by a
  binary search over the *mapped* ids (file pages, not anonymous memory), started from in-memory fences
  (every ``every``-th id of the segment: 8 bytes per ``every`` rows).
- `merge_sorted`: a k-way merge of sorted id runs in bounded chunks (the later run wins a tie), for merges,
  compactions and the store's ``items``; never all ids at once.

Every function here works on whole tensors (no Python loop over ids).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = ["SlotIndex", "IdBitmap", "fences_of", "find_sorted", "merge_sorted"]

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)      # Fibonacci hashing's multiplier, as a (wrapping) int64
_EMPTY, _GONE = -1, -2                        # keys of a never used slot and of a removed one


class SlotIndex:
    """Row id (>= 0) -> memory slot, for at most ``capacity`` rows: open addressing with linear probing over
    ``2 * capacity + 1`` keys (int64) and values (int32), removed keys left as tombstones and cleared by a
    rebuild once keys and tombstones fill three quarters. 24 bytes per budget row (and 12 during a rebuild)."""

    def __init__(self, capacity: int) -> None:
        self.size = 2 * capacity + 1
        self.keys = torch.full((self.size,), _EMPTY, dtype=torch.int64)
        self.vals = torch.full((self.size,), -1, dtype=torch.int32)
        self.live = self.used = 0                         # keys present; keys present or removed

    def _home(self, ids: torch.Tensor) -> torch.Tensor:
        return (((ids * _GOLDEN) >> 32) & 0xFFFFFFFF) * self.size >> 32      # multiply-shift: any size

    def _locate(self, ids: torch.Tensor) -> torch.Tensor:
        """The table positions of ``ids`` (-1 where absent)."""
        out = torch.full_like(ids, -1)
        idx = (ids >= 0).nonzero().squeeze(1)
        q = ids.index_select(0, idx)
        h = self._home(q)
        while idx.numel():
            k = self.keys.index_select(0, h)
            found = k == q
            out[idx[found]] = h[found]
            go = ~found & (k != _EMPTY)                   # a tombstone or another id: the probe goes on
            idx, q, h = idx[go], q[go], h[go] + 1
            h[h == self.size] = 0
        return out

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slots of ``ids`` (-1 where absent). Ids may repeat."""
        pos = self._locate(ids)
        out = torch.full_like(ids, -1)
        at = (pos >= 0).nonzero().squeeze(1)
        out[at] = self.vals.index_select(0, pos[at]).to(torch.int64)
        return out

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Add ``ids`` (>= 0, distinct, none present; at most ``capacity`` present in all) with their slots."""
        if 4 * (self.used + ids.numel()) > 3 * self.size:
            keep = (self.keys >= 0).nonzero().squeeze(1)
            k, v = self.keys[keep], self.vals[keep]
            del keep
            self.keys.fill_(_EMPTY)
            self.vals.fill_(-1)
            self.live = self.used = 0
            self._place(k, v)
        self._place(ids, slots.to(torch.int32))

    def remove(self, ids: torch.Tensor) -> None:
        """Remove ``ids`` (distinct; absent ones are ignored)."""
        pos = self._locate(ids)
        pos = pos[pos >= 0]
        self.keys[pos] = _GONE
        self.vals[pos] = -1
        self.live -= pos.numel()

    def _place(self, ids: torch.Tensor, vals: torch.Tensor) -> None:
        self.live += ids.numel()
        self.used += ids.numel()
        h = self._home(ids)
        while ids.numel():
            empty = self.keys.index_select(0, h) == _EMPTY
            self.keys[h[empty]] = ids[empty]              # ids probing one slot: one of them wins it
            won = self.keys.index_select(0, h) == ids
            self.vals[h[won]] = vals[won]
            ids, vals, h = ids[~won], vals[~won], h[~won] + 1
            h[h == self.size] = 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.vals.nbytes


class IdBitmap:
    """One bit per row id in ``[0, limit)``: ``test`` and ``add`` for whole tensors of ids; ``count`` the bits
    set. Sized for ``rows`` ids at once (a table's rows: 40 MB at 320M rows); grows (doubling) past it."""

    def __init__(self, rows: int = 0) -> None:
        self.bits = torch.zeros((rows + 7) // 8, dtype=torch.uint8)
        self.count = 0

    def test(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether each of ``ids`` is set (False for ids < 0 or past the bitmap). Ids may repeat."""
        inside = (ids >= 0) & (ids < 8 * self.bits.numel())
        out = torch.zeros(ids.shape, dtype=torch.bool)
        at = inside.nonzero().squeeze(1)
        i = ids.index_select(0, at)
        out[at] = ((self.bits.index_select(0, i >> 3).to(torch.int64) >> (i & 7)) & 1).bool()
        return out

    def add(self, ids: torch.Tensor) -> int:
        """Set ``ids`` (>= 0, distinct); returns how many were not set before."""
        if not ids.numel():
            return 0
        top = int(ids.max()) // 8 + 1
        if top > self.bits.numel():
            grown = torch.zeros(max(top, 2 * self.bits.numel()), dtype=torch.uint8)
            grown[: self.bits.numel()] = self.bits
            self.bits = grown
        new = ids[~self.test(ids)]
        # distinct ids not set: their bits in one byte are distinct powers of two, so adding them ORs them in
        self.bits.index_add_(0, new >> 3, (1 << (new & 7)).to(torch.uint8))
        self.count += new.numel()
        return new.numel()

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes


def fences_of(ids: torch.Tensor, every: int, chunk: int, check: Callable[[], None] | None = None,
              name: str = "ids", visit: Callable[[torch.Tensor], object] | None = None) -> torch.Tensor:
    """Every ``every``-th of the sorted ``ids`` (a mapped view), read ``chunk`` ids at a time (a multiple of
    ``every``), checking they are strictly increasing and >= 0 (``ValueError`` naming ``name`` otherwise);
    ``visit`` is called with each chunk (checked)."""
    chunk = max(every, chunk // every * every)
    out, last = [], -1
    for a in range(0, ids.numel(), chunk):
        if check is not None:
            check()
        part = ids[a: a + chunk].clone()
        if int(part[0]) <= last or bool((part[1:] <= part[:-1]).any()):
            del ids                                       # (no view of a mapping the caller closes in the traceback)
            raise ValueError(f"overlay: {name}: its ids are not sorted and distinct (damaged, or not written by "
                             f"this library)")
        out.append(part[::every].clone())
        last = int(part[-1])
        if visit is not None:
            visit(part)
    return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)


def find_sorted(ids: torch.Tensor, fences: torch.Tensor, every: int, q: torch.Tensor) -> torch.Tensor:
    """The positions of ``q`` in the sorted, distinct ``ids`` (-1 where absent), ``fences`` being
    ``ids[::every]``: the fences give each query its block of ``every`` ids, searched by halves (each step one
    gather from ``ids`` for all queries together)."""
    out = torch.full_like(q, -1)
    if not ids.numel() or not q.numel():
        return out
    block = torch.searchsorted(fences, q, right=True) - 1
    idx = (block >= 0).nonzero().squeeze(1)               # below the first id: absent
    qq = q.index_select(0, idx)
    lo = block.index_select(0, idx) * every                # ids[lo] <= q < ids[hi] (hi: the next fence's row)
    hi = torch.clamp(lo + every, max=ids.numel())
    while True:
        wide = hi - lo > 1
        if not bool(wide.any()):
            break
        mid = torch.where(wide, (lo + hi) // 2, lo)
        below = ids.index_select(0, mid) <= qq
        lo = torch.where(wide & below, mid, lo)
        hi = torch.where(wide & ~below, mid, hi)
    found = ids.index_select(0, lo) == qq
    out[idx[found]] = lo[found]
    return out


def lower_bound(ids: torch.Tensor, fences: torch.Tensor, every: int, x: int) -> int:
    """The first position of the sorted, distinct ``ids`` whose id is ``>= x`` (``ids.numel()`` where none is),
    ``fences`` being ``ids[::every]``: the fences narrow it to ``every`` ids, the only ones read."""
    j = int(torch.searchsorted(fences, torch.tensor([x], dtype=fences.dtype))[0])     # fences before x
    lo = 0 if j == 0 else (j - 1) * every + 1            # ids[(j - 1) * every] < x <= ids[j * every]
    hi = min(j * every, ids.numel())
    if hi <= lo:
        return hi
    return lo + int(torch.searchsorted(ids[lo:hi].clone(), torch.tensor([x], dtype=ids.dtype))[0])


def newest_of(found: Sequence[tuple[torch.Tensor, int, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """``(ids, source, rows)`` from runs ``(ids sorted, source, rows)`` given oldest source first: sorted by id,
    each id once, from the newest source holding it (a stable sort keeps equal ids oldest first; the last kept)."""
    ids = torch.cat([f[0] for f in found])
    src = torch.cat([torch.full((f[0].numel(),), f[1], dtype=torch.int64) for f in found])
    rows = torch.cat([f[2] for f in found])
    if len(found) > 1:
        ids, order = torch.sort(ids, stable=True)
        src, rows = src.index_select(0, order), rows.index_select(0, order)
        last = torch.ones_like(ids, dtype=torch.bool)
        last[:-1] = ids[1:] != ids[:-1]
        ids, src, rows = ids[last], src[last], rows[last]
    return ids, src, rows


def merge_sorted(runs: Sequence[torch.Tensor], chunk: int,
                 check: Callable[[], None] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The union of ``runs`` (each sorted and distinct, mapped or not), in id order, at most about ``chunk``
    ids read at a time: ``(ids, run, row)`` per chunk, ``run[i]`` the index of the latest run holding
    ``ids[i]`` and ``row[i]`` its position there. ``check`` is called before each chunk's reads."""
    k = len(runs)
    step = max(16, chunk // max(k, 1))
    pos = [0] * k
    sizes = [r.numel() for r in runs]
    while True:
        live = [i for i in range(k) if pos[i] < sizes[i]]
        if not live:
            return
        if check is not None:
            check()
        # Every run's ids up to the smallest of the runs' step-th next ids: at most ``step`` from each
        top = min(int(runs[i][min(pos[i] + step, sizes[i]) - 1]) for i in live)
        ids, run, row = [], [], []
        for i in live:
            part = runs[i][pos[i]: pos[i] + step]
            m = int(torch.searchsorted(part, torch.tensor([top]), right=True)[0])
            ids.append(part[:m])
            run.append(torch.full((m,), i, dtype=torch.int64))
            row.append(torch.arange(pos[i], pos[i] + m))
            pos[i] += m
        all_ids = torch.cat(ids)
        all_ids, order = torch.sort(all_ids, stable=True)     # runs in order: an id's latest run last
        last = torch.ones_like(all_ids, dtype=torch.bool)
        last[:-1] = all_ids[1:] != all_ids[:-1]
        keep = order[last]
        yield all_ids[last], torch.cat(run)[keep], torch.cat(row)[keep]
