"""A rank's piece of the sharded table, read straight from a checkpoint: `load_table_piece_`.

Through ``ple.io``'s one reader (``ple.io.read_table_rows``): every key of the layer is
checked against its config first, then only the rows (or, for a column-sharded table, row
blocks) the rank needs are read. Rows are split by the checkpoint layout's rule, so with a
checkpoint in W shards over W ranks, rank k reads shard k and nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch.distributed.tensor import DTensor

from ..quant import scheme_of
from ..table import DenseTable, QuantizedTable, Table, is_float_table
from .partition import shard_range
from .table import _bytes, shard_table_, sharded_weight, table_placement

if TYPE_CHECKING:
    from ..io.files import CheckpointSource
    from ..layer import PLELayer

__all__ = ["load_table_piece_"]


def _same_storage(table, dtype: torch.dtype, scale: torch.Tensor | None) -> bool:
    """Whether ``table`` can hold a checkpoint table of ``dtype`` (and ``scale``) as it is."""
    quantized = scale is not None or not is_float_table(dtype)
    if not quantized:
        return not table.quantized                                   # a float table is cast to the layer's dtype
    return (table.quantized and table.weight.dtype == dtype
            and (table.scale is None) == (scale is None)
            and (scale is None or table.scale.dim() == scale.dim()))


def _replace_table(layer, placement: str, dtype: torch.dtype, scale: torch.Tensor | None) -> Table:
    """A new sharded table of the checkpoint's storage (same mesh, placement and token layout), pieces unfilled."""
    old = layer.table
    new: Table
    if scale is not None or not is_float_table(dtype):
        scheme = scheme_of(dtype)
        if scheme is None:
            raise ValueError(f"source: the table's dtype {dtype} is neither a float nor a quantized storage")
        new = QuantizedTable.empty(old.num_rows, old.dim, scheme, device="meta")
    else:
        new = DenseTable(old.num_rows, old.dim, device="meta", dtype=dtype)
    shard_table_(new, sharded_weight(old).device_mesh, placement, tokens=getattr(old, "dtensor_tokens", "replicated"),
                 reduce=getattr(old, "dtensor_reduce", "mean"))
    layer.ple_embedding.ngram_embedding = new
    return new


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a sharded table's weight or scale (a DTensor)."""
    return cast(DTensor, t).to_local()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.dtype == src.dtype:
        _bytes(dst).copy_(_bytes(src))                               # FP8 / int8: the bytes, as they are
    else:
        dst.copy_(src.to(dst.dtype))


def load_table_piece_(layer: PLELayer, source: CheckpointSource, *, prefix: str | None = None,
                      block_bytes: int | None = None) -> None:
    """Fill this rank's piece of ``layer``'s sharded (DTensor) table from a checkpoint (``ple.io.read_table_rows``).

    ``source`` and ``prefix`` are as for ``ple.io.load_layer``. Every key of the layer in
    ``source`` is checked against ``layer.config`` first (a checkpoint of another config, or
    one missing a shard, is a ``ValueError`` naming the key). Rows: only this rank's rows
    (and their per-row scales) are read. Columns: the table is read in row blocks (at most
    ``block_bytes`` each) and this rank's columns kept, so no rank holds the whole table.

    The table takes the checkpoint's storage: a float checkpoint table fills a float table in
    its own dtype; a quantized one (FP8 with its per-tensor scale, int8 with per-row scales)
    replaces the layer's table by a sharded quantized table of the same placement, unless it
    already is one of that scheme. Call it before wrapping the model in DDP (a new table
    brings a new buffer for ``exclude_tables_from_ddp`` to list).
    """
    from ..io.load import BLOCK_BYTES, read_table_rows

    table = layer.table
    kind = table_placement(table)
    if kind is None:
        raise TypeError("layer: its table is not a DTensor (apply TableRowwise / TableColwise first)")
    mesh = sharded_weight(table).device_mesh
    rank, W = mesh.get_local_rank(), mesh.size()
    cfg, index = layer.config, layer.ple_layer_index
    block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
    rows_total, D = table.num_rows, table.dim
    dev = _local(table.weight).device
    if kind == "row":
        a, b = shard_range(rows_total, W, rank)
        rows, scale = read_table_rows(source, cfg, index, start=a, end=b, device=dev, prefix=prefix,
                                      block_bytes=block_bytes)
        if not _same_storage(table, rows.dtype, scale):
            table = _replace_table(layer, kind, rows.dtype, scale)
        with torch.no_grad():
            _copy(_local(table.weight), rows)
            if scale is not None and table.scale is not None:            # _same_storage: both or neither
                piece = _local(table.scale)
                _copy(piece, scale.reshape(piece.shape))
        return
    head, scale = read_table_rows(source, cfg, index, start=0, end=0, prefix=prefix,
                                  block_bytes=block_bytes)     # checks every key first
    if not _same_storage(table, head.dtype, scale):
        table = _replace_table(layer, kind, head.dtype, scale)
    c0, c1 = shard_range(D, W, rank)
    local = _local(table.weight)
    local_scale = _local(table.scale) if table.scale is not None else None
    step = max(1, block_bytes // max(head.element_size() * D, 1))
    with torch.no_grad():
        if local_scale is not None and scale is not None and local_scale.dim() == 1:    # per tensor
            _copy(local_scale, scale.reshape(1))
        for a in range(0, rows_total, step):
            b = min(a + step, rows_total)
            rows, s = read_table_rows(source, cfg, index, start=a, end=b, prefix=prefix,
                                      block_bytes=block_bytes)
            _copy(local[a:b], rows[:, c0:c1])
            if local_scale is not None and s is not None and local_scale.dim() == 2:    # per row, replicated
                _copy(local_scale[a:b], s)
