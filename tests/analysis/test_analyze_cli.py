"""``python -m ple analyze CONFIG TOKENS``: the statistics table of a .npy / .pt token file (the same as
``ngram_stats``), ``--top`` (each head's most-hit rows with their n-grams, as ``row_ngrams`` gives them),
``--json``, and every bad input as one ``error:`` line naming the file, exit status 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from ple import PLEConfig
from ple.__main__ import main
from ple.analysis import _ngrams, cli
from ple.analysis.stats import ngram_stats, row_ngrams

TINY = PLEConfig.preset("tiny")


def run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:                                  # argparse's own errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def corpus() -> torch.Tensor:
    """Four sequences of the tiny preset's tokens, EOS (2) inside."""
    rows = torch.randint(0, 1000, (4, 50), generator=torch.Generator().manual_seed(0))
    rows[:, ::9] = 2
    return rows


def test_a_1d_npy_file_is_one_sequence(corpus, tmp_path, capsys):
    path = tmp_path / "tokens.npy"
    np.save(path, corpus.reshape(-1).numpy().astype(np.int32))
    code, out, err = run(["analyze", "tiny", str(path)], capsys)
    assert code == 0 and err == ""
    assert out == ngram_stats(TINY, corpus.reshape(-1)).table() + "\n"


@pytest.mark.parametrize("form", ["npy 2-D", "pt 2-D", "pt list", "pt tuple"])
def test_files_of_several_sequences(form, corpus, tmp_path, capsys):
    path = tmp_path / ("tokens.npy" if form.startswith("npy") else "tokens.pt")
    if form == "npy 2-D":
        np.save(path, corpus.numpy().astype(np.uint16))
    elif form == "pt 2-D":
        torch.save(corpus, path)
    else:
        torch.save((list if form == "pt list" else tuple)(corpus[i, : 10 * (i + 2)] for i in range(4)), path)
    sequences = list(corpus) if "2-D" in form else [corpus[i, : 10 * (i + 2)] for i in range(4)]
    code, out, _ = run(["analyze", "tiny", str(path)], capsys)
    assert code == 0 and out == ngram_stats(TINY, sequences).table() + "\n"


def test_a_config_json_and_another_layer(corpus, tmp_path, capsys):
    config = TINY.replace(ngram_vocab_size_base=500)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    torch.save(corpus, tmp_path / "t.pt")
    code, out, _ = run(["analyze", str(tmp_path / "config.json"), str(tmp_path / "t.pt"), "--layer", "1"], capsys)
    assert code == 0 and out == ngram_stats(config, corpus, ple_layer_index=1).table() + "\n"


def test_top_lists_the_most_hit_rows_with_their_ngrams(tmp_path, capsys):
    config = TINY.replace(ngram_vocab_size_base=40)                         # small heads: shared rows
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    tokens = torch.randint(3, 60, (300,), generator=torch.Generator().manual_seed(1))
    np.save(tmp_path / "t.npy", tokens.numpy())
    argv = ["analyze", str(tmp_path / "config.json"), str(tmp_path / "t.npy"), "--top", "2"]
    code, out, _ = run(argv, capsys)
    assert code == 0
    code, text, _ = run([*argv, "--json"], capsys)
    report = json.loads(text)
    stats = ngram_stats(config, tokens)
    assert report["heads"] == [vars(h) for h in stats.heads] and report["num_tokens"] == 300
    assert any(h.shared_rows for h in stats.heads)
    for head in stats.heads:
        listed = report["top_rows"][str(head.head)]
        assert len(listed) == 2
        # the most-hit rows: occurrences per row of this head, from row_ngrams over every row of the head
        lo = sum(h.size for h in stats.heads[:head.head])
        every = row_ngrams(config, tokens, range(lo, lo + head.size), top=None)
        hits = sorted(((-sum(c for _, c in g), row) for row, g in every.items() if g))[:2]
        assert [(e["row"], e["occurrences"]) for e in listed] == [(row, -neg) for neg, row in hits]
        for e in listed:
            assert [(tuple(g), c) for g, c in e["ngrams"]] == every[e["row"]][:2]
            line = f"  row {e['row']}: {e['occurrences']:,} occurrence{'' if e['occurrences'] == 1 else 's'}: "
            assert line + "; ".join(f"{' '.join(map(str, g))} x{c:,}" for g, c in e["ngrams"]) in out
        assert f"head {head.head} ({head.order}-grams): its 2 most-hit rows" in out
    assert out.startswith(stats.table() + "\n\n")


def _write(kind: str, tmp_path) -> str:
    path = tmp_path / {"missing": "none.npy", "npy garbage": "bad.npy", "pt garbage": "bad.pt", "float npy": "f.npy",
                       "float pt": "f.pt", "float in list": "fl.pt", "out of range": "big.npy",
                       "negative": "neg.pt", "3-D": "cube.npy", "suffix": "tokens.txt", "dict": "d.pt",
                       "2-D item": "items.pt", "bool": "b.npy", "a folder": "dir.npy"}[kind]
    if kind in ("npy garbage", "pt garbage", "suffix"):
        path.write_bytes(b"not tokens at all")
    elif kind == "float npy":
        np.save(path, np.ones(5))
    elif kind == "float pt":
        torch.save(torch.ones(5), path)
    elif kind == "float in list":
        torch.save([torch.tensor([1, 2]), torch.ones(3, dtype=torch.bfloat16)], path)
    elif kind == "out of range":
        np.save(path, np.array([[1, 2, 3], [4, 1000, 5]]))
    elif kind == "negative":
        torch.save([torch.tensor([1, 2]), torch.tensor([3, -4])], path)
    elif kind == "3-D":
        np.save(path, np.zeros((2, 2, 2), dtype=np.int64))
    elif kind == "dict":
        torch.save({"tokens": torch.tensor([1, 2])}, path)
    elif kind == "2-D item":
        torch.save([torch.zeros(2, 2, dtype=torch.int64)], path)
    elif kind == "bool":
        np.save(path, np.ones(4, dtype=bool))
    elif kind == "a folder":
        path.mkdir()
    return str(path)


@pytest.mark.parametrize("kind, expected", [
    ("missing", "no such file"), ("a folder", "not a regular file"), ("npy garbage", "not a readable .npy file"),
    ("pt garbage", "not a .pt file torch.load reads"), ("float npy", "expected integer token ids, got float64"),
    ("float pt", "expected integer token ids, got float32"), ("float in list", "item 1: expected integer token ids"),
    ("out of range", r"token ids must lie in \[0, 1000\).*found 1000 at position 1 of sequence 1"),
    ("negative", "found -4 at position 1 of sequence 1"), ("3-D", r"got shape \(2, 2, 2\)"),
    ("suffix", "expected a .npy or .pt file"), ("dict", "got dict"), ("2-D item", "item 0: expected a 1-D tensor"),
    ("bool", "expected integer token ids, got bool"),
])
def test_a_bad_token_file_is_one_error_line_naming_it(kind, expected, tmp_path, capsys):
    path = _write(kind, tmp_path)
    code, out, err = run(["analyze", "tiny", path], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: "), err
    assert re.search(expected, lines[0]), lines[0]


@pytest.mark.parametrize("argv, expected", [
    (["no-such-preset", "T"], "error: CONFIG: 'no-such-preset' is neither a file nor a preset"),
    (["missing.json", "T"], "error: CONFIG: no file missing.json"),
    (["BADJSON", "T"], "error: CONFIG: "),
    (["tiny", "T", "--layer", "2"], "error: --layer: the config has 2 PLE layer(s)"),
    (["tiny", "T", "--layer", "-1"], "error: --layer: "),
    (["tiny", "T", "--top", "-1"], "error: --top: expected a count >= 0, got -1"),
])
def test_bad_config_and_options(argv, expected, tmp_path, capsys):
    np.save(tmp_path / "t.npy", np.arange(10))
    (tmp_path / "bad.json").write_text("{not json")
    argv = [str(tmp_path / "t.npy") if a == "T" else str(tmp_path / "bad.json") if a == "BADJSON" else a
            for a in argv]
    code, out, err = run(["analyze", *argv], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(expected), err


def test_help_and_the_module_entry_point(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(3, 30))
    done = subprocess.run([sys.executable, "-m", "ple", "analyze", "tiny", str(tmp_path / "t.npy")],
                          capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr        # no progress bar off a terminal
    assert done.stdout.splitlines()[0] == "n-gram statistics of PLE index 0: 27 tokens in 1 sequence"
    helped = subprocess.run([sys.executable, "-m", "ple", "analyze", "--help"], capture_output=True, text=True,
                            check=False, timeout=120)
    assert helped.returncode == 0 and "--top" in helped.stdout and "--layer" in helped.stdout


def test_a_progress_bar_follows_the_corpus(tmp_path, capsys, monkeypatch):
    """The blocks of the corpus (their count known from the file) and the orders go through the CLI's bar."""
    calls = []

    def recorder(iterable, *, total=None, desc=""):
        items = list(iterable)
        calls.append((desc, total, len(items)))
        return items

    monkeypatch.setattr(cli, "progress", recorder)
    monkeypatch.setattr(_ngrams, "_BLOCK_TOKENS", 16)
    np.save(tmp_path / "t.npy", np.arange(100).reshape(4, 25))
    code, out, _ = run(["analyze", "tiny", str(tmp_path / "t.npy")], capsys)
    assert code == 0 and out == ngram_stats(TINY, torch.arange(100).reshape(4, 25)).table() + "\n"
    assert calls == [("counting n-grams", 7, 7), ("rows of the distinct n-grams", 2, 2)]
