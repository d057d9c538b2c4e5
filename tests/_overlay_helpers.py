"""Crashes injected at an overlay's file operations, and the order of those operations checked against what a
flush promises (``ple.io.disk_table.overlay``), and the killed child processes: used by ``tests/io/test_overlay.py`` and
``tests/io/test_disk_train_kill.py``.

A process killed (SIGKILL) leaves the kernel's page cache behind it, so no kill test sees an fsync that is
missing or late; the order of the operations shows it. `FaultInjector` records every file operation in order
(and makes the ``at``-th one fail), and `check_flush_order` replays the record against the rules that keep a
flush durable whatever reaches the disk, and when:

1. a segment a manifest names has its bytes fsynced after its last write, and the directory fsynced after the
   segment was created, before the rename that installs that manifest (the manifest's own temporary file is
   fsynced before it too);
2. a segment is deleted only once no manifest that may be the one on disk names it: after a manifest's rename,
   the manifest before it may still be the one on disk until the directory is fsynced;
3. the last rename is followed by a directory fsync (the flush is durable when it returns).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ple.io.disk_table.overlay._files import MANIFEST

__all__ = ["Crash", "FaultInjector", "check_flush_order", "watched_child"]

_SEGMENT = re.compile(r"seg-\d+\.safetensors")


class Crash(BaseException):
    """A process death, injected at a file operation (not an Exception: nothing may catch it)."""


class FaultInjector:
    """Counts os.pwrite / os.fsync / os.replace / os.unlink calls in ``count``; the ``at``-th one fails (a pwrite
    writes half its bytes first: a torn write). ``log`` records those calls and the files os.open creates, in
    order: ``(op, path, extra)``, ``op`` one of ``create``, ``pwrite``, ``fsync``, ``replace``, ``unlink``;
    ``path`` absolute (an fsync's or a pwrite's: the file or directory its descriptor was opened on); ``extra``
    of a ``replace``: ``(source, names of the segments it lists)`` where it renames a manifest, else None."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int) -> None:
        self.count, self.at = 0, at
        self.log: list[tuple[str, str, Any]] = []
        self._fds: dict[int, str] = {}
        real_open, real_close = os.open, os.close

        def opened(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            here = "dir_fd" not in kwargs
            new = here and bool(flags & os.O_CREAT) and not os.path.lexists(path)
            fd = real_open(path, flags, *args, **kwargs)
            self._fds[fd] = os.path.abspath(path) if here else os.fspath(path)
            if new:
                self.log.append(("create", self._fds[fd], None))
            return fd

        def closed(fd: int) -> None:
            self._fds.pop(fd, None)
            real_close(fd)

        monkeypatch.setattr(os, "open", opened)
        monkeypatch.setattr(os, "close", closed)
        for name in ("pwrite", "fsync", "replace", "unlink"):
            monkeypatch.setattr(os, name, self._wrap(name, getattr(os, name)))

    def _record(self, name: str, args: tuple[Any, ...]) -> None:
        if name in ("pwrite", "fsync"):
            fd = args[0] if isinstance(args[0], int) else args[0].fileno()
            self.log.append((name, self._fds.get(fd, f"fd {fd}"), None))
        elif name == "unlink":
            self.log.append((name, os.path.abspath(args[0]), None))
        else:
            src, dst = (os.path.abspath(a) for a in args[:2])
            extra = None
            if os.path.basename(dst) == MANIFEST:
                body = json.loads(Path(src).read_bytes())["manifest"]
                extra = (src, frozenset(s["file"] for s in body["segments"]))
            self.log.append((name, dst, extra))

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def op(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            self._record(name, args)
            if self.count == self.at:
                if name == "pwrite":
                    fd, data, offset = args
                    view = memoryview(data).cast("B")
                    real(fd, view[: len(view) // 2], offset)
                raise Crash(f"{name} #{self.at}")
            return real(*args, **kwargs)
        return op


def check_flush_order(log: list[tuple[str, str, Any]], directory: Path, durable: Iterable[str]) -> dict[str, int]:
    """Check the rules of the module docstring on a `FaultInjector`'s ``log`` of a run without a crash, in the
    overlay ``directory`` whose manifest named the segments ``durable`` when the record began (files made
    before it count as durable). Returns ``{"manifests": renames onto the manifest, "retired": deletions of
    segments a manifest named}``."""
    d = os.path.abspath(directory)
    manifest = os.path.join(d, MANIFEST)
    written: dict[str, int] = {}                     # path -> position of its last pwrite
    synced: dict[str, int] = {}                      # path -> position of its last fsync
    created: dict[str, int] = {}                     # path -> position of its creation
    dir_synced = -1                                  # position of the directory's last fsync
    on_disk = [frozenset(durable)]                   # the segments of each manifest that may be the one on disk
    named = set(on_disk[0])                          # every segment a manifest named
    switched, retired = -1, 0
    for i, (op, path, extra) in enumerate(log):
        if op == "create":
            created[path] = i
        elif op == "pwrite":
            written[path] = i
        elif op == "fsync" and path == d:
            dir_synced = i
            on_disk = on_disk[-1:]
        elif op == "fsync":
            synced[path] = i
        elif op == "replace" and path == manifest:
            src, names = extra
            assert synced.get(src, -1) > written.get(src, -1), f"#{i}: the manifest renamed before its fsync"
            for name in sorted(names):
                p = os.path.join(d, name)
                assert p not in written or synced.get(p, -1) > written[p], \
                    f"#{i}: the manifest renamed names {name}, whose bytes were not fsynced after its last write"
                assert p not in created or dir_synced > created[p], \
                    f"#{i}: the manifest renamed names {name}, created after the directory's last fsync"
            on_disk.append(names)
            named |= names
            switched = i
        elif op == "unlink" and _SEGMENT.fullmatch(os.path.basename(path)):
            name = os.path.basename(path)
            assert not any(name in s for s in on_disk), \
                f"#{i}: {name} deleted while a manifest that may be the one on disk names it"
            retired += name in named
    assert switched < 0 or switched < dir_synced, "the last manifest's rename is not followed by a directory fsync"
    return {"manifests": sum(op == "replace" and path == manifest for op, path, _ in log), "retired": retired}


@contextlib.contextmanager
def watched_child(script: str, *args: object) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A test file run as a child process (``python script *args``, ``tests/`` importable as under pytest),
    killed after 300 s (a hung child fails the test, never hangs it) and at the end of the block if still
    running; yields it and ``n`` of the first line it prints, ``ready <n>``."""
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, script, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=Path(tests).parent, env=env)
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().split()
        if ready[:1] != ["ready"]:
            pytest.fail(f"the child did not start: {proc.communicate()[1]}")
        yield proc, int(ready[1])
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
