"""Checks of ``table_update`` (docs/spec.md section 11) and of the row optimizers' hyperparameters."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .args import Host, full_check, host_values, index, int_arg, tensor, value_range

_RULES = ("sgd", "adagrad", "adam")


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    return float(value)


def hyperparameters(rule: str, lr, weight_decay, eps, betas) -> None:
    """``rule`` known; ``lr >= 0``, ``weight_decay >= 0``, ``eps > 0``, each beta in ``[0, 1)`` (a ``ValueError``
    naming the argument; a non-number a ``TypeError``)."""
    if rule not in _RULES:
        raise ValueError(f"rule: expected one of {_RULES}, got {rule!r}")
    if _real("lr", lr) < 0:
        raise ValueError(f"lr: expected lr >= 0, got {lr}")
    if _real("weight_decay", weight_decay) < 0:
        raise ValueError(f"weight_decay: expected weight_decay >= 0, got {weight_decay}")
    if _real("eps", eps) <= 0:
        raise ValueError(f"eps: expected eps > 0, got {eps}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas: expected a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= _real(f"betas[{i}]", b) < 1.0:
            raise ValueError(f"betas: expected each beta in [0, 1), got betas[{i}] = {b}")


def state_shapes(rule: str, rows: int, dim: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of a rule's float32 state tensors for a table of ``rows`` x ``dim``."""
    return {"sgd": (), "adagrad": ((rows,),), "adam": ((rows, dim), (rows,))}[rule]


class UpdateCall(NamedTuple):
    lookups: int                # M
    dim: int                    # D


def table_update_meta(weight, ids, grad, state, rule, lr, weight_decay, eps, betas, step) -> None:
    tensor("weight", weight, ndim=2, kind="float")
    index("ids", ids, ndim=1, device=weight.device)
    M, D = ids.shape[0], weight.shape[1]
    tensor("grad", grad, kind="float", device=weight.device, shape=(M, D))
    hyperparameters(rule, lr, weight_decay, eps, betas)
    int_arg("step", step, minimum=1)
    if not isinstance(state, tuple):
        raise TypeError(f"state: expected a tuple of float32 tensors, got {type(state).__name__}")
    shapes = state_shapes(rule, weight.shape[0], D)
    if len(state) != len(shapes):
        raise ValueError(f"state: the {rule!r} rule keeps {len(shapes)} state tensor(s), got {len(state)}")
    for i, (s, shape) in enumerate(zip(state, shapes, strict=True)):
        tensor(f"state[{i}]", s, device=weight.device, shape=shape)
        if s.dtype != torch.float32:
            raise TypeError(f"state[{i}]: expected float32, got {s.dtype}")


def table_update_values(weight, ids, grad, state, rule, lr, weight_decay, eps, betas, step, *,
                        host: Host = None) -> UpdateCall:
    value_range("ids", host_values("ids", ids, host), weight.shape[0], "rows")
    return UpdateCall(ids.shape[0], weight.shape[1])


table_update_call = full_check(table_update_meta, table_update_values, "table_update")
