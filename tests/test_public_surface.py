"""The public surface of ``ple`` against its committed snapshot, ``tests/public_surface.txt`` (docs/spec.md section 7).

A public name is removed only after a release in which it still works and raises ``DeprecationWarning``
(``ple._deprecation``). The surface, one entry a line in the snapshot:

* every public module (no path component starting with ``_``: ``ple``, ``ple.state``, ``ple.fast`` ...)
  and every name in its ``__all__``: ``ple.state.PLECache``;
* every public member of a public class defined in ``ple`` (methods, properties, class attributes,
  dataclass / NamedTuple fields, and the attributes its methods set on ``self``, such as
  ``PLECache.num_slots``), under the class's shortest public path: ``ple.state.PLECache.free_slots``;
* every keyword-capable parameter of a public function, method or class constructor:
  ``ple.reference.ngram_ids(query_start_loc=)``.

The test fails when an entry of the snapshot is missing from the code, unless the snapshot records it as
``deprecated since V`` with V older than this version (it went out in a release that warned); and when a name
the code marks deprecated is not recorded so in the snapshot. New names pass; record them (and any new
deprecation) with::

    python tests/test_public_surface.py --update

which refuses to drop an entry that did not go through deprecation (it lists them); after a deliberate,
reviewed removal of a name that never was public in fact, ``--update --accept-removals`` writes it anyway.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest

SNAPSHOT = Path(__file__).with_name("public_surface.txt")
HEADER = """\
# The public surface of ple (tests/test_public_surface.py). One entry a line: a module, a module's __all__
# name, a public class member (Class.member) or a parameter (function(param=)). An entry may be removed
# only after a release that shipped it with a DeprecationWarning ("deprecated since V", V older than the
# current version). Regenerate: python tests/test_public_surface.py --update
"""
DEPRECATED = "  deprecated since "


# ---- the surface -----------------------------------------------------------------------------------------
def public_modules() -> list[str]:
    """``ple`` and every module below it with no path component starting with an underscore."""
    import ple
    names = ["ple"] + [m.name for m in pkgutil.walk_packages(ple.__path__, "ple.")
                       if not any(part.startswith("_") for part in m.name.split("."))]
    return sorted(names)


def _self_attributes(cls: type) -> set[str]:
    """Public attributes the class's own methods set on ``self`` (``self.num_slots = ...``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return set()
    out = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for e in ast.walk(target):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add(e.attr)
    return {n for n in out if not n.startswith("_")}


def _members(cls: type) -> set[str]:
    """Public members of ``cls`` from its classes defined in ``ple`` (what it inherits from torch or the
    standard library is not ple's surface)."""
    out: set[str] = set()
    for klass in cls.__mro__:
        if not getattr(klass, "__module__", "").startswith("ple"):
            continue
        out |= set(vars(klass)) | set(getattr(klass, "__annotations__", {})) | _self_attributes(klass)
    return {n for n in out if not n.startswith("_")}


def _parameters(func: object) -> list[str]:
    """Names a caller may pass by keyword."""
    try:
        sig = inspect.signature(func)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in sig.parameters.values()
            if p.kind in kinds and not p.name.startswith("_") and p.name not in ("self", "cls")]


def _callable_entries(path: str, func: object, into: dict[str, str | None]) -> None:
    from ple._deprecation import deprecations_of
    for p in _parameters(func):
        into[f"{path}({p}=)"] = None
    for d in deprecations_of(func):
        if d.kind == "parameter":                         # absent from the signature, still accepted
            into[f"{path}({d.name}=)"] = d.since


@functools.lru_cache(maxsize=1)
def collect() -> tuple[dict[str, str | None], frozenset[str]]:
    """``(surface, present)``: the surface under canonical paths (entry -> the version it is deprecated
    since, or None), and every entry that resolves in the code under any public path (a class or function
    exported from several modules is one surface, listed under its shortest path)."""
    from ple._deprecation import deprecated_alias, deprecations_of

    surface: dict[str, str | None] = {}
    exported: dict[int, tuple[object, list[str]]] = {}
    moved: dict[str, str] = {}                          # a moved module's old path -> the version it warns since
    for module_name in public_modules():
        module = importlib.import_module(module_name)
        was = getattr(module, "__ple_moved__", None)
        if was is not None:
            moved[module_name] = was.since
        surface[module_name] = moved.get(module_name)
        for name in getattr(module, "__all__", ()):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)        # read through a moved module's path
                obj = getattr(module, name)
            since = next((d.since for d in deprecations_of(obj) if d.kind == "function" and d.name == name),
                         moved.get(module_name))
            surface[f"{module_name}.{name}"] = since
            if isinstance(obj, types.ModuleType):
                continue
            if inspect.isclass(obj) and not obj.__module__.startswith("ple"):
                continue
            if inspect.isclass(obj) or callable(obj):
                exported.setdefault(id(obj), (obj, []))[1].append(f"{module_name}.{name}")
    present = set(surface)
    for obj, paths in exported.values():
        home = getattr(obj, "__module__", "") or ""     # a path not moved, the shortest, the defining package's
        canonical = min(paths, key=lambda p: (p.rpartition(".")[0] in moved, p.count("."),
                                              not home.startswith(p.rpartition(".")[0]), p))
        for path in paths:
            entries: dict[str, str | None] = {}
            _callable_entries(path, obj, entries)
            if inspect.isclass(obj):
                for member in _members(obj):
                    value = inspect.getattr_static(obj, member, None)
                    since = value.since if isinstance(value, deprecated_alias) else None
                    entries[f"{path}.{member}"] = since
                    if isinstance(value, (staticmethod, classmethod)):
                        value = value.__func__
                    if inspect.isfunction(value):
                        _callable_entries(f"{path}.{member}", value, entries)
            present |= set(entries)
            old_since = moved.get(path.rpartition(".")[0])
            if old_since is not None:                       # under a moved module's path: each entry deprecated
                surface.update({e: since or old_since for e, since in entries.items()})
            elif path == canonical:
                surface.update(entries)
    return surface, frozenset(present)


# ---- the snapshot and the rule ---------------------------------------------------------------------------
def read_snapshot(path: Path = SNAPSHOT) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, _, since = line.partition(DEPRECATED)
        out[name.strip()] = since.strip() or None
    return out


def format_snapshot(surface: dict[str, str | None]) -> str:
    lines = [name + (f"{DEPRECATED}{since}" if since else "") for name, since in sorted(surface.items())]
    return HEADER + "\n".join(lines) + "\n"


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(part) for part in v.split("."))


def removals(snapshot: dict[str, str | None], present: frozenset[str] | set[str], version: str) -> list[str]:
    """Snapshot entries missing from the code that did not go through a release with a deprecation warning."""
    out = []
    for name, since in sorted(snapshot.items()):
        if name in present:
            continue
        if since is None:
            out.append(f"{name}: removed without deprecation (keep it working with a DeprecationWarning for a "
                       f"release: ple._deprecation)")
        elif _version(since) >= _version(version):
            out.append(f"{name}: deprecated since {since}, removed before a release shipped the warning "
                       f"(this is {version})")
    return out


def unrecorded_deprecations(snapshot: dict[str, str | None], surface: dict[str, str | None]) -> list[str]:
    """Names the code marks deprecated that the snapshot does not record as deprecated since that version."""
    return [f"{name}: deprecated since {since} in the code, not so in the snapshot (run --update)"
            for name, since in sorted(surface.items()) if since is not None and snapshot.get(name) != since]


def _version_of_ple() -> str:
    import ple
    return ple.__version__


# ---- tests -------------------------------------------------------------------------------------------------
needs_all = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("triton", "transformers")),
                               reason="the surface includes ple.fast (triton) and ple.integrations.transformers")


@needs_all
def test_no_public_name_was_removed_without_deprecation():
    surface, present = collect()
    problems = removals(read_snapshot(), present, _version_of_ple())
    assert not problems, "public names removed:\n  " + "\n  ".join(problems)


@needs_all
def test_deprecated_names_are_recorded_in_the_snapshot():
    surface, _ = collect()
    problems = unrecorded_deprecations(read_snapshot(), surface)
    assert not problems, "\n  ".join(problems)


@needs_all
def test_every_public_module_declares_all_and_exports_what_it_declares():
    for module_name in public_modules():
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None)
        assert isinstance(names, (list, tuple)), f"{module_name}: no __all__"
        assert len(set(names)) == len(names), f"{module_name}: __all__ lists a name twice"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)              # a moved module's names warn
            missing = [n for n in names if not hasattr(module, n)]
        assert not missing, f"{module_name}: __all__ names what it lacks: {missing}"


# What docs/spec.md section 7 and the README document: the collector must see each (instance attributes included),
# and the snapshot must hold each, so that removing one fails `test_no_public_name_was_removed...`.
DOCUMENTED = [
    "ple.PLELayer", "ple.PLEConfig", "ple.state.PLECache", "ple.state.StepBatch", "ple.params.HashParams",
    *(f"ple.state.PLECache.{m}" for m in (
        "num_slots", "free_slots", "active_slots", "allocate", "free", "fork", "schedule", "accept", "config",
        "num_layers", "num_spec_tokens", "null_slot", "width", "state_len", "conv_states", "conv_state", "layout",
        "context", "contexts", "length", "save", "load", "device", "dtype")),
    "ple.state.PLECache(num_slots=)", "ple.state.PLECache(num_spec_tokens=)", "ple.state.PLECache.accept(n=)",
    "ple.state.PLECache.schedule(pad_to=)",
    *(f"ple.PLELayer.{m}" for m in ("forward", "step", "config", "backend", "set_backend", "table", "ops",
                                      "ple_layer_index", "ple_embedding", "conv1d", "key_proj", "value_proj")),
    "ple.PLELayer(backend=)", "ple.PLELayer.forward(attention_mask=)",
    *(f"ple.state.StepBatch.{m}" for m in ("num_tokens", "input_ids", "query_start_loc", "ngram_context",
                                             "state_indices", "host")),
    *(f"ple.params.HashParams.{m}" for m in ("multipliers", "head_sizes", "head_offsets", "num_rows",
                                               "vocab_size", "ngram_size", "to")),
    "ple.PLEConfig.conv_state_len", "ple.PLEConfig.preset", "ple.PLEConfig.num_ple_layers",
    "ple.reference.ngram_ids(query_start_loc=)", "ple.reference.export_conv_checkpoints(slots=)",
    "ple.reference.dilated_causal_conv(cu_seqlens=)", "ple.reference.dilated_causal_conv(weight=)",
]


@needs_all
@pytest.mark.parametrize("name", DOCUMENTED)
def test_documented_names_are_in_the_surface_and_the_snapshot(name):
    surface, _ = collect()
    assert name in surface, f"{name}: documented, not found by the collector"
    assert name in read_snapshot(), f"{name}: documented, not in {SNAPSHOT.name} (run --update)"


def test_the_rule_on_a_made_up_surface():
    snapshot = {"ple.a": None, "ple.b": "0.1.0", "ple.c": "0.2.0", "ple.d": None}
    present = {"ple.a"}
    assert removals(snapshot, present, "0.2.0") == [
        "ple.c: deprecated since 0.2.0, removed before a release shipped the warning (this is 0.2.0)",
        "ple.d: removed without deprecation (keep it working with a DeprecationWarning for a release: "
        "ple._deprecation)"]
    assert removals(snapshot, present | {"ple.c", "ple.d"}, "0.2.0") == []          # ple.b went out deprecated
    assert removals({"ple.b": "0.1.0"}, set(), "0.1.0") != []                        # not yet released
    assert unrecorded_deprecations({"ple.a": None}, {"ple.a": "0.1.0"}) != []
    assert unrecorded_deprecations({"ple.a": "0.1.0"}, {"ple.a": "0.1.0", "ple.e": None}) == []
    text = format_snapshot({"ple.b": "0.1.0", "ple.a": None})
    assert text.endswith("ple.a\nple.b  deprecated since 0.1.0\n")


def test_the_snapshot_round_trips(tmp_path):
    surface = {"ple.x": None, "ple.x.y(z=)": "0.1.0"}
    path = tmp_path / "s.txt"
    path.write_text(format_snapshot(surface))
    assert read_snapshot(path) == surface


@needs_all
def test_the_collector_sees_deprecated_parameters_as_present_and_deprecated():
    surface, present = collect()
    for name in ("ple.distributed.fragments(starts=)", "ple.distributed.halo_plan(starts=)",
                 "ple.state.step.step_conv(state=)", "ple.state.PLECache.realign_windows(state=)",
                 "ple.vectorized.gate.BlockGate(H=)"):                  # a constructor's parameter
        assert surface[name] == "0.1.0" and name in present, name
    assert surface["ple.distributed.fragments(query_start_loc_list=)"] is None


# ---- the helpers of ple._deprecation ------------------------------------------------------------------------
def _one_deprecation_warning(record, *needles: str) -> None:
    dep = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert len(dep) == 1, [str(w.message) for w in record]
    message = str(dep[0].message)
    assert all(n in message for n in needles), message
    assert dep[0].filename == __file__                 # points at the caller's line


def test_deprecated_alias_reads_and_writes_through_and_warns():
    from ple._deprecation import Deprecation, deprecated_alias

    class Thing:
        old = deprecated_alias("new", since="0.1.0")

        def __init__(self):
            self.new = 3

    t = Thing()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert t.old == 3
    _one_deprecation_warning(record, "Thing.old", "deprecated since ple 0.1.0", "use ", "Thing.new")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        t.old = 5
    _one_deprecation_warning(record, "Thing.old")
    assert t.new == 5
    assert Thing.__dict__["old"].deprecation == Deprecation("attribute", "old", "new", "0.1.0")
    with pytest.raises(ValueError, match="^since: "):
        deprecated_alias("new", since="soon")


def test_deprecated_parameter_passes_the_old_keyword_on_and_warns():
    from ple._deprecation import Deprecation, deprecated_parameter, deprecations_of

    @deprecated_parameter("b", "c", since="0.2.0")
    @deprecated_parameter("starts", "offsets", since="0.1.0")
    def f(a, offsets=None, c=0):
        return a, offsets, c

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert f(1, offsets=[0], c=2) == (1, [0], 2)            # the new names: no warning
    assert not record
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert f(1, starts=[0, 4]) == (1, [0, 4], 0)
    _one_deprecation_warning(record, "'starts' argument of", "f", "since ple 0.1.0", "'offsets'")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert f(1, b=7) == (1, None, 7)
    _one_deprecation_warning(record, "'b' argument", "since ple 0.2.0")
    with pytest.raises(TypeError, match="got both 'starts' .* and 'offsets'"):
        f(1, starts=[0], offsets=[0])
    assert set(deprecations_of(f)) == {Deprecation("parameter", "starts", "offsets", "0.1.0"),
                                       Deprecation("parameter", "b", "c", "0.2.0")}
    assert list(inspect.signature(f).parameters) == ["a", "offsets", "c"]


def test_deprecated_function_calls_the_new_one_and_warns():
    from ple._deprecation import deprecated_function, deprecations_of

    def new_name(x):
        return 2 * x

    old_name = deprecated_function(new_name, "old_name", since="0.1.0")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert old_name(4) == 8
    _one_deprecation_warning(record, ".old_name is deprecated", ".new_name instead")
    assert old_name.__name__ == "old_name"
    assert [d.kind for d in deprecations_of(old_name)] == ["function"]
    with pytest.raises(TypeError, match="^func: "):
        deprecated_function(3, "x", since="0.1.0")  # type: ignore[arg-type]


def test_the_kept_old_keywords_of_ple_still_work():
    from ple.distributed import fragments, halo_plan
    from ple.state import PLECache

    with pytest.warns(DeprecationWarning, match="'starts' argument of fragments"):
        assert fragments(starts=[0, 3, 5], lo=2, hi=5) == fragments([0, 3, 5], 2, 5) == [(0, 2, 3), (1, 3, 5)]
    with pytest.warns(DeprecationWarning, match="'starts' argument of halo_plan"):
        assert halo_plan([0, 2, 5], starts=[0, 5], history=2, rank=1) == halo_plan([0, 2, 5], [0, 5], 2, 1)
    assert "state" not in inspect.signature(PLECache.realign_windows).parameters
    import ple
    from ple.state import Prefill
    cache = PLECache(ple.PLEConfig.preset("tiny"), 3, num_layers=1)
    batch = cache.schedule([Prefill(cache.allocate(), [1, 2])])
    with pytest.warns(DeprecationWarning, match="'state' argument of PLECache.realign_windows"):
        cache.realign_windows(batch, 0, state=cache.conv_state(0))


def test_the_names_renamed_for_the_glossary_still_work(tmp_path):
    """Old names kept for a release: each warns and gives what its new name gives."""
    import torch

    import ple
    import ple.io as pio
    from ple.io import Checkpoint
    from ple.io.load import select_prefix, table_blocks
    from ple.io.save import CheckpointTable
    from ple.testing.layers import random_layer
    from ple.vectorized import gate as vec_gate
    from ple.vectorized import prefill as vec_prefill

    key, x = torch.randn(3, 4), torch.randn(3, 2)
    w = [torch.zeros(4)] * 3
    with pytest.warns(DeprecationWarning, match="'H' argument of gate"):
        old = vec_gate.gate(key, x, key, *w, 1e-6, H=2)
    assert all(torch.equal(a, b) for a, b in zip(old, vec_gate.gate(key, x, key, *w, 1e-6, hidden_size=2)))
    with pytest.warns(DeprecationWarning, match="'H' argument of BlockGate.__init__"):
        assert vec_gate.BlockGate(2, key, *w, 1e-6, H=2).H == 2
    with pytest.warns(DeprecationWarning, match="use ple.vectorized.grouped_rms_norm instead"):
        old_norm = vec_gate.grouped_rms_norm(key, w[0], 2, 1e-6)
    assert torch.equal(old_norm, vec_gate._grouped_rms_norm(key, w[0], 2, 1e-6))
    for module, new in ((vec_gate, "takes_block_gate_path"), (vec_prefill, "takes_blocked_forward_path")):
        with pytest.warns(DeprecationWarning, match=f"takes_blocked_path is deprecated .*{new} instead"):
            args = (key,) if module is vec_gate else (key, None, False)
            assert module.takes_blocked_path(*args) == getattr(module, new)(*args)
    path, config = tmp_path / "layer.safetensors", ple.PLEConfig.preset("tiny")
    pio.save(random_layer(config), path)
    ckpt = Checkpoint.open(path)
    plan = pio.plan_layer(ckpt, config, 0, select_prefix(ckpt, config, 0))
    key0 = plan.pieces[0].key
    with pytest.warns(DeprecationWarning, match="'block_rows' argument of Checkpoint.read_rows"):
        got = [a for a, _ in ckpt.read_rows(key0, 0, 5, block_rows=2)]
    assert got == [a for a, _ in ckpt.read_rows(key0, 0, 5, rows_per_block=2)] == [0, 2, 4]
    with pytest.warns(DeprecationWarning, match="'block_rows' argument of table_blocks"):
        assert [b[0] for b in table_blocks(ckpt, plan, 0, 5, block_rows=3)] == [0, 3]
    with pytest.warns(DeprecationWarning, match="'block_rows' argument of CheckpointTable.blocks"):
        assert len(list(CheckpointTable(ckpt, plan).blocks(0, 5, block_rows=3))) == 2


MOVED = {"ple.io.disk": "ple.io.disk_table.table", "ple.io.disk_train": "ple.io.disk_table.training",
         "ple.io.mapped": "ple.io.disk_table.mapped", "ple.io.overlay": "ple.io.disk_table.overlay",
         "ple.io.row_cache": "ple.io.disk_table.row_cache"}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_the_disk_tables_old_module_paths_still_work_and_warn(old):
    """The disk table's modules moved into ``ple.io.disk_table``: every public name under its old path warns,
    pointing at the reader's line, and is the new module's own object; the surface records them deprecated."""
    module, new = importlib.import_module(old), importlib.import_module(MOVED[old])
    assert module.__all__ and set(module.__all__) <= set(dir(new))
    for name in module.__all__:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            got = getattr(module, name)
        _one_deprecation_warning(record, f"{old}.{name} is deprecated since ple 0.1.0", f"{MOVED[old]}.{name}")
        assert got is getattr(new, name), name
    with pytest.warns(DeprecationWarning, match=f"{old}.{module.__all__[0]} is deprecated"):
        exec(f"from {old} import {module.__all__[0]}", {})
    with pytest.raises(AttributeError, match=f"has no attribute 'no_such_name' .*moved to '{MOVED[old]}'"):
        module.no_such_name  # noqa: B018
    assert module.__ple_moved__.kind == "module" and module.__ple_moved__.replacement == MOVED[old]
    snapshot = read_snapshot()
    assert all(snapshot.get(f"{old}.{name}") == "0.1.0" for name in module.__all__)
    assert snapshot.get(old) == "0.1.0"


def test_moved_module_checks_its_version():
    from ple._deprecation import moved_module
    with pytest.raises(ValueError, match="^since: "):
        moved_module("ple.old", "ple.io", since="next")


# ---- regenerate -----------------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    if "--update" not in argv:
        print(__doc__)
        return 2
    surface, present = collect()
    old = read_snapshot() if SNAPSHOT.exists() else {}
    problems = removals(old, present, _version_of_ple())
    if problems and "--accept-removals" not in argv:
        print("not updated: these entries would be dropped without deprecation\n  " + "\n  ".join(problems)
              + "\n(--update --accept-removals drops them anyway)")
        return 1
    SNAPSHOT.write_text(format_snapshot(surface))
    added = sorted(set(surface) - set(old))
    print(f"{SNAPSHOT}: {len(surface)} entries ({len(added)} new, {len(problems)} dropped)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
