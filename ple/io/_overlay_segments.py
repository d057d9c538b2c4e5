"""The segment files of an `~ple.io.overlay.OverlayStore`: reading rows from them, writing new ones, retiring
old ones, and the merges that keep a flush's cost to the rows it changes (a mixin of the store; its state
lives there, see ``ple.io.overlay``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import _overlay_files as ofiles
from ._overlay_files import Segment
from .mapped import read_rows

if TYPE_CHECKING:
    from ._overlay_files import HashIndex, Layout

__all__ = ["SegmentFiles", "MAX_SEGMENTS"]

MAX_SEGMENTS = 32
"""Segments past this many are merged whatever their sizes."""

_CHUNK = 65536                   # rows read or written at a time by flushes, merges and `items`
_SHIFT = 32                      # where a row is on disk: serial << 32 | row


class SegmentFiles:
    """The store's segment files (see the module docstring)."""

    directory: Path
    layout: Layout
    _segments: dict[int, Segment]
    _doomed: list[Path]
    _next_serial: int
    _index: HashIndex
    _e_loc: torch.Tensor
    _counts: dict[str, int]

    def _read_disk(self, locs: torch.Tensor, pos: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        """``out[key][pos[i]] = `` the values at ``locs[i]`` (serial << 32 | row), segment by segment."""
        serial = locs >> _SHIFT
        for s in torch.unique(serial).tolist():
            seg = self._segments[s]
            seg.verify()
            seg.check()
            sel = serial == s
            rows, p = locs[sel] & ((1 << _SHIFT) - 1), pos[sel]
            bufs = {k: torch.empty((rows.numel(), *o.shape[1:]), dtype=o.dtype) for k, o in out.items()}
            read_rows([(seg.views[k], rows, bufs[k]) for k in out])
            for k, o in out.items():
                o.index_copy_(0, p, bufs[k])

    def _write(self, n: int, chunks: Iterable[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> Segment:
        serial, self._next_serial = self._next_serial, self._next_serial + 1
        info = ofiles.write_segment(self.directory, serial, self.layout, n, chunks)
        self._counts["bytes_written"] += info["size"]
        seg = Segment(self.directory, info, self.layout, serial, durable=False, trusted=True)
        self._segments[serial] = seg
        return seg

    def _retire(self, seg: Segment) -> None:
        del self._segments[seg.serial]
        seg.close()
        if seg.durable:                                  # the durable manifest lists it: deleted after the next
            self._doomed.append(seg.path)
        else:
            seg.path.unlink(missing_ok=True)

    def _rewrite(self, old: list[Segment], ids: torch.Tensor, ents: torch.Tensor) -> None:
        """Write the current values of entries ``ents`` (ids ``ids``, sorted), all in ``old``, as one new
        segment, and retire ``old``."""
        n, locs = ids.numel(), self._e_loc[ents]

        def chunks() -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
            for a in range(0, n, _CHUNK):
                b = min(n, a + _CHUNK)
                out = {k: torch.empty((b - a, *s), dtype=dt) for k, dt, s in self.layout.fields}
                self._read_disk(locs[a:b], torch.arange(b - a), out)
                yield ids[a:b], out
        if n:
            seg = self._write(n, chunks())
            self._e_loc[ents] = (seg.serial << _SHIFT) + torch.arange(n)
            seg.live = n
        for s in old:
            self._retire(s)

    def _live_rows(self, segs: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, entries)`` of the rows whose current value is in ``segs``, sorted by id."""
        ids, ents = [torch.empty(0, dtype=torch.int64)], [torch.empty(0, dtype=torch.int64)]
        for seg in segs:
            seg.check()
            i = seg.ids.clone()
            e = self._index.find(i)
            live = self._e_loc[e] == (seg.serial << _SHIFT) + torch.arange(seg.rows)
            ids.append(i[live])
            ents.append(e[live])
        all_ids, order = torch.sort(torch.cat(ids))
        return all_ids, torch.cat(ents)[order]

    def _maybe_merge(self) -> None:
        for seg in [s for s in self._segments.values() if s.live == 0]:
            self._retire(seg)
        segs = list(self._segments.values())
        live = sum(s.live for s in segs)
        if sum(s.rows for s in segs) - live > live:                  # dead rows outnumber live ones: compact
            ids, ents = self._index.sorted()
            on = self._e_loc[ents] >= 0
            self._rewrite(segs, ids[on], ents[on])
            self._counts["compactions"] += 1
            return
        # The binary counter: the newest segment absorbs the one before it while that one holds no more live
        # rows than it (or while there are too many). Decided first and written once: merging pairwise would
        # rewrite the growing newest segment once per segment absorbed (many spilled segments at a flush).
        k, total = 1, segs[-1].live if segs else 0
        while k < len(segs) and (segs[-k - 1].live <= total or len(segs) - k + 1 > MAX_SEGMENTS):
            total += segs[-k - 1].live
            k += 1
        if k > 1:
            self._rewrite(segs[-k:], *self._live_rows(segs[-k:]))
            self._counts["merges"] += 1
