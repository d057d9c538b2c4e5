"""The sharded table in checkpoints: a rank's piece read straight from one (`load_table_piece_`), and layers with
sharded tables saved piece by piece (`save_sharded`).

Reading goes through ``ple.io``'s one reader (``ple.io.read_table_rows``): every key of the layer is
checked against its config first, then only the rows (or, for a column-sharded table, row
blocks) the rank needs are read. Rows are split by the checkpoint layout's rule, so with a
checkpoint in W shards over W ranks, rank k reads shard k and nothing else; `save_sharded` writes
such a checkpoint, rank k writing shard k (and its shard of a row optimizer's state).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..quant import scheme_of
from ..table import DenseTable, QuantizedTable, Table, is_float_table
from .partition import shard_range
from .row_update import to_row_shard
from .table import _bytes, shard_table_, sharded_weight, table_placement

if TYPE_CHECKING:
    import os

    from ..io.files import CheckpointSource, Entry
    from ..layer import PLELayer

__all__ = ["load_table_piece_", "save_sharded"]


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
    its own dtype; a quantized one (FP8 with its per-tensor scale, int8 with per-row scales,
    NF4's packed rows) replaces the layer's table by a sharded quantized table of the same
    placement, unless it already is one of that scheme. An NF4 checkpoint fills a row-sharded
    table only: each rank reads its packed rows as stored, bit for bit (their float16 scales
    checked finite by the reader); a column-sharded layer is refused with a ``ValueError``
    naming ``placement``, the layer left as it was. Call it before wrapping the model in DDP
    (a new table brings a new buffer for ``exclude_tables_from_ddp`` to list).
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


# ---- saving -----------------------------------------------------------------------------------------------
def _dense_tensors(layer: PLELayer, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of ``layer`` but its table, under the model's keys (``ple.io.layout.layer_tensors``: the Engram
    family's projection biases too), whole (a parameter FSDP2 shards is gathered: a collective, every rank alike)."""
    from ..io.layout import layer_tensors

    return [(prefix + k, t.full_tensor() if isinstance(t, DTensor) else t) for k, t in layer_tensors(layer)]


def _entry(key: str, t: torch.Tensor) -> Entry:
    from ..io.files import Entry

    t = t.detach()
    return Entry(key, t.dtype, tuple(t.shape), lambda: iter([t.cpu().contiguous()]))


def _write_index(directory: Path, names: list[str]) -> Path:
    """``model.safetensors.index.json`` of the files ``names`` in ``directory`` (read from their headers)."""
    from ..io.files import INDEX_NAME, Checkpoint

    weight_map, total = {}, 0
    for name in names:
        for key, info in Checkpoint.open(directory / name).tensors.items():
            weight_map[key] = name
            total += info.nbytes
    with open(directory / INDEX_NAME, "w", encoding="utf-8") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    return directory / INDEX_NAME


def _optimizer_entries(optimizer: Any, layers: list[PLELayer], prefixes: list[str]
                       ) -> tuple[list[Entry], dict[str, str]]:
    """This rank's entries of ``optimizer``'s state over the sharded tables of ``layers``: shard k of W (rank k
    of the tables' mesh) of each state tensor, the rows a checkpoint's table shard k holds, under the keys and with
    the metadata (the same on every rank) of ``ple.io.optim_state``. A collective for a column-sharded table
    (``exp_avg`` goes from columns to row shards)."""
    from ..io.files import Entry
    from ..io.optim_state import _blocks, _metadata, _names, _order, _state_key  # the layout's own helpers

    order = _order(optimizer, layers)
    tables = optimizer._tables
    entries: list[Entry] = []
    described: list[dict[str, Any] | None] = [None] * len(tables)
    for pfx, j in zip(prefixes, order, strict=True):
        table = tables[j]
        mesh = sharded_weight(table).device_mesh
        W, rank = mesh.size(), mesh.get_local_rank()
        st = optimizer.state[table.weight]
        for name in _names(optimizer.rule):
            piece = to_row_shard(table, st[name].detach())
            entries.append(Entry(_state_key(pfx, W, rank, name), torch.float32, tuple(piece.shape), _blocks(piece)))
        described[j] = {"prefix": pfx, "rows": table.num_rows, "dim": table.dim, "step": int(st["step"]),
                        "parts": W}
    return entries, _metadata(optimizer, described)


def save_sharded(layers: PLELayer | list[PLELayer] | tuple[PLELayer, ...], path: str | os.PathLike[str], *,
                 optimizer: Any = None, prefix: str | None = None, overwrite: bool = False) -> list[Path]:
    """Save layers whose tables are sharded (DTensor) piece by piece, every rank its own; returns the files this
    rank wrote.

    Every rank of the tables' mesh calls it, with the same arguments; ``path`` is a directory all of them see.
    The checkpoint is the model's layout with each table in W shards (the keys of
    ``ple.io.save(layers, path, parts=W)``, one file a rank): rank k writes
    ``model-0000{k+1}-of-0000{W}.safetensors`` holding shard k of every table, which is its own rows (a
    column-sharded table's row shard comes from the ranks' columns by an all-to-all, the table's 1/W a rank);
    rank 0 adds the rest of the layers (parameters FSDP2 shards are gathered whole first), the index and
    ``config.json``. No rank holds more of a table than its shard.
    ``optimizer``: a ``ple.optim`` optimizer training these tables (all of them, and no other); its state goes in
    ``path/optimizer/`` the same way, shard k from rank k (``ple.io.optim_state``). ``prefix`` and
    ``overwrite``: as for ``ple.io.save`` (an Engram-family layer: its prefix ``layers.{i}.engram.``, its projection
    biases, and the ple-only mark, as ``ple.io.save`` writes them).

    Read it back per rank: the table with `load_table_piece_`, the optimizer's state with
    ``ple.io.load_optimizer`` (each rank its own piece); or whole, in one process, with ``ple.io.load_layer`` and
    ``ple.io.load_optimizer``, as a checkpoint saved in W shards.

    Raises:
        TypeError: a layer whose table is not a DTensor (``layers``).
        ValueError: no layer, layers of different configs or meshes, a quantized table (``layers``), a
            ``.safetensors`` path, an existing checkpoint without ``overwrite`` (``path``; on every rank, before
            anything is written), an ``optimizer`` that does not train exactly these tables.
    """
    from ..io.layout import SHARD, layer_prefixes
    from ..io.load import CONFIG_METADATA_KEY
    from ..io.optim_state import OPTIMIZER_DIR
    from ..io.policy import mark_config, mark_metadata, transformers_problems
    from ..io.save import prepare_dst
    from ..io.writer import INDEX_NAME, write_file

    layers = list(layers) if isinstance(layers, (list, tuple)) else [layers]
    if not layers:
        raise ValueError("layers: expected at least one PLELayer")
    if any(table_placement(la.table) is None for la in layers):
        raise TypeError("layers: every layer's table must be a DTensor (apply TableRowwise / TableColwise); save a "
                        "whole layer with ple.io.save")
    if any(la.table.quantized for la in layers):
        raise ValueError("layers: save_sharded writes float tables; save a quantized layer before sharding it")
    cfg, mesh = layers[0].config, sharded_weight(layers[0].table).device_mesh
    if any(la.config != cfg for la in layers) or any(sharded_weight(la.table).device_mesh != mesh for la in layers):
        raise ValueError("layers: expected layers of one config whose tables share one mesh")
    path = Path(path)
    if path.suffix == ".safetensors":
        raise ValueError(f"path: a sharded save writes a directory (one file a rank), got {path}")
    prefixes = layer_prefixes(cfg, [la.ple_layer_index for la in layers], prefix)
    problems = transformers_problems(None, False, family=cfg.family)      # float tables: an Engram config's alone
    if optimizer is not None:
        from ..io.optim_state import _order

        _order(optimizer, layers)                   # it trains exactly these tables (before anything is written)
    W, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    verdict: list[str | None] = [None]
    if rank == 0:                                   # the destination, checked and cleared once
        try:
            prepare_dst(path, overwrite)
            path.mkdir(parents=True, exist_ok=True)
            (path / INDEX_NAME).unlink(missing_ok=True)           # an older save's
            shutil.rmtree(path / OPTIMIZER_DIR, ignore_errors=True)
        except ValueError as e:
            verdict = [str(e)]
    dist.broadcast_object_list(verdict, group=group, group_src=0)
    if verdict[0] is not None:
        raise ValueError(verdict[0])
    entries = []
    with torch.no_grad():
        opt = _optimizer_entries(optimizer, layers, prefixes) if optimizer is not None else None
        for layer, pfx in zip(layers, prefixes, strict=True):
            entries.append(_entry(pfx + SHARD.format(k=rank), to_row_shard(layer.table,
                                                                            sharded_weight(layer.table).to_local())))
            dense = _dense_tensors(layer, pfx)
            if rank == 0:
                entries += [_entry(k, t) for k, t in dense]
    names = ["model.safetensors"] if W == 1 else [f"model-{k + 1:05d}-of-{W:05d}.safetensors" for k in range(W)]
    write_file(path / names[rank], entries,
               mark_metadata({"format": "pt", CONFIG_METADATA_KEY: json.dumps(cfg.to_dict())}, problems))
    files = [path / names[rank]]
    opt_dir = path / OPTIMIZER_DIR
    opt_names = names if opt is not None and opt[0] else ["model.safetensors"]   # SGD has no state: rank 0's file
    if opt is not None and rank < len(opt_names):
        opt_dir.mkdir(exist_ok=True)
        opt_entries = opt[0] or [_entry("optim.none", torch.zeros(0))]
        write_file(opt_dir / opt_names[rank], opt_entries, opt[1])
        files.append(opt_dir / opt_names[rank])
    dist.barrier(group=group)
    if rank == 0:
        if W > 1:
            files.append(_write_index(path, names))
        if opt is not None and len(opt_names) > 1:
            files.append(_write_index(opt_dir, opt_names))
        if not (path / "config.json").exists():
            with open(path / "config.json", "w", encoding="utf-8") as fh:
                json.dump(mark_config(cfg.to_dict(), problems), fh, indent=2)
            files.append(path / "config.json")
    dist.barrier(group=group)                       # the checkpoint is whole when any rank returns
    return files
