"""The PLE layer beyond one device, on ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

* The sharded table (``ple.distributed.table``): a layer's `DenseTable` or `QuantizedTable`
  whose tensors are DTensors on a 1-D ``DeviceMesh``, split by rows (`TableRowwise`) or
  columns (`TableColwise`) with PyTorch's ``parallelize_module``, or `parallelize_tables` for
  every PLE layer of a model. Rows are split by the checkpoint layout's rule (`shard_range`),
  whichever entry point built the table. The layer's ``forward`` and ``step`` are unchanged
  (its ``table.rows`` is a collective); each rank's own tokens: `local_token_rows`, an idle
  serving rank: `join_table_lookup`; a rank's piece from a checkpoint: `load_table_piece_`;
  FSDP2 / DDP: `dense_params`, `exclude_tables_from_ddp`.
* Training the sharded table with ``ple.optim``'s row optimizers (``ple.distributed.row_update``):
  each rank updates the rows (or columns) it holds and keeps their state; the result is one
  process's. `optimizer_comm` counts what their steps send; `save_sharded` writes layers (and an
  optimizer's state) piece by piece, every rank its own shard.
* Sequence parallelism: `sp_forward` (a packed training batch split across
  ranks, with autograd) and `sp_step` (a serving step split across ranks, same
  outputs and cache states as one process), with a whole or a sharded table. The conv's
  history comes from a point-to-point halo exchange (``exchange="halo"``) or, as the
  baseline, an all-gather of every conv input (``exchange="allgather"``).
* `Comm`: the transport calls, counting bytes sent per category.
* `spawn`: run a function on W local processes in one group (tests, benchmarks).

>>> mesh = init_device_mesh("cuda", (W,))                    # after dist.init_process_group
>>> layer = parallelize_tables(copy.deepcopy(full_layer), mesh, "row")   # or a Comm / process group
>>> out_k = sp_forward(layer, hidden_k, ids_k, cu_seqlens, mesh)        # this rank's rows
>>> out_k.backward(grad_k); sync_grads(layer, mesh)
"""

from .checkpoint import load_table_piece_, save_sharded
from .comm import Comm, as_comm
from .dtensor import TableColwise, TableRowwise, as_mesh, dense_params, exclude_tables_from_ddp, parallelize_tables
from .exchange import all_gather_rows, halo_exchange
from .launch import spawn
from .partition import HaloPlan, even_bounds, fragments, halo_plan, shard_range
from .row_update import optimizer_comm
from .sequence import EXCHANGES, sp_dilated_causal_conv, sp_forward, sync_grads
from .serving import sp_step
from .table import join_table_lookup, local_token_rows, shard_table_, table_placement

__all__ = [
    "Comm", "as_comm", "spawn", "even_bounds", "shard_range", "fragments", "HaloPlan", "halo_plan",
    "halo_exchange", "all_gather_rows", "EXCHANGES", "sp_forward", "sp_dilated_causal_conv", "sync_grads",
    "sp_step",
    "TableRowwise", "TableColwise", "parallelize_tables", "shard_table_", "table_placement", "as_mesh",
    "exclude_tables_from_ddp", "dense_params", "local_token_rows", "join_table_lookup", "load_table_piece_",
    "save_sharded", "optimizer_comm",
]
