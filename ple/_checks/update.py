"""Checks of ``table_update`` (docs/spec.md section 11) and of the row optimizers' hyperparameters."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .args import Host, choice_arg, float_arg, full_check, host_values, index, int_arg, tensor, value_range

_RULES = ("sgd", "adagrad", "adam")


def hyperparameters(rule: str, lr, weight_decay, eps, betas) -> None:
    """``rule`` one of ``"sgd"``, ``"adagrad"``, ``"adam"``; finite ``lr >= 0``, ``weight_decay >= 0`` and ``eps > 0``;
    ``betas`` a pair (a tuple or list of two), each in ``[0, 1)``. A wrong Python type (a non-string rule, a
    non-number, ``betas`` not a tuple or list) is a ``TypeError``, a value out of range (a pair of another length
    too) a ``ValueError``, naming the argument (``betas[i]`` for one beta)."""
    choice_arg("rule", rule, _RULES)
    float_arg("lr", lr, minimum=0, finite=True)
    float_arg("weight_decay", weight_decay, minimum=0, finite=True)
    float_arg("eps", eps, above=0, finite=True)
    if not isinstance(betas, (tuple, list)):
        raise TypeError(f"betas: expected a pair (beta1, beta2), a tuple or list, got {type(betas).__name__}")
    if len(betas) != 2:
        raise ValueError(f"betas: expected a pair (beta1, beta2), got {len(betas)} values: {betas!r}")
    for i, b in enumerate(betas):
        float_arg(f"betas[{i}]", b, minimum=0, below=1, finite=True)


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
