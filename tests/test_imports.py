"""The package's imports point down (read from the AST, function-level imports included): no cycle, and no
module imports a layer above its own.

Layers, bottom to top: config, numerics and hash parameters; the op backends (``ple.backends`` and the
three op packages); the table (and its host-offload machinery); the layer; then ``state``, ``io``,
``distributed``, ``integrations``, ``testing``; ``analysis`` (which may use any of them); the command line on
top. A module may import its own
layer or any layer below (a package's ``__init__`` may import its own submodules); imports under
``if TYPE_CHECKING:`` (for annotations, never run) do not count.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ple"

LAYERS = [
    ("bottom", ["ple.config", "ple._progress", "ple._checks", "ple.quant", "ple.params", "ple._deprecation"]),
    ("ops", ["ple.backends", "ple.reference", "ple.vectorized", "ple.fast"]),
    ("table", ["ple.table", "ple.offload", "ple.optim"]),
    ("layer", ["ple.layer", "ple._layer_parts", "ple._engram_state"]),
    ("state", ["ple.state"]),
    ("io", ["ple.io"]),
    ("distributed", ["ple.distributed"]),
    ("integrations", ["ple.integrations"]),
    ("testing", ["ple.testing"]),
    ("analysis", ["ple.analysis"]),
    ("cli", ["ple.demo", "ple.__main__", "ple"]),
]


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: pathlib.Path) -> set[str]:
    """Every ``ple`` module ``path`` imports, anywhere in the file (``from . import x`` resolved to the
    submodule ``x`` where one exists)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "ple")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ple":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if _exists(sub) else target)
    found.discard(name)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (annotations only; never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = getattr(child, "test", None) if isinstance(child, ast.If) else None
            if test is not None and "TYPE_CHECKING" in ast.unparse(test):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _exists(name: str) -> bool:
    p = ROOT.parent.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(ROOT.rglob("*.py"))}


def layer_of(name: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    if rank is None:
        raise AssertionError(f"{name}: in no layer of tests/test_imports.py's LAYERS; add it")
    return rank


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in g.items():
        for dep in deps:
            if dep.startswith(mod + ".") and mod in {m for m in g if (ROOT.parent / mod.replace(".", "/")).is_dir()}:
                continue                                   # a package's __init__ importing its own submodule
            if layer_of(dep) > layer_of(mod):
                bad.append(f"{mod} ({LAYERS[layer_of(mod)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})")
    return sorted(bad)


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), package __init__ edges to their
    own submodules left out."""
    edges = {m: {d for d in deps if d in g and not d.startswith(m + ".")} for m, deps in g.items()}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_upward():
    assert upward_imports(graph()) == []


def test_no_import_cycle():
    assert cycles(graph()) == []


@pytest.mark.parametrize("planted", ["from ..layer import PLELayer", "from ple.testing import numerics"])
def test_a_planted_upward_import_is_caught(planted, tmp_path):
    g = graph()
    g["ple.reference.gate"] = g["ple.reference.gate"] | imports_of_text(planted, "ple/reference/gate.py")
    assert any(b.startswith("ple.reference.gate") for b in upward_imports(g))


def imports_of_text(text: str, rel: str) -> set[str]:
    path = ROOT.parent / rel
    tmp = path.with_name("_planted_probe.py")
    tmp.write_text(text + "\n")
    try:
        return imports_of(tmp)
    finally:
        tmp.unlink()


def test_a_planted_cycle_is_caught():
    g = graph()
    g["ple.config"] = g["ple.config"] | {"ple.layer"}
    assert cycles(g)
