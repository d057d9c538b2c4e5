"""Tools for testing PLE kernels against the reference: the kit, tolerances and Hypothesis strategies.

The kit (docs/spec.md section 10): ``check_ngram_ids``, ``check_embedding_lookup``, ``check_ngram_embedding``,
``check_ple_gate``, ``check_ple_conv``, ``check_export_conv_checkpoints``,
``check_dilated_causal_conv`` and ``check_ple_prefill`` each take a function with the signature of
the reference op of that name and drive it through a property test against ``ple.reference``;
``check_layer(ops)`` checks ``PLELayer(config, ops=ops)`` whole: forward (through the ops'
``ngram_embedding`` and ``ple_prefill``), gradients, and a serving replay whose prefill-only
steps run the ops' ``ple_prefill`` on the cache's states and whose mixed steps run ``ple_gate``,
``ple_conv`` per mode and ``export_conv_checkpoints`` (see ``ple.testing.kit``).
``check_embedding_lookup`` and ``check_ngram_embedding`` also hand the op quantized tables as a
``QuantizedTable`` gathers them (``schemes=``: FP8 bytes, int8, NF4's packed uint8 rows), whose rows
must come back bit for bit (``ple.testing.kit.quantized``).
``check_table_update`` checks a row optimizer step (``ple.reference.table_update``'s signature, spec section
11) against a float64 oracle, the rows not looked up and their state bit for bit (``ple.testing.kit.update``).
``poisoned_empty`` is the context manager that NaN-poisons fresh buffers.
``ple.testing.numerics`` holds the tolerance table (docs/spec.md section 8) and the comparison helpers
every equivalence test uses; ``ple.testing.strategies`` holds Hypothesis strategies for configs,
varlen batches and serving schedules; ``ple.testing.serving`` the replay.
"""

from typing import Any

__all__ = ["check_ngram_ids", "check_embedding_lookup", "check_ngram_embedding", "check_ple_gate", "check_ple_conv",
           "check_export_conv_checkpoints", "check_dilated_causal_conv", "check_ple_prefill", "check_layer",
           "check_table_update", "poisoned_empty"]


def __getattr__(name: str) -> Any:
    """The kit loads on first use: it needs Hypothesis (``pip install -e '.[dev]'``), ``import ple`` does not."""
    if name in __all__:
        from . import kit
        return getattr(kit, name)
    raise AttributeError(f"module 'ple.testing' has no attribute {name!r}")
