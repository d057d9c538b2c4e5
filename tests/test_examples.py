"""The demo, the examples and every python block of the README and docs/ run, and say what they should."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

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
    """docs/distribution.md's command: torchrun, 2 gloo ranks, the table a row-sharded DTensor, FSDP2; loss falls."""
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


# The pages whose ``python`` blocks must run as pasted: the README and every page under docs/.
DOC_PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^`\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)      # (info string, body)
FENCE_LANGS = {"python", "bash", ""}           # "" is printed output; Python goes in python blocks, never "py"
# What a page's blocks print, as its comments say (substrings of the page's output, in order).
PRINTED = {
    "README.md": ["8 6 [1]"],
    "docs/serving.md": ["4 3 []", "1 [1, 2]", "torch.Size([4, 48]) 14 6", "[2, 3] 1"],
    "docs/testing.md": ["ple_conv prefill: residual differs at request"],
    "docs/distribution.md": ["rank 0: rows (6128, 4) of 6128, out (1, 9, 48)"],
    "docs/kernels.md": ["the Triton layer matches the reference"],
    "docs/training.md": ["rows with Adagrad state: "],
    "docs/disk.md": ["rows changed"],
}

# Runs every block in a child forked from one interpreter that has imported only torch (which every block
# imports itself): each child starts from fresh globals in its own empty folder, so a block that leans on
# an earlier block's names, files, modules beyond torch, or global torch settings fails as it would when
# pasted; the fork saves a torch import per block.
RUNNER = r"""
import json, os, sys, time, traceback
import torch  # noqa: F401

blocks, results = json.load(open(sys.argv[1])), []
for i, (name, code) in enumerate(blocks):
    where = os.path.join(os.path.dirname(sys.argv[1]), f"block{i}")
    os.mkdir(where)
    out_path, err_path = where + ".out", where + ".err"
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        with open(out_path, "w") as out, open(err_path, "w") as err:
            os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        os.chdir(where)
        status = 0
        try:
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(status)
    _, status = os.waitpid(pid, 0)
    results.append(dict(name=name, rc=os.waitstatus_to_exitcode(status), seconds=time.perf_counter() - t0,
                        out=open(out_path).read(), err=open(err_path).read()))
json.dump(results, open(sys.argv[2], "w"))
"""


def fenced_blocks(text):
    """``(language, body)`` of every fenced block of a Markdown text, in order."""
    return [(info.strip(), body) for info, body in FENCE.findall(text)]


@pytest.fixture(scope="module")
def block_runs(tmp_path_factory):
    """Every ``python`` block of every page, run once: page -> list of results, in page order."""
    tmp = tmp_path_factory.mktemp("blocks")
    blocks = [(f"{page} python block {i}", body)
              for page in DOC_PAGES
              for i, body in enumerate(b for lang, b in fenced_blocks((ROOT / page).read_text()) if lang == "python")]
    (tmp / "blocks.json").write_text(json.dumps(blocks))
    done = subprocess.run([sys.executable, "-c", RUNNER, str(tmp / "blocks.json"), str(tmp / "results.json")],
                          capture_output=True, text=True, timeout=900, cwd=tmp,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    runs: dict[str, list[dict]] = {page: [] for page in DOC_PAGES}
    for run in json.loads((tmp / "results.json").read_text()):
        runs[run["name"].split(" python block ")[0]].append(run)
    return runs


def test_the_readme_links_every_docs_page_and_nothing_outside():
    """Each docs page is linked from the README, and no page links outside the repository."""
    readme = (ROOT / "README.md").read_text()
    assert all(f"]({page})" in readme for page in DOC_PAGES[1:]), "a docs page the README does not link"
    for page in DOC_PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", (ROOT / page).read_text()):
            if "://" in target:
                continue
            path = ((ROOT / page).parent / target.split("#")[0]).resolve()
            assert path.is_relative_to(ROOT) and path.exists(), f"{page} links {target}, not in the repository"


@pytest.mark.parametrize("page", DOC_PAGES)
def test_every_python_block_runs_as_pasted(page, block_runs):
    """Each ``python`` block of the page, pasted into a fresh interpreter in an empty folder, runs and prints
    what its comments say; the page's other blocks are ``bash`` (commands, some needing a GPU or torchrun)
    or plain output."""
    text = (ROOT / page).read_text()
    fences = fenced_blocks(text)
    assert {lang for lang, _ in fences} <= FENCE_LANGS, f"{page}: a block fenced as none of {FENCE_LANGS}"
    runs = block_runs[page]
    assert len(runs) == sum(lang == "python" for lang, _ in fences) == len(re.findall(r"^```python", text, re.M))
    for run in runs:
        assert run["rc"] == 0, f"{run['name']} failed:\n{run['err']}"
    printed = "".join(run["out"] for run in runs)
    at = 0
    for expected in PRINTED.get(page, []):
        found = printed.find(expected, at)
        assert found >= 0, f"{page}: its blocks did not print {expected!r} (in order); they printed:\n{printed}"
        at = found + len(expected)
    if page == "README.md":
        assert runs, "the README's tour is a python block"


def test_import_and_demo_need_no_test_dependencies():
    """The README's first command installs only ``-e .``: ``import ple`` and the demo must not need Hypothesis."""
    code = ("import sys; sys.modules['hypothesis'] = None\n"
            "import ple, ple.__main__\n"
            "assert ple.__main__.main(['demo', '--steps', '2', '--layers', '1']) == 0\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
