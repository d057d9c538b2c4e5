"""`spawn`: run a function on W fresh local processes joined in one process group (tests, benchmarks, demos).

For real jobs launch with ``torchrun`` instead and call ``dist.init_process_group``
yourself; nothing else in `ple.distributed` depends on how the group was made.
"""

from __future__ import annotations

import os
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn"]


def _worker(rank, world_size, init_method, backend, pg_timeout, fn, args, results):
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout: float = 120.0,
          pg_timeout: float | None = None) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` new processes (``spawn`` start method).

    The processes join one ``backend`` group (gloo by default, through a file in a
    fresh temporary directory), with one intra-op thread each. ``fn`` must be
    importable (a module-level function) and its result picklable. Returns the
    results in rank order; raises ``RuntimeError`` with every failing rank's
    traceback if any rank fails or none answers within ``timeout`` seconds.
    ``pg_timeout`` (default ``timeout / 2``) bounds each collective, so ranks that
    went out of step fail and report instead of waiting for ever.
    """
    pg_timeout = timeout / 2 if pg_timeout is None else pg_timeout
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="ple_dist_")
    init_method = "file://" + os.path.join(tmp, "rendezvous")
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, init_method, backend, pg_timeout, fn, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, object]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, out = results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                if any(not p.is_alive() and p.exitcode not in (0, None) for p in procs) and \
                        all(not p.is_alive() for r, p in enumerate(procs) if r not in got):
                    break
                continue
            got[rank] = (ok, out)
            if not ok:                                   # the others may be stuck in a collective now
                deadline = min(deadline, time.monotonic() + 10.0)
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
        shutil.rmtree(tmp, ignore_errors=True)
    errors = [f"rank {r}:\n{out}" for r, (ok, out) in sorted(got.items()) if not ok]
    missing = [r for r in range(world_size) if r not in got]
    if errors or missing:
        msg = "\n".join(errors)
        if missing:
            msg += f"\nno result from rank(s) {missing} (timed out or crashed)"
        raise RuntimeError(f"spawn({getattr(fn, '__name__', fn)}, world_size={world_size}) failed:\n{msg}")
    return [got[r][1] for r in range(world_size)]
