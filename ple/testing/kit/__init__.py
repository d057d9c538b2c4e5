"""The equivalence-testing kit (SPEC section 10): check your own op, or a whole layer on your ops.

``check_<op>(fn, **options)`` drives ``fn`` (the signature of ``ple.reference.<op>``) through a
Hypothesis property against the reference and returns quietly, or raises ``AssertionError``
naming the smallest failing case and the first wrong element. ``check_layer(ops)`` checks
``PLELayer(config, ops=ops)`` whole. All are usable inside your own pytest tests.
"""

from ._report import poisoned_empty
from .conv import check_export_conv_checkpoints, check_ple_conv
from .layer import check_layer
from .ops import check_dilated_causal_conv, check_embedding_lookup, check_ngram_ids, check_ple_gate

__all__ = ["check_ngram_ids", "check_embedding_lookup", "check_ple_gate", "check_ple_conv",
           "check_export_conv_checkpoints", "check_dilated_causal_conv", "check_layer", "poisoned_empty"]
