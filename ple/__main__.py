"""Command line: ``python -m ple demo``, ``python -m ple inspect PATH``, ``python -m ple convert SRC DST``
(``python -m ple --help``)."""

from __future__ import annotations

import argparse
import sys

from . import demo
from .io import cli as io_cli


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ple", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo._parser(sub)
    io_cli.register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
