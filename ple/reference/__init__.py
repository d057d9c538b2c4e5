"""The reference ops (``backend="reference"``): this package *is* the specification of every op.

Read it beside ``docs/spec.md`` (``../../docs/spec.md`` from this file), the specification in prose:
section 7 lists every op with its arguments, results and errors, section 8 the rounding points.

One plain function per op, written to be read: per-request Python loops where a loop says it
best, index tensors read on the host (``.tolist()``), each rounding point of the model marked
and cited (docs/spec.md section 8). In bfloat16 it equals transformers' ``Qwen4ExpTextPLELayer``
bit for bit. It makes no speed promise, is not free of device-to-host synchronisation and may
break ``torch.compile`` graphs: that is what ``ple.vectorized`` (``"torch"``, the same math and
bits in vectorised eager PyTorch) and ``ple.fast`` (``"triton"``) are for. Both are tested
against this package.

What the other backends share with this one: the public op names of ``__all__`` below, each with
this package's signature and docstring (``ple.backends.twin``); ``HashParams``, ``hash_params``,
``splitmix64`` and ``grouped_rms_norm`` are this package's own objects, re-exported by both.
``nf4_dequantize_rows`` is not an op and is this package's alone: the readable unpacking of NF4 table
rows (docs/spec.md section 13), which a table uses when its ``ops`` have it (this package); on the
other backends ``ple.quant.dequantize_rows`` unpacks them, vectorised, to the same bits.
What they do not share: the module layout. Each keeps a module per part where that fits
(``hashing``, ``embedding``, ``gate``, ``conv``, ``training_conv``, ``prefill``) but places ops
where its implementation needs them (``ple.fast.ngram_embedding`` is the fused hash-and-gather of
``ple.fast.hashing``) and adds modules of its own for its fast paths and kernels; ``ple.fast`` also
exports ``prefill_conv_inputs``, which has no reference twin.

Every public op checks its call first (``ple._checks``). An op that another one composes
(``ngram_ids``, ``embedding_lookup``, ``grouped_rms_norm``, ``ple_gate``, ``ple_conv``,
``dilated_causal_conv``) then runs its body, a private function of the same name with a leading
underscore. ``ngram_embedding`` and ``ple_prefill`` are compositions of the other ops (docs/spec.md
section 7): each checks its whole call once and then runs the bodies of the ops it composes, so
nothing is checked twice.
"""

from .conv import export_conv_checkpoints, ple_conv
from .embedding import embedding_lookup, nf4_dequantize_rows, ngram_embedding
from .gate import grouped_rms_norm, ple_gate
from .hashing import HashParams, hash_params, ngram_ids, splitmix64
from .prefill import ple_prefill
from .table_update import table_update
from .training_conv import dilated_causal_conv

__all__ = [
    "HashParams", "hash_params", "splitmix64", "ngram_ids", "embedding_lookup", "grouped_rms_norm",
    "ple_gate", "ple_conv", "export_conv_checkpoints", "dilated_causal_conv",
    "ngram_embedding",  # the composition ngram_ids -> embedding_lookup, as one op (ple.fast fuses it)
    "ple_prefill",      # the composition gate -> mask -> conv -> adds, as one op (ple.fast fuses it)
    "nf4_dequantize_rows",  # not an op: NF4 rows to values, as docs/spec.md section 13 states it
    "table_update",     # one row-wise optimizer step on the rows a step looked up (ple.optim, section 11)
]
