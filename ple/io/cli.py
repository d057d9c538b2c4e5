"""``python -m ple inspect PATH``, ``python -m ple convert SRC DST`` and ``python -m ple merge PATH DIR OUT``."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .convert import convert
from .inspect import format_inspect, inspect
from .merge import merge
from .save import TABLE_DTYPES

if TYPE_CHECKING:
    import argparse

__all__ = ["register"]


def _size(name: str, text: str) -> int:
    """``--max-file-size`` / ``--block-size`` (``name``) in bytes: ``5GB``, ``256MiB``, ``1000``; anything else is a
    ``ValueError`` naming the option (reported as one ``error:`` line, exit status 2)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise ValueError(f"{name}: expected a size such as 5GB, 256MiB or 1000 (bytes), got {text!r}") from None


def _inspect(args: argparse.Namespace) -> int:
    try:
        report = inspect(args.path, args.config)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_inspect(report))
    return 1 if any(layer["error"] for layer in report["layers"]) else 0


def _convert(args: argparse.Namespace) -> int:
    merged = {None: None, "merged": True, "separate": False}[args.kv]
    try:
        max_file = None if args.max_file_size is None else _size("--max-file-size", args.max_file_size)
        out = convert(args.src, args.dst, config=args.config, parts=args.parts, table_dtype=args.table_dtype,
                      merged_kv=merged, max_file_bytes=max_file, block_bytes=_size("--block-size", args.block_size),
                      overwrite=args.overwrite, ple_only=args.ple_only)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prefix, table in zip(out["layers"], out["tables"], strict=True):
        print(f"{prefix or '(no prefix)'}: table {table}")
    for f in out["files"]:
        print(f"wrote {f}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    try:
        max_file = None if args.max_file_size is None else _size("--max-file-size", args.max_file_size)
        out = merge(args.path, args.overlay, args.out, config=args.config, parts=args.parts,
                    table_dtype=args.table_dtype, max_file_bytes=max_file,
                    block_bytes=_size("--block-size", args.block_size),
                    overwrite=args.overwrite, ple_only=args.ple_only)
    except (ValueError, TypeError, RuntimeError) as e:      # RuntimeError: the overlay is held by its trainer
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prefix, table, ov in zip(out["layers"], out["tables"], out["overlays"], strict=True):
        trained = "not trained" if ov is None else \
            f"{ov['rows']} trained rows from {ov['path']} (generation {ov['generation']}, {ov['dtype']})"
        print(f"{prefix or '(no prefix)'}: table {table}; {trained}")
    for f in out["files"]:
        print(f"wrote {f}")
    return 0


def _command(sub: argparse._SubParsersAction[Any], name: str, func: Callable[[argparse.Namespace], int], *,
             summary: str, description: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``, run by ``func`` (``summary``: its one-line help)."""
    p = sub.add_parser(name, help=summary, description=description)
    p.set_defaults(func=func)
    return p


def _rewrite_command(sub: argparse._SubParsersAction[Any], name: str, func: Callable[[argparse.Namespace], int], *,
                     summary: str, description: str, source: str, parts: str, table_dtype: str, dest: str,
                     kv: bool = False) -> argparse.ArgumentParser:
    """A subcommand that rewrites a checkpoint (``convert``, ``merge``): its `_command` parser with the options the
    two share, in this order: ``--config`` (found with ``source``), ``--parts`` (default: ``parts``),
    ``--table-dtype`` (its help: ``table_dtype``), ``--kv`` where ``kv`` (convert's), ``--max-file-size``,
    ``--block-size``, ``--ple-only``, ``--overwrite`` (the checkpoint at ``dest``). The caller adds the
    positional arguments."""
    p = _command(sub, name, func, summary=summary, description=description)
    p.add_argument("--config", default=None,
                   help=f"config.json or preset name (default: found with {source})")
    p.add_argument("--parts", type=int, default=None,
                   help=f"table shards (0 = whole table; default: {parts})")
    p.add_argument("--table-dtype", choices=sorted(TABLE_DTYPES), default=None, help=table_dtype)
    if kv:
        p.add_argument("--kv", choices=["merged", "separate"], default=None,
                       help="write one merged kv_proj or separate key_proj/value_proj (default: unchanged)")
    p.add_argument("--max-file-size", default=None, help="split the output into files of at most this size, "
                                                          "e.g. 5GB (directory output only)")
    p.add_argument("--block-size", default="256MiB",
                   help="largest block read at once (default: 256MiB)")
    p.add_argument("--ple-only", action="store_true",
                   help="allow an output transformers would load wrong (fp8 / int8 / nf4 table, merged kv_proj); "
                        "config.json and inspect then mark it as for ple only")
    p.add_argument("--overwrite", action="store_true", help=f"replace an existing checkpoint at {dest}")
    return p


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add the ``inspect``, ``convert`` and ``merge`` subcommands to an argparse subparsers object."""
    p = _command(sub, "inspect", _inspect, summary="list a checkpoint's PLE layers, tensors and hash-buffer checks",
                 description="Print the PLE layers of a safetensors checkpoint (file, directory or index): "
                             "tensors, shapes, dtypes, bytes, and whether the hash buffers match the config. "
                             "Reads headers only. Exit status 1 if a layer would not load, 2 if the files "
                             "cannot be read.")
    p.add_argument("path", help="a .safetensors file or a checkpoint directory")
    p.add_argument("--config", default=None,
                   help="config.json or preset name (default: saved in the checkpoint, or a config.json "
                        "beside it)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    c = _rewrite_command(sub, "convert", _convert,
                         summary="re-shard a checkpoint's PLE tables or change their dtype (fp8, int8, nf4)",
                         description="Rewrite a checkpoint with its PLE tables re-sharded and/or in another "
                                     "dtype; every other tensor is copied, and every non-weight file of a "
                                     "model folder (configs, tokenizer). Streams blocks, never a whole "
                                     "table. An fp8 / int8 / nf4 table or a merged kv_proj, which transformers "
                                     "would load wrong, needs --ple-only.",
                         source="the source", parts="unchanged", dest="dst", kv=True,
                         table_dtype="table dtype: fp8 (e4m3, per-tensor scale), int8 (per-row scales), nf4 "
                                     "(4-bit rows holding their float16 scales) or a float dtype")
    c.add_argument("src", help="source .safetensors file or checkpoint directory")
    c.add_argument("dst", help="destination: a .safetensors file, or a directory")

    m = _rewrite_command(sub, "merge", _merge,
                         summary="write a checkpoint of a base and the rows trained into its overlay",
                         description="Write a new checkpoint: the base checkpoint PATH with the table rows a disk "
                                     "table trained into its overlay DIR (load_layer(..., offload='disk', "
                                     "overlay=DIR), or a folder of ple_layer_{i} overlays from load_layers); "
                                     "every other tensor and non-weight file copied, as convert copies them. "
                                     "Streams blocks, never a whole table. A quantized base is written in the "
                                     "overlay's float dtype unless --table-dtype says otherwise; an fp8 / int8 / "
                                     "nf4 output or a merged kv_proj, which transformers would load wrong, needs "
                                     "--ple-only.",
                         source="the base", parts="as in the base", dest="out",
                         table_dtype="table dtype of the output (default: a float base's own, the overlay's for "
                                     "a quantized base): fp8, int8, nf4 or a float dtype")
    m.add_argument("path", help="the base: a .safetensors file or checkpoint directory")
    m.add_argument("overlay", metavar="dir", help="the overlay directory (or a folder of ple_layer_{i} ones)")
    m.add_argument("out", help="destination: a .safetensors file, or a directory")
