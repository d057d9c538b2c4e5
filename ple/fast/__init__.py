"""Triton kernels with the names and signatures of ``ple.reference``.

Each public function validates its arguments with the same checks as its
reference twin (``ple._checks`` and the reference's ``check_*``), then launches
kernels that load, compute in float32 and cast on store. The functions exported
here go through ``torch.library`` custom ops (``torch.ops.ple.*``, see
``ple.fast.library``) so ``torch.compile`` traces the layer without graph breaks;
the kernels and their plain launchers live in ``hashing``, ``embedding``, ``gate``
and ``conv``. Host-side parameters (``hash_params``) are shared with the
reference. On a machine without CUDA the kernels run under ``TRITON_INTERPRET=1``.
"""

from ..reference.gate import grouped_rms_norm
from ..reference.hashing import HashParams, hash_params, splitmix64
from .library import (
    dilated_causal_conv,
    embedding_lookup,
    export_conv_checkpoints,
    ngram_embedding,
    ngram_ids,
    ple_conv,
    ple_gate,
)

__all__ = [
    "HashParams", "hash_params", "splitmix64", "ngram_ids", "embedding_lookup", "grouped_rms_norm",
    "ple_gate", "ple_conv", "export_conv_checkpoints", "dilated_causal_conv",
    "ngram_embedding",  # extra of ple.fast: hash + gather in one kernel
]
