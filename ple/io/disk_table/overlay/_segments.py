"""The segment files of an `~ple.io.disk_table.overlay.OverlayStore`: finding rows in them (newest first, through the
bitmap and each segment's fences), reading them, writing new ones, retiring old ones, and the merges that keep
a flush's cost to the rows it changes, streamed in bounded chunks (a mixin of the store; its state and its
constants live there, see ``ple.io.disk_table.overlay``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..mapped import read_rows
from . import _files as ofiles
from ._files import Segment
from ._index import IdBitmap, fences_of, find_sorted, lower_bound, merge_sorted

if TYPE_CHECKING:
    from ._files import Layout

__all__ = ["SegmentFiles"]


class SegmentFiles:
    """The store's segment files (see the module docstring)."""

    directory: Path
    layout: Layout
    _segments: dict[int, Segment]
    _doomed: list[Path]
    _next_serial: int
    _on_disk: IdBitmap
    _counts: dict[str, int]
    fence_every: int
    chunk_bytes: int
    max_segments: int

    @property
    def _chunk_rows(self) -> int:
        """Rows a flush, a merge or a scan handles at a time: ``chunk_bytes`` of rows and their bookkeeping."""
        return max(self.fence_every, self.chunk_bytes // (self.layout.row_bytes + 64))

    # ---- finding and reading ------------------------------------------------------------------------------
    def _attach(self, seg: Segment) -> None:
        """Index a segment: its fences (checking its ids sorted and distinct), and its ids in the bitmap."""
        seg.fences = fences_of(seg.ids, self.fence_every, self._chunk_rows, seg.check, str(seg.path),
                               self._on_disk.add)

    def _find_disk(self, ids: torch.Tensor, pos: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        """``out[key][pos[i]] = `` the current disk values of ``ids[i]`` (all on disk): the newest segment
        holding each, segments searched newest first, only for the ids not found yet."""
        for seg in reversed(list(self._segments.values())):
            if not ids.numel():
                return
            seg.check()
            rows = find_sorted(seg.ids, seg.fences, self.fence_every, ids)
            hit = rows >= 0
            if bool(hit.any()):
                self._read_from(seg, rows[hit], pos[hit], out)
                ids, pos = ids[~hit], pos[~hit]
        if ids.numel():
            raise RuntimeError(f"overlay: {self.directory}: ids {ids[:8].tolist()} are marked on disk but no "
                               f"segment holds them (a bug)")

    def _runs_between(self, segs: list[Segment], start: int,
                      stop: int) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """``(ids, k, rows)`` of each segment ``segs[k]`` holding ids in ``[start, stop)``: one run of its sorted
        ids, found by two searches through its fences (`lower_bound`)."""
        found = []
        for k, seg in enumerate(segs):
            seg.check()
            a = lower_bound(seg.ids, seg.fences, self.fence_every, start)
            b = max(a, lower_bound(seg.ids, seg.fences, self.fence_every, stop))
            if b > a:
                found.append((seg.ids[a:b].clone(), k, torch.arange(a, b)))
        return found

    def _read_from(self, seg: Segment, rows: torch.Tensor, pos: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        """``out[key][pos] = `` segment ``seg``'s values of rows ``rows``."""
        seg.verify()
        seg.check()
        bufs = {k: torch.empty((rows.numel(), *o.shape[1:]), dtype=o.dtype) for k, o in out.items()}
        read_rows([(seg.views[k], rows, bufs[k]) for k in out])
        for k, o in out.items():
            o.index_copy_(0, pos, bufs[k])

    # ---- writing and retiring -----------------------------------------------------------------------------
    def _write(self, n: int, chunks: Iterable[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> Segment:
        serial, self._next_serial = self._next_serial, self._next_serial + 1
        info = ofiles.write_segment(self.directory, serial, self.layout, n, chunks)
        self._counts["bytes_written"] += info["size"]
        seg = Segment(self.directory, info, self.layout, serial, durable=False, trusted=True)
        self._segments[serial] = seg
        try:
            seg.fences = fences_of(seg.ids, self.fence_every, self._chunk_rows, seg.check, str(seg.path))
        except BaseException:
            del self._segments[serial]
            seg.close()
            seg.path.unlink(missing_ok=True)
            raise
        return seg

    def _write_new(self, ids: torch.Tensor, chunks: Iterable[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> int:
        """Write rows ``ids`` (sorted, distinct; their values from ``chunks``) as a new segment: the newest, whose
        rows replace the copies of older segments (each loses the live rows it held of them), their ids set in
        the bitmap. Returns how many were on no segment before."""
        before = self._on_disk.test(ids)
        seg = self._write(ids.numel(), chunks)
        seg.live = ids.numel()
        older = [s for s in reversed(self._segments.values()) if s is not seg]
        again = ids[before]
        for a in range(0, again.numel(), self._chunk_rows):     # the newest older segment holding each: its copy
            q = again[a: a + self._chunk_rows]                   # was live until now
            for old in older:
                if not q.numel():
                    break
                old.check()
                found = find_sorted(old.ids, old.fences, self.fence_every, q) >= 0
                old.live -= int(found.sum())
                q = q[~found]
        return self._on_disk.add(ids[~before])

    def _count_live(self) -> None:
        """Each segment's live rows, counted: its ids less those a later segment holds (a manifest of an earlier
        version does not list them). Streams each segment's ids through the later ones' searches."""
        segs = list(self._segments.values())
        for i, seg in enumerate(segs):
            seg.live = seg.rows
            for a in range(0, seg.rows, self._chunk_rows):
                seg.check()
                q = seg.ids[a: a + self._chunk_rows].clone()
                for later in segs[i + 1:]:
                    later.check()
                    found = find_sorted(later.ids, later.fences, self.fence_every, q) >= 0
                    seg.live -= int(found.sum())
                    q = q[~found]

    def _retire(self, seg: Segment) -> None:
        del self._segments[seg.serial]
        seg.close()
        if seg.durable:                                  # the durable manifest lists it: deleted after the next
            self._doomed.append(seg.path)
        else:
            seg.path.unlink(missing_ok=True)

    def _merged(self, segs: list[Segment]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The union of ``segs`` (oldest first) by id, the latest copy of each: ``(ids, seg index, row)``."""
        def check() -> None:
            for s in segs:
                s.check()
        return merge_sorted([s.ids for s in segs], self._chunk_rows, check)

    def _rewrite(self, old: list[Segment]) -> None:
        """Write the union of ``old`` (consecutive segments, the newest last; the latest copy of each row) as one
        new segment, streamed, and retire ``old``. Two passes over the ids: one counts the rows (the file's
        layout needs the count first), one writes them."""
        n = sum(ids.numel() for ids, _, _ in self._merged(old))

        def chunks() -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
            for ids, which, rows in self._merged(old):
                out = {k: torch.empty((ids.numel(), *s), dtype=dt) for k, dt, s in self.layout.fields}
                for i in torch.unique(which).tolist():
                    sel = (which == i).nonzero().squeeze(1)
                    self._read_from(old[i], rows[sel], sel, out)
                yield ids, out
        if n:
            self._write(n, chunks()).live = n
        for s in old:
            self._retire(s)

    # ---- merges -------------------------------------------------------------------------------------------
    def _dead_rows(self) -> int:
        """Rows of the segments that a later segment replaces: all their rows less the distinct ids on disk
        (the bitmap's count; the segments' ``live`` add up to it, kept by `_write_new` and the manifest)."""
        return sum(s.rows for s in self._segments.values()) - self._on_disk.count

    def _maybe_merge(self) -> None:
        for seg in [s for s in self._segments.values() if s.live <= 0]:
            self._retire(seg)                            # every row replaced by a later segment's
        segs = list(self._segments.values())
        if self._dead_rows() > self._on_disk.count:      # dead rows outnumber live ones: compact
            self._rewrite(segs)
            self._counts["compactions"] += 1
            return
        # The binary counter: the newest segment absorbs the one before it while that one holds no more live
        # rows than it and those absorbed (or while there are too many). Decided first and written once: merging
        # pairwise would rewrite the growing newest segment once per segment absorbed (many spilled segments at
        # a flush).
        k, total = 1, segs[-1].live if segs else 0
        while k < len(segs) and (segs[-k - 1].live <= total or len(segs) - k + 1 > self.max_segments):
            total += segs[-k - 1].live
            k += 1
        if k > 1:
            self._rewrite(segs[-k:])
            self._counts["merges"] += 1
