"""Moved to ``ple.io.disk_table.training`` (training through an overlay; the disk table's package:
``ple.io.disk_table``).

This old path works for one more release: every name read through it raises a ``DeprecationWarning`` and is
the new module's own object (``ple._deprecation.moved_module``). Import from ``ple.io.disk_table.training`` instead.
"""

from .._deprecation import moved_module

__all__ = [  # noqa: F822 (read through __getattr__)
    "TableOverlay", "OverlayTraining", "check_overlay_args", "base_fingerprint", "sample_ids", "OVERLAY_BYTES",
    "SAMPLE_ROWS"]

__getattr__, __ple_moved__ = moved_module(__name__, "ple.io.disk_table.training", since="0.1.0")
