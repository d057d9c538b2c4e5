"""``python -m ple analyze CONFIG TOKENS``: the n-gram statistics of a token file (`ple.analysis.stats`).

``TOKENS`` is a ``.npy`` file (read memory-mapped: 1-D, one sequence; 2-D, a sequence per row) or a ``.pt``
file (``torch.save`` of a 1-D or 2-D integer tensor, read as the ``.npy``; or of a list or tuple of 1-D
integer tensors, a sequence each), of any integer dtype. The statistics table is printed (`NgramStats.table`);
``--top K`` adds, per head, its K most-hit rows (the most occurrences; ties: ascending row) with their n-grams
and counts (at most K per row, most frequent first, as `row_ngrams` gives them). On a terminal a progress bar
follows the corpus. A usage error (a missing or malformed file, a float dtype, token ids outside the config's
vocabulary, a bad config or option) is one ``error:`` line naming what was wrong, exit status 2.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._progress import progress
from ..config import PLEConfig
from ._ngrams import _check_layer, _is_integer_dtype, _tally
from .stats import _row_ngrams, _stats

if TYPE_CHECKING:
    import argparse

__all__ = ["register"]


def _config(text: str) -> PLEConfig:
    """CONFIG: a config.json (a path, or a name ending in .json) or a preset name; a ValueError naming CONFIG."""
    path = Path(text)
    if text.endswith(".json") or path.is_file():
        if not path.is_file():
            raise ValueError(f"CONFIG: no file {text}")
        try:
            return PLEConfig.from_json(path)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ValueError(f"CONFIG: {text} is not a model config.json ({_one_line(e)})") from None
    try:
        return PLEConfig.preset(text)
    except (ValueError, TypeError) as e:
        raise ValueError(f"CONFIG: {text!r} is neither a file nor a preset ({_one_line(e)})") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _integer_dtype(path: str, dtype: Any) -> None:
    if not _is_integer_dtype(dtype):
        raise ValueError(f"{path}: expected integer token ids, got {str(dtype).replace('torch.', '')}")


def _load_tokens(path: str) -> tuple[Any, int]:
    """The sequences of a token file and their total length; a ValueError naming the file for anything else."""
    p = Path(path)
    if not p.is_file():
        what = "not a regular file" if p.exists() else "no such file"
        raise ValueError(f"{path}: {what} (expected a .npy or .pt file of token ids)")
    if p.suffix == ".npy":
        try:
            array = np.load(p, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise ValueError(f"{path}: not a readable .npy file ({_one_line(e)})") from None
        _integer_dtype(path, array.dtype)
        if array.ndim not in (1, 2):
            raise ValueError(f"{path}: expected a 1-D array (one sequence) or a 2-D one (a sequence per row), "
                             f"got shape {array.shape}")
        return array, int(array.size)
    if p.suffix == ".pt":
        try:
            try:
                obj = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:           # a file of the legacy format cannot be memory-mapped
                if "mmap" not in str(e):
                    raise
                obj = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch.load raises many types for a bad file
            raise ValueError(f"{path}: not a .pt file torch.load reads with weights_only=True "
                             f"({type(e).__name__})") from None
        if isinstance(obj, torch.Tensor):
            _integer_dtype(path, obj.dtype)
            if obj.dim() not in (1, 2):
                raise ValueError(f"{path}: expected a 1-D tensor (one sequence) or a 2-D one (a sequence per row), "
                                 f"got shape {tuple(obj.shape)}")
            return obj, obj.numel()
        if isinstance(obj, (list, tuple)):
            for i, t in enumerate(obj):
                if not isinstance(t, torch.Tensor) or t.dim() != 1:
                    what = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"{path}: item {i}: expected a 1-D tensor of token ids, got {what}")
                _integer_dtype(f"{path}: item {i}", t.dtype)
            return list(obj), sum(t.numel() for t in obj)
        raise ValueError(f"{path}: expected a tensor or a list of 1-D tensors of token ids, got {type(obj).__name__}")
    raise ValueError(f"{path}: expected a .npy or .pt file of token ids")


def _bar(iterable: Iterable, total: int | None, desc: str) -> Iterable:
    return progress(iterable, total=total, desc=desc)


def _format_top(top_rows: dict[int, list[tuple[int, int]]], grams: dict[int, list], P: int) -> list[str]:
    lines = []
    for h, best in top_rows.items():
        lines.append(f"head {h} ({h // P + 2}-grams): its {len(best)} most-hit rows")
        for row, occurrences in best:
            listed = "; ".join(f"{' '.join(map(str, g))} x{c:,}" for g, c in grams[row])
            lines.append(f"  row {row}: {occurrences:,} occurrence{'' if occurrences == 1 else 's'}: {listed}")
    return lines


def _analyze(args: argparse.Namespace) -> int:
    try:
        config = _config(args.config)
        try:
            ple_layer_index = _check_layer(config, args.layer)
        except ValueError as e:
            raise ValueError(f"--layer: {str(e).removeprefix('ple_layer_index: ')}") from None
        if args.top < 0:
            raise ValueError(f"--top: expected a count >= 0, got {args.top}")
        tokens, total = _load_tokens(args.tokens)
        try:
            tally, sequences = _tally(config, tokens, ple_layer_index, progress=_bar, total_tokens=total)
        except (ValueError, TypeError) as e:                     # out of range: name the file, not `tokens`
            raise ValueError(f"{args.tokens}: {str(e).removeprefix('tokens: ')}") from None
        stats, top_rows = _stats(tally, ple_layer_index, sequences, top=args.top, progress=_bar)
        wanted = [row for best in top_rows.values() for row, _ in best]
        grams = _row_ngrams(tally, ple_layer_index, wanted, args.top) if wanted else {}
    except (ValueError, TypeError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    if args.json:
        out: dict[str, Any] = dict(ple_layer_index=ple_layer_index, num_tokens=stats.num_tokens,
                                   num_sequences=stats.num_sequences, heads=[vars(h) for h in stats.heads])
        if args.top:
            out["top_rows"] = {str(h): [dict(row=r, occurrences=c, ngrams=[[list(g), n] for g, n in grams[r]])
                                        for r, c in best] for h, best in top_rows.items()}
        print(json.dumps(out, indent=2))
        return 0
    print(stats.table())
    if args.top:
        print("\n".join(["", *_format_top(top_rows, grams, config.heads_per_ngram)]))
    return 0


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add the ``analyze`` subcommand to an argparse subparsers object."""
    p = sub.add_parser("analyze", help="n-gram statistics of a token file: rows hit, shared rows, collisions",
                       description="Count, for every hash head of one PLE layer, the n-grams of a token file "
                                   "and the table rows they hash to: distinct n-grams, rows hit (beside uniform "
                                   "hashing's expectation), rows shared by two or more n-grams and the fraction "
                                   "of occurrences on such rows. TOKENS: a .npy file (1-D: one sequence; 2-D: a "
                                   "sequence per row; read memory-mapped) or a .pt file (a 1-D or 2-D tensor, or a "
                                   "list of 1-D tensors, a sequence each); any integer dtype. Exit status 2 on a "
                                   "usage error (one error: line).")
    p.add_argument("config", metavar="CONFIG", help="config.json or preset name (tiny, qwen4exp)")
    p.add_argument("tokens", metavar="TOKENS", help="a .npy or .pt file of token ids")
    p.add_argument("--layer", type=int, default=0, help="PLE index of the layer whose hash is counted (default 0)")
    p.add_argument("--top", type=int, default=0,
                   help="also list each head's K most-hit rows with their n-grams (at most K each; default 0: none)")
    p.add_argument("--json", action="store_true", help="print the statistics (and top rows) as JSON")
    p.set_defaults(func=_analyze)
