"""Row-wise optimizers for the n-gram table (docs/spec.md section 11): they touch only the rows a step looked up.

The table is almost all of the layer (the real model's: 320,001,536 x 160). A dense gradient, or Adam's two
dense moments, would be as large as the table; these optimizers keep what a step needs and nothing more:

* `SparseSGD`: ``w_r -= lr * g``; no state.
* `RowwiseAdagrad` (FBGEMM's EXACT_ROWWISE_ADAGRAD): one float32 per row.
* `RowwiseAdam` (FBGEMM's PARTIAL_ROWWISE_ADAM): a float32 first moment per value and a second moment per
  row.

``g`` is the float32 sum of a row's gradient rows, over every lookup of it since the last ``zero_grad()``
(micro-batches accumulate), plus ``weight_decay * w_r``; the formulas are ``ple.reference.table_update``'s.
Each optimizer takes a `PLELayer`, a table, or several, and is a ``torch.optim.Optimizer`` (``param_groups``
with ``lr``, so LR schedulers work; ``state_dict`` / ``load_state_dict``). The table's gradient never
reaches ``.grad``: while an optimizer holds a table, its lookups hand their ids and output gradients to
the optimizer in the backward pass (``ple.table.row_grad_lookup``), and ``step()`` runs the backend's
``table_update`` op on them. The layer's other parameters train with any PyTorch optimizer beside it
(`other_parameters`)::

    table_opt = ple.optim.RowwiseAdagrad(layer, lr=1e-2)
    dense_opt = torch.optim.AdamW(ple.optim.other_parameters(layer), lr=1e-3)
    loss = layer(hidden, input_ids).square().mean()
    loss.backward()
    table_opt.step(); dense_opt.step()
    table_opt.zero_grad(); dense_opt.zero_grad()

With ``fused=True`` each backward call is one step, applied inside the lookup's backward (FBGEMM's mode:
no gradient is kept between backward and step; ``step()`` does nothing for the table, and ``zero_grad()``
has nothing to clear).

Memory: a step keeps the ids and output gradients of its lookups (``T * NH`` rows of D) and allocates
temporaries of that size; nothing of the table's row count but the state itself. A non-finite gradient is
not checked for (it would take a host read): the rows it reaches, and their state, become NaN or infinite.
"""

from .plan import MemoryPlan, plan
from .rowwise import RowOptimizer, RowwiseAdagrad, RowwiseAdam, SparseSGD, other_parameters, update_ops

__all__ = ["SparseSGD", "RowwiseAdagrad", "RowwiseAdam", "RowOptimizer", "other_parameters", "update_ops", "plan",
           "MemoryPlan"]
