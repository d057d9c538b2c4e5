"""The overlay a disk table trains through: `OverlayStore` (``store``), the rows a row optimizer changed and
their state, in memory up to a budget, spilled to segment files beyond it, durable at a flush.

Its parts: ``store`` (the store and every memory constant, `MEMORY_CONSTANTS`), ``_memory`` (the rows in
memory and their spills), ``_segments`` (finding rows in the segment files), ``_index`` (the index off the
heap: a bitmap of trained rows, fences over each segment's sorted ids, streamed merges), ``_files`` (the
segment and manifest formats, written new, fsynced and switched atomically) and ``_lock`` (one writer per
directory, readers shared).
"""

from .store import CHUNK_BYTES, FENCE_EVERY, FIXED_BYTES, MAX_SEGMENTS, MEMORY_CONSTANTS, SLOT_OVERHEAD, OverlayStore

__all__ = ["OverlayStore", "SLOT_OVERHEAD", "MAX_SEGMENTS", "FENCE_EVERY", "CHUNK_BYTES", "FIXED_BYTES",
           "MEMORY_CONSTANTS"]
