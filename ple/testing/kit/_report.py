"""What a failing check says: the first wrong element, located in the case's own terms.

Every comparison of the kit goes through `compare_close` (outputs: the tolerance table of
``ple.testing.numerics``) or `compare_bits` (states, ids: bit for bit). On a mismatch they
raise ``AssertionError`` naming the element (through a ``where`` function that turns an
index into "request 1, row 3 of it, channel 37"), both values, and the case.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ..numerics import LOW_PRECISION, TOLERANCES

__all__ = ["compare_close", "compare_bits", "poisoned_empty", "fmt_case", "row_of"]


def fmt_case(case: dict) -> str:
    """A case as ``key=value`` pairs, tensors summarised (a case is a dict of plain values)."""
    def show(v):
        if isinstance(v, torch.Tensor):
            return f"tensor{tuple(v.shape)}"
        if isinstance(v, torch.dtype):
            return str(v).replace("torch.", "")
        return repr(v)
    return ", ".join(f"{k}={show(v)}" for k, v in case.items())


def row_of(query_start_loc_list: list[int], i: int) -> str:
    """Logical row ``i`` of requests laid end to end at ``query_start_loc_list`` (``[R + 1]``): "request r,
    row p"."""
    q = query_start_loc_list
    for r in range(len(q) - 1):
        if q[r] <= i < q[r + 1]:
            return f"request {r}, row {i - q[r]} of its {q[r + 1] - q[r]}"
    return f"row {i}"


def _value(t: torch.Tensor, idx: tuple) -> str:
    v = t[idx]
    if t.dtype.is_floating_point:
        bits = int(v.reshape(1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).item())
        return f"{v.item():.9g} (0x{bits & ((1 << 8 * t.element_size()) - 1):0{2 * t.element_size()}x})"
    if t.element_size() == 1 and t.dtype != torch.bool:                    # a byte of a quantized row
        return f"{v.item()} (0x{int(v.item()) & 0xFF:02x})"
    return str(v.item())


def _fail(name: str, idx: tuple, where: Callable[[tuple], str], got: torch.Tensor, want: torch.Tensor,
          case: dict, extra: str = "") -> None:
    raise AssertionError(f"{name} differs at {where(idx)}: got {_value(got, idx)}, expected {_value(want, idx)}"
                         f"{extra}\n  case: {fmt_case(case)}")


def _present(got, want, name: str, case: dict, none_is_zero: bool = False) -> bool:
    """``got`` must be a tensor where the reference has one; with ``none_is_zero`` (gradients) None, autograd
    not reaching the input, stands for zeros: accepted where the reference's is all zero. True: nothing more
    to compare."""
    if none_is_zero and got is None and isinstance(want, torch.Tensor) and not bool((want != 0).any()):
        return True                    # autograd not reaching an input whose gradient is all zero (e.g. no rows)
    if not isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
        what = "none was computed (autograd did not reach it)" if got is None else f"got a {type(got).__name__}"
        raise AssertionError(f"{name}: {what}, expected {tuple(want.shape)} {want.dtype}\n  case: {fmt_case(case)}")
    return False


def compare_bits(got: torch.Tensor, want: torch.Tensor, *, name: str, where: Callable[[tuple], str],
                 case: dict) -> None:
    """Bit for bit (NaN payloads included); the first differing element is reported."""
    if _present(got, want, name, case):
        return
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{name}: got {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} "
                             f"{want.dtype}\n  case: {fmt_case(case)}")
    if got.dtype.is_floating_point:
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
        diff = got.contiguous().view(ints) != want.contiguous().view(ints)
    else:
        diff = got != want
    if diff.any():
        idx = tuple(diff.nonzero()[0].tolist())
        _fail(name, idx, where, got, want, case, f" ({int(diff.sum())} of {diff.numel()} elements differ)")


def compare_close(got: torch.Tensor, want: torch.Tensor, exact64: torch.Tensor | None, *, name: str,
                  where: Callable[[tuple], str], case: dict, judge64: bool = False, grad: bool = False) -> None:
    """The tolerance table (docs/spec.md section 8): float32 / float64 elementwise; bfloat16 / float16 against
    the float64 run ``exact64`` (the fast error at most ``factor`` x the reference's own + ``atol`` x scale).
    ``judge64``: float32 judged the same way (against ``exact64``, with float32's ``atol``), for
    ill-conditioned cases (a gate score near zero). A NaN where the reference has none is always a failure.
    ``grad``: ``got`` is a gradient; None (autograd did not reach the input) passes where ``want`` is all zero."""
    if _present(got, want, name, case, grad):
        return
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{name}: got {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} "
                             f"{want.dtype}\n  case: {fmt_case(case)}")
    if got.numel() == 0:
        return
    nan = torch.isnan(got) & ~torch.isnan(want)
    if nan.any():
        _fail(name, tuple(nan.nonzero()[0].tolist()), where, got, want, case,
              " (NaN: an element never written, or read from a poisoned buffer)")
    g, w = got.double(), want.double()
    if exact64 is not None and (got.dtype in LOW_PRECISION or judge64):
        factor, atol = LOW_PRECISION.get(got.dtype, (LOW_PRECISION[torch.bfloat16][0], TOLERANCES[torch.float32][1]))
        e = exact64.detach().cpu().double()
        err = (g - e).abs().nan_to_num(0.0)
        bound = factor * (w - e).abs().nan_to_num(0.0).max() + atol * max(1.0, e.abs().nan_to_num(0.0).max().item())
        if err.max() > bound:
            idx = tuple((err == err.max()).nonzero()[0].tolist())
            _fail(name, idx, where, got, want, case,
                  f"; its error against float64 {err[idx].item():.3g} exceeds the bound {bound.item():.3g}")
        return
    rtol, atol = TOLERANCES.get(got.dtype, (1e-2, 1e-2))
    bad = ((g - w).abs() > rtol * w.abs() + atol) & ~(torch.isnan(g) & torch.isnan(w))
    if bad.any():
        _fail(name, tuple(bad.nonzero()[0].tolist()), where, got, want, case,
              f" (rtol {rtol}, atol {atol}; {int(bad.sum())} of {bad.numel()} elements outside)")


_real_empty, _real_empty_like = torch.empty, torch.empty_like


def _poison(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64, torch.int8):
            t.fill_(-7)
        elif t.dtype == torch.uint8:
            t.fill_(0xF9)                    # -7's byte: a quantized row byte never written shows
    return t


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """While inside, ``torch.empty`` / ``torch.empty_like`` return NaN-filled floats (int64, int32 and
    int8: -7; uint8, the bytes of a quantized table's rows: ``0xF9``), so an element a kernel never writes
    shows up as a mismatch. Restores both on exit."""
    saved = torch.empty, torch.empty_like
    torch.empty = lambda *a, **k: _poison(_real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: _poison(_real_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = saved
