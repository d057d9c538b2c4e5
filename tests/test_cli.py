"""Every bad CLI / demo / example option is one ``error:`` line and exit status 2, never a traceback."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

import ple
from ple.__main__ import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _exit_code(fn, argv):
    try:
        return fn(argv)
    except SystemExit as e:                      # argparse's own errors
        return e.code


@pytest.mark.parametrize("argv", [
    ["demo", "--steps", "0"], ["demo", "--spec", "-1"], ["demo", "--layers", "0"], ["demo", "--layers", "99"],
    ["demo", "--requests", "0"], ["demo", "--steps", "x"], ["demo", "--threads", "-2"],
    ["inspect", "missing_dir"], ["inspect", "CKPT", "--config", "missing.json"],
    ["inspect", "CKPT", "--config", "no-such-preset"], ["inspect", "TORCH_SAVE"],
])
def test_bad_option_is_one_error_line_and_exit_2(argv, tmp_path, capsys):
    layer = ple.PLELayer(ple.PLEConfig.preset("tiny"))
    ple.io.save(layer, tmp_path / "ckpt")
    torch.save(layer.state_dict(), tmp_path / "layer.pt")
    argv = [str(tmp_path / "ckpt") if a == "CKPT" else str(tmp_path / "layer.pt") if a == "TORCH_SAVE" else a
            for a in argv]
    assert _exit_code(main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "error:" in err[-1] and "Traceback" not in "\n".join(err), err


def test_demo_triton_without_a_way_to_run_it(monkeypatch, capsys):
    monkeypatch.setattr(ple.backends, "triton_available", lambda: False)
    assert _exit_code(main, ["demo", "--backend", "triton"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


def test_help_lists_subcommands_and_every_option_has_help(capsys):
    assert _exit_code(main, ["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("demo", "inspect", "convert"):
        assert cmd in out
    for cmd in ("demo", "inspect", "convert"):
        assert _exit_code(main, [cmd, "--help"]) == 0
        text = capsys.readouterr().out
        opts = [line.split()[0] for line in text.splitlines() if line.strip().startswith("--")]
        assert opts, text
        for line in text.split("options:")[1].split("\n  -")[1:]:
            assert len(line.split()) > 1, f"{cmd}: option without help: {line!r}"


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--noise", "2"], ["--batch", "0"], ["--length", "1"]])
def test_train_example_rejects_bad_options(argv, capsys):
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "examples" / "train_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert _exit_code(mod.main, argv) == 2
    assert "error:" in capsys.readouterr().err
