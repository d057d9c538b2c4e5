"""The one switch between ``ple.reference`` and ``ple.fast``."""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType

import torch

__all__ = ["resolve_backend", "backend_module", "triton_available", "triton_compiled_available"]

BACKENDS = ("reference", "triton", "auto")


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Triton is importable and can run here: compiled on CUDA, or interpreted with TRITON_INTERPRET=1."""
    if not _triton_installed():
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def triton_compiled_available() -> bool:
    """Triton can run compiled (not interpreted): Triton is installed and a CUDA device is present."""
    return (_triton_installed() and torch.cuda.is_available()
            and os.environ.get("TRITON_INTERPRET") != "1")


def resolve_backend(backend: str) -> tuple[str, ModuleType]:
    """``"reference"``, ``"triton"`` or ``"auto"`` -> (the name picked, its op module)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if triton_compiled_available() else "reference"
    if backend == "triton":
        if not triton_available():
            raise ValueError("backend: 'triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 to run "
                             "the kernels in the interpreter on the CPU)")
        from . import fast

        return "triton", fast
    from . import reference

    return "reference", reference


def backend_module(name: str) -> ModuleType:
    """The op module of a resolved backend name (``"reference"`` or ``"triton"``), without re-checking."""
    if name == "triton":
        from . import fast

        return fast
    from . import reference

    return reference
