"""The ``"torch"`` backend: the ops of ``ple.reference`` vectorised in eager PyTorch (docs/spec.md section 7).

Same names and signatures as ``ple.reference``, each op's docstring the reference's, marked as such,
followed by this backend's notes (``ple.backends.twin``), the same
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

Paths. Every op has one general path, correct everywhere (autograd, ``torch.compile``, any device, dtype
and state layout), and at most one fast path, taken where the function named under "when" says so; both
give the same bits (``tests/vectorized/test_conv_paths.py`` and ``test_blocked.py`` force each path and
compare it with the reference). "Eagerly" is outside ``torch.compile``; "no autograd" is
``gate.records_grad`` false (grad mode off, or no input requiring a gradient). "Buys" is the time of a
case of ``benchmarks/bench_layer_cpu.py --hidden-size 512 --embed-dim 512`` (C = 2048, one thread) with
the fast path refused over its time as it is, the two interleaved in one run (medians; the range of two
runs; float32, then bfloat16). A path or "when" is named in the op's module (``gate``, ``conv``,
``training_conv``, ``prefill``, ...):

| op | path | when | buys |
|---|---|---|---|
| ``ngram_ids`` | one window gather (``_batch_windows``) | always | one path |
| ``embedding_lookup`` | one ``F.embedding`` | always | one path |
| ``ngram_embedding`` | the two ops' bodies, one check | always | one path |
| ``ple_gate`` | ``BlockGate`` | ``takes_block_gate_path`` (a) | no benchmark case (b) |
| | ``_gate_whole_batch`` | otherwise | general |
| ``ple_conv`` | ``decode.decode_conv`` | decode and ``decode.takes_row_path`` (e) | decode 64: 1.18-1.20x, 1.32-1.36x |
| | gather of every request's history | otherwise (d) | general |
| ``export_conv_checkpoints`` | gather of each owner's S inputs | a logical row (none: returns) | one path |
| ``dilated_causal_conv`` | ``_TapSum`` | ``takes_slice_path``: eager | fwd+bwd 1x2048: 1.13-1.31x, 1.22-1.42x; |
| | | | fwd+bwd 8x256: 1.32-1.48x, 1.21-1.45x |
| | ``_conv_gathered`` | under ``torch.compile`` | general |
| ``ple_prefill`` | ``_forward_blocked`` | ``takes_blocked_forward_path`` (c) | fwd 1x2048: 1.27-1.36x, 1.11-1.13x; |
| | | | fwd 8x256: 1.07-1.08x, 1.14-1.16x |
| | ``prefill.BlockedPrefill`` | ``takes_blocked_backward_path`` (g) | op fwd+bwd (h): 6.4x, 2.4x |
| | gate, ``keep`` mask, conv, adds | otherwise: three combinations (f) | general |
| ``table_update`` | sort, segment sums, gather, scatter | a lookup (none: returns) | one path |

(a) On the CPU, eagerly, no autograd, more rows than one block (``gate.BLOCK_ROWS``, 64).
(b) A decode step's 64 rows are one block, where the two paths are level; ``ple_gate`` alone at
2048 rows: 1.28-1.29x, 1.45-1.46x (a serving step of long prefill chunks and decodes gates all its rows
through it). ``prefill._forward_blocked`` is built on ``BlockGate`` too. (c) No conv state, on the CPU,
eagerly, no autograd. (d) Prefill and spec rows; decode rows the fast path does not take, and every
decode under ``torch.compile``, where the general path is level with the compiled decode path it
replaced (decode-compiled 64, new over old in one run: 1.02-1.05x, 0.94-1.00x). The modes differ there in
data, not in path: decode makes ``query_start_loc`` ``arange(R + 1)`` and reads a history unless
``has_initial_states`` says no; prefill reads one only where ``has_initial_states`` says so; spec always
reads, its history from column ``num_accepted_tokens - 1`` of a window of ``S + spec_query_len - 1`` columns and
keeps ``S + q - 1`` columns. (e) Eagerly, decode rows on a state in the inputs' dtype that has a row view
(``rows.state_rows``: ``PLECache``'s default ``channels_last`` layout, or any layout with one slot, one
column or one channel), K > 1, at least one request, the null slot inside the state.
(f) ``ple_prefill``'s six reachable combinations; "autograd" is ``records_grad`` of its tensors, the conv
weights included. The gate takes its own path as in its row above (``BlockGate`` needs the CPU, eager,
more than 64 rows and no autograd on the gate's own inputs, so with autograd it runs only where the conv
weights alone require a gradient); "the training conv" is ``dilated_causal_conv``'s body (``_TapSum``
eagerly, ``_conv_gathered`` compiled):

* no conv state, no autograd, on the CPU, eagerly: ``_forward_blocked``, the fast path (c);
* no conv state, no autograd, on another device or compiled: the gate (whole batch there), ``keep``
  applied in place, the training conv, the adds (inference where the blocked path does not run);
* no conv state, autograd, on the CPU, eagerly, float32 / float64: ``prefill.BlockedPrefill`` (g), the
  blocked forward and a backward recomputed per block (training on the CPU);
* no conv state, autograd, on another device, compiled, or in bfloat16 / float16: the gate, ``keep``
  applied out of place, the training conv, the adds (training);
* a conv state, no autograd: the gate, ``keep`` in place, then ``conv._ple_conv(mode="prefill")`` (its
  general path) adds y and ``hidden_states`` into ``gated`` itself and writes the states (serving);
* a conv state, autograd: the same into a clone of ``gated``, ``keep`` out of place (so autograd sees
  no in-place op on a tensor it saved).

(g) No conv state, on the CPU, eagerly, autograd recording, float32 or float64: a ``torch.autograd.Function``
whose forward is ``_forward_blocked`` (same bits) saving the inputs and the rows' score sums, and whose
backward (``_prefill_grad.backward_blocked``) recomputes per block of ``gate.BLOCK_ROWS`` rows in scratch
buffers of one or two blocks: the conv's ``dpre`` in row order, added back into a conv-input gradient that
lives in two blocks of rows, each tap inside its sequence; then, one block behind, the norms' and gate's
backward in closed form. Gradients within the tolerance (``tests/vectorized/test_blocked.py``). Not twice
differentiable. bfloat16 and float16 keep the composition: this backward sums in float32 without rounding
its intermediates to the input dtype, so its gradients strayed further from the model's autograd
(``bench_layer_cpu.py``'s bfloat16 gradient check at C 2048: 0.019 relative to transformers' against the
composition's 0.0043, when bfloat16 took it).
(h) ``benchmarks/bench_prefill_backward.py`` (the op alone, forward and ``autograd.grad`` of all seven
inputs, T 2048 in one sequence, float32, 2 threads, both paths interleaved in one run): Engram widths
(C 4096) 60.7 ms against the composition's 390.2 ms (6.4x), Qwen4Exp widths (C 2048) 34.0 against 80.1 ms
(2.4x); at C 4096 every ``[T, C]`` float32 temporary of the composition is 32 MiB, which glibc maps fresh
and the kernel zeroes page by page on first touch. The Engram layer's forward and backward
(``bench_engram.py``) is within its bar of the GEMMs with it ([engram.md](../../docs/engram.md#measured)).

With a conv state and ``token_indices``, the physical rows no logical row maps to are zeroed afterwards.

State writes. ``ple_conv``, ``export_conv_checkpoints`` and ``ple_prefill`` with a state (through
``conv._ple_conv``) write conv states through one of these branches:

* ``decode.decode_conv``: ``rows.copy_rows_`` of each request's S new columns into the state's row view
  (the path runs only where there is one), one scatter of whole rows.
* ``conv._write_windows`` (the general ``ple_conv`` and ``export_conv_checkpoints``), a write of fixed
  shape: every request writes a slot, a request that owns none (the null slot; for the export, no
  checkpoint) the stand-in ``z`` (the null slot, or slot 0 when the null slot is outside
  ``[0, num_slots)``), with the bits that slot ends with, so no host read decides who writes:

  - nothing, when there are no requests, no columns to write or no slots;
  - with the null slot outside ``[0, num_slots)``, the stand-in slot 0's final bits are an owner's new
    window if one owns slot 0, else its own old bits;
  - where ``rows.state_rows`` gives a view (as in (e)): ``rows.copy_rows_`` into it, for the
    16-byte row copies and, compiled, the in-place mutation of the cache (below);
  - otherwise (``channels_first`` with several slots, columns and channels):
    ``conv_state[target[:, None], :, columns] = new`` (an ``index_put_``), correct on any layout.

  Where the state's dtype differs from the inputs', ``conv._ple_conv`` takes the columns it does not
  change from the raw old bits (not a round trip through the inputs' dtype), so they keep their bits.
* ``rows.copy_rows_`` itself: under ``torch.compile`` the operator ``ple_torch::copy_rows_``; eagerly an
  ``index_copy_`` on 16-byte views of the rows where both have the same dtype, contiguous rows and row
  sizes, strides and offsets in whole 16 bytes, else a plain ``index_copy_``. The views: a decode step's 576-row scatter
  0.35 -> 0.11 ms in float32, 0.36 -> 0.06 ms in bfloat16 (a compiled decode step of 64 in bfloat16 is
  1.2x slower without). The operator mutates the cache in place under ``torch.compile``, where a plain
  ``index_copy_`` copies every slot of the layer out and back each step: 58 ms against 0.22 ms at 1024
  slots; not measurable at the benchmark's 65.

The residual is written with ``rows.copy_rows_`` by ``decode.decode_conv`` and with a plain
``index_copy_`` by the general ``ple_conv``; ``table_update`` writes its rows and optimizer states with
``index_copy_``.
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
