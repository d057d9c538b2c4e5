"""Count the places a piece of code turns a tensor into a Python value (a device-to-host sync on a GPU).

>>> with count_host_conversions() as seen:
...     layer.step(hidden, batch, cache)
>>> assert seen.count == 0, seen.report()

Counted while the block runs: ``Tensor.item``, ``tolist``, ``numpy``, ``int()``, ``float()``,
``bool()`` (an ``if tensor:``), ``operator.index`` (a tensor used as a Python int), ``torch.equal``
(returns a Python bool), and ``.cpu()`` / ``.to("cpu")`` of a tensor that is not on the CPU.
Each record keeps the method and the innermost frame outside torch, so a failure says where.
Tensor creation from Python values (``torch.tensor([...])``) and host-to-device copies are
not conversions and are not counted.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

__all__ = ["count_host_conversions", "Conversions"]

_METHODS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")


@dataclass
class Conversions:
    """What `count_host_conversions` saw: ``(method, where)`` records."""

    records: list = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.records)

    def report(self, limit: int = 10) -> str:
        lines = [f"{self.count} tensor-to-Python conversion(s):"]
        lines += [f"  {what} at {where}" for what, where in self.records[:limit]]
        if self.count > limit:
            lines.append(f"  ... and {self.count - limit} more")
        return "\n".join(lines)


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("conversions.py"):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "?"


@contextlib.contextmanager
def count_host_conversions() -> Iterator[Conversions]:
    """Patch the conversion methods of ``torch.Tensor`` (and ``torch.equal``) for the block; yields a
    `Conversions` that fills up as they are called."""
    seen = Conversions()
    saved = {name: getattr(torch.Tensor, name) for name in _METHODS + ("cpu", "to")}
    saved_equal = torch.equal

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            seen.records.append((name, _caller()))
            return original(self, *args, **kwargs)
        return wrapper

    def cpu(self, *args, **kwargs):
        if self.device.type != "cpu":
            seen.records.append(("cpu", _caller()))
        return saved["cpu"](self, *args, **kwargs)

    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if self.device.type != "cpu" and isinstance(target, (str, torch.device)) \
                and torch.device(target).type == "cpu":
            seen.records.append(("to(cpu)", _caller()))
        return saved["to"](self, *args, **kwargs)

    def equal(*args, **kwargs):
        seen.records.append(("torch.equal", _caller()))
        return saved_equal(*args, **kwargs)

    try:
        for name in _METHODS:
            setattr(torch.Tensor, name, counting(name, saved[name]))
        # Patching methods for the duration of the block is the point here.
        torch.Tensor.cpu, torch.Tensor.to, torch.equal = cpu, to, equal  # type: ignore[method-assign]
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.equal = saved_equal
