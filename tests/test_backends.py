"""The backend switch (``ple.backends``): what ``"auto"`` resolves to here, and what `CustomOps` (a user's
``PLELayer(ops=...)``) carries over from the object it wraps."""

from __future__ import annotations

import importlib.util
import inspect
import pydoc
import types

import pytest
import torch
from _helpers import valid_op_calls

import ple
import ple.vectorized as vec
from ple import PLEConfig, PLELayer
from ple.backends import (
    OP_NAMES,
    CustomOps,
    backend_module,
    resolve_backend,
    traits,
    triton_compiled_available,
    twin,
)
from ple.state import PLECache, Prefill
from ple.testing.layers import random_layer
from ple.testing.serving import conv_inputs_of_step

TINY = PLEConfig.preset("tiny")


def torch_ops(**extra):
    return types.SimpleNamespace(**{n: getattr(vec, n) for n in OP_NAMES}, **extra)


def test_auto_resolves_to_what_runs_here():
    name, module = resolve_backend("auto")
    want = "triton" if triton_compiled_available() else "torch"
    assert name == want
    assert module is (ple.fast if want == "triton" else ple.vectorized)
    assert resolve_backend("reference") == ("reference", ple.reference)
    assert resolve_backend("torch") == ("torch", ple.vectorized)


def test_resolve_backend_names_a_bad_name():
    with pytest.raises(ValueError, match="backend: expected one of"):
        resolve_backend("cuda")


def test_custom_ops_declare_their_traits():
    assert traits(CustomOps(torch_ops())) == traits(torch_ops()) == traits(ple.reference)
    fused = CustomOps(torch_ops(FUSED_KV_PROJECTION=True))
    assert traits(fused).fused_kv_projection and not traits(fused).checks_values_when_compiled


def test_a_fused_prefills_own_conv_inputs_reach_the_replay_checker():
    """A user's fused ``ple_prefill`` may round its conv inputs its own way: the serving replay checker
    takes them from the ops' ``prefill_conv_inputs`` where the ops offer one (as ``ple.fast`` does)."""
    seen = []

    def conv_inputs(key, value, hidden, *rest):
        seen.append(key.shape)
        return torch.full_like(hidden, 7.0)

    base = random_layer(TINY, dtype=torch.float32, backend="torch")
    layer = PLELayer(TINY, ops=torch_ops(prefill_conv_inputs=conv_inputs))
    layer.load_state_dict(base.state_dict())
    cache = PLECache(TINY, 2, num_layers=1, dtype=torch.float32)
    batch = cache.schedule([Prefill(cache.allocate(), [5, 6, 7])])
    hidden = torch.randn(3, TINY.hc_hidden_size)
    got = conv_inputs_of_step(layer, hidden, batch)
    assert seen and torch.equal(got, torch.full_like(hidden, 7.0))
    plain = PLELayer(TINY, ops=torch_ops())
    plain.load_state_dict(base.state_dict())
    assert not hasattr(plain.ops, "prefill_conv_inputs")
    calls = len(seen)
    assert not torch.equal(conv_inputs_of_step(plain, hidden, batch), got)      # its ple_gate's, not the marker
    assert len(seen) == calls


def _reference_op(x, *, dilation: int, validate: bool = True):
    """Add the dilation to every element.

    ``x``: any shape. The output has ``x``'s shape and dtype.

    ``validate=False`` skips the value checks.
    """
    return x + dilation


def _decorate_in(module, fn, **kwargs):
    """``twin(_reference_op)(fn)``, ``fn`` defined as if in ``module`` (where the notes' heading comes from)."""
    fn.__module__ = module
    return twin(_reference_op, **kwargs)(fn)


def test_twin_keeps_the_reference_doc_and_appends_the_backends_notes():
    def op(x, *, dilation, validate=True):
        """Adds in place on a copy (this backend's own note)."""
        return x + dilation

    got = _decorate_in("ple.vectorized.fake", op)
    assert got is op                                            # no guard: no wrapper on the hot path
    doc = inspect.getdoc(got)
    ref = inspect.getdoc(_reference_op)
    first, rest = doc.split("\n\n", 1)                          # a first line says whose text follows
    name = f"{_reference_op.__module__}._reference_op"
    assert first == (f"Torch backend twin of ``{name}``: the reference's docstring follows, then this backend's "
                     "notes under \"Torch backend notes:\".")
    assert rest.startswith(ref)                                 # then the reference, whole
    rest = rest[len(ref):]
    assert rest.lstrip("\n").startswith("Torch backend notes:")
    assert "Adds in place on a copy (this backend's own note)." in rest
    assert inspect.signature(got) == inspect.signature(_reference_op)
    assert "Torch backend notes:" in pydoc.render_doc(got)

    def fast_op(x, *, dilation, validate=True):
        """One kernel per call."""
        return x + dilation

    seen = []
    guarded = _decorate_in("ple.fast.fake", fast_op, guard=lambda name, args, kwargs: seen.append(name))
    assert guarded is not fast_op and guarded(torch.ones(2), dilation=2).tolist() == [3.0, 3.0]
    assert seen == ["ple.fast.fast_op"]
    doc = inspect.getdoc(guarded)
    first, rest = doc.split("\n\n", 1)
    assert first.startswith(f"Triton backend twin of ``{name}``: the reference's docstring follows")
    assert rest.startswith(ref) and rest.index("Triton backend notes:") > len(ref) and "One kernel per call." in rest
    assert inspect.signature(guarded) == inspect.signature(_reference_op)


def test_twin_without_notes_still_says_whose_text_it_is():
    def op(x, *, dilation, validate=True):
        return x + dilation

    doc = _decorate_in("ple.vectorized.fake", op).__doc__
    assert doc == (f"Torch backend twin of ``{_reference_op.__module__}._reference_op``: the reference's docstring "
                   f"follows (this backend adds no notes).\n\n{inspect.cleandoc(_reference_op.__doc__)}\n")


@pytest.mark.parametrize("notes", [_reference_op.__doc__, "Add the dilation to every element.",
                                   "Our own words first.\n\n    ``validate=False``   skips the value\n    checks.\n"])
def test_twin_refuses_notes_that_copy_the_reference(notes):
    def op(x, *, dilation, validate=True):
        return x + dilation

    op.__doc__ = notes
    with pytest.raises(ValueError, match=r"fake\..*\.op: its docstring repeats a paragraph of .*_reference_op"):
        _decorate_in("ple.fast.fake", op)


def _twinned_ops():
    """(backend module, its name for itself in docstrings, op name) of every twinned op: each op of ``OP_NAMES``
    and ``table_update``, on the torch backend and, where Triton is installed, on the Triton one."""
    backends = [(vec, "Torch")]
    if importlib.util.find_spec("triton") is not None:
        import ple.fast
        backends.append((ple.fast, "Triton"))
    return [(module, label, name) for module, label in backends for name in (*OP_NAMES, "table_update")]


def test_every_twinned_op_marks_the_reference_text_and_carries_its_backends_notes():
    """``help(op)`` of each backend's op: a first line saying that the reference's docstring follows, the
    reference's docstring whole, then that backend's own notes under its heading, never empty. Dropping an
    op's notes (or the marks) fails here."""
    ops = _twinned_ops()
    assert len(ops) in (9, 18)
    for module, label, name in ops:
        where = f"{module.__name__}.{name}"
        reference = getattr(ple.reference, name)
        doc, ref = inspect.getdoc(getattr(module, name)), inspect.getdoc(reference)
        first, rest = doc.split("\n\n", 1)
        heading = f"{label} backend notes:"
        assert first == (f"{label} backend twin of ``{reference.__module__}.{reference.__qualname__}``: the "
                         f"reference's docstring follows, then this backend's notes under \"{heading}\"."), where
        assert rest.startswith(ref), where
        rest = rest[len(ref):]
        assert rest.startswith(f"\n\n{heading}\n\n"), (where, rest[:80])
        notes = rest[len(heading) + 4:]
        assert len(notes.split()) >= 20 and "reference's docstring" not in notes, (where, notes[:80])
        assert inspect.signature(getattr(module, name)) == inspect.signature(reference)
    notes = vec.export_conv_checkpoints.__doc__.split("Torch backend notes:", 1)[1]
    assert "fixed-shape write" in notes                         # the torch backend's own words are seen


# ---- each op checks its call once, with its own check ---------------------------------------------------

# The checks of ``ple._checks`` that validate one op's call (the others are the helpers they are made of).
_OWN_CHECKS = {"ngram_ids": "ngram", "ngram_embedding": "ngram", "embedding_lookup": "lookup", "ple_gate": "gate",
               "ple_conv": "ple_conv", "export_conv_checkpoints": "export",
               "dilated_causal_conv": "dilated_causal_conv", "ple_prefill": "prefill", "serving ple_prefill": "prefill"}


# The exceptions, as the ``ple._checks`` docstring states them: the torch backend's ``ngram_embedding`` runs
# ``ngram_meta`` and then its ``ngram_ids`` (``ngram_call``) and ``embedding_lookup`` (``lookup_meta``), and its
# serving ``ple_prefill`` runs ``ple_conv_meta`` again through its ``ple_conv(validate=False)``.
_CHECKED_AGAIN: set[tuple[str, str]] = set()


@pytest.mark.parametrize("backend", ["reference", "torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("validate", [True, False])
def test_each_op_checks_its_call_once_with_its_own_check(backend, validate, monkeypatch):
    """What ``ple._checks`` promises: an op's public function runs its own op's checks (``<op>_meta`` and, unless
    ``validate=False``, ``<op>_values``; or ``<op>_call``), each once, and no other op's; a composition
    (``ple_prefill``, ``ngram_embedding``) has its own checks and calls its parts unchecked."""
    import ple._checks as checks

    calls: list[str] = []

    def recorded(name, fn):
        def record(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return record

    for name in checks.__all__:
        fn = getattr(checks, name)
        if inspect.isfunction(fn):
            monkeypatch.setattr(checks, name, recorded(name, fn))
    ops = backend_module(resolve_backend(backend)[0])
    wrong = {}
    for op, args, kwargs in valid_op_calls():
        calls.clear()
        getattr(ops, op.split()[-1])(*args, **kwargs, **({} if op == "ple_gate" else dict(validate=validate)))
        family = _OWN_CHECKS[op]
        own = [c for c in calls if c == "gate_call" or c.endswith(("_meta", "_values", "_call"))]
        if family == "gate":
            right = own == ["gate_call"]
        elif f"{family}_call" in own:
            right = own == [f"{family}_call"]
        else:
            right = own == [f"{family}_meta", f"{family}_values"][:1 + validate]
        if not right or len(calls) != len(set(calls)):                          # its own checks; nothing twice
            wrong[op] = calls[:]
    known = {op for b, op in _CHECKED_AGAIN if b == backend}
    assert wrong.keys() == known, (f"{backend}: the checks each op ran: {wrong}; known exceptions: {known} "
                                   f"(fixed? then update _CHECKED_AGAIN and the ple._checks docstring)")
