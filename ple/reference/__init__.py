"""The eager PyTorch reference: this package *is* the specification of every op.

``ple.fast`` mirrors these names and signatures one for one.
"""

from .conv import export_conv_checkpoints, ple_conv
from .embedding import embedding_lookup
from .gate import grouped_rms_norm, ple_gate
from .hashing import HashParams, hash_params, ngram_ids, splitmix64
from .prefill import ple_prefill
from .training_conv import dilated_causal_conv

__all__ = [
    "HashParams", "hash_params", "splitmix64", "ngram_ids", "embedding_lookup", "grouped_rms_norm",
    "ple_gate", "ple_conv", "export_conv_checkpoints", "dilated_causal_conv",
    "ple_prefill",  # the composition gate -> mask -> conv -> adds, as one op (ple.fast fuses it)
]
