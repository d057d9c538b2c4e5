"""Sharding a model's PLE tables on a `DeviceMesh` with PyTorch's own ``parallelize_module``; FSDP2 and DDP.

A layer's table (`DenseTable` or `QuantizedTable`) keeps its class and its state-dict keys; its
tensors become DTensors on a 1-D mesh (the sharded table of ``ple.distributed.table``), placed
by one of two ``ParallelStyle`` s::

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from ple.distributed import TableRowwise, TableColwise

    mesh = init_device_mesh("cuda", (world_size,))
    parallelize_module(layer, mesh, {"ple_embedding.ngram_embedding": TableRowwise()})
    # or, for every PLE layer of a model (and DDP's ignore list): parallelize_tables(model, mesh, "row")

* `TableRowwise` (``Shard(0)``): each rank holds ``ceil(rows / W)`` rows (the checkpoint layout's
  split, ``shard_range``; trailing ranks may hold fewer, or none). This is the memory win: the
  real model's 320M x 160 table is 1/W per rank.
* `TableColwise` (``Shard(1)``): each rank holds every row and ``ceil(D / W)`` columns, the
  layout of transformers' tensor-parallel plan for this model (``embedding_colwise``). Not for
  an NF4 table, whose packed rows have no columns of values (a ``ValueError``).

Two kinds of lookup (``ple.distributed.table``):

* ``layer(h, ids)`` / ``layer.step``: every rank passes the same tokens (the table is
  sharded, the rest of the layer replicated). Outputs and gradients equal one process's.
* ``input_layouts=Shard(0)``: each rank passes its own tokens (data parallel, or sequence
  parallel), every lookup a ``local_token_rows``. Serving this way, each rank keeps only its
  own requests' ``PLECache`` and steps them with ``layer.step``; a rank without a request in
  a step joins the lookup with ``join_table_lookup``. ``reduce="mean"`` (default) scales the
  table's gradient by ``1 / W``, so it is the gradient of the mean of the ranks' losses, as
  FSDP2 and DDP average the dense gradients; ``"sum"`` leaves the sum.

Composes with FSDP2: ``fully_shard(layer, mesh=mesh, ignored_params={table.weight})``
shards the dense parameters over the same ranks (`dense_params` lists them). With DDP the
table must be left out of its all-reduce and its buffer broadcast (DDP cannot hold a DTensor
and fails at construction with "mixed torch.Tensor and DTensor"): `parallelize_tables` and
`exclude_tables_from_ddp` set DDP's own ignore list (``_ddp_params_and_buffers_to_ignore``)
on the module you pass, which must be the module DDP wraps.

A rank's piece is read straight from a checkpoint with ``load_table_piece_``
(``ple.distributed.checkpoint``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from .. import _checks
from .comm import Comm, GroupLike, as_comm
from .table import PLACEMENTS, shard_table_, table_placement

__all__ = ["TableRowwise", "TableColwise", "parallelize_tables", "exclude_tables_from_ddp", "dense_params",
           "as_mesh"]


def _token_layout(input_layouts) -> str:
    if input_layouts is None or input_layouts == Replicate():
        return "replicated"
    if input_layouts == Shard(0):
        return "sharded"
    raise ValueError(f"input_layouts: expected Replicate() (every rank the same tokens) or Shard(0) (each rank "
                     f"its own tokens), got {input_layouts!r}")


class TableRowwise(ParallelStyle):
    """Shard a PLE layer's table by rows (``Shard(0)``) on a 1-D mesh; see the module docstring.

    For ``parallelize_module(layer, mesh, {"ple_embedding.ngram_embedding": TableRowwise()})``.
    The table is a `DenseTable` (its ``weight`` a DTensor Parameter) or a `QuantizedTable`
    (``weight`` a DTensor buffer of its FP8 / int8 dtype, a per-row ``weight_scale`` sharded as
    the rows, a per-tensor one replicated; or NF4's packed uint8 rows, whole rows a rank).
    ``input_layouts`` says where the layer's tokens are, as in torch's own styles:
    ``Replicate()`` (default: every rank passes the same tokens) or ``Shard(0)`` (each rank
    its own: data or sequence parallel; every lookup is then ``local_token_rows`` with
    ``reduce``, and finds the ranks' token counts with one small all-gather). A table on the
    ``meta`` device is created piece by piece, never whole; fill it with
    ``load_table_piece_``. ``parallelize_module``'s ``src_data_rank`` is honoured (default:
    rank 0's table is scattered; None: each rank slices its own copy).
    """

    placement = "row"

    def __init__(self, *, input_layouts: Placement | None = None, reduce: str = "mean") -> None:
        super().__init__()
        self.tokens = _token_layout(input_layouts)
        self.reduce = _checks.choice_arg("reduce", reduce, ("mean", "sum"))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return shard_table_(module, device_mesh, self.placement, tokens=self.tokens, reduce=self.reduce,
                            src_data_rank=getattr(self, "src_data_rank", 0))


class TableColwise(TableRowwise):
    """Shard a PLE layer's table by columns (``Shard(1)``), the layout of transformers' TP plan.

    Options as for `TableRowwise`; per-row scales of an int8 table are replicated. An NF4 table
    (packed rows) is refused, a ``ValueError`` naming ``placement``: shard it by rows.
    """

    placement = "col"


def _tables(module: nn.Module) -> list[tuple[str, nn.Module]]:
    from ..layer import PLELayer

    return [(name, m.ple_embedding.ngram_embedding) for name, m in module.named_modules() if isinstance(m, PLELayer)]


def as_mesh(mesh_or_group: GroupLike) -> DeviceMesh:
    """A 1-D ``DeviceMesh``: a mesh as it is; a `Comm`, a process group or None (the default group) as a mesh of
    its ranks (``cuda`` for NCCL, else ``cpu``)."""
    if isinstance(mesh_or_group, DeviceMesh):
        return mesh_or_group
    comm = mesh_or_group if isinstance(mesh_or_group, Comm) else as_comm(mesh_or_group)
    return comm.mesh


def exclude_tables_from_ddp(module: nn.Module) -> nn.Module:
    """Put every DTensor table's parameters and buffers in ``module`` on DDP's ignore list; returns ``module``.

    Call it on the module you then wrap in ``DistributedDataParallel``: DDP reads the list
    from that module only. The dense parameters are then all-reduced by DDP, and each rank's
    table piece keeps its own gradient (a quantized table's buffers are not broadcast).
    """
    names = []
    for name, table in _tables(module):
        if table_placement(table) is not None:
            for k, _ in [*table.named_parameters(recurse=False), *table.named_buffers(recurse=False)]:
                names.append(f"{name}.ple_embedding.ngram_embedding.{k}".lstrip("."))
    old = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        module, old + [n for n in names if n not in old])
    return module


def parallelize_tables(module: nn.Module, device_mesh: GroupLike, placement: str = "row", *,
                       input_layouts: Placement | None = None,
                       reduce: str = "mean") -> nn.Module:
    """Shard the table of every `PLELayer` in ``module`` (or ``module`` itself), in place; returns ``module``.

    ``device_mesh``: a 1-D ``DeviceMesh``, or a process group / ``Comm`` / None (the default
    group), made a mesh of its ranks (`as_mesh`). ``placement``: ``"row"`` (`TableRowwise`) or
    ``"col"`` (`TableColwise`); ``input_layouts`` and ``reduce`` as for the styles. Dense and
    quantized tables alike; every rank must hold the same whole table (rank 0's is scattered),
    or a table on the ``meta`` device. Through ``parallelize_module``; then
    `exclude_tables_from_ddp` on ``module``. To keep the whole layer, shard a copy
    (``parallelize_tables(copy.deepcopy(layer), mesh)``).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if placement not in PLACEMENTS:
        raise ValueError(f"placement: expected one of {PLACEMENTS}, got {placement!r}")
    tables = _tables(module)
    if not tables:
        raise ValueError(f"module: no PLELayer in {type(module).__name__}")
    mesh = as_mesh(device_mesh)
    style = TableRowwise if placement == "row" else TableColwise
    for name, _ in tables:
        layer = module.get_submodule(name)
        parallelize_module(layer, mesh,
                           {"ple_embedding.ngram_embedding": style(input_layouts=input_layouts, reduce=reduce)})
    return exclude_tables_from_ddp(module)


def dense_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of ``module`` that are not DTensor tables (what FSDP2 or DDP should own)."""
    tables = {id(t.weight) for _, t in _tables(module) if table_placement(t) is not None}
    return [p for p in module.parameters() if id(p) not in tables]
