"""Checks that run on every rank of a spawned process group (``ple.distributed.spawn``) and keep them in step.

A rank that raised in the middle of a check would skip collectives the other ranks then
wait for, so inside `run_checks` a failed comparison is *recorded* and the check carries
on; each check's failures (or its traceback) are returned per name, and a barrier
separates the checks::

    CHECKS = {"forward": check_forward, ...}          # check(rank, world_size, *args)

    def run(rank, world_size, names, *args):         # module-level, so spawn can pickle it
        return run_checks(CHECKS, names, rank, world_size, *args)

    per_rank = spawn(run, 3, list(CHECKS))           # [{name: None or the failure text}, ...]

Outside `run_checks`, `expect` raises ``AssertionError`` as usual.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .numerics import assert_bitwise_equal

__all__ = ["expect", "close", "same_bits", "run_checks"]

_failures: list[str] | None = None


def expect(ok: object, msg: str) -> None:
    """Record ``msg`` as a failure of the running check if not ``ok`` (raise outside `run_checks`)."""
    if ok:
        return
    if _failures is None:
        raise AssertionError(msg)
    _failures.append(msg)


def close(actual: torch.Tensor | None, expected: torch.Tensor, name: str, tol: float = 1e-9) -> None:
    """`expect` ``|actual - expected| <= tol * (1 + |expected|)`` with equal shapes and dtypes.

    (``torch.testing`` imports DTensor under ``torch.distributed``, which is slow to do per check.)
    """
    if actual is None or actual.shape != expected.shape or actual.dtype != expected.dtype:
        desc = "None" if actual is None else f"{tuple(actual.shape)}/{actual.dtype}"
        return expect(False, f"{name}: {desc} != {tuple(expected.shape)}/{expected.dtype}")
    err = (actual.detach().double() - expected.detach().double()).abs()
    bad = err > tol * (1 + expected.detach().double().abs())
    if bad.any():
        expect(False, f"{name}: {int(bad.sum())} of {bad.numel()} off, max error {float(err.max()):.3g}")


def same_bits(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """`expect` the two tensors equal bit for bit."""
    try:
        assert_bitwise_equal(actual, expected, name=name)
    except AssertionError as e:
        expect(False, str(e))


def run_checks(checks: dict[str, Callable[..., object]], names: list[str], rank: int, world_size: int,
               *args: Any) -> dict[str, str | None]:
    """Run ``checks[name](rank, world_size, *args)`` for every name in turn: ``{name: None or what failed}``."""
    global _failures
    out: dict[str, str | None] = {}
    for name in names:
        _failures = []
        try:
            checks[name](rank, world_size, *args)
            out[name] = None
        except Exception:  # noqa: BLE001 - reported per check by the caller
            out[name] = traceback.format_exc()
        if _failures:
            more = f"\n... and {len(_failures) - 5} more" if len(_failures) > 5 else ""
            out[name] = (out[name] or "") + "\n".join(_failures[:5]) + more
        _failures = None
        dist.barrier()
    return out
