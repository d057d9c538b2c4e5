"""``table_update`` (docs/spec.md section 11) vectorised: one sort of the ids, segment sums, one gather and one
scatter of the looked-up rows, no host read."""

from __future__ import annotations

import torch

from .. import _checks
from .. import reference as _reference
from ..backends import twin
from ..reference.table_update import rule_constants, sqrt32

__all__ = ["table_update"]


@twin(_reference.table_update)
def table_update(weight: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, state: tuple[torch.Tensor, ...], *,
                 rule: str, lr: float, weight_decay: float = 0.0, eps: float = 1e-8,
                 betas: tuple[float, float] = (0.9, 0.999), step: int = 1, validate: bool = True) -> None:
    """The ids are sorted (stable: equal ids keep their lookup order) and each run of equal ids is summed
    by ``index_add_`` in that order (on the CPU one add after another, so ``g`` has the reference's bits;
    on CUDA ``index_add_`` is deterministic under ``torch.use_deterministic_algorithms(True)``). Every
    position of a run then computes its row's update from the same inputs, so the scatter
    (``index_put_``) writes equal values for a repeated row: no host read of the number of distinct
    rows, and every temporary is ``[M, D]`` or ``[M]``, never the table's size."""
    (_checks.table_update_call if validate else _checks.table_update_meta)(weight, ids, grad, state, rule, lr,
                                                                            weight_decay, eps, betas, step)
    M, D = grad.shape
    if M == 0:
        return
    k = rule_constants(rule, lr, weight_decay, eps, betas, step)
    rows, order = torch.sort(ids.long(), stable=True)            # equal ids in lookup order
    starts = torch.ones(M, dtype=torch.bool, device=weight.device)
    starts[1:] = rows[1:] != rows[:-1]
    run = torch.cumsum(starts, 0) - 1                             # [M]: the run (distinct row) of each position
    sums = torch.zeros(M, D, dtype=torch.float32, device=weight.device)
    sums.index_add_(0, run, grad[order].float())                  # each run's gradient rows, in lookup order
    g = sums[run]                                                 # [M, D]: each position's row gradient
    w = weight[rows].float()
    if weight_decay != 0:
        g = g + k["weight_decay"] * w
    if rule == "sgd":
        new = w - k["lr"] * g
    elif rule == "adagrad":
        (s,) = state
        s_r = s[rows] + (g * g).mean(dim=1)
        new = w - (k["lr"] * g) / (sqrt32(s_r) + k["eps"])[:, None]
        s.index_put_((rows,), s_r)
    else:
        m, v = state
        m_r = k["b1"] * m[rows] + k["one_minus_b1"] * g
        v_r = k["b2"] * v[rows] + k["one_minus_b2"] * (g * g).mean(dim=1)
        m_hat = m_r / k["correction1"]
        v_hat = v_r / k["correction2"]
        new = w - (k["lr"] * m_hat) / (sqrt32(v_hat) + k["eps"])[:, None]
        m.index_put_((rows,), m_r)
        v.index_put_((rows,), v_r)
    weight.index_put_((rows,), new.to(weight.dtype))
