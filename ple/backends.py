"""The one switch between the backends, and the one helper that gives a backend's ops the reference's face.

Three op modules carry the names and signatures of docs/spec.md section 7 (`OP_NAMES`):

=============  =====================  ============================================================
``backend=``   module                 what it is
=============  =====================  ============================================================
"reference"    ``ple.reference``      the specification: plain code written to be read (loops
                                      where a loop says it best, host reads allowed); no speed or
                                      compile promise
"torch"        ``ple.vectorized``     the same math vectorised in eager PyTorch: no host reads in
                                      a step, ``torch.compile(fullgraph=True)``-friendly; the CPU
                                      default
"triton"       ``ple.fast``           Triton kernels (``torch.library`` custom ops)
"auto"         either of the two      ``"triton"`` where it runs compiled (Triton and a CUDA
                                      device), else ``"torch"``
=============  =====================  ============================================================

`twin` is how a backend's public function takes the signature and docstring of its reference
twin (both backends use it), so each is written once; a first line says that the reference's text
follows, and the backend function's own docstring holds only what is particular to that backend and is
appended under a heading ("Torch backend notes:", "Triton backend notes:"). An op module may also set
two flags the layer reads (`traits`): ``FUSED_KV_PROJECTION`` (the layer makes one GEMM over the
concatenated key and value weights) and ``CHECKS_VALUES_WHEN_COMPILED`` (its ops check index
values inside a registered op, so a compiled layer may still ask them to).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import textwrap
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple, TypeVar, cast

import torch

from ._checks.args import choice_arg

__all__ = ["resolve_backend", "backend_module", "triton_available", "triton_compiled_available", "CustomOps",
           "OP_NAMES", "BACKENDS", "twin", "traits", "Traits"]

BACKENDS = ("reference", "torch", "triton", "auto")

_F = TypeVar("_F", bound=Callable[..., Any])

_MODULES = {"reference": "ple.reference", "torch": "ple.vectorized", "triton": "ple.fast"}

OP_NAMES = ("ngram_ids", "embedding_lookup", "ngram_embedding", "ple_gate", "ple_conv", "export_conv_checkpoints",
            "dilated_causal_conv", "ple_prefill")
"""The ops a `PLELayer` calls (docs/spec.md section 7); ``PLELayer(ops=...)`` needs each of them."""


class Traits(NamedTuple):
    """What the layer needs to know about an op module beyond its ops (see the module docstring)."""

    fused_kv_projection: bool = False
    checks_values_when_compiled: bool = False


def traits(ops: object) -> Traits:
    """The `Traits` an op module declares (``FUSED_KV_PROJECTION``, ``CHECKS_VALUES_WHEN_COMPILED``);
    False where it declares nothing (a user's ``ops=`` object)."""
    return Traits(bool(getattr(ops, "FUSED_KV_PROJECTION", False)),
                  bool(getattr(ops, "CHECKS_VALUES_WHEN_COMPILED", False)))


def twin(reference: Callable[..., Any], *,
         guard: Callable[[str, tuple[Any, ...], dict[str, Any]], object] | None = None) -> Callable[[_F], _F]:
    """Decorator: the decorated public op takes ``reference``'s signature and docstring.

    ``help(op)`` reads: a first line naming the backend and the reference and saying that the
    reference's docstring follows (`_twin_doc`); the reference's docstring, whole; then the decorated
    function's own docstring, if any, as that backend's notes, under a heading (`_notes_heading`:
    "Torch backend notes:" in ``ple.vectorized``, "Triton backend notes:" in ``ple.fast``), where the
    reference's text ends. Every op of both backends has notes (``tests/test_backends.py``). Notes that
    repeat a paragraph of the reference (a copy of its summary, of its ``validate`` paragraph, ...) are
    refused with a ``ValueError`` when the module is imported: write only what differs.

    ``guard(name, args, kwargs)``, if given, runs before every call (``ple.fast`` refuses CPU
    tensors there when its kernels are compiled). Without a guard the function itself is returned
    (its ``__doc__`` and ``__signature__`` set): no wrapper, no extra call on the hot path.
    """

    def decorate(fn: _F) -> _F:
        doc = _twin_doc(reference, fn)
        if guard is None:               # no wrapper, so no extra call on the hot path: fn itself takes the doc
            call: Callable[..., Any] = fn
        else:
            module = fn.__module__.rsplit(".", 1)[0]

            @functools.wraps(fn)
            def call(*args: Any, **kwargs: Any) -> Any:
                guard(f"{module}.{fn.__name__}", args, kwargs)
                return fn(*args, **kwargs)

        call.__doc__ = doc
        call.__signature__ = inspect.signature(reference)  # type: ignore[attr-defined]  # read by inspect.signature
        return cast(_F, call)           # the same parameters as fn (functools.wraps loses them for mypy)

    return decorate


_NOTES_HEADINGS = {"ple.vectorized": "Torch backend notes:", "ple.fast": "Triton backend notes:"}


def _notes_heading(module: str) -> str:
    """The heading `twin` puts above the notes of a function defined in ``module`` (a dotted name)."""
    for package, heading in _NOTES_HEADINGS.items():
        if module == package or module.startswith(package + "."):
            return heading
    return f"Notes of {module}:"


def _paragraphs(doc: str) -> list[str]:
    """The paragraphs of a docstring, whitespace collapsed (what a copy would repeat)."""
    return [" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n") if p.strip()]


def _backend_label(module: str) -> str:
    """What the first line of a twinned docstring calls the backend of ``module``: "Torch backend", ..."""
    heading = _notes_heading(module)
    return heading.removesuffix(" notes:") if heading.endswith(" backend notes:") else f"``{module}``"


def _twin_doc(reference: Callable[..., Any], fn: Callable[..., Any]) -> str:
    """A first line saying whose text follows, ``reference``'s docstring, then ``fn``'s own (its notes) under
    `_notes_heading`; see `twin`."""
    ref_doc, notes = reference.__doc__, fn.__doc__
    ref_name = f"{reference.__module__}.{reference.__qualname__}"
    heading = _notes_heading(fn.__module__)
    has_notes = bool(notes and notes.strip())
    if has_notes:
        repeated = [p for p in _paragraphs(cast(str, notes)) if p in _paragraphs(ref_doc or "")]
        if repeated:
            raise ValueError(f"{fn.__module__}.{fn.__qualname__}: its docstring repeats a paragraph of {ref_name}'s "
                             f"({repeated[0][:60]!r}...); twin already gives it the reference's docstring, so keep "
                             f"only what is particular to this backend (appended under {heading!r})")
    then = f', then this backend\'s notes under "{heading}"' if has_notes else " (this backend adds no notes)"
    first = f"{_backend_label(fn.__module__)} twin of ``{ref_name}``: the reference's docstring follows{then}."
    out = f"{first}\n\n{inspect.cleandoc(ref_doc) if ref_doc else '(The reference has no docstring.)'}\n"
    if has_notes:
        out += f"\n{heading}\n\n{textwrap.indent(inspect.cleandoc(cast(str, notes)), '    ')}\n"
    return out


class CustomOps:
    """The user's ops for ``PLELayer(ops=...)``: any object (a module, a namespace, a class instance)
    with the `OP_NAMES` attributes, each with the signature of the ``ple.reference`` op of that name.

    The layer calls its ops with ``validate=False`` where it checked the values itself; for a user's ops
    that keyword is optional (docs/spec.md section 7.14): a function that takes no ``validate`` keyword is
    called without it.
    Ops the layer does not call (``hash_params``, ``grouped_rms_norm``) come from ``ple.reference``.
    The flags of `traits` are read from the object (default: two GEMMs, no value checks when compiled).
    """

    # Set in __init__ (from the user's object, or from ple.reference); declared here for type checkers.
    ngram_ids: Callable[..., Any]
    embedding_lookup: Callable[..., Any]
    ngram_embedding: Callable[..., Any]
    ple_gate: Callable[..., Any]
    ple_conv: Callable[..., Any]
    export_conv_checkpoints: Callable[..., Any]
    dilated_causal_conv: Callable[..., Any]
    ple_prefill: Callable[..., Any]
    prefill_conv_inputs: Callable[..., Any]
    hash_params: Callable[..., Any]
    grouped_rms_norm: Callable[..., Any]

    def __init__(self, ops: object) -> None:
        missing = [n for n in OP_NAMES if not callable(getattr(ops, n, None))]
        if missing:
            raise TypeError(f"ops: expected an object with the ops {', '.join(OP_NAMES)}; "
                            f"{type(ops).__name__} lacks {', '.join(missing)}")
        self.wrapped = ops
        for name in OP_NAMES:
            setattr(self, name, _drop_validate(getattr(ops, name)))
        self.FUSED_KV_PROJECTION, self.CHECKS_VALUES_WHEN_COMPILED = traits(ops)
        conv_inputs = getattr(ops, "prefill_conv_inputs", None)
        if callable(conv_inputs):                                   # a fused prefill's own conv inputs (replay)
            self.prefill_conv_inputs = conv_inputs
        from . import reference
        self.hash_params, self.grouped_rms_norm = reference.hash_params, reference.grouped_rms_norm

    def __repr__(self) -> str:
        return f"CustomOps({getattr(self.wrapped, '__name__', type(self.wrapped).__name__)})"


def _drop_validate(fn: Callable[..., Any]) -> Callable[..., Any]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn
    if "validate" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn

    @functools.wraps(fn)
    def call(*args: Any, validate: bool = True, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)
    return call


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Triton is importable and can run here: compiled on CUDA, or interpreted with TRITON_INTERPRET=1."""
    if not _triton_installed():
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def triton_compiled_available() -> bool:
    """Triton can run compiled (not interpreted): Triton is installed and a CUDA device is present."""
    return (_triton_installed() and torch.cuda.is_available()
            and os.environ.get("TRITON_INTERPRET") != "1")


def resolve_backend(backend: str) -> tuple[str, ModuleType]:
    """``"reference"``, ``"torch"``, ``"triton"`` or ``"auto"`` -> (the name picked, its op module)."""
    choice_arg("backend", backend, BACKENDS)     # not a str: TypeError; an unknown name: ValueError
    if backend == "auto":
        backend_module("torch")                  # a layer on "auto" with weights off CUDA runs this one
        backend = "triton" if triton_compiled_available() else "torch"
    if backend == "triton" and not triton_available():
        raise ValueError("backend: 'triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 to run "
                         "the kernels in the interpreter on the CPU)")
    return backend, backend_module(backend)


_LOADED: dict[str, ModuleType] = {}


def backend_module(name: str) -> ModuleType:
    """The op module of a resolved backend name (``"reference"``, ``"torch"`` or ``"triton"``), without
    re-checking. Imported once (then a dict lookup, which ``torch.compile`` traces)."""
    module = _LOADED.get(name)
    if module is None:
        module = _LOADED[name] = importlib.import_module(_MODULES[name])
    return module
