"""The tolerance table (docs/spec.md section 8) and comparisons against the reference.

A fast result is judged against the reference at the same dtype:

* float32 / float64: ``|fast - ref| <= rtol * |ref| + atol`` elementwise, from ``TOLERANCES``.
* bfloat16 / float16: the fast result's error against a float64 run of the
  reference may be at most ``factor`` times the low-precision reference's own
  error against that run, plus ``atol`` times ``max(1, max|float64 run|)`` (mamba's
  rule, with the floor scaled to the tensor so one rounding step of a large value fits).
* Conv states are copies of inputs: equal bit for bit (``assert_bitwise_equal``).
"""

from __future__ import annotations

import torch

__all__ = ["TOLERANCES", "LOW_PRECISION", "assert_close", "assert_bitwise_equal", "assert_no_nan"]

# dtype -> (rtol, atol) for direct comparison at that dtype.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-5),
}

# dtype -> (factor, atol) for judging against the float64 run.
LOW_PRECISION: dict[torch.dtype, tuple[float, float]] = {
    torch.bfloat16: (2.0, 2e-2),
    torch.float16: (2.0, 2e-3),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, exact64: torch.Tensor | None = None,
                 name: str = "output", judge64: bool = False) -> None:
    """Assert ``actual`` (fast) matches ``expected`` (reference at the same dtype).

    For bfloat16 / float16 pass ``exact64``, the reference run in float64 on the same
    inputs; the fast error against it must be within ``factor * ref_error + atol``.
    ``judge64``: judge float32 that way too (bfloat16's factor, float32's ``atol``), for
    ill-conditioned cases where the float32 reference is itself further than 1e-5 from
    float64 (docs/spec.md section 8: a gate score near zero; an all-zero row, whose norm scales its
    gradient by ``1 / sqrt(eps)``).
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype} != reference {expected.dtype}")
    assert_no_nan(actual, name=name, allowed=expected)
    dt = expected.dtype
    if exact64 is not None and (dt in LOW_PRECISION or judge64):
        factor, atol = LOW_PRECISION.get(dt, (LOW_PRECISION[torch.bfloat16][0], TOLERANCES[torch.float32][1]))
        err_fast = (actual.double() - exact64.double()).abs().max().item() if actual.numel() else 0.0
        err_ref = (expected.double() - exact64.double()).abs().max().item() if actual.numel() else 0.0
        scale = max(1.0, exact64.double().abs().max().item()) if actual.numel() else 1.0
        if not err_fast <= factor * err_ref + atol * scale:
            raise AssertionError(f"{name}: {dt} error {err_fast:.3g} against float64 exceeds "
                                 f"{factor} x reference error {err_ref:.3g} + {atol} x {scale:.3g}")
        return
    rtol, atol = TOLERANCES.get(dt, (1e-2, 1e-2))
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, *, name: str = "state") -> None:
    """Assert two tensors hold the same bits (NaN payloads included)."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: {tuple(actual.shape)}/{actual.dtype} != "
                             f"{tuple(expected.shape)}/{expected.dtype}")
    a, b = _bytes(actual), _bytes(expected)
    if not torch.equal(a, b):
        diff = (actual.detach().cpu().double() != expected.detach().cpu().double())
        raise AssertionError(f"{name}: not bit-for-bit equal at {int(diff.sum())} of {diff.numel()} entries; "
                             f"first at {diff.nonzero()[:1].tolist()}")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.detach().cpu().reshape(-1))
    return flat.view(torch.uint8)


def assert_no_nan(t: torch.Tensor, *, name: str = "output", allowed: torch.Tensor | None = None) -> None:
    """Assert ``t`` has no NaN where ``allowed`` (if given) has none: catches never-written poisoned rows."""
    bad = torch.isnan(t)
    if allowed is not None:
        bad &= ~torch.isnan(allowed)
    if bad.any():
        raise AssertionError(f"{name}: {int(bad.sum())} NaN entries (a row the kernel never wrote?) "
                             f"first at {bad.nonzero()[:1].tolist()}")
