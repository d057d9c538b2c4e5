"""A table read in place from its checkpoint: `DiskTable`, safetensors files read in place and a row cache.

The real table (320,001,536 rows of 160: 95 GiB in bfloat16, 48 GiB in FP8) need not be in
memory at all. ``load_layer(path, offload="disk", cache_bytes=N)`` returns a layer whose table
is a `DiskTable`: every file holding a piece of the table (whole, or its shards, in one file or
many) is opened read only, and a lookup reads just the rows it needs with positional reads
(``os.preadv``) into the process's own buffers. Nothing reads the whole table; the kernel's page
cache holds what was read recently (it is not the process's own memory, and the kernel gives it
back under pressure), and
a bounded cache of rows in the process's memory (`RowCache`, ``cache_bytes``) keeps hot rows
across steps whatever the page cache does. It is a ``ple.table.Table``: ``forward``, ``step``,
``start_prefetch`` and the transformers patch use it as any other table.

A lookup (``table.rows``, through `DiskTable.gather`, on the host):

1. the ids ``[T, NH]`` are deduplicated (``torch.unique``), so a row wanted twice is read once;
2. the cache is asked for the distinct rows; those it lacks (misses) are read from the files,
   sorted by file and offset, neighbours in the same or adjacent 4 KiB pages read by one request,
   ``READ_DEPTH`` (64) requests in flight from as many reader threads (a cold read waits on the
   disk, which serves many at once: ``ple.io.disk_table._reads``); the file's pages are never mapped into the
   process, so they do not count in its resident memory;
3. the misses enter the cache, evicting the least recently used rows of their sets (below);
4. the rows are put back in the ids' order and moved to the ids' device; an FP8, int8 or NF4 table
   is dequantized there, by the formula of the in-memory table (``ple.quant``; NF4 rows are
   unpacked by the backend's unpacker, as in memory).

So the rows are the in-memory table's bit for bit: every step is a copy, and dequantization is
the same elementwise formula. FP8 per-tensor and int8 per-row scales are held in memory (int8:
4 bytes a row). An NF4 table's rows are read, cached and moved packed (``D/2 + 4`` bytes a row,
uint8, its float16 scale inside: 84 bytes at D = 160, against 160 for FP8); each row read from
the files has its scale checked finite (as ``load_layer`` checks every row when it reads the
whole table): a NaN or infinite scale is a ``ValueError`` naming the key, the row and the file,
raised before anything is cached. ``layer.start_prefetch`` runs steps 1-3 in the prefetch worker
thread (with or without CUDA; ``ple.offload.start_gather``), so the reads overlap the layers
before this one.

The cache (`RowCache`, ``ple.io.disk_table.row_cache``): ``cache_bytes`` bounds its memory, rows and their
bookkeeping together; rows are kept in the table's stored dtype (NF4: packed rows, so a row
costs ``D/2 + 4`` bytes); it is 16-way set associative, least recently used within a set.
``table.stats()`` counts what happened (``bytes_read``: the stored bytes, packed for NF4).

Safety (``ple.io.disk_table.mapped``): the files are opened (and mapped, for their headers) read only and never
written; each is checked when opened (header and size) and before every read (size and modification
time), so a file truncated or changed after loading is a ``ValueError`` naming it, not a crash; one cut
while its rows are being read gives a short read, a ``ValueError`` naming it too.

A `DiskTable` has no gradient tensor and its ``state_dict`` holds only the scales. It trains only through
an overlay (``load_layer(..., overlay=DIR)``, ``ple.io.disk_table.training``): a row optimizer (``ple.optim``)
writes the rows it changes, and their state, to an overlay store in DIR, and lookups read them from there;
`flush` makes it durable. ``weight`` is a meta tensor that says the table's shape and dtype as the in-memory table's
``weight`` would (``[rows, D]``; NF4: uint8 ``[rows, D/2 + 4]``, with `dim` D), so anything that would
read the values from it fails loudly, and the values stay in the files.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, cast

import torch

from ... import _checks
from ..._deprecation import deprecated_parameter
from ...offload import start_gather
from ...quant import scheme_of
from ...table import is_float_table, row_grad_lookup
from ..files import Checkpoint, dtype_name, human_bytes
from ._reads import READ_DEPTH, pread_rows
from .mapped import READ_THREADS, MappedFile, TablePiece
from .row_cache import CACHE_WAYS, SLOT_OVERHEAD, RowCache
from .training import OverlayTraining

if TYPE_CHECKING:
    from torch.types import Device

    from ...backends import CustomOps
    from ..layout import LayerPlan

__all__ = ["DiskTable", "RowCache", "DISK_CACHE_BYTES", "CACHE_WAYS", "READ_THREADS", "READ_DEPTH"]

DISK_CACHE_BYTES = 256 << 20
"""Default ``cache_bytes`` of ``load_layer(..., offload="disk")``: the row cache's memory."""

_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

# ---- the table ------------------------------------------------------------------------------------------------
_COUNTERS = ("gathers", "rows", "unique_rows", "hits", "misses", "rows_read", "bytes_read", "evictions")


class DiskTable(OverlayTraining):
    """A table whose rows stay in the checkpoint's safetensors files, read in place (positional reads).

    Build it with ``ple.io.load_layer(path, offload="disk", cache_bytes=N)`` (or
    `DiskTable.from_checkpoint`); see the module docstring for how lookups, the cache and the
    safety checks work. ``weight`` is a meta tensor ``[rows, D]`` of the table's dtype (the
    stored one for FP8 / int8, the layer's for a float table, as the in-memory table would
    have; NF4: uint8 ``[rows, D/2 + 4]``, the packed rows' shape, and `dim` is D);
    ``weight_scale`` (FP8 and int8 tables) is a real buffer: the FP8 scale moves with the
    layer (``layer.to(device)``), int8 per-row scales stay in host memory with the rows' cache;
    an NF4 table has none (each row holds its scale).
    Moving or casting the layer changes no file: a float table's rows are cast to the layer's
    dtype as they are looked up. A float table with an overlay takes no float dtype but its
    overlay's: ``layer.to(dtype)`` to another is a ``ValueError`` naming ``dtype``, and nothing
    is changed (the overlay's rows keep their dtype: it is chosen when the overlay is made).

    `stats` (this class only; other tables have none) counts the lookups, `reset_stats` zeroes the
    counters, `clear_cache` empties the cache, `drop_page_cache` asks the kernel to forget the
    files' pages (for cold measurements), `close` releases the files.
    """

    def __init__(self, pieces: Sequence[TablePiece], files: Sequence[MappedFile], *, num_rows: int, dim: int,
                 stored_dtype: torch.dtype, value_dtype: torch.dtype | None = None,
                 weight_scale: torch.Tensor | None = None, cache_bytes: int = DISK_CACHE_BYTES,
                 ways: int = CACHE_WAYS) -> None:
        _checks.int_arg("cache_bytes", cache_bytes, minimum=0)
        _checks.int_arg("ways", ways, minimum=1)
        super().__init__()
        self._pieces = [p for p in pieces if p.stop > p.start]
        self._files = list(files)
        self._stored = stored_dtype
        self._value = stored_dtype if value_dtype is None or scheme_of(stored_dtype) else value_dtype
        self._dim = dim
        scheme = scheme_of(stored_dtype)
        width = scheme.weight_width(dim) if scheme is not None else dim                  # NF4: D/2 + 4 bytes
        self.weight = torch.empty((num_rows, width), dtype=self._value, device="meta")   # not a buffer
        if weight_scale is not None:
            self.register_buffer("weight_scale", weight_scale)
        row_bytes = width * stored_dtype.itemsize
        u = next(u for u in _UNITS if row_bytes % u == 0 and all(p.offset % u == 0 for p in self._pieces))
        self._unit, self._units, self._row_bytes = _UNITS[u], row_bytes // u, row_bytes
        self._map_pieces(num_rows)
        capacity = cache_bytes // (row_bytes + SLOT_OVERHEAD)
        self._cache = RowCache(capacity, self._units, self._unit, ways=ways,
                               small_ids=num_rows < 2**31) if capacity else None
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._closed = False
        self._overlay = None

    def _map_pieces(self, num_rows: int) -> None:
        """Where each row is: row ``r`` of piece ``k`` is the ``row_bytes`` bytes at ``origin[k] + r * row_bytes``
        of file ``file_of[k]`` (an index into ``_files``). Rows of shards written one after the other (as
        ``ple.io.save`` writes them) are neighbours in their file, so a gather's reads coalesce across shards."""
        rb = self._row_bytes
        index = {id(f): i for i, f in enumerate(self._files)}
        self._piece_starts = torch.tensor([p.start for p in self._pieces] + [num_rows], dtype=torch.int64)
        self._origin = torch.tensor([p.offset - p.start * rb for p in self._pieces], dtype=torch.int64)
        self._file_of = torch.tensor([index[id(p.file)] for p in self._pieces], dtype=torch.int64)
        keys: dict[int, list[str]] = {}
        for p in self._pieces:
            keys.setdefault(index[id(p.file)], []).append(p.key)
        self._file_keys = [k[0] + (f" (and {len(k) - 1} more)" if len(k) > 1 else "")      # errors name them
                           for k in (keys.get(i, ["table rows"]) for i in range(len(self._files)))]

    # ---- building ----------------------------------------------------------------------------------------
    @classmethod
    @deprecated_parameter("block_rows", "rows_per_block", since="0.1.0")
    def from_checkpoint(cls, ckpt: Checkpoint, plan: LayerPlan, *, dtype: torch.dtype | None = None,
                        cache_bytes: int = DISK_CACHE_BYTES, device: Device = None,
                        rows_per_block: int = 1 << 20) -> DiskTable:
        """The table of ``plan`` (``ple.io.layout.plan_layer``, so already checked) mapped from its files.

        ``dtype``: the layer's dtype, what a float table's rows are cast to (default: the
        stored one). ``device``: where an FP8 table's scale goes (the layer's device). int8
        per-row scales are read into host memory, ``rows_per_block`` at a time (the keyword
        ``block_rows=`` still works and warns: deprecated). An NF4 table's rows
        (``D/2 + 4`` bytes each, scales inside) are all left in the files.
        """
        width = plan.scheme.weight_width(plan.dim) if plan.scheme is not None else plan.dim    # NF4: D/2 + 4
        files: dict[Path, MappedFile] = {}
        pieces = []
        try:
            for tp in plan.pieces:
                info = ckpt.info(tp.key)
                path = info.file
                if path not in files:
                    files[path] = MappedFile(path)
                mf = files[path]
                begin, _ = mf.span(tp.key, plan.table_dtype, (tp.stop - tp.start, width))
                pieces.append(TablePiece(tp.start, tp.stop, tp.key, mf, begin))
            scale = None
            if plan.scheme is None or plan.scheme.packed:               # float, or NF4: the scales are in the rows
                pass
            elif plan.scheme.per_row:
                scale = torch.empty((plan.num_rows, 1), dtype=torch.float32)
                for tp in plan.pieces:
                    for a in range(tp.start, tp.stop, rows_per_block):
                        b = min(a + rows_per_block, tp.stop)
                        scale[a:b].copy_(ckpt.read(cast(str, tp.scale_key), a - tp.start, b - tp.start))
            else:
                scale = ckpt.read(cast(str, plan.scale_key)).reshape(1).to(device, copy=True)   # not a view of a map
            return cls(pieces, list(files.values()), num_rows=plan.num_rows, dim=plan.dim,
                       stored_dtype=plan.table_dtype, value_dtype=dtype, weight_scale=scale,
                       cache_bytes=cache_bytes)
        except BaseException:
            for mf in files.values():
                mf.close()
            raise

    # ---- what it holds -------------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        """D, the values per row (an NF4 row stores them in ``D/2 + 4`` bytes)."""
        return self._dim

    @property
    def files(self) -> list[Path]:
        """The files the table is read from."""
        return [f.path for f in self._files]

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype of the rows in the files (and in the cache)."""
        return self._stored

    @property
    def cache(self) -> RowCache | None:
        """The row cache (None with ``cache_bytes=0``)."""
        return self._cache

    def extra_repr(self) -> str:
        nbytes = self.num_rows * self._row_bytes
        nf4 = " (nf4)" if self._packed else ""
        over = "" if self._overlay is None else f", overlay={str(self._overlay.store.directory)!r}"
        return (f"{self.num_rows}, {self.dim}, dtype={dtype_name(self._stored)}{nf4}, {human_bytes(nbytes)} in "
                f"{len(self._files)} file(s), cache={human_bytes(self._cache_bytes)}{over}")

    def stats(self) -> dict[str, int | float]:
        """What the lookups did since the table was made (or `reset_stats`), prefetches included.

        ``gathers``: lookups and prefetches; ``rows``: rows asked for (``T * NH`` each, repeats
        counted); ``unique_rows``: distinct rows among them (each gather's own); ``hits``: those
        found in the cache; ``misses``: those read from the files (``rows_read``, the same
        count; ``bytes_read`` their bytes); ``hit_rate``: hits / unique rows; ``evictions``:
        cached rows replaced; ``cached_rows`` / ``capacity_rows``: the cache now and at most;
        ``cache_bytes``: the bound it was given.
        """
        with self._lock:
            out: dict[str, int | float] = dict(self._counts)
            out["hit_rate"] = out["hits"] / out["unique_rows"] if out["unique_rows"] else 0.0
            out["cached_rows"] = len(self._cache) if self._cache is not None else 0
            out["capacity_rows"] = self._cache.capacity if self._cache is not None else 0
            out["cache_bytes"] = self._cache_bytes
        return out

    def reset_stats(self) -> None:
        """Zero the counters of `stats` (the cache keeps its rows)."""
        with self._lock:
            self._counts = dict.fromkeys(_COUNTERS, 0)

    def clear_cache(self) -> None:
        """Empty the row cache."""
        with self._lock:
            if self._cache is not None:
                self._cache.clear()

    def drop_page_cache(self) -> None:
        """Ask the kernel to drop the files' pages from the page cache (this process's mapped pages first),
        so the next reads come from the disk: for cold measurements. A hint the kernel may ignore."""
        with self._lock:
            for f in self._files:
                f.drop_page_cache()

    def close(self) -> None:
        """Release the mappings and files, and the overlay and its lock, with no flush (updates since the last
        `flush` are dropped; a ``with`` block flushes first: `__exit__`); a lookup after is a ``RuntimeError``."""
        with self._lock:
            self._closed = True
            for f in self._files:
                f.close()
            if self._overlay is not None:
                self._overlay.close()

    # ---- lookups --------------------------------------------------------------------------------------------------
    def gather(self, ids: torch.Tensor, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stored rows of host ids ``[T, NH]``: ``(rows [T, NH * D] in the stored dtype, row_scale)``.

        As ``ple.quant.gather_raw`` gives them: ``row_scale`` is None (float), the FP8 scale
        ``[1]`` or the int8 rows' scales ``[T, NH]``; NF4 rows are packed, uint8
        ``[T, NH * (D/2 + 4)]``, with ``row_scale`` None. ``pin``: into pinned memory (for a copy
        to a GPU). Ids outside ``[0, rows)`` are a ``ValueError`` naming ``ids``; a file changed
        since it was mapped is a ``ValueError`` naming it, and so is an NF4 row read with a scale
        that is not finite (naming its key and row too): nothing is cached, nothing changed.
        """
        T, NH = ids.shape
        W = self.weight.shape[1]                                         # D, or an NF4 row's D/2 + 4 bytes
        flat = ids.reshape(-1).to(torch.int64)
        out = torch.empty((flat.numel(), self._units), dtype=self._unit, pin_memory=pin)
        if flat.numel():
            uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
            lo, hi = int(uniq[0]), int(uniq[-1])
            if lo < 0 or hi >= self.num_rows:
                raise ValueError(f"ids: rows must lie in [0, {self.num_rows}), got min {lo} and max {hi}")
            with self._lock:
                urows = self._distinct_rows(uniq)
                self._counts["rows"] += flat.numel()
            torch.index_select(urows, 0, inverse, out=out)
        rows = out.view(torch.uint8).view(self._stored).view(T, NH * W)
        scale = self.scale
        if scale is not None and scale.dim() == 2:                      # int8: per-row scales, in memory
            row_scale = torch.empty(flat.numel(), dtype=torch.float32, pin_memory=pin)
            torch.index_select(scale.view(-1), 0, flat, out=row_scale)
            return rows, row_scale.view(T, NH)
        return rows, scale

    def _distinct_rows(self, uniq: torch.Tensor) -> torch.Tensor:
        """Rows of sorted distinct ids ``[n]`` as ``[n, units]``: hits from the cache, misses read. Holds the lock."""
        if self._closed:
            raise RuntimeError("DiskTable: the table was closed; load the layer again")
        n = uniq.numel()
        cache = self._cache
        if cache is not None:
            sets, slots = cache.find(uniq)
            hit = slots >= 0
            hit_idx, miss_idx = hit.nonzero().squeeze(1), (~hit).nonzero().squeeze(1)
            miss_ids = uniq.index_select(0, miss_idx)
        else:
            miss_ids = uniq
        misses = self._read(miss_ids)                     # checks the files first: may raise, nothing changed
        if self._packed:
            self._check_scales(miss_ids, misses)          # may raise, nothing changed
        if cache is None:
            urows = misses
            hits = 0
            evicted = 0
        else:
            urows = torch.empty((n, self._units), dtype=self._unit)
            hit_slots = slots.index_select(0, hit_idx)
            hits = hit_idx.numel()
            if hits:
                urows.index_copy_(0, hit_idx, cache.store.index_select(0, hit_slots))
            if miss_idx.numel():
                urows.index_copy_(0, miss_idx, misses)
            evicted = cache.update(hit_slots, miss_ids, sets.index_select(0, miss_idx), misses)
        c = self._counts
        c["gathers"] += 1
        c["unique_rows"] += n
        c["hits"] += hits
        c["misses"] += miss_ids.numel()
        c["rows_read"] += miss_ids.numel()
        c["bytes_read"] += miss_ids.numel() * self._row_bytes
        c["evictions"] += evicted
        return urows

    def _read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of sorted distinct ids from the files, ``[n, units]``: each file checked first, then the rows read
        with 64 positional reads in flight (an ``io_uring``, else reader threads) into a buffer of this call
        (``ple.io.disk_table._reads.pread_rows``)."""
        out = torch.empty((ids.numel(), self._units), dtype=self._unit)
        if not ids.numel():
            return out
        piece = torch.searchsorted(self._piece_starts, ids, right=True) - 1
        checked = set()
        for k in torch.unique(piece).tolist():                           # before any byte of a file is read
            p = self._pieces[k]
            if id(p.file) not in checked:
                p.file.check(p.key)
                checked.add(id(p.file))
        offsets = self._origin.index_select(0, piece) + ids * self._row_bytes
        pread_rows(self._files, self._file_of.index_select(0, piece), offsets, self._row_bytes, out,
                   what=self._file_keys)
        return out

    def _check_scales(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """NF4 rows ``[n, units]`` just read (sorted ids ``[n]``) must hold finite float16 scales: else a
        ``ValueError`` naming the key, the row (of that key) and the file."""
        raw = rows.view(torch.uint8)
        half = raw.shape[1] - 4                                          # the scale: bytes D/2 (low), D/2 + 1
        bad = ((raw[:, half + 1] & 0x7C) == 0x7C).nonzero()              # exponent all ones: inf or NaN
        if not bad.numel():
            return
        i = int(bad[0])
        r = int(ids[i])
        p = self._pieces[int(torch.searchsorted(self._piece_starts, torch.tensor(r), right=True)) - 1]
        value = float(raw[i, half: half + 2].contiguous().view(torch.float16))
        raise ValueError(f"{p.key}: row {r - p.start}'s NF4 scale is {value} (bytes {half}, {half + 1} of the row), "
                         f"expected a finite float16; a damaged file? (in {p.file.path})")

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype, *, ops: ModuleType | CustomOps,
               validate: bool = True) -> torch.Tensor:
        """`rows` without a prefetch: gathered now, on the host, then turned into values on ``ids``'s device
        (NF4 rows unpacked by ``ops``'s unpacker where it has one, as in memory; ``ops`` gathers nothing)."""
        _checks.index("ids", ids, ndim=2)

        def values() -> torch.Tensor:
            cuda = ids.device.type == "cuda"
            rows, scale = self.gather(ids.to("cpu"), cuda)               # range-checked there, always
            rows = rows.to(ids.device, non_blocking=cuda)
            if scale is not None:
                scale = scale.to(ids.device, non_blocking=cuda and scale.is_pinned())
            return self._overlaid(ids, self._values_on(ops, rows, scale, dtype))

        return row_grad_lookup(self, ids, values, ops) if self._trains_by_rows() else values()

    def _values(self, rows: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if self.quantized:                             # FP8 / int8 / NF4: as the in-memory table
            return super()._values(rows, scale, dtype)
        return rows.to(self._value).to(dtype)          # as the in-memory table: cast to the layer's dtype first

    def prefetch(self, ids: torch.Tensor, device: torch.device) -> None:
        """Start reading the rows of ``ids`` ``[T, NH]`` in the prefetch worker (``ple.offload.start_gather``)."""
        self._pending = start_gather(self.gather, ids, torch.device(device))

    # ---- placement ------------------------------------------------------------------------------------------------
    def offload_(self, *, pin: bool | None = None) -> DiskTable:
        """Nothing to do: the table is already out of device memory (in its files). Returns self."""
        self._pending = None
        return self

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> DiskTable:
        # No file changes: a float table takes the new dtype for its lookups (as the in-memory table's values
        # would be cast), an FP8 scale moves with the layer (bit for bit), int8 per-row scales stay on the host.
        if is_float_table(self._value) and scheme_of(self._stored) is None:
            value, overlay = fn(torch.empty(0, dtype=self._value)).dtype, self._overlay
            if overlay is not None and value not in (self._value, overlay.dtype):     # (the layer's first module)
                raise ValueError(f"dtype: the table trains through an overlay of {overlay.dtype} rows "
                                 f"({overlay.store.directory}), which stay {overlay.dtype} under a {value} layer. "
                                 f"Nothing was changed: cast to {overlay.dtype}, or load with dtype={value} and a "
                                 f"new overlay to train {value} rows")
            self._value = value
            self.weight = torch.empty(tuple(self.weight.shape), dtype=self._value, device="meta")
        scale = self.scale
        if scale is not None and scale.dim() == 1:
            self._buffers["weight_scale"] = fn(scale.view(torch.int32)).view(torch.float32)
        return self


