"""One table of argument mistakes and the exception each must be (docs/spec.md section 9).

An argument of the wrong Python type (a string for ``eps``, a float for an index, a non-string ``mode``) is a
``TypeError``; one of the right type outside its range or set a ``ValueError``; the same mistake the same type
everywhere, with a message that starts with the argument's name. `MISTAKES` holds the rows (mistake, argument,
bad value, expected exception); each row runs through every target that takes that argument: every op of every
backend (`ple.backends.OP_NAMES`, ``grouped_rms_norm``, ``table_update``, ``hash_params``; ``triton`` under the
interpreter), the row optimizers, ``ple.optim.plan``, `PLEConfig` (and ``from_dict``, ``preset``), `PLELayer`
and the backend switch, and every ``ple.testing.check_*`` kit. A target's base call is valid (the ops':
``tests/_helpers.valid_op_calls``, run by `test_the_base_op_calls_are_valid`), so each failure comes from the
one mistake; a failed op call changes no tensor. The command line reports its usage errors as one ``error:`` line
naming the option, exit status 2 (`test_cli_usage_errors_are_one_line_naming_the_option`).
"""

from __future__ import annotations

import inspect
import math
import re

import numpy as np
import pytest
import torch
from _helpers import args_snapshot, assert_args_unchanged, valid_op_calls

import ple
import ple.optim as O
import ple.testing as kits
from ple import PLEConfig, PLELayer, _checks
from ple.__main__ import main
from ple.backends import backend_module, resolve_backend
from ple.distributed.dtensor import TableColwise, TableRowwise
from ple.distributed.sequence import _host_offsets
from ple.io import load_layer, save

TINY = PLEConfig.preset("tiny")
NAN, INF = math.nan, math.inf


def ints(name: str, minimum: int | None = None, *, none: bool = True) -> list[tuple]:
    """The mistakes of an int argument: a float, a numeric string, a bool, a 0-dim tensor and None (``none=False``
    where None is valid) are a TypeError; below ``minimum`` (if given) a ValueError."""
    rows = [(f"{name}-float", name, 2.0, TypeError), (f"{name}-str", name, "2", TypeError),
            (f"{name}-bool", name, True, TypeError), (f"{name}-tensor", name, torch.tensor(2), TypeError)]
    rows += [(f"{name}-none", name, None, TypeError)] if none else []
    return rows + ([(f"{name}-below-{minimum}", name, minimum - 1, ValueError)] if minimum is not None else [])


def floats(name: str, *, minimum: bool = False, positive: bool = False, finite: bool = False) -> list[tuple]:
    """The mistakes of a float argument: a string, None, a bool, a tensor; negative (``minimum``: >= 0, or
    ``positive``), 0 (``positive``), inf (``finite``), NaN: a ValueError."""
    rows = [(f"{name}-str", name, "0.1", TypeError), (f"{name}-none", name, None, TypeError),
            (f"{name}-bool", name, True, TypeError), (f"{name}-tensor", name, torch.tensor(0.1), TypeError),
            (f"{name}-nan", name, NAN, ValueError)]
    rows += [(f"{name}-negative", name, -1.0, ValueError)] if minimum or positive else []
    rows += [(f"{name}-zero", name, 0.0, ValueError)] if positive else []
    return rows + ([(f"{name}-inf", name, INF, ValueError)] if finite else [])


def bools(name: str) -> list[tuple]:
    return [(f"{name}-int", name, 1, TypeError), (f"{name}-str", name, "yes", TypeError),
            (f"{name}-none", name, None, TypeError)]


def choice(name: str, unknown: str) -> list[tuple]:
    """A choice among strings: an int, None or bytes is a TypeError; an unknown string a ValueError."""
    return [(f"{name}-int", name, 3, TypeError), (f"{name}-none", name, None, TypeError),
            (f"{name}-bytes", name, unknown.encode(), TypeError), (f"{name}-unknown", name, unknown, ValueError)]


def choices(name: str, one: str, unknown: str, *, empty_ok: bool = False) -> list[tuple]:
    """A kit's sequence of names: a single name (a str) or a non-string item is a TypeError; an unknown name,
    or none at all (unless ``empty_ok``), a ValueError."""
    rows = [(f"{name}-str", name, one, TypeError), (f"{name}-int-item", name, [3], TypeError),
            (f"{name}-unknown", name, [one, unknown], ValueError)]
    return rows + ([] if empty_ok else [(f"{name}-empty", name, (), ValueError)])


CAPS = ("max_requests", "max_dim", "max_hidden", "max_channels", "max_lookups")
CONFIG_INTS = ("vocab_size", "hidden_size", "hc_count", "ple_conv_kernel_size", "ngram_size",
               "ngram_vocab_size_base", "make_ngram_vocab_size_divisible_by", "split_ngram_parts")

# (mistake, argument, bad value, expected exception[, a word of the only targets it is for]): each row runs on
# every target whose signature has the argument.
MISTAKES: list[tuple] = [
    # the ops
    *floats("eps", positive=True),
    # the gate family's keywords (docs/spec.md section 15): conv_eps None means eps, so None is no mistake
    *[row for row in floats("conv_eps", positive=True, finite=True) if row[2] is not None], *bools("unit_offset"),
    *bools("validate"),
    *ints("dilation", 1), *ints("null_slot"), *ints("state_len", 1), *ints("group_size", 1),
    *ints("heads_per_ngram", 1), *ints("step", 1), *ints("ple_layer_index", 0),
    *ints("eos_token_id", 0, none=False), ("eos_token_id-none", "eos_token_id", None, TypeError, "ngram"),
    *ints("spec_query_len"), ("spec_query_len-below-1", "spec_query_len", 0, ValueError, "spec"),
    *choice("mode", "chunked"), ("mode-capitalised", "mode", "Prefill", ValueError),
    *choice("rule", "lion"),
    *floats("lr", minimum=True, finite=True), *floats("weight_decay", minimum=True, finite=True),
    ("betas-float", "betas", 0.9, TypeError), ("betas-str", "betas", "ab", TypeError),
    ("betas-none", "betas", None, TypeError), ("betas-one", "betas", (0.9,), ValueError),
    ("betas-three", "betas", [0.9, 0.99, 0.999], ValueError), ("betas-str-entry", "betas", (0.9, "x"), TypeError),
    ("betas-bool-entry", "betas", (True, 0.9), TypeError), ("betas-one-or-more", "betas", (1.0, 0.9), ValueError),
    ("betas-negative", "betas", (0.9, -0.1), ValueError), ("betas-nan", "betas", (NAN, 0.9), ValueError),
    *ints("dim", 2), ("dim-odd", "dim", 3, ValueError),
    ("rows-float", "rows", torch.zeros(2, 6), TypeError),
    ("rows-width", "rows", torch.zeros(2, 5, dtype=torch.uint8), ValueError),
    # the optimizers and the plan
    *bools("fused"), *choice("table_dtype", "fp8"), ("table_dtype-dtype", "table_dtype", torch.float32, TypeError),
    *ints("world_size", 1), *ints("tokens", 0),
    # the config, the layer, the backend switch
    *[row for name in CONFIG_INTS
      for row in ints(name, 2 if name in ("ngram_size", "ngram_vocab_size_base") else 1, none=False)],
    *ints("seed", none=False), ("seed-negative", "seed", -1, ValueError, "config"),
    *floats("rms_norm_eps", positive=True, finite=True),
    ("ple_layer_ids-str", "ple_layer_ids", "2", TypeError), ("ple_layer_ids-float", "ple_layer_ids", [1.0], TypeError),
    ("ple_layer_ids-str-item", "ple_layer_ids", ["a"], TypeError),
    ("ple_layer_ids-zero", "ple_layer_ids", [0], ValueError),
    *choice("name", "qwen5"), *choice("backend", "cuda"),
    # sharding and loading
    *choice("reduce", "max"), *choice("offload", "gpu"),
    ("offload-int", "offload", 1, TypeError), ("values-float-item", "values", [0, 1.5], TypeError),
    ("values-empty", "values", [], ValueError),
    # the kits
    *ints("max_examples", 1),
    *[row for cap in CAPS for row in ints(cap, 0 if cap == "max_lookups" else 1, none=False)],
    ("dtypes-dtype", "dtypes", torch.float32, TypeError), ("dtypes-str", "dtypes", "float32", TypeError),
    ("dtypes-str-item", "dtypes", ["float32"], TypeError), ("dtypes-empty", "dtypes", (), ValueError),
    ("dtypes-int", "dtypes", (torch.int32,), ValueError),
    *bools("grad"), *bools("serving"), ("exact_states-int", "exact_states", 1, TypeError),
    *choices("modes", "prefill", "chunked"), *choices("parts", "forward", "both"),
    *choices("families", "engram", "deepseek"),
    *choices("rules", "adam", "lion"), *choices("schemes", "nf4", "q4", empty_ok=True),
]


# ---- the targets: (label, a function of the backend name giving (callable, args, kwargs)) ----------------------

def _ops_target(op: str):
    def make(backend):
        for name, args, kwargs in valid_op_calls():
            if name == op:
                return getattr(backend_module(backend), op.split()[-1]), args, kwargs
        raise AssertionError(op)
    return make


def _extra_op(op: str, build):
    return lambda backend: (getattr(backend_module(backend), op), *build())


def _spec_conv():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(4, 5, generator=g)
    return ((rows, rows.clone(), torch.randn(3, 5, 6, generator=g), torch.randn(5, 3, generator=g),
             torch.tensor([2, 0])),
            dict(mode="spec", dilation=2, query_start_loc=torch.tensor([0, 2, 4]), spec_query_len=3,
                 num_accepted_tokens=torch.tensor([1, 3])))


def _table_update():
    g = torch.Generator().manual_seed(2)
    return ((torch.randn(6, 3, generator=g), torch.tensor([0, 5, 0]), torch.randn(3, 3, generator=g),
             (torch.zeros(6, 3), torch.zeros(6))), dict(rule="adam", lr=0.1, step=2))


OP_TARGETS = [(op, _ops_target(op)) for op, _, _ in valid_op_calls()] + [
    ("spec ple_conv", _extra_op("ple_conv", _spec_conv)),
    ("grouped_rms_norm", _extra_op("grouped_rms_norm", lambda: ((torch.randn(3, 6), torch.zeros(6), 3, 1e-6), {}))),
    ("table_update", _extra_op("table_update", _table_update)),
    ("hash_params", _extra_op("hash_params", lambda: ((TINY, 1), {}))),
]


def _checkpoint():
    """A saved tiny layer, made once (``load_layer``'s valid call)."""
    global _CHECKPOINT
    if _CHECKPOINT is None:
        import tempfile
        _CHECKPOINT = tempfile.mkdtemp(prefix="ple-error-types-")
        save(PLELayer(TINY, 0, backend="reference"), _CHECKPOINT)
    return _CHECKPOINT


_CHECKPOINT: str | None = None


def _sequence_offsets(values):
    """Offsets a sequence-parallel call takes on the host (``sp_forward``'s ``bounds``), checked by name."""
    return _host_offsets("values", values)


def _from_dict(**fields):
    return PLEConfig.from_dict(fields)


def _layer():
    return PLELayer(TINY, 0, backend="reference")


def _never(*args, **kwargs):
    """The function a kit checks: with its options not checked first, a case runs it and the kit fails otherwise."""
    raise RuntimeError("the kit ran a case: its options were not checked first")


KIT_NAMES = [name for name in kits.__all__ if name.startswith("check_")]

# (label, the callable, a function giving the (args, kwargs) of a valid call)
OTHER_TARGETS = [
    ("SparseSGD", O.SparseSGD, lambda: ((_layer(),), dict(lr=0.1))),
    ("RowwiseAdagrad", O.RowwiseAdagrad, lambda: ((_layer(),), dict(lr=0.1))),
    ("RowwiseAdam", O.RowwiseAdam, lambda: ((_layer(),), dict(lr=0.1))),
    ("nf4_dequantize_rows", ple.reference.nf4_dequantize_rows,
     lambda: ((torch.zeros(2, 6, dtype=torch.uint8), 4, torch.float32), {})),
    ("plan", O.plan, lambda: (("tiny",), {})),
    ("config PLEConfig", PLEConfig, lambda: ((), TINY.to_dict())),
    ("config from_dict", _from_dict, lambda: ((), TINY.to_dict())),
    ("config preset", PLEConfig.preset, lambda: (("tiny",), {})),
    ("PLELayer", PLELayer, lambda: ((TINY, 0), dict(backend="reference"))),
    ("resolve_backend", resolve_backend, lambda: (("reference",), {})),
    ("TableRowwise", TableRowwise, lambda: ((), {})),
    ("TableColwise", TableColwise, lambda: ((), {})),
    ("load_layer", load_layer, lambda: ((_checkpoint(),), {})),
    ("sequence offsets", _sequence_offsets, lambda: (([0, 2],), {})),
    *[(f"kit {name}", getattr(kits, name), lambda: ((_never,), dict(max_examples=1))) for name in KIT_NAMES],
]


def _parameters(fn, build=None) -> set[str]:
    """The arguments ``fn`` takes by name: its named parameters, and where it takes ``**``, the keywords of its
    valid call (``build()``: PLEConfig.from_dict's fields)."""
    params = inspect.signature(fn).parameters.values()
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return named | (set(build()[1]) if any(p.kind == p.VAR_KEYWORD for p in params) else set())


def _cases():
    """Every (target, mistake) pair whose target takes the mistake's argument."""
    ref = backend_module("reference")
    out = []
    targets = ([(f"{b} {label}", b, make, _parameters(getattr(ref, label.split()[-1])))
                for b in ("reference", "torch", "triton") for label, make in OP_TARGETS]
               + [(label, None, lambda fn=fn, build=build: (fn, *build()), _parameters(fn, build))
                  for label, fn, build in OTHER_TARGETS])
    for label, backend, make, params in targets:
        for row in MISTAKES:
            mistake, arg, value, exc = row[:4]
            if arg not in params or (len(row) > 4 and row[4] not in label):
                continue
            marks = [pytest.mark.interpreter] if backend == "triton" else []
            out.append(pytest.param(backend, make, arg, value, exc, id=f"{label}: {mistake}", marks=marks))
    return out


CASES = _cases()


@pytest.mark.parametrize("backend, make, arg, value, exc", CASES)
def test_a_mistake_is_the_same_exception_everywhere_naming_the_argument(backend, make, arg, value, exc):
    fn, args, kwargs = make(backend) if backend is not None else make()
    bound = inspect.signature(fn).bind(*args, **kwargs)
    if arg in inspect.signature(fn).parameters:
        bound.arguments[arg] = value            # positional or keyword, wherever the base call passes it
        call_args, call_kwargs = bound.args, bound.kwargs
    else:                                       # a field of PLEConfig.from_dict's dict
        call_args, call_kwargs = args, {**kwargs, arg: value}
    named = [*((f"arg{i}", a) for i, a in enumerate(call_args)), *call_kwargs.items()]
    named += [(f"{k}[{i}]", t) for k, v in named if isinstance(v, tuple) for i, t in enumerate(v)]   # state
    tensors = {k: v for k, v in named if isinstance(v, torch.Tensor)}
    before = args_snapshot(tensors)
    with pytest.raises(exc) as e:
        fn(*call_args, **call_kwargs)
    assert re.match(rf"{re.escape(arg)}\b", str(e.value)), f"{type(e.value).__name__}: {e.value}"
    assert type(e.value) is exc, f"{type(e.value).__name__}: {e.value}"
    assert_args_unchanged(tensors, before)


def test_every_argument_of_the_table_reaches_a_target():
    """No row of `MISTAKES` is dead: each runs somewhere (a renamed argument would leave its rows idle)."""
    used = {p.id.split(": ", 1)[1] for p in CASES}
    assert {row[0] for row in MISTAKES} <= used, {row[0] for row in MISTAKES} - used


@pytest.mark.parametrize("backend", ["reference", "torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_the_base_op_calls_are_valid(backend):
    """The extra base calls of `OP_TARGETS` (``valid_op_calls``' run in tests/test_backends.py) run cleanly."""
    for _, make in OP_TARGETS[-4:]:
        fn, args, kwargs = make(backend)
        fn(*args, **kwargs)


def test_the_base_calls_of_the_other_targets_are_valid():
    for label, fn, build in OTHER_TARGETS:
        if not label.startswith("kit"):     # a kit's base call would run its cases
            args, kwargs = build()
            fn(*args, **kwargs)


def test_what_counts_as_each_kind_of_scalar():
    """The documented choices of ``ple._checks.args``: numpy's integer scalars are ints (returned as ``int``), a
    bool is neither an int nor a float, a tensor is not an int, numpy's float scalars are floats; a bool is only
    True or False."""
    for v in (3, np.int64(3), np.int32(3), np.uint8(3)):
        assert _checks.int_arg("n", v) == 3 and type(_checks.int_arg("n", v)) is int
    for v in (True, np.float64(3.0), torch.tensor(3), 3.0):
        with pytest.raises(TypeError, match="^n: expected an int"):
            _checks.int_arg("n", v)
    for v in (1, 0.5, np.float32(0.5), np.int64(1)):
        assert type(_checks.float_arg("x", v)) is float
    with pytest.raises(TypeError, match="^x: "):
        _checks.float_arg("x", False)
    with pytest.raises(TypeError, match="^flag: "):
        _checks.bool_arg("flag", np.bool_(True))
    assert PLEConfig.preset("tiny", seed=np.int64(5)) == PLEConfig.preset("tiny", seed=5)
    assert type(PLEConfig.preset("tiny", seed=np.int64(5)).seed) is int
    want = ple.reference.hash_params(TINY, 1)
    got = ple.reference.hash_params(TINY, np.int64(1))
    assert got.multipliers.tolist() == want.multipliers.tolist()


def _exit_code(argv):
    try:
        return main(argv)
    except SystemExit as e:                 # argparse's own errors
        return e.code


@pytest.mark.parametrize("argv, option", [
    (["plan", "--config", "missing.json"], "--config"),
    (["plan", "--config", "no-such-preset"], "name"),
    (["plan", "--device-memory", "lots"], "device_memory"),
    (["plan", "--tokens", "-1"], "tokens"),
    (["convert", "SRC", "OUT", "--max-file-size", "5 furlongs"], "--max-file-size"),
    (["convert", "SRC", "OUT", "--block-size", "big"], "--block-size"),
    (["merge", "SRC", "DIR", "OUT", "--max-file-size", "q"], "--max-file-size"),
    (["check", "ple.reference", "--max-examples", "0"], "--max-examples"),
    (["check", "ple.reference", "--dtypes", "int8"], "--dtypes"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_cli_usage_errors_are_one_line_naming_the_option(argv, option, tmp_path, capsys):
    argv = [str(tmp_path / a.lower()) if a in ("SRC", "OUT", "DIR") else a for a in argv]
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {option}"), err

