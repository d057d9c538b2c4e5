"""The checks every op's validation is made of: one argument's type, rank, dtype kind, device and shape;
scalars, one helper per kind (`int_arg`, `float_arg`, `bool_arg`, `choice_arg`; `choices_arg` for a
sequence of choices); cumulative row offsets; host values (`host_values`, the ``host`` mapping); and `full_check`, which
makes an op's ``<op>_call`` from its ``<op>_meta`` and ``<op>_values`` (see the package docstring)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence, Set

import torch

_INDEX_DTYPES = (torch.int32, torch.int64)

Host = Mapping[str, Sequence[int]] | None
"""Host values by argument name (see the package docstring); None: copy what is needed."""


def _kind_ok(dtype: torch.dtype, kind: str) -> tuple[bool, str]:
    if kind in ("index", "int"):
        return dtype in _INDEX_DTYPES, "an int32 or int64 tensor"
    if kind == "anyint":
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool), "an integer tensor"
    if kind == "flag":
        return not (dtype.is_floating_point or dtype.is_complex), "a bool or integer tensor"
    if kind == "float":
        return dtype.is_floating_point, "a floating-point tensor"
    raise AssertionError(f"unknown tensor kind {kind!r}")


def tensor(name: str, t, *, ndim: int | None = None, kind: str | None = None, device=None,
           shape: tuple | None = None) -> torch.Tensor:
    """Check ``t``'s rank, kind, device and shape (``None`` entries: any); a wrong kind is a ``TypeError``.

    Kinds: ``"index"`` (int32 / int64 only; ``"int"`` the same), ``"anyint"`` (any integer
    dtype but bool), ``"flag"`` (bool or any integer dtype), ``"float"``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if kind is not None:
        ok, want = _kind_ok(t.dtype, kind)
        if not ok:
            raise TypeError(f"{name}: expected {want}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            wanted = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {wanted}, got {tuple(t.shape)}")
    return t


def index(name: str, t, *, ndim: int = 1, device=None, shape: tuple | None = None,
          kind: str = "index") -> torch.Tensor:
    """An index (or flag) tensor whose values the op needs: ``tensor`` checks, and not on the meta device."""
    tensor(name, t, ndim=ndim, kind=kind, device=device, shape=shape)
    if t.device.type == "meta":
        raise ValueError(f"{name}: its values are needed, so it cannot be on the meta device")
    return t


# ---- scalars: one helper per kind (docs/spec.md section 9) ---------------------------------------------
# A wrong Python type is a ``TypeError``; the right type outside its range or set a ``ValueError``; each message
# starts with the argument's name. Each returns the value as a plain Python scalar.
#
# int: a Python int or any ``numbers.Integral`` (numpy's integer scalars), returned as ``int``. Not a bool
# (``True`` where a count or an index belongs is a mistake, so it is a ``TypeError`` although bool subclasses
# int), and not a tensor, even a 0-dim one (reading it is a device-to-host copy, which does not trace: pass
# ``int(t)``). float: any ``numbers.Real`` but a bool (a Python int or float, numpy's scalars), returned as
# ``float``. bool: ``True`` or ``False`` only (not 0 / 1, not ``numpy.bool_``). A choice: a ``str`` of a fixed
# set (an int or ``None`` in its place is a ``TypeError``, an unknown string a ``ValueError``).


def int_arg(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]`` (``None``: unbounded); see the kinds above."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        want = (f">= {minimum}" if maximum is None else f"<= {maximum}" if minimum is None
                else f"in [{minimum}, {maximum}]")
        raise ValueError(f"{name}: expected an int {want}, got {value}")
    return value


def float_arg(name: str, value, *, minimum: float | None = None, above: float | None = None,
              below: float | None = None, finite: bool = False) -> float:
    """``value`` as a float ``>= minimum``, ``> above`` and ``< below`` (each ``None``: unbounded), finite if
    ``finite``; NaN fails every bound. See the kinds above."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a float (an int or float), got {type(value).__name__}")
    x = float(value)
    bounds = [(minimum, ">=", lambda b: x >= b), (above, ">", lambda b: x > b), (below, "<", lambda b: x < b)]
    if any(b is not None and not ok(b) for b, _, ok in bounds) or (finite and not math.isfinite(x)):
        want = " and ".join(f"{op} {b}" for b, op, _ in bounds if b is not None)
        want = ("a finite float" if finite else "a float") + (f" {want}" if want else "")
        raise ValueError(f"{name}: expected {want}, got {value!r}")
    return x


def bool_arg(name: str, value) -> bool:
    """``value``, which must be ``True`` or ``False``; see the kinds above."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool (True or False), got {type(value).__name__}")
    return value


def validating(validate) -> bool:
    """An op's ``validate`` flag, which must be ``True`` or ``False`` (a ``TypeError`` naming it otherwise): whether
    the op checks its values as well as its metadata."""
    return bool_arg("validate", validate)


def _one_of(choices: Sequence) -> str:
    return ", ".join(map(repr, choices))


def choice_arg(name: str, value, choices: Sequence[str]) -> str:
    """``value``, a ``str`` among ``choices``; see the kinds above."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected one of {_one_of(choices)} (a str), got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name}: expected one of {_one_of(choices)}, got {value!r}")
    return value


def choices_arg(name: str, values, choices: Sequence, *, kind: type = str, allow_empty: bool = False) -> tuple:
    """``values``, a sequence (a list, a tuple, ...; not a ``str``, not a single ``kind``) of ``kind`` items
    among ``choices``, as a tuple: a kit's ``modes``, ``dtypes``, .... Not a sequence, or an item not a
    ``kind``: a ``TypeError``; an unknown item, or none at all unless ``allow_empty``: a ``ValueError``."""
    what = f"a sequence of {_one_of(choices)}"
    if isinstance(values, (str, bytes, kind)) or not isinstance(values, (Sequence, Set)):
        raise TypeError(f"{name}: expected {what}, got {type(values).__name__} {values!r}")
    items = tuple(values)
    wrong = [v for v in items if not isinstance(v, kind)]
    if wrong:
        raise TypeError(f"{name}: expected {what}, got {type(wrong[0]).__name__} {wrong[0]!r} among them")
    unknown = [v for v in items if v not in choices]
    if unknown or not (items or allow_empty):
        got = f"unknown {_one_of(unknown)}" if unknown else "none"
        raise ValueError(f"{name}: expected {what}{', or none' if allow_empty else ''}; got {got}")
    return items


def host_list(t: torch.Tensor) -> list[int]:
    """The values of an integer tensor as a Python list (one device-to-host copy)."""
    return t.detach().to("cpu", torch.int64).tolist()


def host_values(name: str, t: torch.Tensor, host: Host = None) -> torch.Tensor:
    """Argument ``name``'s values as a CPU int64 tensor: ``host[name]`` if given (with ``t``'s shape), else a copy."""
    if host is not None and name in host:
        v = torch.as_tensor(host[name], dtype=torch.int64)
        if tuple(v.shape) != tuple(t.shape):
            raise ValueError(f"{name}: host values of shape {tuple(v.shape)} given for a tensor of shape "
                             f"{tuple(t.shape)}")
        return v
    return t.detach().to("cpu", torch.int64)


def value_range(name: str, v: torch.Tensor, hi: int, what: str) -> None:
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= hi):
        raise ValueError(f"{name}: {what} must lie in [0, {hi}), got min {int(v.min())} and max {int(v.max())}")


def offsets_meta(name: str, t, *, device, num_requests: int | None = None) -> int:
    """Metadata of cumulative row offsets ``[R+1]``; returns R."""
    index(name, t, device=device)
    if t.numel() < 1:
        raise ValueError(f"{name}: expected at least one entry (R + 1 offsets), got an empty tensor")
    if num_requests is not None and t.numel() != num_requests + 1:
        raise ValueError(f"{name}: expected {num_requests + 1} entries (one per request + 1), got {t.numel()}")
    return t.numel() - 1


def offsets_values(name: str, t: torch.Tensor, *, total: int, host: Host = None) -> list[int]:
    """Values of cumulative row offsets: start at 0, non-decreasing, end at ``total``; returns them."""
    q = host_values(name, t, host).tolist()
    if q[0] != 0:
        raise ValueError(f"{name}: expected to start at 0, got {q[0]}")
    if any(b < a for a, b in zip(q, q[1:])):
        raise ValueError(f"{name}: expected non-decreasing offsets, got {q}")
    if q[-1] != total:
        raise ValueError(f"{name}: expected to end at the number of rows {total}, got {q[-1]}")
    return q


def offsets_arg(name: str, t, *, total: int, device, num_requests: int | None = None,
                host: Host = None) -> list[int]:
    """Validate cumulative row offsets ``[R+1]``: start at 0, non-decreasing, end at ``total``."""
    offsets_meta(name, t, device=device, num_requests=num_requests)
    return offsets_values(name, t, total=total, host=host)


def rows_values(t: torch.Tensor, num_tokens: int, host: Host, *, distinct: bool) -> list[int]:
    rows = host_values("token_indices", t, host).tolist()
    if any(not 0 <= r < num_tokens for r in rows):
        raise ValueError(f"token_indices: expected rows in [0, {num_tokens}), got {rows}")
    if distinct and len(set(rows)) != len(rows):
        raise ValueError("token_indices: expected distinct rows, got repeats")
    return rows


def full_check(meta, values, what: str):
    """``<op>_call``: ``meta(*args, **kwargs)`` then ``values(*args, host=host, **kwargs)`` (the op's arguments)."""

    def call(*args, host: Host = None, **kwargs):
        meta(*args, **kwargs)
        return values(*args, host=host, **kwargs)

    call.__doc__ = f"Validate a ``{what}`` call (its arguments, and ``host``): metadata, then values."
    return call
