"""Every memory budget of a disk table, in one place: `memory_budget`, `merge_budget`, `MEMORY_CONSTANTS`.

A layer whose table is a `DiskTable` (``load_layer(path, offload="disk", cache_bytes=C, overlay=DIR,
overlay_bytes=O)``) holds in its process's anonymous memory (``RssAnon``, not the file pages the kernel caches)
at most, at every moment of training (lookups, optimizer steps, spills, flushes, the overlay's merges):

=====================  ===================================================================================
part                   bytes
=====================  ===================================================================================
row cache              ``C`` (rows in their stored dtype and 16 bytes of bookkeeping each, `RowCache`)
scales                 an int8 table's per-row float32 scales (4 bytes a row); none for float, FP8, NF4
reader threads         `READER_BYTES`: the stacks and allocator arenas of the `READ_DEPTH` reader threads
overlay                ``O`` (rows in memory, their state and ``SLOT_OVERHEAD`` each, hash index included)
overlay index          the bitmap of trained rows (1 bit a table row) + the fences (1/16 byte a row on disk)
overlay constant       ``FIXED_BYTES``: chunks in flight in flushes and merges, segment bookkeeping, what the
                       C allocator keeps of freed temporaries
=====================  ===================================================================================

plus the layer's other parameters and their optimizer state, and the step's own tensors (activations,
gradients, the ids and rows of the step, the reads' scratch of the rows it misses): what the same step costs
on a table in memory, less the table. Nothing grows with the rows trained but the fences, 1/16 byte a row on
disk (16 MB at 256M rows).

``merge`` (``ple.io.merge``) of the base and the overlay, in a process of its own or after the layer is
closed: `merge_budget`, the overlay's index and constant (opened read only, nothing in memory) and
``MERGE_BLOCKS`` blocks of ``block_bytes``: the block being written (in the output dtype) and the next one
being made beside it (``ple.io._pipeline``: the base's block as float32, it put back in the output dtype, the
overlay's rows of the block).

Checked in a fresh process that trains a whole disk layer far past its overlay's budget, flushes and merges
(tests/io/test_disk_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from ..files import human_bytes
from ._reads import READ_DEPTH
from .overlay.store import FENCE_EVERY, FIXED_BYTES, SLOT_OVERHEAD
from .row_cache import SLOT_OVERHEAD as CACHE_SLOT_OVERHEAD

if TYPE_CHECKING:
    from .table import DiskTable

__all__ = ["MemoryBudget", "memory_budget", "merge_budget", "READER_BYTES", "MERGE_BLOCKS", "MEMORY_CONSTANTS"]

READER_BYTES = 16 << 20
"""The reader threads' own memory: `READ_DEPTH` threads' touched stack pages and the per-thread arenas the C
allocator gives threads that allocate (the reads' buffers are the caller's: the step's tensors)."""

MERGE_BLOCKS = 4
"""Blocks of ``block_bytes`` a merge holds at once (see the module docstring)."""

MEMORY_CONSTANTS = {"READER_BYTES": READER_BYTES, "READ_DEPTH": READ_DEPTH, "MERGE_BLOCKS": MERGE_BLOCKS,
                    "CACHE_SLOT_OVERHEAD": CACHE_SLOT_OVERHEAD, "OVERLAY_SLOT_OVERHEAD": SLOT_OVERHEAD,
                    "FENCE_EVERY": FENCE_EVERY, "FIXED_BYTES": FIXED_BYTES}
"""Every constant of the budgets, by name (the overlay's own: ``ple.io.disk_table.overlay.MEMORY_CONSTANTS``)."""


@dataclass(frozen=True)
class MemoryBudget:
    """The parts of a disk table's memory budget, in bytes (the module docstring says what each holds);
    `total` is their sum, the bound on the process's anonymous memory beyond its baseline, the layer's other
    parameters and state and the step's own tensors."""

    row_cache: int
    scales: int
    reader_threads: int
    overlay: int
    overlay_index: int
    overlay_constant: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, int]:
        """The parts and ``total``, by name."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "total": self.total}

    def __str__(self) -> str:
        return "\n".join(f"{name:<17} {human_bytes(n):>10}" for name, n in self.as_dict().items())


def _index_bytes(table_rows: int, rows_on_disk: int) -> int:
    return (table_rows + 7) // 8 + 8 * (rows_on_disk // FENCE_EVERY + 1)


def memory_budget(table: DiskTable, *, rows_on_disk: int | None = None) -> MemoryBudget:
    """The memory budget of ``table`` now: its row cache's ``cache_bytes``, its scales, the reader threads,
    and, if it trains through an overlay, the overlay's ``overlay_bytes``, index and constant.

    ``rows_on_disk``: the overlay rows on disk to size the fences for (default: those it has now; pass the
    most you expect, e.g. the table's rows, for a bound that holds for the rest of a run). A `DiskTable`
    without an overlay has zeros for the overlay's parts.
    """
    from .table import DiskTable
    if not isinstance(table, DiskTable):
        raise TypeError(f"table: expected a DiskTable (load_layer(..., offload='disk')), got {type(table).__name__}")
    scale = getattr(table, "weight_scale", None)
    scales = scale.numel() * scale.element_size() if scale is not None and scale.numel() > 1 else 0
    store = table.overlay
    overlay = index = constant = 0
    if store is not None:
        st = store.stats()
        on_disk = st["rows"] if rows_on_disk is None else rows_on_disk
        overlay = store.capacity * (store.layout.row_bytes + store.slot_overhead)      # <= overlay_bytes
        index, constant = _index_bytes(table.num_rows, on_disk), FIXED_BYTES
    return MemoryBudget(row_cache=int(table.stats()["cache_bytes"]), scales=scales, reader_threads=READER_BYTES,
                        overlay=overlay, overlay_index=index, overlay_constant=constant)


def merge_budget(table_rows: int, rows_on_disk: int, block_bytes: int) -> int:
    """The bound on a merge's anonymous memory beyond its process's baseline (see the module docstring):
    the overlay's index and constant, and `MERGE_BLOCKS` blocks of ``block_bytes``."""
    return _index_bytes(table_rows, rows_on_disk) + FIXED_BYTES + MERGE_BLOCKS * block_bytes
