"""``ple.fast`` on CPU tensors with compiled (not interpreted) kernels says what to do."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
CODE = """
import torch, ple.fast as f
calls = {
    "ple_gate": lambda: f.ple_gate(torch.randn(2, 4), torch.randn(2, 2), torch.randn(2, 4), torch.zeros(4),
                                   torch.zeros(4), torch.zeros(4), 1e-6),
    "embedding_lookup": lambda: f.embedding_lookup(torch.randn(5, 3), torch.tensor([[1, 2]])),
    "dilated_causal_conv": lambda: f.dilated_causal_conv(torch.randn(1, 4, 3), torch.randn(3, 2), dilation=1),
}
for name, call in calls.items():
    try:
        call()
        print(name, "RAN")
    except ValueError as e:
        assert "TRITON_INTERPRET=1" in str(e) and "CUDA" in str(e) and name in str(e), str(e)
        print(name, "refused")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, CPU tensors are a plain device mismatch")
def test_cpu_tensors_without_the_interpreter_get_a_clear_error():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ple_gate", "refused", "embedding_lookup", "refused", "dilated_causal_conv",
                                   "refused"], done.stdout
