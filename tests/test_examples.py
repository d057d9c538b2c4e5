"""The demo and the training example run, and say what they should."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import ple.__main__ as cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_demo_runs_and_checks_every_token(capsys):
    assert cli.main(["demo", "--requests", "5", "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert "backend=reference" in out
    assert "requests 5 (finished 5)" in out
    assert "conv states checked bit for bit" in out
    assert out.rstrip().endswith("OK")


def _load_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_tiny_ple_beats_its_no_ple_twin(capsys):
    example = _load_example("train_tiny")
    assert example.main(["--steps", "60"]) == 0
    out = capsys.readouterr().out
    losses = {line.split(":")[0].strip(): float(line.split("->")[1].split()[0])
              for line in out.splitlines() if "->" in line}
    assert losses["with PLE"] < losses["without PLE"] - 0.5


def test_readme_tour_runs_as_pasted():
    """The README's tour is the first ``python`` block; pasted into a fresh interpreter it must run."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start:text.index("```", start)]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_readme_test_your_own_kernel_runs_as_pasted():
    """The "Test your own kernel" block runs, and the planted mistake is reported as the README says."""
    text = (ROOT / "README.md").read_text()
    section = text.index("## Test your own kernel")
    start = text.index("```python\n", section) + len("```python\n")
    code = text[start:text.index("```", start)]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    first = done.stdout.strip().splitlines()[0]
    assert first.startswith("ple_conv prefill: residual differs at request"), done.stdout
