"""Run an op written for one device on tensors of another: `on_device`, and `ops_on_device` for a whole module.

The kit and the test suite build their cases on the CPU (seeded ``torch.Generator``\\ s, small sizes). On
a GPU machine the Triton kernels run compiled and refuse CPU tensors, so to check them there each call
is moved: every tensor argument is copied to the device (with autograd, so gradients flow back to the
CPU leaves), the op runs, tensor results come back to the argument's device, and tensor arguments the op
changed in place (``ple_conv``'s ``residual`` and ``conv_state``, ``table_update``'s ``weight`` and the
tensors of its ``state`` tuple, ...) are copied back into the caller's tensors, views included. The bits are
the op's own: a copy changes none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["on_device", "ops_on_device"]


def _moved(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor) and x.device != device:
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_moved(v, device) for v in x)
    return x


def _back(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(_back(v, device) for v in x)
    return x


def _pairs(orig: Any, moved: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(a caller's tensor, its copy on the device), for every tensor argument moved, inside tuples and lists too."""
    if isinstance(orig, torch.Tensor):
        return [] if moved is orig else [(orig, moved)]
    if isinstance(orig, (list, tuple)):
        return [p for o, m in zip(orig, moved, strict=True) for p in _pairs(o, m)]
    return []


def on_device(fn: Callable[..., Any], device: torch.device | str) -> Callable[..., Any]:
    """``fn`` run on ``device`` for arguments on any device; see the module docstring.

    Results come back to the device of the first tensor argument. Tensors the call mutates in place (an
    argument, or one inside a tuple or list argument) are copied back into the caller's tensors after it
    returns (a version-counter check finds them).
    """
    device = torch.device(device)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        flat = [*args, *kwargs.values()]
        home = next((t.device for t in flat if isinstance(t, torch.Tensor)), None)
        if home is None or home == device:
            return fn(*args, **kwargs)
        moved_args = [_moved(a, device) for a in args]
        moved_kwargs = {k: _moved(v, device) for k, v in kwargs.items()}
        pairs = _pairs([*args, *kwargs.values()], [*moved_args, *moved_kwargs.values()])
        versions = [m._version for _, m in pairs]
        out = fn(*moved_args, **moved_kwargs)
        with torch.no_grad():
            for (orig, moved), v in zip(pairs, versions, strict=True):
                if moved._version != v:                      # changed in place: write it back
                    orig.copy_(moved)
        return _back(out, home)

    return call


def ops_on_device(ops: object, names: Iterable[str], device: torch.device | str) -> SimpleNamespace:
    """A namespace of ``ops``'s ``names``, each wrapped by `on_device`; other attributes of ``ops`` (flags
    such as ``FUSED_KV_PROJECTION``) are kept."""
    space = SimpleNamespace(**{k: getattr(ops, k) for k in dir(ops) if k.isupper()})
    for name in names:
        setattr(space, name, on_device(getattr(ops, name), device))
    return space
