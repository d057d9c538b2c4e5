"""The row update of a trained table (docs/spec.md section 11): the op ``ple.optim``'s optimizers call.

``table_update`` applies one optimizer step to the rows a step looked up, and only to them: for each
distinct row, the float32 sum of its gradient rows in lookup order, then the rule's formula in float32,
the new row rounded once to the table's dtype. Written as a plain loop over the distinct rows, every
rounding point marked; ``ple.vectorized`` and ``ple.fast`` compute the same formulas vectorised.
"""

from __future__ import annotations

import torch

from .. import _checks

__all__ = ["table_update", "rule_constants", "sqrt32"]


def sqrt32(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of float32 ``x``: through float64 (exact for a square root;
    torch's float32 ``sqrt`` on the CPU is one ulp off for some inputs)."""
    return torch.sqrt(x.double()).float()


def rule_constants(rule: str, lr: float, weight_decay: float, eps: float, betas: tuple[float, float],
                   step: int) -> dict[str, float]:
    """The scalars of one step as the update uses them: each computed in float64 (Python floats) from the
    arguments, then rounded once to float32 (``lr``, ``weight_decay``, ``eps``, ``b1``, ``1 - b1``,
    ``b2``, ``1 - b2``, and Adam's bias corrections ``1 - b1**step``, ``1 - b2**step``)."""
    def f32(v: float) -> float:
        return float(torch.tensor(v, dtype=torch.float32))

    b1, b2 = betas
    out = {"lr": f32(lr), "weight_decay": f32(weight_decay), "eps": f32(eps)}
    if rule == "adam":
        out.update(b1=f32(b1), one_minus_b1=f32(1.0 - b1), b2=f32(b2), one_minus_b2=f32(1.0 - b2),
                   correction1=f32(1.0 - b1**step), correction2=f32(1.0 - b2**step))
    return out


def table_update(weight: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, state: tuple[torch.Tensor, ...], *,
                 rule: str, lr: float, weight_decay: float = 0.0, eps: float = 1e-8,
                 betas: tuple[float, float] = (0.9, 0.999), step: int = 1, validate: bool = True) -> None:
    """One optimizer step on the rows ``ids`` looked up (docs/spec.md section 11), in place.

    For each distinct row ``r`` of ``ids`` (each once, however often it was looked up):

    * ``g`` = the float32 sum of ``grad``'s rows at ``r``'s positions, in the order of ``ids``
      (the lookup order), plus ``weight_decay * w_r`` (skipped when ``weight_decay`` is 0);
    * ``"sgd"``: ``w_r -= lr * g``;
    * ``"adagrad"`` (FBGEMM's EXACT_ROWWISE_ADAGRAD): ``s_r += mean(g * g)``, ``w_r -= lr * g /
      (sqrt(s_r) + eps)``;
    * ``"adam"`` (FBGEMM's PARTIAL_ROWWISE_ADAM): ``m_r = b1 * m_r + (1 - b1) * g``, ``v_r = b2 * v_r +
      (1 - b2) * mean(g * g)``, ``w_r -= lr * (m_r / (1 - b1**step)) / (sqrt(v_r / (1 - b2**step)) + eps)``.

    Everything in float32 (the table's row read up exactly, the scalars rounded once to float32 by
    `rule_constants`); the new row is rounded once to the table's dtype. Rows not in ``ids``, and
    their state, are not touched. A non-finite gradient is not checked for (that would read values
    on the host): it makes the row, and its state, NaN or infinite.

    Args:
        weight: the table, float ``[rows, D]`` (float32, float16, bfloat16 or float64: the math is
            float32 for all of them), updated in place.
        ids: int32 / int64 ``[M]``, the rows looked up, in lookup order (token-major, head-minor).
        grad: float ``[M, D]``, the gradient of each lookup (any float dtype; summed in float32).
        state: the rule's state, updated in place: ``()`` for SGD, ``(s,)`` for Adagrad (float32
            ``[rows]``), ``(m, v)`` for Adam (float32 ``[rows, D]`` and ``[rows]``).
        rule: ``"sgd"``, ``"adagrad"`` or ``"adam"``.
        lr, weight_decay, eps, betas: the rule's hyperparameters (``eps`` and ``betas`` unused by
            the rules that have none).
        step: Adam's step count t, at least 1 (its bias corrections); unused by the other rules.
        validate: False skips the value check (the range of ``ids``), for callers whose ids came from
            a lookup that checked them; out-of-range values are then undefined behaviour.

    Raises:
        TypeError: a tensor of the wrong kind (``weight`` not float, ``ids`` not int32 / int64,
            ``grad`` not float, ``state`` not a tuple of float32 tensors); an argument of the wrong Python
            type (``rule`` not a str, ``lr``, ``weight_decay``, ``eps`` or a beta not a number, ``betas`` not
            a tuple or list, ``step`` not an int).
        ValueError: a shape or device mismatch, an id outside ``[0, rows)``, an unknown ``rule``,
            ``lr < 0``, ``weight_decay < 0``, ``eps <= 0``, a hyperparameter not finite, ``betas`` not two
            values in ``[0, 1)``, ``step < 1``.
            Nothing is modified then.
    """
    check = _checks.table_update_call if _checks.validating(validate) else _checks.table_update_meta
    check(weight, ids, grad, state, rule, lr, weight_decay, eps, betas, step)
    k = rule_constants(rule, lr, weight_decay, eps, betas, step)
    D = weight.shape[1]
    ids_list = ids.tolist()
    grad32 = grad.float()                                           # each gradient value exactly in float32

    # The distinct rows, in the order they are first looked up, and the positions of each.
    positions: dict[int, list[int]] = {}
    for i, r in enumerate(ids_list):
        positions.setdefault(r, []).append(i)

    for r, where in positions.items():
        w = weight[r].float()                                       # the row, exactly in float32
        # g: the row's gradient rows summed one after another in lookup order, in float32.
        g = torch.zeros(D, dtype=torch.float32, device=weight.device)
        for i in where:
            g = g + grad32[i]                                       # rounded to float32 at each add
        if weight_decay != 0:
            g = g + k["weight_decay"] * w                           # product rounded, then the sum rounded
        if rule == "sgd":
            new = w - k["lr"] * g                                   # lr * g rounded, then the difference
        elif rule == "adagrad":
            (s,) = state
            s_r = s[r] + (g * g).mean()                             # squares, their float32 mean, the sum: rounded
            new = w - (k["lr"] * g) / (sqrt32(s_r) + k["eps"])      # each of *, sqrt, +, /, - rounded
            s[r] = s_r
        else:
            m, v = state
            m_r = k["b1"] * m[r] + k["one_minus_b1"] * g            # two products and a sum, each rounded
            v_r = k["b2"] * v[r] + k["one_minus_b2"] * (g * g).mean()
            m_hat = m_r / k["correction1"]
            v_hat = v_r / k["correction2"]
            new = w - (k["lr"] * m_hat) / (sqrt32(v_hat) + k["eps"])
            m[r] = m_r
            v[r] = v_r
        weight[r] = new.to(weight.dtype)                            # the one rounding to the table's dtype
