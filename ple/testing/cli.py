"""``python -m ple check MODULE[:ATTR]``: run the kit (docs/spec.md section 10) on an object of ops, one line per op.

The object is imported (``MODULE`` is a dotted module name importable from the current directory,
or a path to a ``.py`` file; ``ATTR`` a dotted attribute of it: a namespace, a class instance, ...).
For every op of ``ple.backends.OP_NAMES`` it has, and ``table_update`` (the row optimizers' op, which the
layer does not call), ``ple.testing.check_<op>`` runs against the reference; then ``check_layer`` if it
has every op of ``OP_NAMES`` (``--ops`` picks a subset, ``layer`` included).
Each line says the op, the calls of the user's functions the cases made, the time, for the two lookups
(``embedding_lookup``, ``ngram_embedding``) the tables their cases gathered (float dtypes, then the
quantized schemes: ``fp8``, ``int8``, ``nf4``; ``--schemes`` picks them), and ``ok`` or ``FAIL`` with
the first line of the failure and its smallest case. Exit 0 when all pass, 1 on a failure, 2 on a
usage error (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import inspect
import pathlib
import sys
import time
from collections.abc import Callable
from typing import IO, Any

__all__ = ["register", "run_checks", "load_object"]

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float64": "float64", "fp64": "float64", "float16": "float16", "fp16": "float16"}


_OTHER_OPS = ("table_update",)
"""Ops the kit checks beside ``OP_NAMES``: backend ops the layer itself does not call (the row optimizers')."""


class UsageError(Exception):
    """A bad command line: printed as one ``error:`` line, exit status 2."""


def load_object(spec: str) -> object:
    """``MODULE[:ATTR]`` -> the object. ``MODULE`` is a dotted name (the current directory is importable)
    or a ``.py`` path; ``ATTR`` a dotted attribute path."""
    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise UsageError(f"MODULE: expected MODULE[:ATTR], got {spec!r}")
    if module_name.endswith(".py"):
        path = pathlib.Path(module_name)
        if not path.is_file():
            raise UsageError(f"MODULE: no file {module_name}")
        loader_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert loader_spec is not None and loader_spec.loader is not None    # a .py file always has both
        module = importlib.util.module_from_spec(loader_spec)
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            raise UsageError(f"MODULE: importing {module_name} failed: {type(e).__name__}: {e}") from None
    else:
        if "" not in sys.path and "." not in sys.path:
            sys.path.insert(0, "")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise UsageError(f"MODULE: cannot import {module_name!r} ({e})") from None
        except Exception as e:
            raise UsageError(f"MODULE: importing {module_name} failed: {type(e).__name__}: {e}") from None
    obj: object = module
    for part in filter(None, attr.split(".")):
        if not hasattr(obj, part):
            raise UsageError(f"ATTR: {module_name} has no attribute {attr!r} ({part!r} is missing)")
        obj = getattr(obj, part)
    return obj


class _Counted:
    """Wraps an op and counts its calls (the cases a check ran)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.calls = fn, 0
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)


def _summary(err: BaseException) -> str:
    """The first line of a failure and the line naming its case (of the first failure, where Hypothesis
    found several)."""
    while group := getattr(err, "exceptions", None):   # an ExceptionGroup (Python 3.11+)
        err = group[0]
    prefix = "" if isinstance(err, AssertionError) else f"{type(err).__name__}: "
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    first = lines[0] if lines else type(err).__name__
    case = next((ln for ln in lines[1:] if ln.startswith("case")), None)
    return prefix + (first if case is None else f"{first}; {case}")


def _options(check: Callable[..., Any], opts: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(check).parameters
    return {k: v for k, v in opts.items() if v is not None and k in params}


def _tables(check: Callable[..., Any], opts: dict[str, Any]) -> str:
    """What a lookup check's tables were (``"[tables: float32, bfloat16, fp8, int8, nf4]  "``); "" for the
    checks without quantized tables."""
    params = inspect.signature(check).parameters
    if "schemes" not in params:
        return ""
    dtypes = opts["dtypes"] if opts.get("dtypes") is not None else params["dtypes"].default
    schemes = opts["schemes"] if opts.get("schemes") is not None else params["schemes"].default
    names = [str(d).replace("torch.", "") for d in dtypes] + list(schemes)
    return f"[tables: {', '.join(names)}]  "


def run_checks(obj: object, *, ops: list[str] | None = None, max_examples: int | None = None,
               dtypes: list[str] | None = None, seed: int = 0, out: IO[str] | None = None,
               schemes: list[str] | None = None) -> int:
    """Run the kit's checks on ``obj``; print one line per op to ``out`` (default stdout); return the exit
    status (0 or 1). ``schemes``: the quantized tables of the lookup checks (``[]``: float tables only;
    None: each check's own, all of ``fp8``, ``int8``, ``nf4``)."""
    out = sys.stdout if out is None else out
    import torch

    from .. import testing
    from ..backends import OP_NAMES

    names = list(dict.fromkeys((*OP_NAMES, *_OTHER_OPS)))
    have = [n for n in names if callable(getattr(obj, n, None))]
    wanted = names + ["layer"] if ops is None else ops
    unknown = [n for n in wanted if n not in names and n != "layer"]
    if unknown:
        raise UsageError(f"--ops: unknown op(s) {', '.join(unknown)}; expected names of {', '.join(names)}, "
                         f"or layer")
    selected = [n for n in wanted if n in have]
    run_layer = "layer" in wanted and all(n in have for n in OP_NAMES)
    if ops is not None:
        missing = [n for n in wanted if n != "layer" and n not in have]
        if missing:
            raise UsageError(f"--ops: the object has no {', '.join(missing)}")
        if "layer" in wanted and not run_layer:
            raise UsageError(f"--ops: layer needs every op ({', '.join(OP_NAMES)}); the object lacks "
                             f"{', '.join(n for n in OP_NAMES if n not in have)}")
    if not selected and not run_layer:
        raise UsageError(f"MODULE: {obj!r} has none of the ops {', '.join(names)}")
    dts = None if dtypes is None else tuple(getattr(torch, d) for d in dtypes)
    opts = dict(max_examples=max_examples, dtypes=dts, seed=seed, schemes=None if schemes is None else tuple(schemes))
    failed = 0
    width = max(len(n) for n in selected + ["layer"])
    for name in selected + (["layer"] if run_layer else []):
        target: object
        if name == "layer":
            counted = {n: _Counted(getattr(obj, n)) for n in OP_NAMES}
            target = type("Ops", (), {n: staticmethod(c) for n, c in counted.items()})
            check, calls = testing.check_layer, lambda cs=counted: sum(c.calls for c in cs.values())
        else:
            op = _Counted(getattr(obj, name))
            target = op
            check, calls = getattr(testing, f"check_{name}"), (lambda t=op: t.calls)
        tables = _tables(check, opts)
        t0 = time.perf_counter()
        try:
            check(target, **_options(check, opts))
            status = "ok"
        except Exception as e:                      # AssertionError, or the user's op raised: a failure
            failed += 1
            status = f"FAIL: {_summary(e)}"
        print(f"{name:<{width}}  {calls():>6} calls {time.perf_counter() - t0:6.1f} s  {tables}{status}", file=out,
              flush=True)
    skipped = [n for n in names if n not in have]
    if skipped and ops is None:
        layer = "; layer needs every op" if not run_layer else ""
        print(f"(not checked: {', '.join(skipped)} absent{layer})", file=out)
    return 1 if failed else 0


def _check(args: argparse.Namespace) -> int:
    try:
        ops = None if args.ops is None else [s.strip() for s in args.ops.split(",") if s.strip()]
        dtypes = None
        if args.dtypes is not None:
            names = [s.strip().lower() for s in args.dtypes.split(",") if s.strip()]
            bad = [n for n in names if n not in _DTYPES]
            if bad or not names:
                raise UsageError(f"--dtypes: expected names of {', '.join(sorted(set(_DTYPES.values())))}, "
                                 f"got {args.dtypes!r}")
            dtypes = [_DTYPES[n] for n in names]
        schemes = None
        if args.schemes is not None:
            from .kit.quantized import SCHEMES
            schemes = [s.strip().lower() for s in args.schemes.split(",") if s.strip()]
            schemes = [] if schemes == ["none"] else schemes
            bad = [s for s in schemes if s not in SCHEMES]
            if bad or not args.schemes.strip():
                raise UsageError(f"--schemes: expected names of {', '.join(SCHEMES)}, or none; got {args.schemes!r}")
        if args.max_examples is not None and args.max_examples < 1:
            raise UsageError(f"--max-examples: expected a positive count, got {args.max_examples}")
        try:
            import hypothesis  # noqa: F401
        except ImportError:
            raise UsageError("the kit needs Hypothesis: pip install hypothesis (or -e '.[dev]')") from None
        obj = load_object(args.target)
        return run_checks(obj, ops=ops, max_examples=args.max_examples, dtypes=dtypes, seed=args.seed,
                          schemes=schemes)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add the ``check`` subcommand to an argparse subparsers object."""
    p = sub.add_parser("check", help="check your ops against the reference (the kit, one line per op)",
                       description="Run every ple.testing.check_<op> that applies to MODULE[:ATTR] (a module, "
                                   "a namespace or an instance with op functions of ple.reference's "
                                   "signatures), then check_layer if it has every op.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("target", metavar="MODULE[:ATTR]",
                   help="dotted module name (importable from here) or a .py file, then an optional attribute")
    p.add_argument("--max-examples", type=int, default=None, help="Hypothesis examples per check "
                   "(default: each check's own)")
    p.add_argument("--dtypes", default=None, help="comma-separated dtypes, e.g. float32,bfloat16 "
                   "(default: each check's own)")
    p.add_argument("--schemes", default=None, help="comma-separated quantized tables the lookup checks "
                   "gather besides float ones, of fp8,int8,nf4, or none (default: all three)")
    p.add_argument("--seed", type=int, default=0, help="Hypothesis seed")
    p.add_argument("--ops", default=None, help="comma-separated op names to check (and 'layer'); default: all "
                   "the object has")
    p.set_defaults(func=_check)
