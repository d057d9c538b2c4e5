"""The ``"torch"`` backend: the ops of ``ple.reference`` vectorised in eager PyTorch (docs/spec.md section 7).

Same names and signatures as ``ple.reference``, each op's docstring the reference's followed by this
backend's notes (``ple.backends.twin``), the same
rounding points, so in bfloat16 it equals the reference (and transformers) bit for bit; conv
states are equal bit for bit in every dtype. Unlike the reference, nothing here reads a tensor's
values on the host once the checks have run (``validate=False`` skips those too): requests are
found with ``torch.searchsorted`` on the device offsets, conv histories are gathered with index
arithmetic, and state writes have a fixed shape. So a serving step makes no device-to-host
synchronisation and ``torch.compile(fullgraph=True)`` traces the layer and its step (the one host
read left is of CPU tensors: the blocked CPU forward reads its sequence offsets). This is
the default of ``backend="auto"`` where Triton cannot run compiled (the CPU).

Speed on a CPU comes from few, large ops and small temporaries: the norms without ``pow`` or
mixed-dtype ops (``gate``), the hash as one window gather (``hashing``), and the fast paths below.
In float32 and float64 the forward rounds as the reference does too (blocks keep vector lanes,
products and adds are rounded separately), so it matches bit for bit but for an occasional last bit
of a ``silu`` run on a differently shaped tensor; gradients are within the tolerance.

Paths. Every op has one general path, correct everywhere (autograd, ``torch.compile``, any device
and dtype), and at most one fast path, taken where the function named under "when" says so; both give
the same bits (``tests/vectorized/test_conv_paths.py`` and ``test_blocked.py`` force each path and
compare it with the reference). "Buys" is the time of a case of ``benchmarks/bench_layer_cpu.py
--hidden-size 512 --embed-dim 512`` (C = 2048, one thread) with the fast path refused over its time as
it is, the two interleaved in one run (medians; the range of two runs; float32, then bfloat16):

| op | path | when | buys |
|---|---|---|---|
| ``ple_gate`` | ``gate._gate_whole_batch`` | otherwise | general |
| | ``gate.BlockGate`` | ``gate.takes_blocked_path`` (a) | no benchmark case (b) |
| ``ple_prefill`` | gate, mask, conv, adds | otherwise | general |
| | ``prefill._forward_blocked`` | ``prefill.takes_blocked_path`` (c) | forward 1x2048: 1.27-1.36x, 1.11-1.13x; |
| | | | forward 8x256: 1.07-1.08x, 1.14-1.16x |
| ``dilated_causal_conv`` | ``training_conv._conv_gathered`` | under ``torch.compile`` | general |
| | ``training_conv._TapSum`` | ``training_conv.takes_slice_path``: eager | fwd+bwd 1x2048: 1.13-1.31x, 1.22-1.42x; |
| | | | fwd+bwd 8x256: 1.32-1.48x, 1.21-1.45x |
| ``ple_conv`` | gather of every request's history | otherwise (d) | general |
| | ``decode.decode_conv`` | ``decode.takes_row_path`` (e) | decode 64: 1.18-1.20x, 1.32-1.36x |
| the other ops | one path each | | |

(a) On the CPU, eagerly, nothing recording autograd, more rows than one block (``gate.BLOCK_ROWS``, 64).
(b) A decode step's 64 rows are one block, where the two paths are level; ``ple_gate`` alone at
2048 rows: 1.28-1.29x, 1.45-1.46x (a serving step of long prefill chunks and decodes gates all its rows
through it). ``prefill._forward_blocked`` is built on ``BlockGate`` too. (c) No conv state, on the CPU,
eagerly, nothing recording autograd. (d) Prefill and spec rows; decode rows the fast path does not
take, and every decode under ``torch.compile``, where the general path is level with the compiled
decode path it replaced (decode-compiled 64, new over old in one run: 1.02-1.05x, 0.94-1.00x).
(e) Eagerly, decode rows on a state in the inputs' dtype whose columns are rows in memory
(``PLECache``'s default layout), K > 1, at least one request, the null slot inside the state.

Both ``ple_conv`` paths write states through ``rows.copy_rows_``: an ``index_copy_`` on 16-byte views of
the rows (a decode step's 576-row scatter: 0.35 -> 0.11 ms in float32, 0.36 -> 0.06 ms in bfloat16; a
compiled decode step of 64 in bfloat16 is 1.2x slower without), under ``torch.compile`` behind the
operator ``ple_torch::copy_rows_``, which mutates the cache in place (a plain ``index_copy_`` there copies
every slot of the layer out and back each step: 58 ms against 0.22 ms at 1024 slots; not measurable at
the benchmark's 65).
"""

from ..reference.gate import grouped_rms_norm
from ..reference.hashing import HashParams, hash_params, splitmix64
from .conv import export_conv_checkpoints, ple_conv
from .embedding import embedding_lookup, ngram_embedding
from .gate import ple_gate
from .hashing import ngram_ids
from .prefill import ple_prefill
from .table_update import table_update
from .training_conv import dilated_causal_conv

__all__ = [
    "HashParams", "hash_params", "splitmix64", "ngram_ids", "embedding_lookup", "ngram_embedding",
    "grouped_rms_norm", "ple_gate", "ple_conv", "export_conv_checkpoints", "dilated_causal_conv", "ple_prefill",
    "table_update",
]
