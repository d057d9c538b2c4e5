"""Triton kernels with the names and signatures of ``ple.reference``.

One module per part, mirroring the reference: ``hashing``, ``embedding``, ``gate``,
``conv`` (the serving step; its fused decode / spec kernel in ``conv_decode``),
``training_conv``, ``prefill`` (gate + conv + adds of whole requests in one pass) and
``table_update`` (the row optimizers' step, ``ple.optim``). Each
holds, in this order, its kernels, their launchers and the op's registration with
``torch.library`` (``torch.ops.ple.*``, through ``_library.register``) so ``torch.compile`` traces the
layer without graph breaks. The public functions take the signature and docstring of
their reference twin (``_library.twin``); each checks the call's metadata
(``ple._checks.<op>_meta``) before dispatch, and the registered op checks the index
values at run time (``ple._checks.<op>_values``), see ``ple._checks``, unless the call passes
``validate=False``: then the op reads no value on the host (grids come from shapes, tiles are
found on the device), so it makes no device-to-host synchronisation. Kernels load,
compute in float32 (float64 for float64 inputs) and round on store with the shared
``_numerics``. Host-side parameters (``hash_params``) are shared with the reference.
On a machine without CUDA the kernels run under ``TRITON_INTERPRET=1``.
"""

from ..reference.gate import grouped_rms_norm
from ..reference.hashing import HashParams, hash_params, splitmix64
from .conv import export_conv_checkpoints, ple_conv
from .embedding import embedding_lookup
from .gate import ple_gate
from .hashing import ngram_embedding, ngram_embedding_nf4, ngram_ids
from .prefill import ple_prefill, prefill_conv_inputs
from .table_update import table_update
from .training_conv import dilated_causal_conv

__all__ = [
    "HashParams", "hash_params", "splitmix64", "ngram_ids", "embedding_lookup", "grouped_rms_norm",
    "ple_gate", "ple_conv", "export_conv_checkpoints", "dilated_causal_conv",
    "ple_prefill",      # gate, mask, conv, silu and both residual adds in one pass (reference: their composition)
    "ngram_embedding",  # hash + gather in one kernel (reference: their composition)
    "prefill_conv_inputs",  # the conv inputs ple_prefill's state kernel writes (the serving replay's oracle)
    "ngram_embedding_nf4",  # not an op: hash, gather and unpack of an NF4 table's rows in one kernel
    "table_update",     # one row-wise optimizer step on the rows a step looked up (ple.optim, section 11)
]

FUSED_KV_PROJECTION = True
"""The layer projects with one GEMM over ``cat([key_proj.weight, value_proj.weight])`` (``PLELayer.project``)."""

CHECKS_VALUES_WHEN_COMPILED = True
"""The value checks run inside the registered ops, at run time, so a compiled graph keeps them."""
