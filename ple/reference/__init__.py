"""The reference ops (``backend="reference"``): this package *is* the specification of every op.

One plain function per op, written to be read: per-request Python loops where a loop says it
best, index tensors read on the host (``.tolist()``), each rounding point of the model marked
and cited (SPEC section 8). In bfloat16 it equals transformers' ``Qwen4ExpTextPLELayer`` bit
for bit. It makes no speed promise, is not free of device-to-host synchronisation and may break
``torch.compile`` graphs: that is what ``ple.vectorized`` (``"torch"``, the same math and bits
in vectorised eager PyTorch) and ``ple.fast`` (``"triton"``) are for. Both mirror these names,
signatures and docstrings one for one and are tested against this package.

``ngram_embedding`` and ``ple_prefill`` are compositions of the other ops (SPEC section 7).
"""

from .conv import export_conv_checkpoints, ple_conv
from .embedding import embedding_lookup, ngram_embedding
from .gate import grouped_rms_norm, ple_gate
from .hashing import HashParams, hash_params, ngram_ids, splitmix64
from .prefill import ple_prefill
from .training_conv import dilated_causal_conv

__all__ = [
    "HashParams", "hash_params", "splitmix64", "ngram_ids", "embedding_lookup", "grouped_rms_norm",
    "ple_gate", "ple_conv", "export_conv_checkpoints", "dilated_causal_conv",
    "ngram_embedding",  # the composition ngram_ids -> embedding_lookup, as one op (ple.fast fuses it)
    "ple_prefill",      # the composition gate -> mask -> conv -> adds, as one op (ple.fast fuses it)
]
