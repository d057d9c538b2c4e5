"""Command line: ``python -m ple demo``, ``python -m ple check MODULE[:ATTR]``, ``python -m ple inspect PATH``,
``python -m ple convert SRC DST``, ``python -m ple merge PATH DIR OUT``, ``python -m ple plan``,
``python -m ple analyze CONFIG TOKENS`` (``python -m ple --help``)."""

from __future__ import annotations

import argparse
import sys

from . import demo
from .analysis import cli as analysis_cli
from .io import cli as io_cli
from .optim import cli as optim_cli
from .testing import cli as check_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ple", description="ple's command line: a serving demo "
                                     "checked against the whole-sequence layer, the kit for your own ops, "
                                     "checkpoint tools, the memory plan of training a table, and the n-gram "
                                     "statistics of a corpus. "
                                     "`python -m ple COMMAND --help` describes each command's options.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    demo._parser(sub)
    check_cli.register(sub)
    io_cli.register(sub)
    optim_cli.register(sub)
    analysis_cli.register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
