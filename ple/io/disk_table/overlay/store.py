"""`OverlayStore`: a durable store of changed table rows and their optimizer state, for a trainable disk table.

The checkpoint's files are never written: the rows that training changes live in an *overlay* directory,
keyed by row id (int64). Each row holds ``dim`` values of ``dtype`` (bfloat16 unless said) and one tensor
per optimizer state of ``state`` (``{name: (shape_per_row, dtype)}``, e.g. ``{"sum": ((), torch.float32)}``).

    store = OverlayStore.open(DIR, base=fingerprint, dim=D, state={"sum": ((), torch.float32)},
                              memory_bytes=1 << 30, table_rows=N)
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

Memory (every budget and constant: the block below, `MEMORY_CONSTANTS`). Rows (with their state and
``SLOT_OVERHEAD`` bytes of bookkeeping each: id, last update, dirty flag and their hash-index entry) are kept
in memory up to ``memory_bytes``; beyond it the least recently updated are *spilled* to a segment file in the
directory (not durable until a flush lists it), from which lookups read them (mapped); spilled files are
merged at the next flush, so a step does not wait on a merge (unless over ``MAX_SEGMENTS`` files pile up).
The budget's memory is allocated once, its pages backed as rows are written. The index is off the heap
(``ple.io.disk_table.overlay._index``): a hash index of the rows *in memory* only (counted in the budget); each
segment's ids, sorted in its file, searched where they lie (mapped: file pages, not the process's own
memory) from in-memory fences (every ``FENCE_EVERY``-th id: 1/16 byte a row); and a bitmap of the ids on
disk (1 bit per table row: ``table_rows`` sizes it at once, 40 MB at 320M rows, else it grows with the
largest id), which filters out ids in no segment before any search and counts the distinct rows on disk.
A lookup looks in memory, then in the segments newest first (a later copy of a row shadows an earlier one):
hash probes, fence searches and gathers, never a Python loop over the ids. Merges, compactions, flushes and
`items` stream in chunks of ``CHUNK_BYTES``: the process's own memory stays within ``memory_bytes`` + the
bitmap + the fences + ``FIXED_BYTES`` (+ the caller's tensors), whatever the rows trained.

Durability (the files: ``ple.io.disk_table.overlay._files``). `flush` writes the rows changed since the last flush as a
new immutable segment and fsyncs it, then switches the manifest (which lists the segments with their sizes,
checksums and live rows) atomically; files of earlier generations are deleted only after that. The index has
no file of its own: the bitmap and the fences are rebuilt at open from the segments' ids (read once, as their
checksum already was), so a crash cannot leave it out of step with the rows. A process killed at any moment
leaves the directory as of the last flush that returned or of the one in progress, never a mixture; its
leftovers are deleted at the next open. A flush costs the rows changed since the last one: a segment's live
rows (those no later segment replaces) are kept as segments are written (the rows a new segment replaces are
found by the same search as a lookup's); the newest two segments are merged when the newer holds as many
live rows as the older (a binary counter: few segments, each row rewritten a logarithmic number of times), a
segment with none left is retired, and all are compacted into one should dead rows (all the segments' rows
less the bitmap's count) outnumber live ones: the disk holds at most about twice the live rows. A merge
reads its segments' ids twice, a chunk at a time (a k-way merge counting the merged rows, which the new
file's layout needs first, then one writing them). A segment's size and the checksums of its header and ids
are checked at open (its ids also sorted and distinct, as every version of this library wrote them: an
overlay of an earlier version opens as it is, its segments' live rows counted at open), those of its rows
and states before the first of its rows is returned: a missing, truncated or altered file is a
``ValueError`` naming it. Not thread safe.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from .... import _checks
from ...writer import fsync_dir
from .._heap import release_freed
from . import _files as ofiles
from ._files import DirLock, Layout
from ._index import IdBitmap, merge_sorted, newest_of
from ._memory import MemoryRows

__all__ = ["OverlayStore", "SLOT_OVERHEAD", "MAX_SEGMENTS", "FENCE_EVERY", "CHUNK_BYTES", "FIXED_BYTES",
           "MEMORY_CONSTANTS"]

# ---- memory: every budget and constant of the store --------------------------------------------------------
SLOT_OVERHEAD = 96
"""Bytes a row in memory costs beyond its values, counted in ``memory_bytes``: held, its id (8), last update
(8) and dirty flag (1), and its hash-index entry (`SlotIndex`: 24); at moments, per row of the budget, a
flush's or an eviction's temporaries (the slots sorted by id, the last updates copied: up to 40) or a
rebuild of the index (12). Rounded up."""

FENCE_EVERY = 128
"""A segment keeps every this many-th of its ids in memory (its fences): 8 bytes per 128 rows on disk."""

CHUNK_BYTES = 8 << 20
"""Rows (and their bookkeeping) a flush, a spill, a merge, a compaction or a scan handles at a time."""

MAX_SEGMENTS = 32
"""Segments past this many are merged whatever their sizes."""

FIXED_BYTES = 64 << 20
"""The stated constant: the process's anonymous memory the store may take beyond ``memory_bytes``, the bitmap
(``table_rows / 8``) and the fences (``8 / FENCE_EVERY`` a row on disk), whatever the rows trained: a few
``CHUNK_BYTES`` of chunks in flight (a merge's ids, sources and positions, the rows read and written), the
bookkeeping of up to ``MAX_SEGMENTS`` segments, and what the C allocator keeps of freed temporaries (glibc serves
blocks up to 32 MiB from its heap once such blocks were freed, and keeps them; the store hands whole free pages back
after each spill and flush and after it opens and verifies, ``ple.io.disk_table._heap``, so what it keeps does not
pile up, nor sit in one thread's heap while another allocates). The caller's tensors (a
step's ids and rows) are not counted. Checked: tests/io/test_overlay_memory.py."""

MEMORY_CONSTANTS = {"SLOT_OVERHEAD": SLOT_OVERHEAD, "FENCE_EVERY": FENCE_EVERY, "CHUNK_BYTES": CHUNK_BYTES,
                    "MAX_SEGMENTS": MAX_SEGMENTS, "FIXED_BYTES": FIXED_BYTES}

_CHUNK = 65536                   # rows `items` yields at a time by default


class OverlayStore(MemoryRows):
    """A durable store of table rows and their optimizer state, keyed by row id (see the module docstring).
    Made by `OverlayStore.open`."""

    fence_every, chunk_bytes, max_segments, slot_overhead = FENCE_EVERY, CHUNK_BYTES, MAX_SEGMENTS, SLOT_OVERHEAD

    def __init__(self, directory: Path, layout: Layout, base: Any, memory_bytes: int, readonly: bool,
                 lock: DirLock, table_rows: int = 0) -> None:
        self.directory, self.layout, self.base, self.readonly = directory, layout, base, readonly
        self._lock: DirLock | None = lock
        self.generation = 0
        self.meta: dict[str, Any] = {}
        self._segments: dict = {}                        # serial -> Segment, in the order written (serial order)
        self._doomed: list[Path] = []                    # merged away; deleted once a manifest no longer lists them
        self._next_serial = 1
        self._on_disk = IdBitmap(table_rows)             # the ids some segment holds
        self._mem_only = 0                               # rows in memory that no segment holds
        self._memory_bytes = memory_bytes
        self._counts = dict.fromkeys(("bytes_written", "flushes", "spilled_rows", "merges", "compactions"), 0)
        self._reset_memory()

    # ---- opening and closing ------------------------------------------------------------------------------
    @classmethod
    def open(cls, directory: str | os.PathLike[str], *, base: Any, dim: int | None, dtype: torch.dtype = torch.bfloat16,
             state: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None, memory_bytes: int,
             create: bool = True, readonly: bool = False, table_rows: int | None = None) -> OverlayStore:
        """Open the overlay in ``directory``: resume its last flushed generation, or start an empty one
        (``create``; the directory is made if absent). See the module docstring for the arguments;
        ``dim=None`` takes the row layout (``dim``, ``dtype``, ``state``) the overlay was flushed with (one
        must exist). ``table_rows``: the rows of the table (ids are below it), to size the bitmap once."""
        directory = Path(directory)
        if table_rows is not None and (isinstance(table_rows, bool) or not isinstance(table_rows, int)
                                       or table_rows < 0):
            raise ValueError(f"table_rows: expected an int >= 0 or None, got {table_rows!r}")
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
            return cls._snapshot(directory, layout, base, memory_bytes, table_rows or 0)
        store = cls(directory, layout, base, memory_bytes, readonly, lock, table_rows or 0)
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
    def _snapshot(cls, directory: Path, layout: Layout, base: Any, memory_bytes: int, table_rows: int,
                  tries: int = 8) -> OverlayStore:
        """Read only, while a writer holds the overlay: its last flushed generation, without the lock. A
        flush may delete files of the generation just read before they are opened: then the newer manifest
        is read again. Files once opened stay readable (mapped) whatever the writer does after."""
        for attempt in range(tries):
            body = ofiles.read_manifest(directory)
            if body is None:
                raise ValueError(f"overlay: {directory} holds no overlay (no {ofiles.MANIFEST})")
            store = cls(directory, layout, base, memory_bytes, True, DirLock.unlocked(directory), table_rows)
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
        if self.num_rows:
            raise ValueError(f"overlay: {self.directory} holds {self.num_rows} rows with the state "
                             f"{self.layout.describe()['state']}; it cannot take {layout.describe()['state']}")
        self.layout = layout
        self._reset_memory()

    def _resume(self, body: dict[str, Any]) -> None:
        if ofiles.layout_of(body) != self.layout.describe():
            raise ValueError(f"overlay: {self.directory} holds rows of {ofiles.layout_of(body)}, opened for "
                             f"{self.layout.describe()}")
        diff = ofiles.differences(body.get("base"), self.base)
        if diff:
            raise ValueError(f"overlay: {self.directory} was made on another base: " + "; ".join(diff[:8]))
        self.generation, self.meta, self._next_serial = int(body["generation"]), body["meta"], body["next_serial"]
        for info in body["segments"]:                    # each segment's ids streamed: fences and bitmap
            seg = ofiles.Segment(self.directory, info, self.layout, int(info["serial"]), durable=True, trusted=False)
            self._segments[seg.serial] = seg
            self._attach(seg)
        if any("live" not in info for info in body["segments"]):     # a manifest of an earlier version
            self._count_live()
        release_freed()                                  # the ids' chunks streamed: heap back to the kernel

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
    def read(self, ids: torch.Tensor,
             keys: Iterable[str] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(hit [n] bool, {key: [n, *shape]})`` for ``keys`` (default all: ``"rows"``, ``"state.<name>"``);
        zeros where ``hit`` is False. Ids may repeat."""
        self._check_open()
        ids = ofiles.as_ids(ids)
        fields = {k: (dt, s) for k, dt, s in self.layout.fields}
        keys = fields if keys is None else keys
        out = {k: torch.zeros((ids.numel(), *fields[k][1]), dtype=fields[k][0]) for k in keys}
        slot = self._slots.find(ids)
        mem = slot >= 0
        at = mem.nonzero().squeeze(1)
        for k, o in out.items():
            o.index_copy_(0, at, self._mem[k].index_select(0, slot.index_select(0, at)))
        rest = (~mem).nonzero().squeeze(1)
        disk = self._on_disk.test(ids.index_select(0, rest))      # ids in no segment: no search
        rest = rest[disk]
        self._find_disk(ids.index_select(0, rest), rest, out)
        hit = mem
        hit[rest] = True
        return hit, out

    def read_range(self, start: int, stop: int,
                   keys: Iterable[str] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The rows the overlay holds with ids in ``[start, stop)``, sorted by id: ``(ids [m], {key: [m, ...]})``
        for ``keys`` (default all, as `read`), each its current value (in memory, else the newest segment's).

        It costs the rows found, not the range: a segment's ids are sorted, so its rows in a range are one run
        of it, found by two searches through its fences; the rows in memory are picked from its slots. What
        ``ple.io.merge`` reads, block by block of the table.
        """
        self._check_open()
        start, stop = _checks.int_arg("start", start), _checks.int_arg("stop", stop)
        fields = {k: (dt, s) for k, dt, s in self.layout.fields}
        keys = list(fields if keys is None else keys)
        for k in keys:
            if k not in fields:
                raise ValueError(f"keys: {k!r} is not a field of this overlay (its fields: {list(fields)})")
        segs = list(self._segments.values())             # oldest first; the rows in memory are newer
        found = self._runs_between(segs, start, stop) + self._held_between(start, stop, len(segs))
        if not found:
            return torch.empty(0, dtype=torch.int64), {k: torch.empty((0, *fields[k][1]), dtype=fields[k][0])
                                                       for k in keys}
        ids, src, rows = newest_of(found)
        out = {k: torch.empty((ids.numel(), *fields[k][1]), dtype=fields[k][0]) for k in keys}
        self._gather(out, segs, src, rows)
        return ids, out

    def _gather(self, out: dict[str, torch.Tensor], segs: list, which: torch.Tensor, rows: torch.Tensor) -> None:
        """``out[key][i] = `` the value of row ``rows[i]`` of ``segs[which[i]]``, or of memory slot ``rows[i]``
        where ``which[i] == len(segs)``."""
        for i in torch.unique(which).tolist():
            sel = (which == i).nonzero().squeeze(1)
            if i < len(segs):
                self._read_from(segs[i], rows.index_select(0, sel), sel, out)
            else:
                slots = rows.index_select(0, sel)
                for k, o in out.items():
                    o.index_copy_(0, sel, self._mem[k].index_select(0, slots))

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hit [n] bool, rows [n, dim])``: the overlay's rows of ``ids`` (zeros where it has none)."""
        hit, out = self.read(ids, ["rows"])
        return hit, out["rows"]

    def state_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(hit [n] bool, {name: [n, *shape]})``: the optimizer state of ``ids`` (zeros where none)."""
        hit, out = self.read(ids, [f"state.{n}" for n, _, _ in self.layout.state])
        return hit, {k.removeprefix("state."): v for k, v in out.items()}

    def items(self, chunk_rows: int = _CHUNK) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
        """Every row, sorted by id, ``chunk_rows`` at a time: ``(ids, rows, {name: state})``, merged from the
        segments and memory in bounded chunks. Do not update the store while iterating."""
        self._check_open()
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows: expected an int >= 1, got {chunk_rows!r}")
        segs = list(self._segments.values())
        held = (self._slot_id[: self._used] >= 0).nonzero().squeeze(1)
        mem_ids, order = torch.sort(self._slot_id.index_select(0, held))
        mem_slots = held[order]
        del held, order

        def check() -> None:
            for s in segs:
                s.check()

        def emit(ids: torch.Tensor, which: torch.Tensor, rows: torch.Tensor):
            out = {k: torch.empty((ids.numel(), *s), dtype=dt) for k, dt, s in self.layout.fields}
            mem = (which == len(segs)).nonzero().squeeze(1)              # positions in mem_ids -> slots
            rows = rows.index_copy(0, mem, mem_slots.index_select(0, rows.index_select(0, mem)))
            self._gather(out, segs, which, rows)
            return ids, out.pop("rows"), {k.removeprefix("state."): v for k, v in out.items()}

        pending = [torch.empty(0, dtype=torch.int64) for _ in range(3)]
        for got in merge_sorted([s.ids for s in segs] + [mem_ids], min(chunk_rows, self._chunk_rows), check):
            pending = [torch.cat([p, g]) for p, g in zip(pending, got, strict=True)]
            while pending[0].numel() >= chunk_rows:
                yield emit(*(p[:chunk_rows] for p in pending))
                pending = [p[chunk_rows:] for p in pending]
        if pending[0].numel():
            yield emit(*pending)

    def verify(self) -> None:
        """Check every segment's checksums now (a lookup checks a segment's before reading its first row)."""
        self._check_open()
        for seg in self._segments.values():
            seg.check_head()
            seg.verify()
        release_freed()                                  # the checksums' reads: heap back to the kernel

    # ---- updating (`update` and the memory slots: ``_memory``) ----------------------------------
    def flush(self, meta: dict[str, Any] | None = None) -> None:
        """Make every update so far durable, with ``meta`` (JSON-able; default: the last flush's) saved with it."""
        self._check_open(write=True)
        meta = self.meta if meta is None else ofiles.jsonable(meta, "meta")
        slots = self._slot_dirty[: self._used].nonzero().squeeze(1)
        if slots.numel():                                # the rows changed since last written
            ids, order = torch.sort(self._slot_id.index_select(0, slots))
            slots = slots[order]
            n, step = ids.numel(), self._chunk_rows
            chunks = ((ids[a: a + step], {k: m.index_select(0, slots[a: a + step]) for k, m in self._mem.items()})
                      for a in range(0, n, step))
            self._mem_only -= self._write_new(ids, chunks)
            self._slot_dirty[slots] = False
            del ids, slots, order
        self._maybe_merge()
        fsync_dir(self.directory)                        # the new segments' names, before the manifest's
        body = {"generation": self.generation + 1, "next_serial": self._next_serial, **self.layout.describe(),
                "base": self.base, "meta": meta,
                "segments": [s.info | {"live": s.live} for s in self._segments.values()]}
        self._counts["bytes_written"] += ofiles.write_manifest(self.directory, body)
        self.generation, self.meta = self.generation + 1, meta
        for seg in self._segments.values():
            seg.durable = True
        for path in self._doomed:                        # no manifest lists them now
            path.unlink(missing_ok=True)
        self._doomed = []
        self._counts["flushes"] += 1
        release_freed()                                  # the flush's and merges' chunks: heap back to the kernel

    # ---- sizes --------------------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows in the overlay (in memory or on disk, flushed or not)."""
        return self._on_disk.count + self._mem_only

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of the directory's overlay files: segments (flushed, spilled, awaiting deletion) and manifest."""
        paths = self._doomed + [self.directory / ofiles.MANIFEST]
        return sum(s.size for s in self._segments.values()) + sum(p.stat().st_size for p in paths if p.exists())

    def stats(self) -> dict[str, int]:
        """Counters and sizes: rows, rows in memory, segments, bytes on disk, live and dead bytes (rows on disk,
        distinct and replaced), memory (the budget's, allocated) and index bytes (the bitmap and the fences:
        the index's part beyond the budget), and since opening: bytes written, flushes, spilled rows, merges,
        compactions."""
        segs = self._segments.values()
        return {"rows": self.num_rows, "rows_in_memory": self._slots.live,
                "capacity_rows": self.capacity, "segments": len(segs), "bytes_on_disk": self.bytes_on_disk,
                "live_bytes": self._on_disk.count * self.layout.row_bytes,
                "dead_bytes": self._dead_rows() * self.layout.row_bytes,
                "memory_bytes": self._slot_id.numel() * (self.layout.row_bytes + SLOT_OVERHEAD),
                "index_bytes": self._on_disk.nbytes + sum(s.fences.nbytes for s in segs),
                "generation": self.generation, **self._counts}

    def __repr__(self) -> str:
        return (f"OverlayStore({str(self.directory)!r}, rows={self.num_rows}, generation={self.generation}, "
                f"dim={self.layout.dim}, dtype={self.layout.dtype})")
