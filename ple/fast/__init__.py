"""Triton kernels with the names and signatures of ``ple.reference``.

Each public function validates its arguments with the same checks as its
reference twin (``ple._checks``), then launches kernels that load, compute in
float32 and cast on store. Host-side parameters (``hash_params``) are shared
with the reference. On a machine without CUDA the kernels run under
``TRITON_INTERPRET=1``.
"""

from ..reference.gate import grouped_rms_norm
from ..reference.hashing import HashParams, hash_params, splitmix64
from .conv import dilated_causal_conv, export_conv_checkpoints, ple_conv
from .embedding import embedding_lookup
from .gate import ple_gate
from .hashing import ngram_embedding, ngram_ids

__all__ = [
    "HashParams", "hash_params", "splitmix64", "ngram_ids", "embedding_lookup", "grouped_rms_norm",
    "ple_gate", "ple_conv", "export_conv_checkpoints", "dilated_causal_conv",
    "ngram_embedding",  # extra of ple.fast: hash + gather in one kernel
]
