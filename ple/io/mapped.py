"""Moved to ``ple.io.disk_table.mapped`` (the checkpoint's files opened read only; the disk table's package:
``ple.io.disk_table``).

This old path works for one more release: every name read through it raises a ``DeprecationWarning`` and is
the new module's own object (``ple._deprecation.moved_module``). Import from ``ple.io.disk_table.mapped`` instead.
"""

from .._deprecation import moved_module

__all__ = ["MappedFile", "TablePiece", "map_view", "read_rows", "READ_THREADS", "READ_DEPTH"]  # noqa: F822 (read through __getattr__)

__getattr__, __ple_moved__ = moved_module(__name__, "ple.io.disk_table.mapped", since="0.1.0")
