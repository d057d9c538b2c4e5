"""ple: the hashed n-gram embedding (PLE) layer of Qwen4Exp.

* ``ple.reference``: eager PyTorch, the specification of every op.
* ``ple.fast``: Triton kernels with the same names and signatures.
* ``ple.state``: per-request conv-state caches and the step scheduler.
* ``ple.PLELayer``: the layer, on either backend (``backend="reference" | "triton" | "auto"``).
"""

from .config import PRESETS, PLEConfig
from .layer import PLELayer

__all__ = ["PLEConfig", "PRESETS", "PLELayer"]
__version__ = "0.1.0"
