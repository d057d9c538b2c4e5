"""Weights in and out: PLE layers in the model's safetensors layout.

* `load_layer` / `load_layers`: from a file, a directory or a sharded index (the
  directory or its ``model.safetensors.index.json``), with any key prefix (the model's is
  ``model.language_model.layers.{i}.ple.``; an Engram-family checkpoint's ``layers.{i}.engram.``),
  the table whole or in ``split_ngram_parts`` shards, float, FP8 or int8, separate or merged kv
  projection; every key checked against the config first (see ``ple.io.layout``). Both families
  (``PLEConfig.family``) go through every function here; ``config.json`` keeps the family.
* `read_table_rows`: rows ``[start, end)`` of one layer's table (e.g. one rank's share of
  a sharded table), checked as `load_layer` checks, reading only the shards and rows
  that hold them; `read_table` reads the whole table the same way.
* `save`: the same layout, sharded and optionally quantized, streamed to disk.
* `convert`: re-shard a checkpoint's tables or change their dtype, block by block.
* `merge`: a new checkpoint of a base and the rows a disk table trained into its overlay
  (``load_layer(..., offload="disk", overlay=DIR)``, ``ple.io.disk_table.training``), block by block.
* ``ple.io.policy``: what transformers would load wrong, and the ``ple_only`` mark.
* `inspect`: what a checkpoint holds, from its headers.
* `DiskTable` (``ple.io.disk_table``, a package of its own): a table left in its files, read in place
  (positional reads, many in flight) through a row cache, ``load_layer(..., offload="disk", cache_bytes=N)``;
  trainable through an overlay (``ple.io.disk_table.overlay``).

Command line: ``python -m ple inspect PATH``, ``python -m ple convert SRC DST`` and
``python -m ple merge PATH DIR OUT``.
"""

from .convert import convert
from .disk_table import DiskTable
from .files import Checkpoint, TensorInfo
from .inspect import format_inspect, inspect
from .layout import MODEL_PREFIX, LayerPlan, find_layers, model_prefix, plan_layer, shard_rows
from .load import LoadReport, load_layer, load_layers, read_table, read_table_rows, resolve_config
from .merge import merge
from .optim_state import load_optimizer
from .save import save

__all__ = [
    "Checkpoint", "TensorInfo", "inspect", "format_inspect", "MODEL_PREFIX", "LayerPlan", "find_layers",
    "model_prefix", "plan_layer", "shard_rows", "LoadReport", "load_layer", "load_layers", "read_table",
    "read_table_rows", "resolve_config", "convert", "save", "DiskTable", "load_optimizer",
    "merge",
]
