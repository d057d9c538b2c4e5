"""The PLE layer beyond one device, on ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

* Sharded table: `ShardedPLELayer` (a `PLELayer` whose n-gram table is split by
  rows over a process group; ``forward`` and ``step`` unchanged) and
  `ShardedTable` (a ``ple.table.Table``), with quantized tables and
  ``ShardedPLELayer.load_table_from_checkpoint`` (a rank's rows read straight from the
  checkpoint through ``ple.io.read_table_rows``).
* Sequence parallelism: `sp_forward` (a packed training batch split across
  ranks, with autograd) and `sp_step` (a serving step split across ranks, same
  outputs and cache states as one process). The conv's history comes from a
  point-to-point halo exchange (``exchange="halo"``) or, as the baseline, an
  all-gather of every conv input (``exchange="allgather"``).
* `Comm`: the transport calls, counting bytes sent per category.
* `spawn`: run a function on W local processes in one group (tests, benchmarks).

>>> comm = Comm()                                   # after dist.init_process_group
>>> layer = ShardedPLELayer.from_layer(full_layer)  # or ShardedPLELayer(config, group=...)
>>> out_k = sp_forward(layer, hidden_k, ids_k, cu_seqlens, comm)   # this rank's rows
>>> out_k.backward(grad_k); sync_grads(layer, comm)
"""

from .comm import Comm, as_comm
from .dtensor import (
    TableColwise,
    TableRowwise,
    dense_params,
    exclude_tables_from_ddp,
    join_table_lookup,
    load_table_piece_,
    local_token_rows,
    parallelize_tables,
)
from .exchange import all_gather_rows, halo_exchange
from .launch import spawn
from .partition import HaloPlan, even_bounds, fragments, halo_plan, row_range
from .sequence import EXCHANGES, sp_dilated_causal_conv, sp_forward, sync_grads
from .serving import sp_step
from .table import ShardedPLELayer, ShardedTable

__all__ = [
    "Comm", "as_comm", "spawn", "even_bounds", "row_range", "fragments", "HaloPlan", "halo_plan",
    "halo_exchange", "all_gather_rows", "EXCHANGES", "sp_forward", "sp_dilated_causal_conv", "sync_grads",
    "sp_step",
    "ShardedTable", "ShardedPLELayer",
    "TableRowwise", "TableColwise", "parallelize_tables", "exclude_tables_from_ddp", "dense_params",
    "local_token_rows", "join_table_lookup", "load_table_piece_",
]
