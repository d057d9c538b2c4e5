"""The one switch between ``ple.reference`` and ``ple.fast``."""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType

import torch

__all__ = ["resolve_backend", "backend_module", "triton_available", "triton_compiled_available", "CustomOps",
           "OP_NAMES"]

BACKENDS = ("reference", "triton", "auto")

OP_NAMES = ("ngram_ids", "embedding_lookup", "ple_gate", "ple_conv", "export_conv_checkpoints",
            "dilated_causal_conv")
"""The ops a `PLELayer` calls (SPEC section 7); ``PLELayer(ops=...)`` needs each of them."""


class CustomOps:
    """The user's ops for ``PLELayer(ops=...)``: any object (a module, a namespace, a class instance)
    with the `OP_NAMES` attributes, each with the signature of the ``ple.reference`` op of that name.

    The layer calls its ops with ``validate=False`` where it checked the values itself (SPEC section 7
    does not list ``validate``): a function that takes no ``validate`` keyword is called without it.
    Ops the layer does not call (``hash_params``, ``grouped_rms_norm``) come from ``ple.reference``.
    """

    def __init__(self, ops):
        missing = [n for n in OP_NAMES if not callable(getattr(ops, n, None))]
        if missing:
            raise TypeError(f"ops: expected an object with the ops {', '.join(OP_NAMES)}; "
                            f"{type(ops).__name__} lacks {', '.join(missing)}")
        self.wrapped = ops
        for name in OP_NAMES:
            setattr(self, name, _drop_validate(getattr(ops, name)))
        from . import reference
        self.hash_params, self.grouped_rms_norm = reference.hash_params, reference.grouped_rms_norm

    def __repr__(self) -> str:
        return f"CustomOps({getattr(self.wrapped, '__name__', type(self.wrapped).__name__)})"


def _drop_validate(fn):
    import inspect
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn
    if "validate" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn

    @functools.wraps(fn)
    def call(*args, validate=True, **kwargs):
        return fn(*args, **kwargs)
    return call


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
