"""Argument validation of every public op, shared by the three backends (docs/spec.md section 9).

Every op validates all of its arguments here before it touches a tensor (so a failed call
changes nothing); messages start with the argument's name and say what was expected. An argument of the
wrong Python type is a ``TypeError``, one of the right type outside its range or set a ``ValueError``, the same
on every op: each kind of scalar has one helper in ``args`` (``int_arg``, ``float_arg``, ``bool_arg``,
``choice_arg``), which says what counts as that kind. One function per op validates a call and returns its
description, a ``NamedTuple`` with the host values the op needs: ``ngram_call`` -> `NgramCall`
(``ngram_ids``; with ``weight=``, ``ngram_embedding``), ``lookup_call`` -> `LookupCall`, ``gate_call`` -> `GateCall`,
``ple_conv_call`` -> `ConvCall`, ``export_call`` -> `CheckpointCall`, ``dilated_causal_conv_call``
-> `DilatedCausalConvCall`, ``prefill_call`` (``ple_prefill``: the gate's checks, then the training
conv's or the serving conv's). Their fields are the host values, named ``<argument>_list``.

Split by cost: ``<op>_call(*args, host=None)`` is ``<op>_meta(*args)`` then
``<op>_values(*args, host=host)``. *Metadata* (free: Python types, ranks, shapes, dtypes,
devices; a tensor on another device than the first, or an index tensor whose values are
needed on the meta device, is a ``ValueError``) never reads a value, so it traces with fake
tensors under ``torch.compile``. *Values* (index ranges, distinct slots and token rows,
offsets non-decreasing from 0 to the row count, ``num_accepted_tokens`` in range, token
ids in ``[0, V)``, flags 0 or 1) trust the metadata and read each index tensor once
through `host_values`; ``host`` maps argument names to values the caller already holds on
the host (a scheduler's), used instead of a device-to-host copy.

Who calls what: ``ple.reference`` and ``ple.vectorized`` call ``<op>_meta`` and, unless
``validate=False``, ``<op>_values`` (together: ``<op>_call``). ``ple.fast``'s public function
calls ``<op>_meta`` (at trace time under ``torch.compile``, and before dispatch, so a meta tensor
among real ones never reaches the fake kernel); its registered op (``torch.ops.ple.*``) trusts
that and calls only ``<op>_values``, at run time inside the op, so a compiled graph has no graph
break.

Once each: an op runs its own op's checks, ``<op>_meta`` once and ``<op>_values`` at most once, and
no other op's. A composition has checks of its own and runs its parts unchecked: ``ple_prefill``
(``prefill_*``) and ``ngram_embedding`` (``ngram_*`` with ``weight=``) on every backend.
``tests/test_backends.py`` records the checks each op runs on
each backend and holds this paragraph to them.

Modules, one concern each (everything is re-exported here, so callers write ``_checks.<name>``):
``args`` (one argument's checks, offsets, host values, `full_check`), ``ops`` (hashing, lookup,
gate), ``conv`` (serving conv, checkpoint export, training conv), ``prefill`` (``ple_prefill``), ``update``
(``table_update`` and the row optimizers' hyperparameters).
"""

from .args import (
    Host,
    bool_arg,
    choice_arg,
    choices_arg,
    float_arg,
    full_check,
    host_list,
    host_values,
    index,
    int_arg,
    offsets_arg,
    offsets_meta,
    offsets_values,
    rows_values,
    tensor,
    validating,
    value_range,
)
from .conv import (
    CheckpointCall,
    ConvCall,
    DilatedCausalConvCall,
    dilated_causal_conv_call,
    dilated_causal_conv_meta,
    dilated_causal_conv_values,
    export_call,
    export_meta,
    export_values,
    ple_conv_call,
    ple_conv_meta,
    ple_conv_values,
)
from .ops import (
    GateCall,
    LookupCall,
    NgramCall,
    gate_call,
    lookup_call,
    lookup_meta,
    lookup_values,
    ngram_call,
    ngram_meta,
    ngram_values,
)
from .prefill import prefill_call, prefill_meta, prefill_values
from .update import (
    UpdateCall,
    hyperparameters,
    state_shapes,
    table_update_call,
    table_update_meta,
    table_update_values,
)

__all__ = ["Host", "tensor", "index", "int_arg", "float_arg", "bool_arg", "validating", "choice_arg", "choices_arg",
           "host_list", "host_values", "value_range", "offsets_meta", "offsets_values", "offsets_arg", "rows_values",
           "full_check",
           "NgramCall", "ngram_meta", "ngram_values", "ngram_call", "LookupCall", "lookup_meta", "lookup_values",
           "lookup_call", "GateCall", "gate_call",
           "ConvCall", "ple_conv_meta", "ple_conv_values", "ple_conv_call", "CheckpointCall", "export_meta",
           "export_values", "export_call", "DilatedCausalConvCall", "dilated_causal_conv_meta",
           "dilated_causal_conv_values", "dilated_causal_conv_call", "prefill_meta", "prefill_values", "prefill_call",
           "UpdateCall", "hyperparameters", "state_shapes", "table_update_meta", "table_update_values",
           "table_update_call"]
