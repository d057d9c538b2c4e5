"""The sharded n-gram table: a ``ple.table.Table`` whose tensors are DTensors on a 1-D ``DeviceMesh``.

There is one sharded table. `shard_table_` (what the ``ParallelStyle`` s ``TableRowwise`` /
``TableColwise`` of ``ple.distributed.dtensor`` apply) turns a layer's `DenseTable` or
`QuantizedTable` into it in place: the module keeps its class and its state-dict keys, its
``weight`` becomes a DTensor of the table's own dtype (a Parameter for a float table, a
buffer for an FP8 / int8 / NF4 one) and its ``weight_scale`` goes with it:

=============  ===============================  ==================================================
placement      ``weight``                       ``weight_scale``
=============  ===============================  ==================================================
``"row"``      ``Shard(0)``: rank k rows        per row (int8, ``[rows, 1]``): ``Shard(0)``, the
               `shard_range` (k)                same rows; per tensor (FP8, ``[1]``): replicated
``"col"``      ``Shard(1)``: every row, rank    replicated (every rank needs every row's scale)
               k's columns
=============  ===============================  ==================================================

An NF4 table (uint8 ``[rows, D/2 + 4]``, each row its packed codes and float16 scale, no
``weight_scale``) is sharded by rows only: rank k holds whole packed rows, `shard_range` (k)
of them. Its columns are not values (a byte holds two codes, and the scale sits at the row's
end), so ``placement="col"`` is a ``ValueError``.

Rows are split by `shard_range`, the checkpoint layout's rule (``ceil(rows / W)`` a rank, the
last ranks possibly fewer or none), whichever entry point built the table: a rank's piece of
a table split over W ranks is shard k of a checkpoint in W shards.

Its lookup is ``Table.rows(ids, dtype, ops=...)`` (``ple.table`` dispatches a DTensor table to
`dtensor_rows`, registered here), a collective:

* rows: each rank gathers the rows it owns and fills the others with ``-0.0`` (a quantized
  table: their raw bytes, and a per-row scale's four bytes beside them, as uint8, zeros
  elsewhere), a ``Partial`` DTensor. Redistributing it to ``Replicate`` (every rank the same
  tokens) is the all-reduce, to ``Shard(0)`` (tokens split across ranks) the reduce-scatter.
  Exactly one rank owns each row, and ``x + (-0.0) == x`` for every float ``x`` (``+0.0``
  and ``-0.0`` too), so the sum is the row itself, bit for bit.
* columns: the lookup is local, then the columns are all-gathered (``Shard(2) -> Replicate``)
  or exchanged all-to-all (``Shard(2) -> Shard(0)``).

A quantized table's rows travel in its own width (one byte an element) and are dequantized
after the collective, ``(q.float() * scale).to(dtype)``, as the whole table does. An NF4
table's packed rows travel as they are stored, ``D/2 + 4`` bytes a row (84 at D = 160,
against 320 for a bfloat16 row of values): each rank fills the rows it does not own with
zero bytes, the byte-wise sum (uint8, no carry: every other rank adds 0) is the owner's row,
bit for bit, and only then are the rows unpacked, by the table's own unpacker (the backend's
``nf4_dequantize_rows`` or ``ple.quant.dequantize_rows``), as the whole table unpacks them.
Autograd through every collective is DTensor's; a float table's gradient is a DTensor of the
same placement holding each rank's piece only.

With tokens split across ranks (``input_layouts=Shard(0)``, or `local_token_rows` directly),
the ranks' hash ids are all-gathered first (padded to the largest count with ``-1``, owned by
no rank) and each rank gets its own tokens' rows back; an idle serving rank takes part with
`join_table_lookup`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from .. import _checks
from ..quant import dequantize_rows
from ..table import Table, register_dtensor_lookup
from .partition import shard_range

if TYPE_CHECKING:
    from ..layer import PLELayer
    from .comm import Comm

__all__ = ["PLACEMENTS", "shard_table_", "table_placement", "dtensor_rows", "local_token_rows",
           "join_table_lookup"]

PLACEMENTS = ("row", "col")
_REDUCES = ("mean", "sum")


def sharded_weight(table: nn.Module) -> DTensor:
    """``table.weight`` of a sharded table (a ``TypeError`` if it is not a DTensor)."""
    w = getattr(table, "weight", None)
    if not isinstance(w, DTensor):
        raise TypeError(f"table: its weight is not a DTensor (got {type(w).__name__})")
    return w


def table_placement(table: object) -> str | None:
    """``"row"``, ``"col"`` or None (not a DTensor table)."""
    w = getattr(table, "weight", None)
    if not isinstance(w, DTensor):
        return None
    (p,) = w.placements
    return "row" if p == Shard(0) else "col"


def _one_byte_float(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point and t.element_size() == 1


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-byte table (FP8 or int8) as uint8, so collectives and gathers move it bit for bit."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def _place(t: torch.Tensor, mesh, placement, src_data_rank) -> DTensor:
    """``t`` (the whole tensor, every rank alike) as a DTensor of ``placement``, in ``t``'s own dtype."""
    raw = t.view(torch.uint8) if _one_byte_float(t) else t             # FP8 travels as its bytes
    local = distribute_tensor(raw, mesh, [placement], src_data_rank=src_data_rank).to_local()
    return DTensor.from_local(local.view(t.dtype), mesh, [placement], run_check=False, shape=t.shape,
                              stride=t.stride())


def _piece_on_mesh(t: torch.Tensor, mesh, placement, *, init) -> DTensor:
    """A DTensor of ``t``'s shape and dtype whose local piece is made on the mesh's device (``t`` is on meta)."""
    shape = list(t.shape)
    if isinstance(placement, Shard):
        a, b = shard_range(shape[placement.dim], mesh.size(), mesh.get_local_rank())
        shape[placement.dim] = b - a
    local = init(torch.empty(shape, dtype=t.dtype, device=mesh.device_type))
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=t.shape, stride=t.stride())


def _set(table: nn.Module, name: str, value: DTensor, requires_grad: bool = False) -> None:
    if name in table._parameters:
        table._parameters[name] = nn.Parameter(value, requires_grad=requires_grad)
    else:
        table._buffers[name] = value


def shard_table_(table: nn.Module, mesh: DeviceMesh, placement: str = "row", *, tokens: str = "replicated",
                 reduce: str = "mean", src_data_rank: int | None = 0) -> Table:
    """Make ``table`` (a layer's `DenseTable` or `QuantizedTable`) the sharded table on ``mesh``, in place.

    ``placement``: ``"row"`` or ``"col"`` (see the module docstring). ``tokens``:
    ``"replicated"`` (every rank looks up the same ids) or ``"sharded"`` (each rank its own:
    every lookup is `local_token_rows` with ``reduce``). ``src_data_rank``: as for
    ``distribute_tensor`` (rank 0's table is scattered; None: every rank slices its own
    copy). A table on the ``meta`` device is never made whole: each rank creates its piece
    (a float table normal(0, 1), as the model initialises it; a quantized one zeros, scales
    one; an NF4 one zero bytes, rows of scale 0), to be filled by ``load_table_piece_``.
    An NF4 table is sharded by rows only (its packed rows are not columns of values): with
    ``placement="col"`` a ``ValueError`` naming ``placement``. Returns ``table``.
    """
    if not isinstance(table, Table) or not isinstance(getattr(table, "weight", None), torch.Tensor):
        raise TypeError(f"module: expected the layer's table (ple_embedding.ngram_embedding, a ple.table.Table), "
                        f"got {type(table).__name__}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement: expected one of {PLACEMENTS}, got {placement!r}")
    if table._packed and placement != "row":
        raise ValueError(f"placement: an NF4 table's rows are packed (codes and scale in D/2 + 4 bytes); shard it "
                         f"by rows (placement='row'), got {placement!r}")
    if reduce not in _REDUCES:
        raise ValueError(f"reduce: expected 'mean' or 'sum', got {reduce!r}")
    if mesh.ndim != 1:
        raise ValueError(f"device_mesh: expected a 1-D mesh, got {mesh.ndim} dimensions (pass mesh['tp'] of a "
                         f"2-D mesh)")
    w = table.weight
    if isinstance(w, DTensor):
        raise ValueError(f"module: the table is already a DTensor ({w.placements})")
    dim = 0 if placement == "row" else 1
    scale = table.scale
    scale_place = Shard(0) if scale is not None and scale.dim() == 2 and dim == 0 else Replicate()
    if w.device.type == "meta":
        init = torch.zero_ if table.quantized else nn.init.normal_
        _set(table, "weight", _piece_on_mesh(w, mesh, Shard(dim), init=init),
             requires_grad=w.requires_grad)
        if scale is not None:
            _set(table, "weight_scale", _piece_on_mesh(scale, mesh, scale_place, init=lambda t: t.fill_(1.0)))
    else:
        _set(table, "weight", _place(w.detach(), mesh, Shard(dim), src_data_rank), requires_grad=w.requires_grad)
        if scale is not None:
            _set(table, "weight_scale", _place(scale.detach(), mesh, scale_place, src_data_rank))
    # Plain attributes, read back by local_token_rows and load_table_piece_ (setattr: nn.Module's typed
    # __setattr__ takes tensors and modules only).
    setattr(table, "dtensor_tokens", tokens)  # noqa: B010
    setattr(table, "dtensor_reduce", reduce)  # noqa: B010
    table._pending = None
    return table


# ---- what a rank contributes ------------------------------------------------------------------------
def _owned(table, n_local: int, ids: torch.Tensor):
    """Where ids ``[n, NH]`` fall in this rank's rows: ``(owned mask, local row index, 0 where not owned)``."""
    mesh = table.weight.device_mesh
    start, _ = shard_range(table.num_rows, mesh.size(), mesh.get_local_rank())
    rel = ids.long() - start
    owned = (rel >= 0) & (rel < n_local)                              # ids < 0 (padding) are owned by none
    return owned, torch.where(owned, rel, torch.zeros_like(rel))


def _row_part(table, ids: torch.Tensor, ops) -> torch.Tensor:
    """``[n, NH, width]``: this rank's share of the rows of ids ``[n, NH]`` under ``Shard(0)``.

    A float table: its rows (autograd reaches them), ``-0.0`` where another rank owns the row.
    A quantized table: the rows' bytes (uint8) and, with per-row scales, the scale's four
    bytes after them (``width = D + 4``); zeros where another rank owns the row. An NF4
    table: its packed rows as stored (``width = D/2 + 4``), zeros where another rank owns the row.
    """
    w, scale = table.weight.to_local(), table.scale
    per_row = scale is not None and scale.dim() == 2
    n, NH = ids.shape
    D = table.dim
    if not table.quantized:
        fill = torch.full((), -0.0, dtype=w.dtype, device=w.device)
        if w.shape[0] == 0:              # a rank that owns no rows; `- w.sum()` (-0.0 - 0.0) gives it a gradient
            return fill.expand(n, NH, D) - w.sum()
        owned, safe = _owned(table, w.shape[0], ids)
        rows = ops.embedding_lookup(w, safe, validate=False).reshape(n, NH, D)
        return torch.where(owned[..., None], rows, fill)
    stored = w.shape[1]                                                   # D, or D/2 + 4 for NF4's packed rows
    width = stored + (4 if per_row else 0)
    if w.shape[0] == 0:
        return torch.zeros((n, NH, width), dtype=torch.uint8, device=w.device)
    owned, safe = _owned(table, w.shape[0], ids)
    rows = ops.embedding_lookup(_bytes(w), safe, validate=False).reshape(n, NH, stored)
    if per_row:
        s = scale.to_local().view(torch.uint8)                            # [rows_k, 4]: the float32's bytes
        rows = torch.cat([rows, ops.embedding_lookup(s, safe, validate=False).reshape(n, NH, 4)], dim=2)
    return torch.where(owned[..., None], rows, torch.zeros((), dtype=torch.uint8, device=w.device))


def _col_part(table, ids: torch.Tensor, ops) -> torch.Tensor:
    """``[n, NH, D_k]``: this rank's columns of the rows of ids ``[n, NH]`` (raw bytes for a quantized table)."""
    w = table.weight.to_local()
    n, NH = ids.shape
    src = _bytes(w) if table.quantized else w
    if w.shape[1] == 0:                  # a rank that holds no columns (D < W); its gradient is [rows, 0]
        return src.new_zeros((n, NH, 0)) if table.quantized else w.new_zeros((n, NH, 0)) + w.sum()
    safe = ids.long().clamp(min=0)                                        # padding ids (-1) look up row 0
    return ops.embedding_lookup(src, safe, validate=False).reshape(n, NH, w.shape[1])


def _collect(table, ids: torch.Tensor, ops, target) -> torch.Tensor:
    """Every rank's share of the rows of ids ``[n, NH]`` (the same on every rank), redistributed to ``target``:
    ``Replicate()`` gives ``[n, NH, width]``, ``Shard(0)`` this rank's ``[n / W, NH, width]`` block."""
    mesh = table.weight.device_mesh
    n, NH = ids.shape
    if table_placement(table) == "row":
        part = DTensor.from_local(_row_part(table, ids, ops), mesh, [Partial()], run_check=False)
    else:
        part = DTensor.from_local(_col_part(table, ids, ops), mesh, [Shard(2)], run_check=False,
                                  shape=torch.Size((n, NH, table.dim)), stride=(NH * table.dim, table.dim, 1))
    return part.redistribute(mesh, [target]).to_local()


def _finish(table, got: torch.Tensor, ids: torch.Tensor, dtype, ops) -> torch.Tensor:
    """The collected ``[T, NH, width]`` of this rank's ids ``[T, NH]`` -> rows ``[T, NH * D]`` in ``dtype``."""
    T, NH = ids.shape
    D = table.dim
    if not table.quantized:
        return got.reshape(T, NH * D).to(dtype or got.dtype)
    dtype = dtype or torch.get_default_dtype()
    if table._packed:                          # NF4: the packed rows came whole, each with its scale; unpack them
        return table._values_on(ops, got.reshape(T, NH * got.shape[2]), None, dtype)
    q = got[..., :D].contiguous().view(table.weight.dtype).reshape(T, NH * D)
    scale = table.scale.to_local()
    if scale.dim() == 2 and table_placement(table) == "row":             # the scale's bytes came with the row
        row_scale = got[..., D:].contiguous().view(torch.float32).reshape(T, NH)
    elif scale.dim() == 2:                                                # replicated per-row scales
        row_scale = ops.embedding_lookup(scale, ids.long().clamp(min=0), validate=False).reshape(T, NH)
    else:
        row_scale = scale
    return dequantize_rows(q, row_scale, dtype)


def _check_ids(table, ids: torch.Tensor, validate: bool) -> None:
    _checks.tensor("ids", ids, ndim=2, kind="int", device=table.weight.to_local().device)
    if validate and ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= table.num_rows:
            raise ValueError(f"ids: expected rows in [0, {table.num_rows}), got values in [{lo}, {hi}]")


def _reference_ops(ops):
    if ops is None:
        from .. import reference as ops
    return ops


# ---- lookups -------------------------------------------------------------------------------------------
def dtensor_rows(table: Table, ids: torch.Tensor, dtype: torch.dtype | None = None, *, ops: Any = None,
                 validate: bool = True) -> torch.Tensor:
    """``Table.rows`` of the sharded table: ids ``[T, NH]`` -> ``[T, NH * D]``. With replicated tokens every rank
    passes the same ids; with ``tokens="sharded"`` each its own (`local_token_rows`)."""
    ops = _reference_ops(ops)
    _check_ids(table, ids, validate)
    if getattr(table, "dtensor_tokens", "replicated") == "sharded":
        return local_token_rows(table, ids, dtype, reduce=getattr(table, "dtensor_reduce", "mean"), ops=ops)
    return _finish(table, _collect(table, ids, ops, Replicate()), ids, dtype, ops)


register_dtensor_lookup(dtensor_rows)


def local_token_rows(layer_or_table: PLELayer | Table, ids: torch.Tensor, dtype: torch.dtype | None = None, *,
                     counts: list[int] | None = None, reduce: str = "mean", ops: Any = None,
                     comm: Comm | None = None) -> torch.Tensor:
    """Rows for this rank's own hash ids ``[T_k, NH]`` (each rank its own tokens): ``[T_k, NH * D]``.

    ``counts`` lists every rank's ``T_k`` (default: all-gathered, a host sync). The ids of
    all ranks are all-gathered (padded to the largest count), each rank looks up what it
    holds, and the result goes back to each rank's tokens: a reduce-scatter (rows) or an
    all-to-all (columns), DTensor's ``redistribute`` both ways, with its autograd.
    ``reduce`` says whose gradient a float table gets: ``"mean"`` (of the ranks' mean loss,
    as FSDP2 / DDP average the dense gradients) or ``"sum"``. Every rank must call it; a
    rank with no tokens passes ``[0, NH]``. ``ops``: the op module (default: the layer's, or
    the reference for a bare table). ``comm`` (a ``ple.distributed.Comm``), if given, counts
    the bytes sent under ``"table_ids"`` and ``"table_rows"`` (``"table_rows_grad"`` in
    backward), by `Comm`'s ring convention.
    """
    from ..layer import PLELayer

    layer = layer_or_table if isinstance(layer_or_table, PLELayer) else None
    table = layer.table if layer is not None else layer_or_table
    if table_placement(table) is None:
        raise TypeError("layer_or_table: expected a layer whose table is a DTensor (TableRowwise / TableColwise)")
    if reduce not in _REDUCES:
        raise ValueError(f"reduce: expected 'mean' or 'sum', got {reduce!r}")
    ops = ops or (layer.ops if layer is not None else _reference_ops(None))
    mesh = sharded_weight(table).device_mesh
    _check_ids(table, ids, validate=False)
    W, rank = mesh.size(), mesh.get_local_rank()
    T, NH = ids.shape
    if counts is None:
        sizes = [torch.zeros(1, dtype=torch.int64, device=ids.device) for _ in range(W)]
        dist.all_gather(sizes, torch.tensor([T], dtype=torch.int64, device=ids.device), group=mesh.get_group())
        counts = [int(s) for s in sizes]
    if len(counts) != W or counts[rank] != T:
        raise ValueError(f"counts: expected {W} token counts with this rank's = {T}, got {counts}")
    m = max(counts)
    padded = torch.full((m, NH), -1, dtype=torch.int64, device=ids.device)     # -1: no row
    padded[:T] = ids
    all_ids = DTensor.from_local(padded, mesh, [Shard(0)], run_check=False).redistribute(
        mesh, [Replicate()]).to_local()                                        # [W * m, NH]
    got = _collect(table, all_ids, ops, Shard(0))[:T]                          # [T, NH, width]
    if comm is not None:                        # what this rank sends: (W - 1) / W of its [W * m, NH, width_k]
        width = got.shape[2] if table_placement(table) == "row" else sharded_weight(table).to_local().shape[1]
        sent = (W - 1) * m * NH * width * got.element_size()
        comm.count("table_ids", (W - 1) * padded.numel() * padded.element_size())
        comm.count("table_rows", sent)
        if got.requires_grad:
            got.register_hook(lambda g: comm.count("table_rows_grad", sent))
    if reduce == "mean" and W > 1 and got.requires_grad:
        got.register_hook(lambda g: g / W)
    return _finish(table, got, ids, dtype, ops)


def join_table_lookup(layer: PLELayer) -> None:
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
    dev = sharded_weight(table).to_local().device
    with torch.no_grad():
        rows = local_token_rows(layer, torch.zeros((0, layer.config.num_ngram_heads), dtype=torch.int64,
                                                   device=dev), reduce=getattr(table, "dtensor_reduce", "mean"))
        # DTensor's collectives are asynchronous until their result is used: use it, so none is left in flight
        # (an unfinished one makes gloo abort at exit).
        rows.sum()
