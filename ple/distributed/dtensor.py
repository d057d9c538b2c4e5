"""The n-gram table as a DTensor on a `DeviceMesh`: row or column sharding on PyTorch's own engine.

A layer's `DenseTable` keeps its class and its state-dict key; its ``weight`` becomes a
``DTensor`` Parameter on a 1-D mesh, placed by one of two ``ParallelStyle`` s that
``torch.distributed.tensor.parallel.parallelize_module`` applies::

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from ple.distributed import TableRowwise, TableColwise

    mesh = init_device_mesh("cuda", (world_size,))
    parallelize_module(layer, mesh, {"ple_embedding.ngram_embedding": TableRowwise()})
    # or, for every PLE layer of a model (and DDP's ignore list): parallelize_tables(model, mesh, "row")

* `TableRowwise` (``Shard(0)``): each rank holds ``ceil(rows / W)`` rows (``torch.chunk``'s split;
  trailing ranks may hold fewer, or none). A lookup gathers the owned rows of every id and
  zeros elsewhere, a ``Partial`` DTensor; redistributing it to ``Replicate`` is the
  all-reduce, to ``Shard(0)`` (tokens split across ranks) the reduce-scatter. Exactly one rank
  owns each row, so the sum is the row itself, bit for bit. This is the memory win: the
  real model's 320M x 160 table is 1/W per rank.
* `TableColwise` (``Shard(1)``): each rank holds every row and ``ceil(D / W)`` columns, the
  layout of transformers' tensor-parallel plan for this model (``embedding_colwise``); the
  lookup is local, then the columns are all-gathered (``Shard(2) -> Replicate``) or, with
  tokens split across ranks, exchanged all-to-all (``Shard(2) -> Shard(0)``).

Autograd through every collective is DTensor's (``DTensor.from_local`` / ``redistribute``):
the parameter's gradient is a DTensor of the same placement, holding each rank's rows (or
columns) only, and an optimizer steps it like any DTensor parameter.

Two kinds of lookup:

* ``layer(h, ids)`` / ``layer.step``: every rank passes the same tokens (the table is
  sharded, the rest of the layer replicated). Outputs and gradients equal one process's.
* `local_token_rows`: each rank passes its own tokens (data parallel, or sequence
  parallel), ``counts`` giving every rank's token count (a host list; without it one small
  all-gather finds them, a host sync). Serving this way, each rank keeps only its own
  requests' ``PLECache`` and steps them with ``layer.step``; a rank without a request in a
  step joins the lookup with `join_table_lookup`. ``reduce="mean"`` (default) scales the table's
  gradient by ``1 / W``, so it is the gradient of the mean of the ranks' losses, as FSDP2 and
  DDP average the dense gradients; ``"sum"`` leaves the sum.

Composes with FSDP2: ``fully_shard(layer, mesh=mesh, ignored_params={table.weight})``
shards the dense parameters over the same ranks (`dense_params` lists them). With DDP the
table must be left out of its all-reduce (DDP cannot hold a DTensor parameter and fails at
construction with "mixed torch.Tensor and DTensor"): `parallelize_tables` and
`exclude_tables_from_ddp` set DDP's own ignore list
(``_ddp_params_and_buffers_to_ignore``) on the module you pass, which must be the module
DDP wraps.

A rank's piece is read straight from a checkpoint with `load_table_piece_` (``ple.io``'s one
reader: every key checked against the layer's config first, then only the rows, or row
blocks, the rank needs). Quantized tables are not DTensor tables (they have no gradient):
use `ShardedPLELayer` for those.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from .. import _checks
from ..table import DenseTable

__all__ = ["TableRowwise", "TableColwise", "parallelize_tables", "exclude_tables_from_ddp", "dense_params",
           "local_token_rows", "join_table_lookup", "load_table_piece_", "table_placement", "shard_range",
           "PLACEMENTS"]

PLACEMENTS = ("row", "col")


def shard_range(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s chunk of ``size`` under ``Shard``: ``torch.chunk``'s split."""
    chunk = -(-size // world_size) if size else 0
    return min(rank * chunk, size), min((rank + 1) * chunk, size)


def table_placement(table) -> str | None:
    """``"row"``, ``"col"`` or None (not a DTensor table)."""
    w = getattr(table, "weight", None)
    if not isinstance(w, DTensor):
        return None
    (p,) = w.placements
    return "row" if p == Shard(0) else "col"


def _token_layout(input_layouts) -> str:
    if input_layouts is None or input_layouts == Replicate():
        return "replicated"
    if input_layouts == Shard(0):
        return "sharded"
    raise ValueError(f"input_layouts: expected Replicate() (every rank the same tokens) or Shard(0) (each rank "
                     f"its own tokens), got {input_layouts!r}")


def _shard_table_(table: nn.Module, mesh, dim: int, tokens: str = "replicated", reduce: str = "mean") -> nn.Module:
    if type(table) is not DenseTable:
        raise TypeError(f"module: expected the layer's DenseTable (ple_embedding.ngram_embedding), got "
                        f"{type(table).__name__} (quantized and ShardedTable tables cannot become DTensors)")
    if mesh.ndim != 1:
        raise ValueError(f"device_mesh: expected a 1-D mesh, got {mesh.ndim} dimensions (pass mesh['tp'] of a "
                         f"2-D mesh)")
    w = table.weight
    if isinstance(w, DTensor):
        raise ValueError(f"module: the table is already a DTensor ({w.placements})")
    if w.device.type == "meta":                     # never materialised whole: each rank makes its piece
        shape = list(w.shape)
        a, b = shard_range(shape[dim], mesh.size(), mesh.get_local_rank())
        shape[dim] = b - a
        local = torch.empty(shape, dtype=w.dtype, device=mesh.device_type)
        nn.init.normal_(local)
        stride = (w.shape[1], 1)
        dt = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=w.shape, stride=stride)
    else:
        dt = distribute_tensor(w.detach(), mesh, [Shard(dim)])
    table.weight = nn.Parameter(dt, requires_grad=w.requires_grad)
    table.dtensor_tokens, table.dtensor_reduce = tokens, reduce
    return table


class TableRowwise(ParallelStyle):
    """Shard a PLE layer's `DenseTable` by rows (``Shard(0)``) on a 1-D mesh; see the module docstring.

    For ``parallelize_module(layer, mesh, {"ple_embedding.ngram_embedding": TableRowwise()})``.
    ``input_layouts`` says where the layer's tokens are, as in torch's own styles:
    ``Replicate()`` (default: every rank passes the same tokens) or ``Shard(0)`` (each rank
    its own: data or sequence parallel; every lookup is then `local_token_rows` with
    ``reduce``, and finds the ranks' token counts with one small all-gather). A table on the
    ``meta`` device is created piece by piece (normal(0, 1), as the model initialises it),
    never whole; fill it with `load_table_piece_`.
    """

    dim = 0

    def __init__(self, *, input_layouts=None, reduce: str = "mean"):
        super().__init__()
        self.tokens = _token_layout(input_layouts)
        if reduce not in ("mean", "sum"):
            raise ValueError(f"reduce: expected 'mean' or 'sum', got {reduce!r}")
        self.reduce = reduce

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return _shard_table_(module, device_mesh, self.dim, self.tokens, self.reduce)


class TableColwise(TableRowwise):
    """Shard a PLE layer's `DenseTable` by columns (``Shard(1)``), the layout of transformers' TP plan.

    Options as for `TableRowwise`.
    """

    dim = 1


def _tables(module: nn.Module) -> list[tuple[str, nn.Module]]:
    from ..layer import PLELayer

    return [(name, m.ple_embedding.ngram_embedding) for name, m in module.named_modules() if isinstance(m, PLELayer)]


def exclude_tables_from_ddp(module: nn.Module) -> nn.Module:
    """Put every DTensor (or `ShardedTable`) table parameter of ``module`` on DDP's ignore list; returns ``module``.

    Call it on the module you then wrap in ``DistributedDataParallel``: DDP reads the list
    from that module only. The dense parameters are then all-reduced by DDP, and each rank's
    table piece keeps its own gradient.
    """
    from .table import ShardedTable

    names = []
    for name, table in _tables(module):
        if table_placement(table) is not None or isinstance(table, ShardedTable):
            names += [f"{name}.ple_embedding.ngram_embedding.{k}".lstrip(".") for k, _ in
                      table.named_parameters(recurse=False)]
            names += [f"{name}.ple_embedding.ngram_embedding.{k}".lstrip(".") for k, _ in
                      table.named_buffers(recurse=False)]
    old = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        module, old + [n for n in names if n not in old])
    return module


def parallelize_tables(module: nn.Module, device_mesh, placement: str = "row", *, input_layouts=None,
                       reduce: str = "mean") -> nn.Module:
    """Shard the table of every `PLELayer` in ``module`` (or ``module`` itself) on ``device_mesh``; returns it.

    ``placement``: ``"row"`` (`TableRowwise`) or ``"col"`` (`TableColwise`); ``input_layouts`` and
    ``reduce`` as for the styles. Through ``parallelize_module``; then `exclude_tables_from_ddp`
    on ``module``.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if placement not in PLACEMENTS:
        raise ValueError(f"placement: expected one of {PLACEMENTS}, got {placement!r}")
    tables = _tables(module)
    if not tables:
        raise ValueError(f"module: no PLELayer in {type(module).__name__}")
    style = TableRowwise if placement == "row" else TableColwise
    for name, _ in tables:
        layer = module.get_submodule(name)
        parallelize_module(layer, device_mesh,
                           {"ple_embedding.ngram_embedding": style(input_layouts=input_layouts, reduce=reduce)})
    return exclude_tables_from_ddp(module)


def dense_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of ``module`` that are not DTensor tables (what FSDP2 or DDP should own)."""
    tables = {id(t.weight) for _, t in _tables(module) if table_placement(t) is not None}
    return [p for p in module.parameters() if id(p) not in tables]


# ---- lookups ------------------------------------------------------------------------------------------
def _owned_rows(table, local: torch.Tensor, ids: torch.Tensor, ops) -> torch.Tensor:
    """``[n, NH, D]``: rows of ``ids`` ``[n, NH]`` this rank owns (``Shard(0)``), zeros elsewhere (ids < 0 too)."""
    mesh = table.weight.device_mesh
    start, _ = shard_range(table.num_rows, mesh.size(), mesh.get_local_rank())
    n, NH = ids.shape
    rel = ids.long() - start
    owned = (rel >= 0) & (rel < local.shape[0])
    if local.shape[0] == 0:              # a rank that owns no rows; `+ local.sum()` (zero) gives it a gradient
        return local.new_zeros((n, NH, table.dim)) + local.sum()
    safe = torch.where(owned, rel, torch.zeros_like(rel))
    rows = ops.embedding_lookup(local, safe, validate=False).reshape(n, NH, table.dim)
    return torch.where(owned[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def _local_cols(table, local: torch.Tensor, ids: torch.Tensor, ops) -> torch.Tensor:
    n, NH = ids.shape
    if local.shape[1] == 0:              # a rank that holds no columns (D < W); its gradient is [rows, 0]
        return local.new_zeros((n, NH, 0)) + local.sum()
    safe = ids.long().clamp(min=0)                                    # padding ids (-1) look up row 0
    return ops.embedding_lookup(local, safe, validate=False).reshape(n, NH, local.shape[1])


def _check_ids(table, ids: torch.Tensor, validate: bool) -> None:
    _checks.tensor("ids", ids, ndim=2, kind="int", device=table.weight.to_local().device)
    if validate and ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= table.num_rows:
            raise ValueError(f"ids: expected rows in [0, {table.num_rows}), got values in [{lo}, {hi}]")


def dtensor_rows(table, ids: torch.Tensor, dtype: torch.dtype, *, ops, validate: bool = True) -> torch.Tensor:
    """``Table.rows`` of a DTensor table: ``[T, NH]`` ids -> ``[T, NH * D]``. With replicated tokens every rank
    passes the same ids; with ``input_layouts=Shard(0)`` each its own (`local_token_rows`)."""
    if getattr(table, "dtensor_tokens", "replicated") == "sharded":
        _check_ids(table, ids, validate)
        return local_token_rows(table, ids, dtype, reduce=table.dtensor_reduce, ops=ops)
    _check_ids(table, ids, validate)
    w = table.weight
    mesh, local = w.device_mesh, w.to_local()
    T, NH = ids.shape
    D = table.dim
    if table_placement(table) == "row":
        part = DTensor.from_local(_owned_rows(table, local, ids, ops), mesh, [Partial()], run_check=False)
    else:
        part = DTensor.from_local(_local_cols(table, local, ids, ops), mesh, [Shard(2)], run_check=False,
                                  shape=(T, NH, D), stride=(NH * D, D, 1))
    full = part.redistribute(mesh, [Replicate()]).to_local()
    return full.reshape(T, NH * D).to(dtype)


def local_token_rows(layer_or_table, ids: torch.Tensor, dtype: torch.dtype | None = None, *,
                     counts: list[int] | None = None, reduce: str = "mean", ops=None) -> torch.Tensor:
    """Rows for this rank's own hash ids ``[T_k, NH]`` (each rank its own tokens): ``[T_k, NH * D]``.

    ``counts`` lists every rank's ``T_k`` (default: all-gathered, a host sync). The ids of
    all ranks are all-gathered (padded to the largest count), each rank looks up what it
    holds, and the result goes back to each rank's tokens: a reduce-scatter (rows) or an
    all-to-all (columns), DTensor's ``redistribute`` both ways, with its autograd.
    ``reduce`` says whose gradient the table gets: ``"mean"`` (of the ranks' mean loss, as
    FSDP2 / DDP average the dense gradients) or ``"sum"``. Every rank must call it; a rank
    with no tokens passes ``[0, NH]``. ``ops``: the op module (default: the layer's, or the
    reference for a bare table).
    """
    from ..layer import PLELayer

    layer = layer_or_table if isinstance(layer_or_table, PLELayer) else None
    table = layer.table if layer is not None else layer_or_table
    if table_placement(table) is None:
        raise TypeError("layer_or_table: expected a layer whose table is a DTensor (TableRowwise / TableColwise)")
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce: expected 'mean' or 'sum', got {reduce!r}")
    if ops is None:
        if layer is not None:
            ops = layer.ops
        else:
            from .. import reference as ops
    w = table.weight
    mesh, local = w.device_mesh, w.to_local()
    _check_ids(table, ids, validate=False)
    W, rank = mesh.size(), mesh.get_local_rank()
    T, NH = ids.shape
    if counts is None:
        sizes = [torch.zeros(1, dtype=torch.int64, device=ids.device) for _ in range(W)]
        dist.all_gather(sizes, torch.tensor([T], dtype=torch.int64, device=ids.device), group=mesh.get_group())
        counts = [int(s) for s in sizes]
    if len(counts) != W or counts[rank] != T:
        raise ValueError(f"counts: expected {W} token counts with this rank's = {T}, got {counts}")
    m, D = max(counts), table.dim
    padded = torch.full((m, NH), -1, dtype=torch.int64, device=ids.device)     # -1: no row
    padded[:T] = ids
    all_ids = DTensor.from_local(padded, mesh, [Shard(0)], run_check=False).redistribute(
        mesh, [Replicate()]).to_local()                                        # [W * m, NH]
    if table_placement(table) == "row":
        part = DTensor.from_local(_owned_rows(table, local, all_ids, ops), mesh, [Partial()], run_check=False)
    else:
        part = DTensor.from_local(_local_cols(table, local, all_ids, ops), mesh, [Shard(2)], run_check=False,
                                  shape=(W * m, NH, D), stride=(NH * D, D, 1))
    mine = part.redistribute(mesh, [Shard(0)]).to_local()[:T]                  # [T, NH, D]
    if reduce == "mean" and W > 1 and mine.requires_grad:
        mine.register_hook(lambda g: g / W)
    return mine.reshape(T, NH * D).to(dtype or mine.dtype)


def join_table_lookup(layer) -> None:
    """Take part in the table lookups of one layer step without tokens of your own (an idle serving rank).

    With per-rank tokens (``input_layouts=Shard(0)``) every rank serves its own requests
    from its own ``PLECache`` (no rank holds another's cache), but each lookup is a
    collective: in a step where this rank has no request, call this once per PLE layer
    where the others call ``layer.step`` (or ``layer(...)``).
    """
    table = layer.table
    if getattr(table, "dtensor_tokens", None) != "sharded":
        raise ValueError("layer: its table is not a DTensor with per-rank tokens (input_layouts=Shard(0)); "
                         "with replicated tokens every rank runs every step")
    dev = table.weight.to_local().device
    with torch.no_grad():
        rows = local_token_rows(layer, torch.zeros((0, layer.config.num_ngram_heads), dtype=torch.int64,
                                                   device=dev), reduce=table.dtensor_reduce)
        # DTensor's collectives are asynchronous until their result is used: use it, so none is left in flight
        # (an unfinished one makes gloo abort at exit).
        rows.sum()


# ---- checkpoints --------------------------------------------------------------------------------------
def load_table_piece_(layer, source, *, prefix: str | None = None, block_bytes: int | None = None) -> None:
    """Fill this rank's piece of ``layer``'s DTensor table from a checkpoint, through ``ple.io.read_table_rows``.

    Every key of the layer in ``source`` is checked against ``layer.config`` first (a
    checkpoint of another config, or one missing a shard, is a ``ValueError`` naming the
    key). Rows: only this rank's rows are read. Columns: the table is read in row blocks
    (at most ``block_bytes`` each) and this rank's columns kept, so no rank holds the whole
    table. A quantized checkpoint table is a ``ValueError`` (use `ShardedPLELayer`).
    """
    from ..io.load import BLOCK_BYTES, read_table_rows

    table = layer.table
    kind = table_placement(table)
    if kind is None:
        raise TypeError("layer: its table is not a DTensor (apply TableRowwise / TableColwise first)")
    w = table.weight
    mesh, local = w.device_mesh, w.to_local()
    rank, W = mesh.get_local_rank(), mesh.size()
    cfg, index = layer.config, layer.ple_layer_index
    block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
    if kind == "row":
        a, b = shard_range(table.num_rows, W, rank)
        pieces = [((a, b), read_table_rows(source, cfg, index, start=a, end=b, prefix=prefix,
                                           block_bytes=block_bytes))]
        cols = slice(None)
    else:
        c0, c1 = shard_range(table.dim, W, rank)
        cols = slice(c0, c1)
        step = max(1, block_bytes // max(4 * table.dim, 1))
        read_table_rows(source, cfg, index, start=0, end=0, prefix=prefix)         # checks every key first
        pieces = (((a, min(a + step, table.num_rows)),
                   read_table_rows(source, cfg, index, start=a, end=min(a + step, table.num_rows), prefix=prefix,
                                   block_bytes=block_bytes)) for a in range(0, table.num_rows, step))
    base = shard_range(table.num_rows, W, rank)[0] if kind == "row" else 0
    with torch.no_grad():
        for (a, b), (rows, scale) in pieces:
            if scale is not None or not rows.dtype.is_floating_point or rows.element_size() == 1:
                raise ValueError(f"source: the checkpoint's table is quantized ({rows.dtype}); a DTensor table "
                                 f"is a float table (use ple.distributed.ShardedPLELayer for quantized tables)")
            local[a - base:b - base].copy_(rows[:, cols].to(local.dtype))
