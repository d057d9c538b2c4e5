"""Moved to ``ple.io.disk_table.overlay`` (the overlay store; the disk table's package: ``ple.io.disk_table``).

This old path works for one more release: every name read through it raises a ``DeprecationWarning`` and is
the new module's own object (``ple._deprecation.moved_module``). Import from ``ple.io.disk_table.overlay`` instead.
"""

from .._deprecation import moved_module

__all__ = [  # noqa: F822 (read through __getattr__)
    "OverlayStore", "SLOT_OVERHEAD", "MAX_SEGMENTS", "FENCE_EVERY", "CHUNK_BYTES", "FIXED_BYTES",
    "MEMORY_CONSTANTS"]

__getattr__, __ple_moved__ = moved_module(__name__, "ple.io.disk_table.overlay", since="0.1.0")
