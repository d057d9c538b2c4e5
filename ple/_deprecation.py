"""How a public name leaves ``ple``: never at once (docs/spec.md, section 7.15).

A public name (anything in a public module's ``__all__``; a method, property or attribute of
a public class; a keyword parameter of a public function) is removed or renamed only after a
release in which the old name still works and raises ``DeprecationWarning``. The helpers here
keep an old name working for that release and mark it, so that ``tests/test_public_surface.py``
knows it: a name of the committed snapshot (``tests/public_surface.txt``) that is missing from
the code fails that test unless the snapshot recorded it as deprecated in an earlier release.

* `deprecated_alias`, a class attribute under its old name::

      class PLECache:
          old_name = deprecated_alias("new_name", since="0.2.0")

* `deprecated_parameter`, a keyword parameter under its old name::

      @deprecated_parameter("starts", "query_start_loc_list", since="0.2.0")
      def fragments(query_start_loc_list, lo, hi): ...

  (a class's constructor parameter: the decorator on its ``__init__``; `deprecations_of` the class sees it);

* `deprecated_function`, a module-level function under its old name (keep the old name in
  ``__all__``): ``old_name = deprecated_function(new_name, "old_name", since="0.2.0")``.
* `moved_module`, a module moved to a new path (the old file keeps only this)::

      __all__ = ["DiskTable", ...]                     # the old module's public names, as they were
      __getattr__, __ple_moved__ = moved_module(__name__, "ple.io.disk_table.table", since="0.1.0")

  every name read through the old path warns and is the new module's own object;
* `warn_deprecated`, the warning itself, for anything else.

``since`` is the ``ple`` version that first warns. The next release may drop the name (and
``python tests/test_public_surface.py --update`` then drops it from the snapshot).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Deprecation", "warn_deprecated", "deprecated_alias", "deprecated_parameter", "deprecated_function",
           "deprecations_of", "moved_module", "MARKER"]

F = TypeVar("F", bound=Callable[..., Any])

MARKER = "__ple_deprecated__"
"""The attribute a wrapper of `deprecated_parameter` / `deprecated_function` carries: its `Deprecation`s."""


@dataclass(frozen=True)
class Deprecation:
    """One old name kept for a release: ``kind`` is ``"attribute"`` (of a class), ``"parameter"`` (of a
    function), ``"function"`` (of a module) or ``"module"`` (a module moved: ``name`` its old path,
    ``replacement`` its new one); ``replacement`` is the name to use instead (or None)."""

    kind: str
    name: str
    replacement: str | None
    since: str


def _check_since(since: object) -> str:
    if not isinstance(since, str) or not all(part.isdigit() for part in since.split(".")):
        raise ValueError(f"since: expected the ple version that first warns, like '0.2.0', got {since!r}")
    return since


def warn_deprecated(what: str, replacement: str | None, since: str, *, stacklevel: int = 3) -> None:
    """Raise the ``DeprecationWarning`` of ``what`` (deprecated since ple ``since``), naming the replacement.

    ``stacklevel=3`` points the warning at the caller of the function that calls this one (the user's line).
    """
    instead = f"; use {replacement} instead" if replacement else ""
    warnings.warn(f"{what} is deprecated since ple {since} and will be removed in a later release{instead}",
                  DeprecationWarning, stacklevel=stacklevel)


class deprecated_alias:  # noqa: N801 (used like a decorator / property)
    """A class attribute kept under an old name: reading or setting it warns and forwards to ``new``."""

    def __init__(self, new: str, *, since: str) -> None:
        if not isinstance(new, str) or not new.isidentifier():
            raise ValueError(f"new: expected the attribute's new name, got {new!r}")
        self.new = new
        self.since = _check_since(since)
        self.name = "?"
        self.owner = "?"

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.owner = owner.__qualname__

    @property
    def deprecation(self) -> Deprecation:
        return Deprecation("attribute", self.name, self.new, self.since)

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        warn_deprecated(f"{self.owner}.{self.name}", f"{self.owner}.{self.new}", self.since)
        return getattr(obj, self.new)

    def __set__(self, obj: object, value: Any) -> None:
        warn_deprecated(f"{self.owner}.{self.name}", f"{self.owner}.{self.new}", self.since)
        setattr(obj, self.new, value)


def _marked(wrapper: Callable[..., Any], wrapped: Callable[..., Any], deprecation: Deprecation) -> None:
    """Record ``deprecation`` on ``wrapper``, after those of ``wrapped`` (stacked decorators keep them all)."""
    setattr(wrapper, MARKER, (*deprecations_of(wrapped), deprecation))


def deprecations_of(func: object) -> tuple[Deprecation, ...]:
    """The deprecations a function carries (its deprecated parameters; itself if it is a deprecated name); a
    class, also those of its constructor (`deprecated_parameter` on ``__init__``)."""
    own = tuple(getattr(func, MARKER, ()))
    return own + tuple(getattr(getattr(func, "__init__", None), MARKER, ())) if isinstance(func, type) else own


def deprecated_parameter(old: str, new: str, *, since: str) -> Callable[[F], F]:
    """Decorator: keyword ``old`` still works (and warns), passed on as ``new``; both at once is a ``TypeError``.

    Stacked on another `deprecated_parameter`, the two make one wrapper (so each warning points at the caller).
    """
    _check_since(since)

    def wrap(func: F) -> F:
        target = getattr(func, "_ple_renamed", func)                    # the function under the wrappers
        renames = {**getattr(func, "_ple_renames", {}), old: (new, since)}   # old -> (new, since)

        @functools.wraps(target)
        def inner(*args: Any, **kwargs: Any) -> Any:
            for was in [k for k in kwargs if k in renames]:
                now, first = renames[was]
                if now in kwargs:
                    raise TypeError(f"{target.__qualname__}() got both {was!r} (deprecated) and {now!r}; "
                                    f"pass {now!r}")
                warn_deprecated(f"the {was!r} argument of {target.__qualname__}", repr(now), first)
                kwargs[now] = kwargs.pop(was)
            return target(*args, **kwargs)

        inner._ple_renamed = target  # type: ignore[attr-defined]
        inner._ple_renames = renames  # type: ignore[attr-defined]
        _marked(inner, func, Deprecation("parameter", old, new, since))
        return inner  # type: ignore[return-value]

    return wrap


def deprecated_function(func: F, old: str, *, since: str) -> F:
    """``func`` under its old name ``old``: calling it warns, then calls ``func``."""
    _check_since(since)
    if not callable(func):
        raise TypeError(f"func: expected the function that replaces {old!r}, got {type(func).__name__}")

    @functools.wraps(func)
    def inner(*args: Any, **kwargs: Any) -> Any:
        warn_deprecated(f"{func.__module__}.{old}", f"{func.__module__}.{func.__name__}", since)
        return func(*args, **kwargs)

    inner.__name__ = inner.__qualname__ = old
    _marked(inner, func, Deprecation("function", old, func.__name__, since))
    return inner  # type: ignore[return-value]


def moved_module(old: str, new: str, *, since: str) -> tuple[Callable[[str], Any], Deprecation]:
    """A module moved from ``old`` to ``new``: returns the old module's ``(__getattr__, __ple_moved__)``.

    Reading any name of the new module through the old path (``from old import X``, ``old.X``) raises the
    ``DeprecationWarning`` (pointing at the reader's line) and gives the new module's own object, so classes
    and constants stay one object under both paths. ``import old`` alone does not warn: nothing is used yet.
    ``__ple_moved__`` tells ``tests/test_public_surface.py`` that every entry under the old path is deprecated
    since ``since``.
    """
    _check_since(since)
    target = importlib.import_module(new)

    def __getattr__(name: str) -> Any:  # noqa: N807 (a module's __getattr__)
        if name.startswith("__") or not hasattr(target, name):
            raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {new!r})")
        warn_deprecated(f"{old}.{name}", f"{new}.{name}", since)
        return getattr(target, name)

    return __getattr__, Deprecation("module", old, new, since)
