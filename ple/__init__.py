"""ple: the hashed n-gram embedding (PLE) layer of Qwen4Exp.

* ``ple.reference``: eager PyTorch, the specification of every op, written to be read.
* ``ple.vectorized``: the ``"torch"`` backend, the same ops vectorised (sync-free, compile-friendly;
  the CPU default).
* ``ple.fast``: Triton kernels with the same names and signatures (imports Triton, so it
  loads on first use: ``ple.fast`` or ``import ple.fast``).
* ``ple.state``: per-request conv-state caches and the step scheduler.
* ``ple.io``: checkpoints in the model's safetensors layout.
* ``ple.testing``: tolerances, strategies and checkers for testing kernels.
* ``ple.table``: the n-gram table (dense, quantized, host-offloaded; sharded in ``ple.distributed``).
* ``ple.optim``: row-wise optimizers that train the table through the rows a step looked up.
* ``ple.analysis``: what the memory holds and what it does (n-gram statistics, probes, ablations).
* ``ple.PLELayer``: the layer, on any backend (``backend="reference" | "torch" | "triton" | "auto"``).

After a bare ``import ple``, ``ple.reference``, ``ple.vectorized``, ``ple.state``, ``ple.io``,
``ple.testing`` and ``ple.optim`` are usable as attributes (docs/spec.md section 7); ``ple.fast``,
``ple.distributed`` and ``ple.analysis`` are imported when first used.
"""

import importlib
from types import ModuleType

from . import io, optim, reference, state, table, testing, vectorized
from .config import PRESETS, PLEConfig
from .layer import PLELayer

__all__ = ["PLEConfig", "PRESETS", "PLELayer", "reference", "vectorized", "state", "io", "testing", "table",
           "optim"]
__version__ = "0.1.0"

_LAZY = ("fast", "distributed", "analysis")


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
