"""``python -m ple check MODULE[:ATTR]`` (docs/spec.md section 10): one line per op, exit 0 / 1 / 2."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ple.__main__ import main
from ple.backends import OP_NAMES

PLANTED = textwrap.dedent("""
    import types
    import ple

    def ple_gate(key, value, hidden_states, wk, wq, wc, eps):
        gated, conv_input = ple.vectorized.ple_gate(key, value, hidden_states, wk, wq, wc, eps)
        return gated, conv_input * 1.001          # the planted mistake: conv inputs 0.1 % too large

    ngram_ids = ple.vectorized.ngram_ids
    ops = types.SimpleNamespace(**{n: getattr(ple.vectorized, n) for n in ple.backends.OP_NAMES})
    ops.ple_gate = ple_gate
""")


def _run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out.strip().splitlines(), out.err.strip().splitlines()


def test_every_op_of_the_torch_backend_passes(capsys):
    code, out, err = _run(["check", "ple.vectorized", "--max-examples", "2", "--dtypes", "float32,bfloat16"],
                          capsys)
    assert code == 0, out + err
    names = [line.split()[0] for line in out if line.strip()]
    assert names == [*OP_NAMES, "table_update", "layer"], out
    assert all(line.rstrip().endswith("ok") for line in out), out


def test_a_planted_mistake_fails_and_names_the_op(tmp_path, capsys):
    path = tmp_path / "my_kernels.py"
    path.write_text(PLANTED)
    code, out, _ = _run(["check", str(path), "--ops", "ngram_ids,ple_gate", "--max-examples", "5"], capsys)
    assert code == 1, out
    lines = dict(line.split(maxsplit=1) for line in out)
    assert lines["ngram_ids"].endswith("ok"), out
    assert "FAIL" in lines["ple_gate"] and "conv_input" in lines["ple_gate"] and "case" in lines["ple_gate"], out


def test_a_namespace_attribute_runs_the_layer_check(tmp_path, capsys):
    (tmp_path / "my_kernels.py").write_text(PLANTED)
    code, out, _ = _run(["check", f"{tmp_path / 'my_kernels.py'}:ops", "--ops", "layer", "--max-examples", "3",
                         "--dtypes", "bfloat16"], capsys)
    assert code == 1 and out[0].startswith("layer") and "FAIL" in out[0], out


@pytest.mark.parametrize("argv,words", [
    (["check", "no_such_module_anywhere"], "cannot import"),
    (["check", "ple.vectorized:no_such_attr"], "no attribute"),
    (["check", "ple.vectorized", "--ops", "ple_conv,nope"], "unknown op"),
    (["check", "ple.vectorized", "--dtypes", "float8"], "--dtypes"),
    (["check", "ple.vectorized", "--max-examples", "0"], "--max-examples"),
    (["check", "ple.config"], "none of the ops"),
    (["check", "ple.config:PLEConfig", "--ops", "layer"], "layer needs every op"),
])
def test_usage_errors_are_one_line_and_exit_2(argv, words, capsys):
    code, out, err = _run(argv, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and words in err[0], err


def test_runs_as_a_module_command(tmp_path):
    (tmp_path / "my_kernels.py").write_text(PLANTED)
    proc = subprocess.run([sys.executable, "-m", "ple", "check", "my_kernels", "--ops", "ple_gate",
                           "--max-examples", "3"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ple_gate") and "FAIL" in proc.stdout
