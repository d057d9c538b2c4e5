"""A table left in its checkpoint's files, read in place and trainable: ``load_layer(path, offload="disk")``.

The checkpoint files themselves (reading, writing, converting, merging) are ``ple.io``'s; this package is what
serves and trains a table from them without holding it in memory. Its parts:

* ``table``: `DiskTable`, the ``ple.table.Table`` whose lookups read rows from the files (deduplicated,
  through the row cache, misses read at the disk's queue depth), and whose updates go to an overlay;
* ``row_cache``: `RowCache`, the bounded, set-associative cache of rows in the process's memory;
* ``_reads`` (and ``_uring``): reads of the missed rows, 64 in flight (an ``io_uring``, else reader threads),
  neighbours coalesced, into buffers the process owns;
* ``mapped``: the files opened read only and checked (header, size, modification time) before every read;
* ``training``: `TableOverlay` / `OverlayTraining`, a row optimizer's steps through the overlay
  (``load_layer(..., overlay=DIR)``), and the base's fingerprint an overlay is tied to;
* ``overlay``: `OverlayStore`, the trained rows and their state: in memory up to a budget, spilled to
  segment files beyond it, its index off the heap, durable at ``flush()``;
* ``budget``: every memory budget in one place: `memory_budget` of a table (row cache, scales, reader
  threads, overlay, its index and constant), `merge_budget`, `MEMORY_CONSTANTS`; ``_heap`` hands the freed heap
  of the overlay's spills and flushes back to the kernel.

(Before this package these lived beside the checkpoint files as ``ple.io.disk``, ``ple.io.row_cache``,
``ple.io.mapped``, ``ple.io.disk_train`` and ``ple.io.overlay``; those paths still work for a release and
warn.)
"""

from .budget import MEMORY_CONSTANTS, MemoryBudget, memory_budget, merge_budget
from .overlay import OverlayStore
from .row_cache import CACHE_WAYS, RowCache
from .table import DISK_CACHE_BYTES, READ_DEPTH, READ_THREADS, DiskTable
from .training import OVERLAY_BYTES, OverlayTraining, TableOverlay

__all__ = ["DiskTable", "RowCache", "OverlayStore", "OverlayTraining", "TableOverlay", "DISK_CACHE_BYTES",
           "OVERLAY_BYTES", "CACHE_WAYS", "READ_DEPTH", "READ_THREADS", "MemoryBudget", "memory_budget",
           "merge_budget", "MEMORY_CONSTANTS"]
