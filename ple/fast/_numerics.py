"""Numerics shared by the kernels: bfloat16 rounding on the bits, the accumulation dtype, block sizes.

* **bfloat16 rounding.** float32 -> bfloat16 is done on the bits, round to nearest even,
  instead of ``.to(tl.bfloat16)``: the Triton interpreter's own cast truncates (and it
  cannot do bfloat16 arithmetic), so the bit version gives the same bits on a GPU and
  under the interpreter. The one NaN rule: **every NaN becomes the canonical quiet NaN
  0x7FC0**, as PyTorch does on the CPU (so a NaN stays a NaN, its payload is dropped).
  bfloat16 -> float32 is exact (a shift). `round_io` rounds a float32 value to the
  inputs' dtype by the ``IS_BF16`` / ``IS_FP16`` flags; `rnd` by the dtype ``DT`` itself.
* **Accumulation dtype.** ``acc_dtype`` (the reference's rule, re-exported):
  ``torch.promote_types(dtype, float32)``, i.e. float32, or float64 for float64 inputs.
  Kernels get it as the ``IS_FP64`` flag (`is_fp64`); `to_acc`, `rsqrt` and `scalars` (``eps``
  and ``sqrt(H)``, the host passing ``eps`` as two float32 halves, `eps_parts`) compute in it.
* **Block sizes and tiles.** `pow2_block` (the next power of two, capped), and the conv
  kernels' time tiles of variable-length requests, found on the device: `tile_grid` (how many
  programs, from shapes only) and `tile_of` (the request and first position of a program's
  tile, by a binary search over the device offsets; `search_steps` its loop count).
* **Runs of sorted ids.** `sorted_run_start`: where a program of a launch over sorted (id, row) pairs
  stands, and whether it starts a run of equal ids (the deterministic table gradient, ``table_update``).
* **Deterministic mode.** `deterministic` is PyTorch's own switch,
  ``torch.use_deterministic_algorithms(True)``: while it is on, every backward kernel of
  ``ple.fast`` reduces in a fixed order with no float atomics (table gradient, conv ``dW``,
  ``dvalue``, the norm weights' gradients), so results are bit-identical across runs and
  across the kernels' block sizes. Off (the default), some reductions use atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.gate import acc_dtype

__all__ = ["acc_dtype", "is_fp64", "deterministic", "DETERMINISTIC_CHUNK",
           "pow2_block", "tile_grid", "search_steps", "tile_of", "bf16_to_f32", "f32_to_bf16", "round_bf16",
           "up", "down", "rnd", "convert", "silu", "round_io", "to_acc", "rsqrt", "scalars", "eps_parts",
           "sorted_run_start"]


def is_fp64(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` accumulates in float64 (``acc_dtype``), the kernels' ``IS_FP64`` flag."""
    return acc_dtype(dtype) == torch.float64


def deterministic() -> bool:
    """Whether the kernels must reduce in a fixed order (``torch.use_deterministic_algorithms``).

    Read on the host at launch time (no device sync). In this mode a gradient reduced over
    tokens is summed in fixed chunks of `DETERMINISTIC_CHUNK` tokens, each chunk's partial
    stored separately and the partials added in token order by a second pass, so the bits do
    not depend on how many tokens a program takes.
    """
    return torch.are_deterministic_algorithms_enabled()


DETERMINISTIC_CHUNK = 16
"""Tokens per partial sum of a deterministic reduction (a constant, independent of block sizes)."""


def pow2_block(n: int, cap: int) -> int:
    """``next_power_of_2(max(n, 1))``, at most ``cap``."""
    return min(cap, triton.next_power_of_2(max(n, 1)))


@triton.jit
def bf16_to_f32(x):
    """Exact bfloat16 -> float32 on the bits."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16(x):
    """float32 -> bfloat16, round to nearest even on the bits; every NaN -> 0x7FC0."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def round_bf16(x):
    """float32 ``x`` rounded to bfloat16 and back to float32."""
    return bf16_to_f32(f32_to_bf16(x))


@triton.jit
def up(x, IS_SRC_BF16: tl.constexpr, IS_FP64: tl.constexpr):
    """Exact upcast of a loaded value to the accumulation dtype (float32, or float64)."""
    if IS_SRC_BF16:
        x = bf16_to_f32(x)
    if IS_FP64:
        return x.to(tl.float64)
    else:
        return x.to(tl.float32)


@triton.jit
def down(x, DT: tl.constexpr, IS_DT_BF16: tl.constexpr):
    """Round a float32 / float64 value to ``DT`` (nearest even) for storing."""
    if IS_DT_BF16:
        return f32_to_bf16(x.to(tl.float32))
    else:
        return x.to(DT)


@triton.jit
def rnd(x, DT: tl.constexpr, IS_DT_BF16: tl.constexpr, IS_FP64: tl.constexpr):
    """Round an accumulator value to ``DT`` and back: ``x.to(DT).to(acc)`` of the reference."""
    if IS_DT_BF16:
        return up(f32_to_bf16(x.to(tl.float32)), True, IS_FP64)
    else:
        return up(x.to(DT), False, IS_FP64)


@triton.jit
def convert(x, DT: tl.constexpr, IS_SRC_BF16: tl.constexpr, IS_DST_BF16: tl.constexpr):
    """``x.to(DT)`` between storage dtypes (state <-> inputs)."""
    if IS_SRC_BF16:
        x = bf16_to_f32(x)
    return down(x, DT, IS_DST_BF16)


@triton.jit
def silu(a):
    return a * tl.sigmoid(a)


@triton.jit
def round_io(x, IS_BF16: tl.constexpr, IS_FP16: tl.constexpr):
    """Round float32 ``x`` to the input dtype and back (identity for float32 / float64 inputs)."""
    r = x
    if IS_BF16:
        r = round_bf16(x)
    if IS_FP16:
        r = x.to(tl.float16).to(tl.float32)
    return r


# ---- the accumulation dtype ------------------------------------------------------------------------


@triton.jit
def to_acc(x, IS_FP64: tl.constexpr):
    """``x`` in the accumulation dtype (a plain cast: for values that are float32 / float64 already, or zeros)."""
    if IS_FP64:
        y = x.to(tl.float64)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def rsqrt(x, IS_FP64: tl.constexpr):
    """``1 / sqrt(x)``: IEEE sqrt and division in float64, ``tl.rsqrt`` in float32."""
    if IS_FP64:
        y = 1.0 / tl.sqrt(x)
    else:
        y = tl.rsqrt(x)
    return y


@triton.jit
def scalars(H, eps_hi, eps_lo, sqrt_h, IS_FP64: tl.constexpr):
    """``eps`` and ``sqrt(H)`` in the compute dtype.

    Float kernel arguments are float32, so a float64 kernel gets ``eps`` as the sum of two
    float32 halves (`eps_parts`) and computes ``sqrt(H)`` itself; a float32 kernel uses ``eps``
    and ``sqrt(H)`` rounded to float32, as torch does with a Python scalar.
    """
    if IS_FP64:
        eps = (tl.zeros([], dtype=tl.float64) + eps_hi) + eps_lo
        root = tl.sqrt(tl.zeros([], dtype=tl.float64) + H)
    else:
        eps = eps_hi
        root = sqrt_h
    return eps, root


def eps_parts(eps: float) -> tuple[float, float]:
    """``eps`` as float32 ``hi + lo`` (exact to about 48 bits) for the float64 kernels (`scalars`)."""
    hi = float(torch.tensor(eps, dtype=torch.float32))
    lo = float(torch.tensor(eps - hi, dtype=torch.float32))
    return hi, lo


# ---- tiles of the conv kernels --------------------------------------------------------------------


def search_steps(num_requests: int) -> int:
    """Steps of a binary search over ``num_requests`` candidates (``ceil(log2 R)``), a runtime loop count."""
    return max(num_requests - 1, 0).bit_length()


def tile_grid(num_rows: int, num_requests: int, block_t: int) -> int:
    """Programs for the ``block_t``-row tiles of ``num_requests`` requests over ``num_rows`` rows (shapes only).

    Request r's tiles get the program ids ``[base_r, base_r + ceil(n_r / block_t))`` with
    ``base_r = offsets[r] // block_t + r``; that range ends at or before ``base_{r+1}``, and
    ``base_R = num_rows // block_t + R`` bounds them all, so no host value is needed. Ids in a gap
    (at most one per request) own no rows and do nothing.
    """
    return num_rows // block_t + num_requests


@triton.jit
def tile_of(pid, offs_ptr, stride_offs_r, R, steps, BLOCK_T: tl.constexpr):
    """``(request, first position)`` of program ``pid``'s tile (int64), see `tile_grid`.

    The request is the largest r in ``[0, R)`` with ``offsets[r] // BLOCK_T + r <= pid`` (``steps`` =
    `search_steps` (R) halvings; empty requests own no id, so the search skips them). The first
    position may lie past the request's rows: then the program owns no rows.
    """
    pid = pid.to(tl.int64)
    lo = pid * 0
    hi = lo + R - 1
    for _ in range(steps):
        mid = (lo + hi + 1) // 2
        go_right = tl.load(offs_ptr + mid * stride_offs_r).to(tl.int64) // BLOCK_T + mid <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    base = tl.load(offs_ptr + lo * stride_offs_r).to(tl.int64) // BLOCK_T + lo
    return lo, (pid - base) * BLOCK_T


# ---- runs of sorted ids (the deterministic table gradient, table_update) ----------------------------


@triton.jit
def sorted_run_start(pairs_ptr):
    """``(p, (0, 1), id, starts)`` of program ``p`` (``program_id(0)``, int64) over ``[M, 2]`` int64 (id, row)
    pairs sorted by id: the offsets of a pair's two columns, the id of pair ``p``, and whether ``p`` starts
    that id's run (the program that does starts the run's work)."""
    p = tl.program_id(0).to(tl.int64)
    two = tl.arange(0, 2).to(tl.int64)
    rid, _ = tl.split(tl.load(pairs_ptr + 2 * p + two))
    prev = tl.load(pairs_ptr + 2 * p - 2, mask=p > 0, other=-1)  # ids are >= 0
    return p, two, rid, rid != prev
