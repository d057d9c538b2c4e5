"""The equivalence-testing kit (docs/spec.md section 10): check your own op, or a whole layer on your ops.

``check_<op>(fn, **options)`` drives ``fn`` (the signature of ``ple.reference.<op>``) through a
Hypothesis property against the reference and returns quietly, or raises ``AssertionError``
naming the smallest failing case and the first wrong element: one per op of
``ple.backends.OP_NAMES`` (``check_ngram_ids``, ``check_embedding_lookup``,
``check_ngram_embedding``, ``check_ple_gate``, ``check_ple_conv``,
``check_export_conv_checkpoints``, ``check_dilated_causal_conv``, ``check_ple_prefill``), and
``check_table_update`` for the row optimizers' op (judged against a float64 oracle; the layer does not call it).
``check_layer(ops)`` checks ``PLELayer(config, ops=ops)`` whole (forward, gradients, a serving
replay with prefill-only and mixed steps). ``poisoned_empty`` is the NaN-poisoning context
manager the checks run the function under. All are usable inside your own pytest tests.

Modules: ``ops`` (hashing, lookups, the gate, the training conv), ``conv`` (the serving conv
and checkpoints), ``prefill`` (the fused prefill), ``layer``; ``cases`` (the tensors the checks
build their cases from, for tests that draw cases of their own); ``quantized`` (the FP8, int8
and NF4 tables the lookup checks gather, and how their rows are judged); ``update`` (the row
optimizers' step, its float64 ``oracle`` and ``assert_near_oracle``); ``_report`` (the comparisons and
failure messages); ``_options`` (the checks' keyword options, checked before any case runs).
"""

from ._report import poisoned_empty
from .conv import check_export_conv_checkpoints, check_ple_conv
from .layer import check_layer
from .ops import (
    check_dilated_causal_conv,
    check_embedding_lookup,
    check_ngram_embedding,
    check_ngram_ids,
    check_ple_gate,
)
from .prefill import check_ple_prefill
from .update import check_table_update

__all__ = ["check_ngram_ids", "check_embedding_lookup", "check_ngram_embedding", "check_ple_gate", "check_ple_conv",
           "check_export_conv_checkpoints", "check_dilated_causal_conv", "check_ple_prefill", "check_layer",
           "check_table_update", "poisoned_empty"]
