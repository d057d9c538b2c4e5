"""The package is typed: mypy (pinned in the dev extra, configured in ``pyproject.toml``) finds no error in
``ple/``, finds the error of a wrong annotation planted in a copy of a public module (both in the deep
tier, which ``.ci/run`` runs: mypy takes ~30 s from a cold cache), and every public function and method of
the public modules is fully annotated (read from the AST, in the quick tier).

mypy runs in-process (``mypy.api``) with the repository's config and its cache (``.mypy_cache`` at the
root, which ``mypy`` from the command line shares): about 30 s the first time, a few seconds after.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

mypy_api = pytest.importorskip("mypy.api", reason="mypy is not installed (it is in the dev extra: "
                                                  "pip install -e '.[dev]'); the typing checks need it")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ple"
CONFIG = ROOT / "pyproject.toml"
CACHE = ROOT / ".mypy_cache"


def run_mypy(*targets: str) -> tuple[int, str]:
    """``(exit status, report)`` of mypy on ``targets`` with the repository's config."""
    out, err, status = mypy_api.run(["--config-file", str(CONFIG), "--cache-dir", str(CACHE),
                                     "--no-error-summary", "--no-pretty", *targets])
    return status, out + err


@pytest.mark.deep                       # ~30 s of mypy from a cold cache: the deep tier (.ci/run runs it)
def test_the_package_type_checks():
    status, report = run_mypy(str(PACKAGE))
    assert status == 0, f"mypy found errors in ple/:\n{report}"


@pytest.mark.deep
def test_a_wrong_return_annotation_is_caught(tmp_path):
    src = (PACKAGE / "quant.py").read_text()
    right = "def scheme_of(dtype: torch.dtype) -> Scheme | None:"
    assert src.count(right) == 1
    planted = src.replace(right, "def scheme_of(dtype: torch.dtype) -> Scheme:")    # it returns None too
    path = tmp_path / "quant.py"
    path.write_text(planted)
    lines = planted.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("def scheme_of("))
    line = next(i for i in range(start, len(lines)) if lines[i].strip() == "return None") + 1
    status, report = run_mypy(str(path))
    assert status != 0, report
    assert re.search(rf"quant\.py:{line}: error: Incompatible return value type \(got \"None\", expected "
                     rf"\"Scheme\"\)  \[return-value\]", report), report


# ---- public functions are annotated ---------------------------------------------------------------------
def _is_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A Triton kernel (``@triton.jit``, ``@triton.autotune``, ...): its parameters are kernel arguments."""
    return any(ast.unparse(d).startswith(("triton.", "tl.")) for d in fn.decorator_list)


def _missing(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
    a = fn.args
    params = a.posonlyargs + a.args + a.kwonlyargs
    if method and params and params[0].arg in ("self", "cls", "mcs"):
        params = params[1:]
    missing = [p.arg for p in params if p.annotation is None]
    missing += [f"*{v.arg}" for v in (a.vararg,) if v is not None and v.annotation is None]
    missing += [f"**{v.arg}" for v in (a.kwarg,) if v is not None and v.annotation is None]
    return missing + (["return"] if fn.returns is None else [])


def _public(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def unannotated(tree: ast.Module, module: str) -> list[str]:
    """``module.qualname: missing`` for every public function and method of ``tree`` (not nested in a function,
    not in a private class; Triton kernels aside) lacking a parameter or return annotation."""
    found = []

    def visit(node: ast.AST, path: list[str], in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and _public(child.name):
                visit(child, path + [child.name], True)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                missing = _missing(child, in_class)
                if _public(child.name) and not _is_kernel(child) and missing:
                    found.append(f"{module}.{'.'.join(path + [child.name])}: {', '.join(missing)}")
            elif not isinstance(child, ast.ClassDef):
                visit(child, path, in_class)          # if TYPE_CHECKING / try blocks at module level

    visit(tree, [], False)
    return found


def public_modules() -> list[pathlib.Path]:
    """The package's modules whose dotted name has no private part (``ple.fast._library`` has one)."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if not any(p.startswith("_") and p not in ("__init__", "__main__") for p in parts):
            out.append(path)
    return out


def _name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def test_public_functions_are_annotated():
    missing = [m for p in public_modules() for m in unannotated(ast.parse(p.read_text()), _name(p))]
    assert missing == [], "public functions without full annotations:\n" + "\n".join(missing)


@pytest.mark.parametrize("planted", [
    "def f(x: int):\n    return x\n",                               # no return annotation
    "def f(x, y: int) -> int:\n    return y\n",                     # a parameter without one
    "class A:\n    def m(self, *args) -> None:\n        pass\n",    # a method's *args
])
def test_an_unannotated_public_function_is_caught(planted):
    assert unannotated(ast.parse(planted), "probe")
    private = planted.replace("def f", "def _f").replace("class A", "class _A")
    assert unannotated(ast.parse(private), "probe") == []
