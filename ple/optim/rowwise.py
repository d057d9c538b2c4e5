"""The row optimizers: `SparseSGD`, `RowwiseAdagrad`, `RowwiseAdam` (see the package docstring)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import _checks

if TYPE_CHECKING:
    from types import ModuleType

    from ..table import Table

__all__ = ["SparseSGD", "RowwiseAdagrad", "RowwiseAdam", "RowOptimizer", "other_parameters", "update_ops",
           "STATE_NAMES"]

STATE_NAMES = {"sgd": (), "adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq")}
"""Each rule's state tensors, in the order ``table_update`` takes them (their shapes: ``_checks.state_shapes``)."""


def _tables(params: Any) -> list[Table]:
    """The tables of ``params``: a PLELayer, a table, or an iterable of them, each table once."""
    from ..table import Table

    items = [params] if isinstance(params, Table) or _is_layer(params) else params
    if not isinstance(items, Iterable) or isinstance(items, torch.Tensor):
        raise TypeError(f"params: expected a PLELayer, a table or an iterable of them, got {type(params).__name__}")
    out: list[Table] = []
    for item in items:
        table = item.table if _is_layer(item) else item
        if not isinstance(table, Table):
            raise TypeError(f"params: expected PLELayers or tables (ple.table.Table), got {type(item).__name__}")
        if any(t is table for t in out):
            raise ValueError("params: a table is given twice")
        out.append(table)
    if not out:
        raise ValueError("params: no table given")
    return out


def _is_layer(obj: Any) -> bool:
    """A `PLELayer` (told by its table; ``ple.layer`` sits above this module)."""
    from ..table import Table

    return isinstance(obj, torch.nn.Module) and isinstance(getattr(obj, "table", None), Table)


def other_parameters(layer: torch.nn.Module) -> list[torch.nn.Parameter]:
    """``layer``'s parameters but its table's weight: what a PyTorch optimizer beside a row optimizer takes."""
    if not _is_layer(layer):
        raise TypeError(f"layer: expected a PLELayer, got {type(layer).__name__}")
    table_weight = cast("Table", layer.table).weight
    return [p for p in layer.parameters() if p is not table_weight]


def _overlay_of(table: Table) -> Any:
    """The overlay a disk table trains through (``ple.io.disk_table.training.TableOverlay``), or None."""
    return getattr(table, "_overlay", None)


def _check_trainable(table: Table) -> None:
    w = table.trained
    if table.quantized and _overlay_of(table) is None:
        what = "nf4" if w.dtype == torch.uint8 else ("fp8" if table.scale is not None and table.scale.numel() == 1
                                                      else "int8")
        raise ValueError(f"params: the table is quantized ({what}); a quantized table does not train (train a float "
                         f"table and quantize it after)")
    if not w.requires_grad:
        raise ValueError("params: the table is frozen (its weight does not require grad); set "
                         "layer.table.trained.requires_grad_(True) to train it")
    if table.sparse_grad:
        raise ValueError("params: the table was made with sparse_table_grad=True, for torch.optim.SparseAdam; a row "
                         "optimizer needs no gradient tensor (make the layer without it)")
    owner = table.row_optimizer
    if owner is not None:
        raise ValueError(f"params: the table is already trained by another optimizer ({type(owner).__name__}); "
                         f"one optimizer per table")


_sharded: Any = None           # what trains a sharded (DTensor) table: set by register_sharded_training


def register_sharded_training(impl: Any) -> None:
    """Set what trains a sharded (DTensor) table: an object (a module) with ``local_state_shapes(table, rule)``,
    ``route_lookups(table, ids, grad)`` and ``sharded_update(table, ids, grad, state, op, **hyperparameters)``.

    ``ple.distributed`` registers ``ple.distributed.row_update`` when imported (this module imports nothing
    above it); a DTensor table is made by ``ple.distributed``, so it is there before any such table is.
    """
    global _sharded
    _sharded = impl


def _sharded_training() -> Any:
    if _sharded is None:
        raise RuntimeError("a DTensor table is trained through ple.distributed: import ple.distributed")
    return _sharded


def _state_shapes(table: Table, rule: str) -> tuple[tuple[int, ...], ...]:
    """The shapes of ``rule``'s state for ``table``: a sharded (DTensor) table's are those of this rank's piece
    (``ple.distributed.row_update``)."""
    if table.is_dtensor:
        return cast("tuple[tuple[int, ...], ...]", _sharded_training().local_state_shapes(table, rule))
    return _checks.state_shapes(rule, table.num_rows, table.dim)


def update_ops(ops: ModuleType | Any, weight: torch.Tensor) -> Any:
    """The ``table_update`` to run for a table on ``weight``'s device, given the layer's op module: its own
    where it has one and can run there, else the torch backend's (e.g. a host table on the Triton backend)."""
    fn = getattr(ops, "table_update", None)
    from .. import vectorized

    if fn is None:
        return vectorized.table_update
    if getattr(ops, "__name__", "") == "ple.fast" and weight.device.type == "cpu":
        from ..fast._library import INTERPRETED

        if not INTERPRETED:
            return vectorized.table_update
    return fn


class RowOptimizer(torch.optim.Optimizer):
    """The common machinery of `SparseSGD`, `RowwiseAdagrad` and `RowwiseAdam` (not made directly)."""

    rule = ""

    def __init__(self, params: Any, lr: float, *, weight_decay: float = 0.0, eps: float = 1e-8,
                 betas: tuple[float, float] = (0.9, 0.999), fused: bool = False) -> None:
        if type(self) is RowOptimizer:
            raise TypeError("RowOptimizer: use SparseSGD, RowwiseAdagrad or RowwiseAdam")
        _checks.hyperparameters(self.rule, lr, weight_decay, eps, betas)
        _checks.bool_arg("fused", fused)
        tables = _tables(params)
        for t in tables:
            _check_trainable(t)
        defaults = dict(lr=float(lr), weight_decay=float(weight_decay), eps=float(eps),
                        betas=(float(betas[0]), float(betas[1])), rule=self.rule)
        super().__init__([t.trained for t in tables], defaults)
        self.fused = fused
        self._tables = tables
        self._pending: dict[int, list[tuple[torch.Tensor, torch.Tensor, Any]]] = {}
        for t in tables:                          # an overlay's rows must fit the rule: checked before any change
            overlay = _overlay_of(t)
            if overlay is not None:
                overlay.attach(self.rule, STATE_NAMES[self.rule], _state_shapes(t, self.rule))
        for t in tables:
            w = t.trained
            st = self.state[w]
            st["step"] = 0
            if _overlay_of(t) is None:            # a disk table's state lives in its overlay, row by row
                for name, shape in zip(STATE_NAMES[self.rule], _state_shapes(t, self.rule), strict=True):
                    st[name] = torch.zeros(shape, dtype=torch.float32, device=w.device)
            t._row_sink = weakref.ref(self)

    # ---- what the table calls ---------------------------------------------------------------------
    def _accept(self, table: Table, ids: torch.Tensor, grad: torch.Tensor, ops: Any) -> None:
        """A lookup's backward: ``ids`` ``[T, NH]`` and the gradient of its rows ``[T, NH * D]``."""
        D = table.dim
        flat_ids, flat_grad = ids.reshape(-1), grad.reshape(-1, D)
        if table.is_dtensor:                 # what this rank keeps: its rows' lookups, or its columns of all
            flat_ids, flat_grad = _sharded_training().route_lookups(table, flat_ids, flat_grad)
        if self.fused:
            with torch.no_grad():
                self._apply(table, [(flat_ids, flat_grad, ops)], count_step=True)
        else:
            self._pending.setdefault(id(table), []).append((flat_ids, flat_grad, ops))

    # ---- the optimizer ------------------------------------------------------------------------------
    def _group_of(self, weight: torch.Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(p is weight for p in group["params"]):
                return group
        raise AssertionError("a table outside the optimizer's groups")

    def _apply(self, table: Table, calls: list[tuple[torch.Tensor, torch.Tensor, Any]], *, count_step: bool) -> None:
        w = table.trained
        st = self.state[w]
        if count_step:
            st["step"] += 1
        if not calls:
            return
        dev = w.device if _overlay_of(table) is None else torch.device("cpu")     # a disk table: on the host
        # Asynchronous only towards a GPU: a non-blocking copy to the host may be read before it has landed.
        nb = dev.type == "cuda"
        if len(calls) == 1:                                       # one backward call: no copy
            ids, grad = calls[0][0].to(dev, non_blocking=nb), calls[0][1].to(dev, non_blocking=nb)
        else:
            ids = torch.cat([c[0].to(dev, non_blocking=nb) for c in calls])
            grad = torch.cat([c[1].to(dev, non_blocking=nb) for c in calls])
        group = self._group_of(w)
        hyper: dict[str, Any] = dict(rule=self.rule, lr=group["lr"], weight_decay=group["weight_decay"],
                                     eps=group["eps"], betas=tuple(group["betas"]), step=max(st["step"], 1))
        overlay = _overlay_of(table)
        if overlay is not None:              # a disk table: the step's rows and state, in its overlay
            overlay.update(ids, grad, update_ops(calls[-1][2], ids.new_empty(0, dtype=torch.float32)), hyper)
            return
        update = update_ops(calls[-1][2], w)
        state = tuple(st[n] for n in STATE_NAMES[self.rule])
        if table.is_dtensor:                 # this rank's piece and state (ple.distributed.row_update)
            _sharded_training().sharded_update(table, ids, grad, state, update, **hyper)
            return
        update(w.data, ids, grad, state, validate=False, **hyper)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Update the rows looked up since the last ``zero_grad()`` (with ``fused=True``: nothing to do)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.fused:
            return loss
        for t in self._tables:
            self._apply(t, self._pending.pop(id(t), []), count_step=True)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the lookups' gradients not yet applied."""
        self._pending.clear()

    def state_dict(self) -> dict[str, Any]:
        """PyTorch's layout (``state`` by parameter index, ``param_groups``); each group names its ``rule``."""
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict` of the same rule and table sizes, into the state tensors in place (float32 kept).

        Raises ``ValueError`` naming ``state_dict`` (nothing loaded) for another rule, another number of
        tables, or state of another shape; ``TypeError`` for state that is not float32."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise TypeError("state_dict: expected an optimizer state dict (with 'state' and 'param_groups')")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict: {len(groups)} parameter groups, this optimizer has {len(self.param_groups)}")
        index = 0
        plan = []
        for saved, group in zip(groups, self.param_groups, strict=True):
            if saved.get("rule") != self.rule:
                raise ValueError(f"state_dict: saved by a {saved.get('rule')!r} optimizer, this one is {self.rule!r}")
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"state_dict: a group of {len(saved['params'])} tables, this one has "
                                 f"{len(group['params'])}")
            _checks.hyperparameters(self.rule, saved["lr"], saved["weight_decay"], saved["eps"], saved["betas"])
            for key, w in zip(saved["params"], group["params"], strict=True):
                st = state_dict["state"].get(key, {})
                table = next(t for t in self._tables if t.trained is w)
                names = () if _overlay_of(table) is not None else STATE_NAMES[self.rule]   # in the overlay
                for name, shape in zip(names, _state_shapes(table, self.rule)[:len(names)], strict=True):
                    t = st.get(name)
                    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                        piece = " (this rank's piece)" if table.is_dtensor else ""
                        raise ValueError(f"state_dict: table {index}'s {name!r} should be {shape}{piece} for a table "
                                         f"of {tuple(w.shape)}, got {got}")
                    if t.dtype != torch.float32:
                        raise TypeError(f"state_dict: table {index}'s {name!r} should be float32, got {t.dtype}")
                step = st.get("step", 0)
                if isinstance(step, torch.Tensor):
                    step = int(step.item())
                step = _checks.int_arg(f"state_dict: table {index}'s step", step, minimum=0)
                plan.append((w, st, step))
                index += 1
        for w, st, step in plan:
            mine = self.state[w]
            mine["step"] = step
            for name in STATE_NAMES[self.rule]:
                if name in mine:                  # not a disk table's: its state is in its overlay
                    mine[name].copy_(cast(torch.Tensor, st[name]))
        for saved, group in zip(groups, self.param_groups, strict=True):
            for key in ("lr", "weight_decay", "eps", "betas", "initial_lr"):
                if key in saved:
                    group[key] = tuple(saved[key]) if key == "betas" else saved[key]

    def describe_table(self, table: Table) -> dict[str, Any]:
        """What resumes ``table``'s training besides its rows' state: the rule, the step count and the group's
        hyperparameters (JSON-able; a disk table's overlay keeps it at each flush, for ``ple.io.load_optimizer``)."""
        group = self._group_of(table.trained)
        out = {"rule": self.rule, "step": int(self.state[table.trained]["step"])}
        for key in ("lr", "weight_decay", "eps", "betas", "initial_lr"):
            if key in group:
                out[key] = list(group[key]) if key == "betas" else float(group[key])
        return out

    def __repr__(self) -> str:
        g = self.param_groups[0]
        extra = {"sgd": "", "adagrad": f", eps={g['eps']}", "adam": f", betas={tuple(g['betas'])}, eps={g['eps']}"}
        return (f"{type(self).__name__}({len(self._tables)} table(s), lr={g['lr']}, weight_decay={g['weight_decay']}"
                f"{extra[self.rule]}, fused={self.fused})")


class SparseSGD(RowOptimizer):
    """SGD on the rows looked up: ``w_r -= lr * g`` (``g`` with ``weight_decay * w_r`` added). No state.

    Args:
        params: a `PLELayer`, a table, or an iterable of them (each table once; trainable: a float table whose
            weight requires grad, not held by another optimizer). A sharded (DTensor) table too: each rank
            updates the rows or columns it holds and keeps their state (``ple.distributed.row_update``).
        lr: the learning rate, >= 0.
        weight_decay: L2 weight decay added to the gradient, >= 0.
        fused: apply each backward call's update inside the backward (no gradient kept).

    Raises:
        ValueError / TypeError naming the argument (``params``, ``lr``, ``weight_decay``); nothing is changed.
    """

    rule = "sgd"

    def __init__(self, params: Any, lr: float, *, weight_decay: float = 0.0, fused: bool = False) -> None:
        super().__init__(params, lr, weight_decay=weight_decay, fused=fused)


class RowwiseAdagrad(RowOptimizer):
    """Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD): ``s_r += mean(g * g)``, ``w_r -= lr * g / (sqrt(s_r) +
    eps)``. State: ``sum``, float32 ``[rows]`` (4 bytes a row), zeros at the start.

    Args:
        params, lr, weight_decay, fused: as for `SparseSGD`.
        eps: added to ``sqrt(s_r)``, > 0.
    """

    rule = "adagrad"

    def __init__(self, params: Any, lr: float, *, eps: float = 1e-8, weight_decay: float = 0.0,
                 fused: bool = False) -> None:
        super().__init__(params, lr, weight_decay=weight_decay, eps=eps, fused=fused)


class RowwiseAdam(RowOptimizer):
    """Adam with a row-wise second moment (FBGEMM's PARTIAL_ROWWISE_ADAM): ``m_r = b1 m_r + (1 - b1) g``, ``v_r =
    b2 v_r + (1 - b2) mean(g * g)``, ``w_r -= lr (m_r / (1 - b1^t)) / (sqrt(v_r / (1 - b2^t)) + eps)``, t the
    optimizer's step count (+1 per ``step()``; per backward call when fused). Rows not looked up keep their
    moments (lazy, as ``torch.optim.SparseAdam``). State: ``exp_avg`` float32 ``[rows, D]``, ``exp_avg_sq``
    float32 ``[rows]``.

    Args:
        params, lr, weight_decay, fused: as for `SparseSGD`.
        betas: ``(b1, b2)``, each in ``[0, 1)``.
        eps: > 0.
    """

    rule = "adam"

    def __init__(self, params: Any, lr: float, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, fused: bool = False) -> None:
        super().__init__(params, lr, weight_decay=weight_decay, eps=eps, betas=betas, fused=fused)
