"""Every notebook in ``notebooks/`` runs top to bottom, draws at least one plot, and labels every axis and colorbar.

The notebooks are executed with nbclient in a Jupyter kernel running this interpreter, with
``SMOKE_TEST=1`` (each notebook shrinks itself), ``MPLBACKEND=Agg`` and one OpenMP thread. Each
notebook has a wall-clock budget, ``NOTEBOOK_TIMEOUT``; they take 5-20 s each on a 2-core CPU.
Notebooks that import ``ple.fast`` carry the ``interpreter`` marker (Triton kernels, interpreted on a
CPU: the conftest sets ``TRITON_INTERPRET=1``, which the kernel inherits). Notebooks must be
committed stripped: no outputs, no execution counts.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NOTEBOOK_TIMEOUT = 150  # seconds per notebook, kernel start included
KERNEL = "ple-notebooks"

# Run right after a notebook's first code cell: every plt.show() checks that each axis and colorbar of the
# figures it shows has a label; the last cell asserts none was missing.
LABEL_CHECK = """
import matplotlib.pyplot as _plt
_plt_show, _unlabelled = _plt.show, []
def _labelled_show(*args, **kwargs):
    for num in _plt.get_fignums():
        for ax in _plt.figure(num).axes:
            if not ax.axison:
                continue
            where = repr(ax.get_title() or _plt.figure(num).get_suptitle())
            if hasattr(ax, "_colorbar"):
                if not (ax.get_ylabel() or ax.get_xlabel()):
                    _unlabelled.append(f"{where}: a colorbar without a label")
                continue
            _unlabelled.extend(f"{where}: no {n} label" for n, lab in (("x", ax.get_xlabel()),
                                                                        ("y", ax.get_ylabel())) if not lab)
    return _plt_show(*args, **kwargs)
_plt.show = _labelled_show
"""


def _runs_kernels(path: pathlib.Path) -> bool:
    """Does the notebook import the Triton kernels (``ple.fast``)?"""
    code = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    return any("from ple import fast" in src or "ple.fast" in src for src in code)


RUNS = [pytest.param(p, id=p.stem, marks=[pytest.mark.interpreter] if _runs_kernels(p) else [])
        for p in NOTEBOOKS]


@pytest.fixture(scope="module")
def jupyter_path(tmp_path_factory) -> pathlib.Path:
    """A kernel spec running ipykernel under this very interpreter (not whatever ``python3`` is)."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "ple notebooks (tests)",
        "language": "python",
    }))
    return root


def test_the_six_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert len(names) >= 6, names
    for prefix in ("01_", "02_", "03_", "04_", "05_", "06_"):
        assert any(n.startswith(prefix) for n in names), f"no notebook {prefix}*.ipynb in {names}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stripped_and_has_a_smoke_knob(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name}: no code cells"
    for i, cell in enumerate(code):
        assert cell.outputs == [] and cell.execution_count is None, \
            f"{path.name}: code cell {i} has outputs; strip them before committing"
    assert 'os.environ.get("SMOKE_TEST"' in code[0].source, \
        f"{path.name}: the first code cell must read the SMOKE_TEST knob from the environment"


@pytest.mark.parametrize("path", RUNS)
def test_notebook_runs_and_plots(path, jupyter_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))   # searched first: finds the kernel spec above
    monkeypatch.setenv("SMOKE_TEST", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")                 # notebooks select the inline backend themselves
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    nb = nbformat.read(path, as_version=4)
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    nb.cells.insert(first + 1, nbformat.v4.new_code_cell(LABEL_CHECK))
    nb.cells.append(nbformat.v4.new_code_cell("assert not _unlabelled, _unlabelled"))
    start = time.monotonic()
    deadline = start + NOTEBOOK_TIMEOUT       # one budget for the whole notebook: each cell gets what is left
    client = NotebookClient(nb, kernel_name=KERNEL, resources={"metadata": {"path": str(path.parent)}},
                            timeout_func=lambda cell: max(1, int(deadline - time.monotonic())))
    try:
        client.execute()
    except CellTimeoutError:
        pytest.fail(f"{path.name}: did not finish within {NOTEBOOK_TIMEOUT} s (SMOKE_TEST=1)")
    seconds = time.monotonic() - start
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert images, f"{path.name}: ran in {seconds:.0f} s but showed no plot"


def test_kernel_is_this_interpreter(jupyter_path, monkeypatch):
    """The notebooks see the packages of the environment running the tests."""
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys; print(sys.executable)")])
    NotebookClient(nb, kernel_name=KERNEL, timeout=60).execute()
    assert nb.cells[0].outputs[0]["text"].strip() == sys.executable
