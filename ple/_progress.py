"""Progress bars for long work: tqdm on a terminal, silent otherwise (logs, CI, captured output)."""

from __future__ import annotations

import sys
from collections.abc import Iterable


def progress(iterable: Iterable, *, total: int | None = None, desc: str = "", file=None) -> Iterable:
    """``iterable`` wrapped in a tqdm bar written to ``file`` (stderr) when that is a terminal."""
    file = file or sys.stderr
    if not getattr(file, "isatty", lambda: False)():
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:                      # tqdm is a dependency; a stripped install still runs
        return iterable
    return tqdm(iterable, total=total, desc=desc, file=file, leave=False, dynamic_ncols=True)


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def byte_bar(total: int, *, desc: str = "", file=None):
    """A tqdm bar counting ``total`` bytes (``update(n)``, ``close()``) on a terminal, else a silent one."""
    file = file or sys.stderr
    if not getattr(file, "isatty", lambda: False)():
        return _Silent()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Silent()
    return tqdm(total=total, desc=desc, file=file, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                dynamic_ncols=True)
