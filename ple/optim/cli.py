"""``python -m ple plan``: the memory plan of training a table (`ple.optim.plan`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import PLEConfig
from .plan import plan

if TYPE_CHECKING:
    import argparse

__all__ = ["register"]


def _config(text: str) -> PLEConfig:
    if text.endswith(".json") or Path(text).is_file():
        if not Path(text).is_file():          # a usage error (one line, exit 2), not an OSError's traceback
            raise ValueError(f"--config: no file {text}")
        return PLEConfig.from_json(text)
    return PLEConfig.preset(text)


def _plan(args: argparse.Namespace) -> int:
    try:
        cfg = _config(args.config)
        plans = [plan(cfg, args.table_dtype, rule, w, tokens=args.tokens, fused=args.fused,
                      device_memory=args.device_memory)
                 for w in args.world_size for rule in args.rule]
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([dict(vars(p), total_bytes=p.total_bytes, fits=p.fits) for p in plans], indent=2))
    else:
        print("\n\n".join(p.format() for p in plans))
    return 1 if any(p.fits is False for p in plans) else 0


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add the ``plan`` subcommand to an argparse subparsers object."""
    p = sub.add_parser("plan", help="bytes per rank of training a table: table, optimizer state, a step's traffic",
                       description="Count, for a config, a table dtype, a row optimizer's rule and a world size "
                                   "(the table sharded by rows), the bytes per rank of the table, its optimizer "
                                   "state, a step's working memory and traffic, and whether they fit the "
                                   "device memory. Exit status 1 if some plan does not fit, 2 on a usage error.")
    p.add_argument("--config", default="qwen4exp", help="preset name or config.json (default: qwen4exp, the real "
                                                        "model's table)")
    p.add_argument("--table-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rule", nargs="+", default=["adagrad"], choices=["sgd", "adagrad", "adam"],
                   help="one or more rules (default adagrad)")
    p.add_argument("--world-size", nargs="+", type=int, default=[1], help="one or more world sizes (default 1)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens a step per rank (default 2048)")
    p.add_argument("--fused", action="store_true", help="fused=True: no gradient kept between backward and step")
    p.add_argument("--device-memory", default=None, help="memory per device, e.g. 141GB or 80GiB")
    p.add_argument("--json", action="store_true", help="print the plans as JSON")
    p.set_defaults(func=_plan)
