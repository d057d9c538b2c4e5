"""Progress bars: tqdm on a terminal, nothing at all otherwise (captured output, logs, CI)."""

from __future__ import annotations

import io

from ple._progress import byte_bar, progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_bars_only_on_a_terminal():
    quiet = io.StringIO()
    assert list(progress(range(3), file=quiet)) == [0, 1, 2]
    bar = byte_bar(100, file=quiet)
    bar.update(100)
    bar.close()
    assert quiet.getvalue() == ""
    tty = _Terminal()
    assert list(progress(range(3), desc="steps", file=tty)) == [0, 1, 2]
    bar = byte_bar(2048, desc="model.safetensors", file=tty)
    bar.update(2048)
    bar.close()
    assert "steps" in tty.getvalue() and "model.safetensors" in tty.getvalue()
