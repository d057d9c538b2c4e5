"""The demo and the training example run, and say what they should."""

from __future__ import annotations

import importlib.util
import os
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


def test_train_sharded_runs_under_torchrun_and_learns():
    """The README's command: torchrun, 2 gloo ranks, the table a row-sharded DTensor, FSDP2; the loss falls."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "examples" / "train_sharded.py"), "--steps", "25"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 ranks, table row-sharded ((6032, 8) of (12064, 8) on rank 0)" in done.stdout
    first, last = (float(x.split()[-1]) for x in done.stdout.split("loss: step 1 ")[1].split(" -> "))
    assert last < first - 1.0


def test_serve_sharded_runs_under_torchrun_and_matches_the_whole_table():
    """Each of 2 gloo ranks serves its own requests from its own cache, idle steps included, bit for bit."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "examples" / "serve_sharded.py")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2 and all("equal the whole-table layer bit for bit" in line for line in lines), lines
    assert any("(0 idle)" not in line for line in lines)                # an idle step joined the lookups


def test_train_tiny_ple_beats_its_no_ple_twin(capsys):
    example = _load_example("train_tiny")
    assert example.main(["--steps", "60"]) == 0
    out = capsys.readouterr().out
    losses = {line.split(":")[0].strip(): float(line.split("->")[1].split()[0])
              for line in out.splitlines() if "->" in line}
    assert losses["with PLE"] < losses["without PLE"] - 0.5


def test_every_readme_python_block_runs_as_pasted(tmp_path):
    """Each ``python`` block of the README, pasted into a fresh interpreter (in an empty folder), runs."""
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```python\n")[1:]
    assert len(blocks) >= 3
    for i, block in enumerate(blocks):
        code = block[:block.index("```")]
        where = tmp_path / f"block{i}"
        where.mkdir()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=where,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, f"README python block {i}:\n{code}\n{done.stderr}"
        if "check_ple_conv(my_conv" in code:          # "Test your own kernel": the report it shows
            first = done.stdout.strip().splitlines()[0]
            assert first.startswith("ple_conv prefill: residual differs at request"), done.stdout


def test_import_and_demo_need_no_test_dependencies():
    """The README's first command installs only ``-e .``: ``import ple`` and the demo must not need Hypothesis."""
    code = ("import sys; sys.modules['hypothesis'] = None\n"
            "import ple, ple.__main__\n"
            "assert ple.__main__.main(['demo', '--steps', '2', '--layers', '1']) == 0\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
