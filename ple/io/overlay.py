"""`OverlayStore`: a durable store of changed table rows and their optimizer state, for a trainable disk table.

The checkpoint's files are never written: the rows that training changes live in an *overlay* directory,
keyed by row id (int64). Each row holds ``dim`` values of ``dtype`` (bfloat16 unless said) and one tensor
per optimizer state of ``state`` (``{name: (shape_per_row, dtype)}``, e.g. ``{"sum": ((), torch.float32)}``).

    store = OverlayStore.open(DIR, base=fingerprint, dim=D, state={"sum": ((), torch.float32)},
                              memory_bytes=1 << 30)
    hit, rows = store.lookup(ids)               # rows of ids in the overlay (zeros where hit is False)
    hit, states = store.state_rows(ids)         # {name: [n, *shape]}
    store.update(ids, rows, {"sum": sums})      # insert or overwrite (ids distinct)
    store.flush(meta={"step": 10})              # durable: DIR now holds every update so far
    for ids, rows, states in store.items(65536): ...     # every row, sorted by id, in bounded memory
    store.close()                               # (or use it as a context manager); unflushed updates are lost

Opening. `OverlayStore.open` creates the directory if absent (nothing durable is written before the first
`flush`) or resumes its last flushed generation (`generation`, and the ``meta`` saved with it). ``base``
is a JSON-able fingerprint of the base checkpoint, chosen by the caller: an overlay made on another base is a
``ValueError`` naming the keys that differ, and so is one of another ``dim``, ``dtype`` or ``state``. One
writer at a time: the directory is locked (``flock``, released on `close` or when the process dies) and a
second writer, in this process or another, is refused (``RuntimeError``, saying which and how to release it);
a store garbage-collected without `close` releases the lock too (its unflushed spill files are left, deleted
at the next open). ``readonly=True`` opens it to read (while a writer holds it: a snapshot of its last
flushed generation, read without the lock).

Memory. Rows (with their state and 24 bytes of bookkeeping each) are kept in memory up to ``memory_bytes``;
beyond it the least recently updated are *spilled* to a segment file in the directory (not durable until a
flush lists it), from which lookups read them (mapped); spilled files are merged at the next flush, so a
step does not wait on a merge (unless over ``MAX_SEGMENTS`` files pile up). The budget's memory is allocated
once, its pages backed as rows are written. The index (up to about 90 bytes a row, the 9M rows of a 300-step
fine-tune of the real table: 0.8 GB) is not counted in the budget. A lookup is hash probes and gathers, never a
Python loop over the ids.

Durability (the files: ``ple.io._overlay_files``). `flush` writes the rows changed since the last flush as a
new immutable segment and fsyncs it, then switches the manifest (which lists the segments with their sizes
and checksums) atomically; files of earlier generations are deleted only after that. A process killed at any
moment leaves the directory as of the last flush that returned or of the one in progress, never a mixture;
its leftovers are deleted at the next open. A flush costs the rows changed since the last one: the newest two
segments are merged when the newer holds as many live rows as the older (a binary counter: few segments, each
row rewritten a logarithmic number of times), and all are compacted into one should dead rows (replaced by
later ones) outnumber live ones: the disk holds at most about twice the live rows. A segment's size and the
checksums of its header and ids are checked at open, those of its rows and states before the first of its rows
is returned: a missing, truncated or altered file is a ``ValueError`` naming it. Not thread safe.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from . import _overlay_files as ofiles
from ._overlay_files import DirLock, HashIndex, Layout, Segment
from ._overlay_segments import _CHUNK, _SHIFT, MAX_SEGMENTS, SegmentFiles
from .writer import fsync_dir

__all__ = ["OverlayStore", "SLOT_OVERHEAD", "MAX_SEGMENTS"]

SLOT_OVERHEAD = 24
"""Bytes of bookkeeping a row in memory costs beyond its values: its id, index entry and last update."""



class OverlayStore(SegmentFiles):
    """A durable store of table rows and their optimizer state, keyed by row id (see the module docstring).
    Made by `OverlayStore.open`."""

    def __init__(self, directory: Path, layout: Layout, base: Any, memory_bytes: int, readonly: bool,
                 lock: DirLock) -> None:
        self.directory, self.layout, self.base, self.readonly = directory, layout, base, readonly
        self._lock: DirLock | None = lock
        self.generation = 0
        self.meta: dict[str, Any] = {}
        self._segments: dict[int, Segment] = {}          # in the order written (serial order)
        self._doomed: list[Path] = []                    # merged away; deleted once a manifest no longer lists them
        self._next_serial = 1
        self._index = HashIndex(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
        self._n = 0                                      # entries (rows in the overlay)
        self._e_slot = torch.empty(0, dtype=torch.int64)  # entry -> memory slot, or -1
        self._e_loc = torch.empty(0, dtype=torch.int64)  # entry -> serial << 32 | row of its current value, or -1
        self._memory_bytes = memory_bytes
        self.capacity = memory_bytes // (layout.row_bytes + SLOT_OVERHEAD)
        self._mem = {key: torch.empty((0, *shape), dtype=dt) for key, dt, shape in layout.fields}
        self._slot_id, self._slot_ent, self._slot_stamp = (torch.empty(0, dtype=torch.int64) for _ in range(3))
        self._used, self._clock, self._free = 0, 0, torch.empty(0, dtype=torch.int64)     # slots: used, free
        self._dirty: list[torch.Tensor] = []             # entries updated since the last flush (repeats allowed)
        self._counts = dict.fromkeys(("bytes_written", "flushes", "spilled_rows", "merges", "compactions"), 0)

    # ---- opening and closing ------------------------------------------------------------------------------
    @classmethod
    def open(cls, directory: str | os.PathLike[str], *, base: Any, dim: int | None, dtype: torch.dtype = torch.bfloat16,
             state: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None, memory_bytes: int,
             create: bool = True, readonly: bool = False) -> OverlayStore:
        """Open the overlay in ``directory``: resume its last flushed generation, or start an empty one
        (``create``; the directory is made if absent). See the module docstring for the arguments;
        ``dim=None`` takes the row layout (``dim``, ``dtype``, ``state``) the overlay was flushed with (one
        must exist)."""
        directory = Path(directory)
        if dim is None:
            found = cls.manifest(directory)
            if found is None:
                raise ValueError(f"overlay: {directory} holds no overlay (no {ofiles.MANIFEST}) to take the row "
                                 f"layout from")
            layout = ofiles.parse_layout(found, directory / ofiles.MANIFEST)
        else:
            layout = Layout.of(dim, dtype, state)
        base = ofiles.jsonable(base, "base")
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < 0:
            raise ValueError(f"memory_bytes: expected an int >= 0, got {memory_bytes!r}")
        if not directory.is_dir():
            if readonly or not create:
                raise ValueError(f"overlay: {directory} is not a directory")
            directory.mkdir(parents=True)
        try:
            lock = DirLock(directory, shared=readonly)
        except RuntimeError:
            if not readonly:
                raise
            return cls._snapshot(directory, layout, base, memory_bytes)
        store = cls(directory, layout, base, memory_bytes, readonly, lock)
        try:
            body = ofiles.read_manifest(directory)
            if body is None and (readonly or not create):
                raise ValueError(f"overlay: {directory} holds no overlay (no {ofiles.MANIFEST})")
            if body is not None:
                store._resume(body)
            if not readonly:
                ofiles.clean_leftovers(directory, {s["file"] for s in body["segments"]} if body else set())
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def _snapshot(cls, directory: Path, layout: Layout, base: Any, memory_bytes: int,
                  tries: int = 8) -> OverlayStore:
        """Read only, while a writer holds the overlay: its last flushed generation, without the lock. A
        flush may delete files of the generation just read before they are opened: then the newer manifest
        is read again. Files once opened stay readable (mapped) whatever the writer does after."""
        for attempt in range(tries):
            body = ofiles.read_manifest(directory)
            if body is None:
                raise ValueError(f"overlay: {directory} holds no overlay (no {ofiles.MANIFEST})")
            store = cls(directory, layout, base, memory_bytes, True, DirLock.unlocked(directory))
            try:
                store._resume(body)
                return store
            except ValueError:
                store.close()
                again = ofiles.read_manifest(directory)
                if attempt == tries - 1 or again is None or again["generation"] == body["generation"]:
                    raise                                # not a flush racing this read: damage
        raise AssertionError("unreachable")

    @staticmethod
    def manifest(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The last flushed manifest of the overlay in ``directory`` (its ``generation``, ``dim``, ``dtype``,
        ``state``, ``base``, ``meta`` and ``segments``), or None where there is none; read without the lock
        (the switch to a new one is atomic). A damaged one is a ``ValueError`` naming it."""
        directory = Path(directory)
        return ofiles.read_manifest(directory) if directory.is_dir() else None

    def relayout(self, state: dict[str, tuple[tuple[int, ...], torch.dtype]] | None) -> None:
        """Change the optimizer state a row holds, while the overlay holds no row (``ValueError`` otherwise):
        for an overlay opened before the rule that trains it was known. Takes effect at the next `flush`."""
        self._check_open(write=True)
        layout = Layout.of(self.layout.dim, self.layout.dtype, state)
        if layout == self.layout:
            return
        if self._n:
            raise ValueError(f"overlay: {self.directory} holds {self._n} rows with the state "
                             f"{self.layout.describe()['state']}; it cannot take {layout.describe()['state']}")
        self.layout = layout
        self.capacity = self._memory_bytes // (layout.row_bytes + SLOT_OVERHEAD)
        self._mem = {key: torch.empty((0, *shape), dtype=dt) for key, dt, shape in layout.fields}
        self._slot_id, self._slot_ent, self._slot_stamp = (torch.empty(0, dtype=torch.int64) for _ in range(3))
        self._used, self._free = 0, torch.empty(0, dtype=torch.int64)

    def _resume(self, body: dict[str, Any]) -> None:
        if ofiles.layout_of(body) != self.layout.describe():
            raise ValueError(f"overlay: {self.directory} holds rows of {ofiles.layout_of(body)}, opened for "
                             f"{self.layout.describe()}")
        diff = ofiles.differences(body.get("base"), self.base)
        if diff:
            raise ValueError(f"overlay: {self.directory} was made on another base: " + "; ".join(diff[:8]))
        self.generation, self.meta, self._next_serial = int(body["generation"]), body["meta"], body["next_serial"]
        ids, locs = [torch.empty(0, dtype=torch.int64)], [torch.empty(0, dtype=torch.int64)]
        for info in body["segments"]:
            seg = Segment(self.directory, info, self.layout, int(info["serial"]), durable=True, trusted=False)
            self._segments[seg.serial] = seg
            ids.append(seg.ids.clone())
            locs.append((seg.serial << _SHIFT) + torch.arange(seg.rows))
        order = torch.argsort(torch.cat(ids), stable=True)           # a later segment's row after an earlier's
        all_ids, all_locs = torch.cat(ids)[order], torch.cat(locs)[order]
        last = torch.ones_like(all_ids, dtype=torch.bool)
        last[:-1] = all_ids[1:] != all_ids[:-1]
        all_ids, self._e_loc = all_ids[last], all_locs[last]
        self._n = all_ids.numel()
        self._e_slot = torch.full_like(all_ids, -1)
        self._index = HashIndex(all_ids, torch.arange(self._n))
        serials, counts = torch.unique(self._e_loc >> _SHIFT, return_counts=True)
        for s, c in zip(serials.tolist(), counts.tolist(), strict=True):
            self._segments[s].live = c

    def close(self) -> None:
        """Release the directory. Updates since the last `flush` are dropped (their spill files deleted)."""
        for seg in self._segments.values():
            seg.close()
            if not seg.durable and not self.readonly:
                seg.path.unlink(missing_ok=True)
        self._segments = {}
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def closed(self) -> bool:
        """Whether `close` was called (the store's lookups and updates are then a ``ValueError``)."""
        return self._lock is None

    def __enter__(self) -> OverlayStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self, write: bool = False) -> None:
        if self._lock is None:
            raise ValueError(f"overlay: the store of {self.directory} is closed")
        if write and self.readonly:
            raise ValueError(f"overlay: {self.directory} was opened read only")

    # ---- reading ------------------------------------------------------------------------------------------
    def _gather(self, ents: torch.Tensor, out: dict[str, torch.Tensor], pos: torch.Tensor) -> None:
        """``out[key][pos] = `` the values of entries ``ents``, from memory or disk."""
        slot = self._e_slot.index_select(0, ents)
        mem = slot >= 0
        at, slot = pos[mem], slot[mem]
        for k, o in out.items():
            o.index_copy_(0, at, self._mem[k].index_select(0, slot))
        self._read_disk(self._e_loc[ents[~mem]], pos[~mem], out)

    def read(self, ids: torch.Tensor,
             keys: Iterable[str] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(hit [n] bool, {key: [n, *shape]})`` for ``keys`` (default all: ``"rows"``, ``"state.<name>"``);
        zeros where ``hit`` is False. Ids may repeat."""
        self._check_open()
        ids = ofiles.as_ids(ids)
        ent = self._index.find(ids)
        hit = ent >= 0
        fields = {k: (dt, s) for k, dt, s in self.layout.fields}
        keys = fields if keys is None else keys
        out = {k: torch.zeros((ids.numel(), *fields[k][1]), dtype=fields[k][0]) for k in keys}
        pos = hit.nonzero().squeeze(1)
        self._gather(ent.index_select(0, pos), out, pos)
        return hit, out

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hit [n] bool, rows [n, dim])``: the overlay's rows of ``ids`` (zeros where it has none)."""
        hit, out = self.read(ids, ["rows"])
        return hit, out["rows"]

    def state_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(hit [n] bool, {name: [n, *shape]})``: the optimizer state of ``ids`` (zeros where none)."""
        hit, out = self.read(ids, [f"state.{n}" for n, _, _ in self.layout.state])
        return hit, {k.removeprefix("state."): v for k, v in out.items()}

    def items(self, chunk_rows: int = _CHUNK) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
        """Every row, sorted by id, ``chunk_rows`` at a time: ``(ids, rows, {name: state})``. Do not update
        the store while iterating."""
        self._check_open()
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows: expected >= 1, got {chunk_rows}")
        ids, ents = self._index.sorted()
        for a in range(0, self._n, chunk_rows):
            e = ents[a: a + chunk_rows]
            out = {k: torch.empty((e.numel(), *s), dtype=dt) for k, dt, s in self.layout.fields}
            self._gather(e, out, torch.arange(e.numel()))
            yield ids[a: a + chunk_rows], out.pop("rows"), {k.removeprefix("state."): v for k, v in out.items()}

    def verify(self) -> None:
        """Check every segment's checksums now (a lookup checks a segment's before reading its first row)."""
        self._check_open()
        for seg in self._segments.values():
            seg.check_head()
            seg.verify()

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
        ent = self._index.find(ids)
        new = ent < 0
        k = int(new.sum())
        if k:
            ent[new] = fresh = torch.arange(self._n, self._n + k)
            if self._n + k > self._e_loc.numel():       # grow the entries geometrically
                grow = max(self._n + k, 2 * self._e_loc.numel(), 1024) - self._e_loc.numel()
                self._e_slot, self._e_loc = (torch.cat([t, torch.full((grow,), -1, dtype=torch.int64)])
                                             for t in (self._e_slot, self._e_loc))
            self._n += k
            self._index.insert(ids[new], fresh)
        old = self._e_loc.index_select(0, ent)
        serials, counts = torch.unique(old[old >= 0] >> _SHIFT, return_counts=True)
        for s, c in zip(serials.tolist(), counts.tolist(), strict=True):
            self._segments[s].live -= c                  # the copies on disk are no longer current
        self._e_loc.index_fill_(0, ent, -1)
        self._clock += 1
        slot = self._e_slot.index_select(0, ent)
        res = slot >= 0
        at = slot[res]
        self._slot_stamp.index_fill_(0, at, self._clock)
        for key, v in vals.items():
            self._mem[key].index_copy_(0, at, v[res])
        self._dirty.append(ent)
        if sum(d.numel() for d in self._dirty) > 4 * self.capacity + _CHUNK:     # keep the list short
            e = torch.unique(torch.cat(self._dirty))
            self._dirty = [e[self._e_loc[e] < 0]]
        out = (~res).nonzero().squeeze(1)
        room = self.capacity - int(res.sum())            # slots this update's resident rows leave
        put, over = out[:room], out[room:]
        if put.numel():
            slots = self._take(put.numel())
            for key, v in vals.items():
                self._mem[key].index_copy_(0, slots, v.index_select(0, put))
            self._slot_id[slots], self._slot_ent[slots], self._slot_stamp[slots] = ids[put], ent[put], self._clock
            self._e_slot[ent[put]] = slots
        if over.numel():                                 # more than the budget holds: straight to a spill file
            self._spill(ids[over], ent[over], {key: v[over] for key, v in vals.items()})

    def _take(self, k: int) -> torch.Tensor:
        """``k`` free memory slots: free ones, new ones up to the budget, then the least recently updated
        rows' (evicted: written to a spill file unless already on disk), an eighth of the budget at a time."""
        fresh = min(k - self._free.numel(), self.capacity - self._used)
        if fresh > 0:
            if self._used + fresh > self._slot_id.numel():   # the whole budget at once (never a copy of it beside
                n = self._slot_id.numel()                      # itself): its pages are backed as rows are written
                mem = {key: m.new_empty((self.capacity, *m.shape[1:])) for key, m in self._mem.items()}
                for key, m in self._mem.items():
                    mem[key][:n] = m
                self._mem = mem
                self._slot_id, self._slot_ent, self._slot_stamp = (
                    torch.cat([t, torch.full((self.capacity - n,), -1, dtype=torch.int64)])
                    for t in (self._slot_id, self._slot_ent, self._slot_stamp))
            self._free = torch.cat([self._free, torch.arange(self._used, self._used + fresh)])
            self._used += fresh
        if k > self._free.numel():
            stamps = self._slot_stamp[: self._used].clone()
            stamps[self._slot_ent[: self._used] < 0] = self._clock + 1          # free slots are not evicted
            evictable = int((stamps < self._clock).sum())
            victims = torch.topk(stamps, min(evictable, max(k - self._free.numel(), self.capacity // 8)),
                                 largest=False).indices
            ents = self._slot_ent[victims]
            dirty = self._e_loc[ents] < 0
            if bool(dirty.any()):
                v = victims[dirty]
                self._spill(self._slot_id[v], ents[dirty], {key: m.index_select(0, v) for key, m in self._mem.items()})
            self._e_slot[ents] = -1
            self._slot_ent[victims] = -1
            self._free = torch.cat([self._free, victims])
        slots, self._free = self._free[:k], self._free[k:]
        return slots

    def _spill(self, ids: torch.Tensor, ents: torch.Tensor, vals: dict[str, torch.Tensor]) -> None:
        ids, order = torch.sort(ids)
        seg = self._write(ids.numel(), [(ids, {k: v[order] for k, v in vals.items()})])
        self._e_loc[ents[order]] = (seg.serial << _SHIFT) + torch.arange(ids.numel())
        seg.live = ids.numel()
        self._counts["spilled_rows"] += ids.numel()
        if len(self._segments) > MAX_SEGMENTS:           # else merged at the next flush, not inside a step
            self._maybe_merge()

    def flush(self, meta: dict[str, Any] | None = None) -> None:
        """Make every update so far durable, with ``meta`` (JSON-able; default: the last flush's) saved with it."""
        self._check_open(write=True)
        meta = self.meta if meta is None else ofiles.jsonable(meta, "meta")
        e = torch.unique(torch.cat(self._dirty)) if self._dirty else torch.empty(0, dtype=torch.int64)
        e = e[self._e_loc[e] < 0]                        # still only in memory (not spilled since)
        if e.numel():
            slots = self._e_slot[e]
            ids, order = torch.sort(self._slot_id[slots])
            slots, e = slots[order], e[order]
            n = ids.numel()
            chunks = ((ids[a: a + _CHUNK], {k: m.index_select(0, slots[a: a + _CHUNK]) for k, m in self._mem.items()})
                      for a in range(0, n, _CHUNK))
            seg = self._write(n, chunks)
            self._e_loc[e] = (seg.serial << _SHIFT) + torch.arange(n)
            seg.live = n
        self._dirty = []
        self._maybe_merge()
        fsync_dir(self.directory)                        # the new segments' names, before the manifest's
        body = {"generation": self.generation + 1, "next_serial": self._next_serial, **self.layout.describe(),
                "base": self.base, "meta": meta, "segments": [s.info for s in self._segments.values()]}
        self._counts["bytes_written"] += ofiles.write_manifest(self.directory, body)
        self.generation, self.meta = self.generation + 1, meta
        for seg in self._segments.values():
            seg.durable = True
        for path in self._doomed:                        # no manifest lists them now
            path.unlink(missing_ok=True)
        self._doomed = []
        self._counts["flushes"] += 1

    # ---- sizes --------------------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows in the overlay (in memory or on disk, flushed or not)."""
        return self._n

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of the directory's overlay files: segments (flushed, spilled, awaiting deletion) and manifest."""
        paths = self._doomed + [self.directory / ofiles.MANIFEST]
        return sum(s.size for s in self._segments.values()) + sum(p.stat().st_size for p in paths if p.exists())

    def stats(self) -> dict[str, int]:
        """Counters and sizes: rows, rows in memory, segments, bytes on disk, live and dead bytes, memory
        and index bytes, and since opening: bytes written, flushes, spilled rows, merges, compactions."""
        segs = self._segments.values()
        live = sum(s.live for s in segs)
        return {"rows": self._n, "rows_in_memory": int((self._slot_ent[: self._used] >= 0).sum()),
                "capacity_rows": self.capacity, "segments": len(segs), "bytes_on_disk": self.bytes_on_disk,
                "live_bytes": live * self.layout.row_bytes,
                "dead_bytes": (sum(s.rows for s in segs) - live) * self.layout.row_bytes,
                "memory_bytes": self._slot_id.numel() * (self.layout.row_bytes + SLOT_OVERHEAD),
                "index_bytes": self._index.nbytes + self._e_slot.nbytes + self._e_loc.nbytes,
                "generation": self.generation, **self._counts}

    def __repr__(self) -> str:
        return (f"OverlayStore({str(self.directory)!r}, rows={self._n}, generation={self.generation}, "
                f"dim={self.layout.dim}, dtype={self.layout.dtype})")
