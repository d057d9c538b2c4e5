"""The ``"torch"`` backend: the ops of ``ple.reference`` vectorised in eager PyTorch (SPEC section 7).

Same names, signatures and docstrings as ``ple.reference`` (``ple.backends.twin``), the same
rounding points, so in bfloat16 it equals the reference (and transformers) bit for bit; conv
states are equal bit for bit in every dtype. Unlike the reference, nothing here reads a tensor's
values on the host once the checks have run (``validate=False`` skips those too): requests are
found with ``torch.searchsorted`` on the device offsets, conv histories are gathered with index
arithmetic, and state writes have a fixed shape. So a serving step makes no device-to-host
synchronisation and ``torch.compile(fullgraph=True)`` traces the layer and its step (the one host
read left is of CPU tensors: the blocked CPU forward reads its sequence offsets). This is
the default of ``backend="auto"`` where Triton cannot run compiled (the CPU).

Speed on a CPU comes from few, large ops and small temporaries: the norms without ``pow`` or
mixed-dtype ops, the gate and the whole-sequence forward in blocks of rows whose float32
temporaries are buffers reused from block to block (``gate.BlockGate``), the conv as shifted-slice multiply-adds with an
``autograd.Function`` backward, the hash as one window gather, a decode step in a fixed number of
ops; under ``torch.compile`` formulations inductor fuses without recomputation (see the modules).
In float32 and float64 the forward rounds as the reference does too (blocks keep vector lanes,
products and adds are rounded separately), so it matches bit for bit but for an occasional last bit
of a ``silu`` run on a differently shaped tensor; gradients are within the tolerance.
"""

from ..reference.gate import grouped_rms_norm
from ..reference.hashing import HashParams, hash_params, splitmix64
from .conv import export_conv_checkpoints, ple_conv
from .embedding import embedding_lookup, ngram_embedding
from .gate import ple_gate
from .hashing import ngram_ids
from .prefill import ple_prefill
from .training_conv import dilated_causal_conv

__all__ = [
    "HashParams", "hash_params", "splitmix64", "ngram_ids", "embedding_lookup", "ngram_embedding",
    "grouped_rms_norm", "ple_gate", "ple_conv", "export_conv_checkpoints", "dilated_causal_conv", "ple_prefill",
]
