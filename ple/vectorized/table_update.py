"""``table_update`` (docs/spec.md section 11) vectorised: one sort of the ids, segment sums, one gather and one
scatter of the looked-up rows, no host read."""

from __future__ import annotations

import torch

from .. import _checks
from .. import reference as _reference
from ..backends import twin
from ..reference.table_update import rule_constants, sqrt32

__all__ = ["table_update"]

_SCRATCH: dict[tuple[str, torch.device], torch.Tensor] = {}


def _buffer(name: str, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """A float32 ``shape`` buffer kept between calls (eager only): a fresh 20 MB temporary costs a page fault a
    page on every step (about 4 ms on this CPU, more than the arithmetic on it). Grown, never shrunk: it holds
    the largest step's ``[M, D]`` until the process ends. Under ``torch.compile`` a plain ``torch.empty``."""
    n = shape[0] * shape[1]
    if torch.compiler.is_compiling():
        return torch.empty(shape, dtype=torch.float32, device=device)
    key = (name, device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH[key] = torch.empty(n, dtype=torch.float32, device=device)
    return buf[:n].view(shape)


@twin(_reference.table_update)
def table_update(weight: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, state: tuple[torch.Tensor, ...], *,
                 rule: str, lr: float, weight_decay: float = 0.0, eps: float = 1e-8,
                 betas: tuple[float, float] = (0.9, 0.999), step: int = 1, validate: bool = True) -> None:
    """The ids are sorted (stable: equal ids keep their lookup order) and each run of equal ids is summed
    by ``index_add_`` in that order (on the CPU one add after another, so ``g`` has the reference's bits;
    on CUDA ``index_add_`` is deterministic under ``torch.use_deterministic_algorithms(True)``). Every
    position of a run then computes its row's update from the same inputs, so the scatter
    (``index_copy_``) writes equal values for a repeated row: no host read of the number of distinct
    rows, and every temporary is ``[M, D]`` or ``[M]``, never the table's size. Gathers are
    ``index_select`` and the formulas run in place on the gathered copies (the same roundings).

    Most float32 ``[M, D]`` temporaries are buffers kept between eager calls (grown, never shrunk: the
    largest step's stay until the process ends); under ``torch.compile`` they are fresh ``torch.empty``."""
    check = _checks.table_update_call if _checks.validating(validate) else _checks.table_update_meta
    check(weight, ids, grad, state, rule, lr, weight_decay, eps, betas, step)
    M, D = grad.shape
    if M == 0:
        return
    k = rule_constants(rule, lr, weight_decay, eps, betas, step)
    rows, order = torch.sort(ids.long(), stable=True)            # equal ids in lookup order
    starts = torch.ones(M, dtype=torch.bool, device=weight.device)
    starts[1:] = rows[1:] != rows[:-1]
    run = torch.cumsum(starts, 0) - 1                             # [M]: the run (distinct row) of each position
    dev = weight.device
    in_order = grad.index_select(0, order) if grad.dtype != torch.float32 else \
        torch.index_select(grad, 0, order, out=_buffer("in_order", (M, D), dev))
    sums = _buffer("sums", (M, D), dev).zero_()
    sums.index_add_(0, run, in_order.float())                     # each run's gradient rows, in lookup order
    g = torch.index_select(sums, 0, run, out=_buffer("g", (M, D), dev))   # [M, D]: each position's row gradient
    w = torch.index_select(weight, 0, rows, out=_buffer("w", (M, D), dev)) if weight.dtype == torch.float32 \
        else weight.index_select(0, rows).float()
    if weight_decay != 0:
        g.add_(torch.mul(w, k["weight_decay"], out=_buffer("sq", (M, D), dev)))
    # In place below: the same operations, in the same order, as the reference's (each rounded once).
    if rule == "sgd":
        new = w.sub_(g.mul_(k["lr"]))
    elif rule == "adagrad":
        (s,) = state
        s_r = s.index_select(0, rows).add_(torch.mul(g, g, out=_buffer("sq", (M, D), dev)).mean(dim=1))
        new = w.sub_(g.mul_(k["lr"]).div_(sqrt32(s_r).add_(k["eps"])[:, None]))
        s.index_copy_(0, rows, s_r)
    else:
        m, v = state
        m_r = m.index_select(0, rows).mul_(k["b1"]).add_(torch.mul(g, k["one_minus_b1"],
                                                                    out=_buffer("sq", (M, D), dev)))
        v_r = v.index_select(0, rows).mul_(k["b2"]).add_(
            torch.mul(g, g, out=_buffer("sq", (M, D), dev)).mean(dim=1).mul_(k["one_minus_b2"]))
        m_hat = m_r / k["correction1"]
        v_hat = v_r / k["correction2"]
        new = w.sub_(m_hat.mul_(k["lr"]).div_(sqrt32(v_hat).add_(k["eps"])[:, None]))
        m.index_copy_(0, rows, m_r)
        v.index_copy_(0, rows, v_r)
    weight.index_copy_(0, rows, new.to(weight.dtype))   # a repeated row: equal values from each of its positions
