"""Triton kernels for the dilated causal convolution over whole sequences, for training (docs/spec.md section 5).

Same name, signature and numbers as ``ple.reference.training_conv.dilated_causal_conv``.

Tiles: a program owns ``BLOCK_T`` consecutive positions of one sequence and a block of channels, and
loads its ``ROWS`` rows (a power of two) once, halo included: the ``S = (K-1)*d`` rows before the owned
ones (forward, ``BLOCK_T = FWD_ROWS - S``) or the ``S`` rows before and after (backward,
``BLOCK_T = BWD_ROWS - 2S``; the rows double until at least ``MIN_OWNED`` are owned). Each tap is read
from the loaded tile with ``tl.gather`` (registers / shuffles), not loaded again, so x is read once plus
its halo. Dense ``[B, L, C]`` tiles come from the program id; packed ``[T, C]`` with ``cu_seqlens``
launches ``T // span + B`` programs (an upper bound from shapes, ``_numerics.tile_grid``) and each finds
its sequence, first row and length by one scan over ``cu_seqlens`` on the device (`_find_tile`, read
through its stride; a program past its sequence's rows does nothing). No host values: the backward
reads none either. The weights are passed as a ``[K, C]`` copy (C*K elements) so a tap's weights load
contiguously.

Forward: ``y`` (``FWD_SUB`` channel blocks per program, one after the other). Backward: one kernel,
``BWD_TILES`` consecutive tiles per program. It recomputes the pre-activation and
``g' = dy * silu'(preact)`` rounded to ``x``'s dtype (as the reference's autograd rounds it) for the owned
rows and the ``S`` after them, so ``g'`` is neither stored nor re-read; ``dx_t = sum_j w_j g'_{t+lag_j}``
inside each sequence; the weight gradient ``sum_t g'_t x_{t-lag_j}`` of its owned rows goes into a
float32 (float64 for float64 inputs) buffer of partial sums, ``[programs along time * SPLIT, K, C]``
(``SPLIT`` row groups so each thread stores 4 consecutive sums; 31 MB at B 4 x L 4096 x C 10240), which
the launcher sums (no atomics). Bytes per token moved (bfloat16, C 10240, K 4, d 3): forward reads x
``ROWS / BLOCK_T = 64/55`` times and writes y once; backward reads x ``64/46`` times and dy ``55/46`` times
and writes dx once, plus the partial sums, ``4 * SPLIT * K * C / (BWD_TILES * 46)`` bytes (1.8 KB).

Deterministic mode (``torch.use_deterministic_algorithms(True)``, `_numerics.deterministic`, read when
the backward launches): ``dW`` is summed in an order that depends on no block size. The owned rows are a
multiple of ``_numerics.DETERMINISTIC_CHUNK`` (16) positions, so each chunk of 16 positions of a sequence
lies in one tile; its sum is a pairwise tree of fixed shape (`_chunk_sums`), stored as its own row of a
``[chunks, K, C]`` buffer, and a second kernel (`_dcc_dw_sum_kernel`) adds the rows one after the other
in token order (rows of tiles past a sequence's end are zeros and change no bit). ``dx`` has no
reduction across programs and is the same in both modes. Cost: the partial-sum buffer grows to one row
of K*C accumulators per 16 positions (168 MB at B 4 x L 4096 x C 10240, written once and read once by the
second pass: about 10 KB a token, a sixth more than the op's own minimum), the owned rows of a tile
drop to a multiple of 16 (32 of 64 at d 3, so x and dy are read 2 and 1.7 times), every backward program runs
all its ``BWD_TILES`` tiles (empty ones too, to write their zero rows), the tree adds a few gathers per
tap, and the second pass is a sequential loop over the chunks.

Numerics as in ``conv`` (``_numerics``). Recompilation: K, the dilation, the block sizes, the dtypes
and the flags are compile-time constants; the length arguments are ``do_not_specialize``. The strides,
batch strides included, are specialised as Triton does (``== 1``, divisible by 16): that is what lets
the compiler prove the rows 16-byte aligned and issue 128-bit accesses (``benchmarks/codegen.py``), at
the cost of one compile per such stride class.

Registered as ``torch.ops.ple.dilated_causal_conv`` (autograd:
``ple.dilated_causal_conv_backward``): the public function checks the metadata
(``ple._checks.dilated_causal_conv_meta``), the op the values of ``cu_seqlens`` at run time unless
``validate=False`` (then no device-to-host synchronisation at all, forward or backward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _checks
from ..reference import training_conv as _reference
from . import _numerics
from ._library import register, twin
from ._numerics import acc_dtype, deterministic, down, is_fp64, pow2_block, rnd, silu, tile_grid, up

__all__ = ["dilated_causal_conv"]


@triton.jit
def _find_tile(pid, cu_seqlens_ptr, stride_cu_seqlens_r, R, SPAN: tl.constexpr, SCAN: tl.constexpr):
    """(first row, length, first position) of the sequence tile of program ``pid`` (int64), the tiling of
    `_numerics.tile_grid` with ``SPAN`` positions per tile: the sequence is the last r in ``[0, R)`` with
    ``cu_seqlens[r] // SPAN + r <= pid``. Found by a scan over ``cu_seqlens``, ``SCAN`` offsets per step (one
    wide load each; a sequence's id needs no search, its first and next offsets fall out of the same
    scan), in ``ceil((R + 1) / SCAN)`` steps. The first position may lie past the sequence: then the
    program owns no rows."""
    seq = pid * 0 - 1
    first = pid * 0
    end = pid * 0 + (1 << 62)
    for step in range(0, tl.cdiv(R + 1, SCAN)):
        r = (step * SCAN + tl.arange(0, SCAN)).to(tl.int64)
        inside = r <= R
        off = tl.load(cu_seqlens_ptr + r * stride_cu_seqlens_r, mask=inside, other=0).to(tl.int64)
        before = (r < R) & (off // SPAN + r <= pid)              # sequences up to this program's
        # float64 holds every offset exactly (< 2**53); its reductions need no integer warp reduction
        seq = tl.maximum(seq, tl.max(tl.where(before, r.to(tl.float64), -1.0), 0).to(tl.int64))
        first = tl.maximum(first, tl.max(tl.where(before, off.to(tl.float64), 0.0), 0).to(tl.int64))
        end = tl.minimum(end, tl.min(tl.where(inside & ~before, off.to(tl.float64), 2.0**62), 0).to(tl.int64))
    return first, end - first, (pid - (first // SPAN + seq)) * SPAN


@triton.jit
def _tile(cu_seqlens_ptr, stride_cu_seqlens_r, L, tiles_per_seq, C, IS_VARLEN: tl.constexpr, SPAN: tl.constexpr,
          SCAN: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's tile: (first row of its sequence, batch index, length, first owned position,
    channels, channel mask); the program owns the ``SPAN`` positions from the first.

    Packed (``IS_VARLEN``): ``L`` is the number of sequences (`_find_tile`); ``tiles_per_seq`` unused.
    """
    pid64 = tl.program_id(0).to(tl.int64)
    if IS_VARLEN:
        lo, n, t0 = _find_tile(pid64, cu_seqlens_ptr, stride_cu_seqlens_r, L, SPAN, SCAN)
        b = pid64 * 0
    else:
        b = pid64 // tiles_per_seq
        t0 = (pid64 - b * tiles_per_seq) * SPAN
        lo = pid64 * 0
        n = pid64 * 0 + L
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    return lo, b, n, t0, c, c < C


@triton.jit
def _shifted(v, i, shift, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row ``i + shift`` of the register tile ``v`` for every row ``i`` (clamped to the tile): a tap
    reads the rows already loaded instead of loading them again."""
    src = tl.minimum(tl.maximum(i + shift, 0), ROWS - 1)
    return tl.gather(v, tl.broadcast_to(src[:, None], (ROWS, BLOCK_C)), 0)


@triton.jit
def _taps(w_ptr, c, cmask, stride_w_c, stride_w_k, K: tl.constexpr, KP: tl.constexpr, IS_W_BF16: tl.constexpr,
          IS_FP64: tl.constexpr):
    """All ``K`` taps' weights of the channels, ``[KP, BLOCK_C]`` (``KP`` a power of two >= K; zeros past K)."""
    k = tl.arange(0, KP)
    return up(tl.load(w_ptr + k[:, None] * stride_w_k + c[None, :] * stride_w_c,
                      mask=(k < K)[:, None] & cmask[None, :], other=0.0), IS_W_BF16, IS_FP64)


@triton.jit
def _tap(wall, j, KP: tl.constexpr):
    """Row ``j`` of `_taps` (exact: the other rows add zeros)."""
    return tl.sum(tl.where((tl.arange(0, KP) == j)[:, None], wall, 0.0), axis=0)


@triton.jit
def _preact(xt, wall, i, K: tl.constexpr, KP: tl.constexpr, DILATION: tl.constexpr, IS_X_BF16: tl.constexpr,
            IS_FP64: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """The conv sum at each loaded row ``i >= (K-1)*DILATION`` of the loaded tile ``xt`` (rows before
    that are not meaningful), rounded to x's dtype (in the accumulation dtype)."""
    XT = xt.dtype
    acc = tl.zeros([ROWS, BLOCK_C], dtype=tl.float32)
    if IS_FP64:
        acc = acc.to(tl.float64)
    for j in tl.static_range(K):
        xv = up(_shifted(xt, i, -(K - 1 - j) * DILATION, ROWS, BLOCK_C), IS_X_BF16, IS_FP64)
        acc = acc + _tap(wall, j, KP)[None, :] * xv
    return rnd(acc, XT, IS_X_BF16, IS_FP64)


@triton.jit
def _chunk_sums(v, i, HALO: tl.constexpr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_C: tl.constexpr):
    """``[ROWS // CHUNK, BLOCK_C]``: the sums of ``v``'s rows ``HALO + k*CHUNK ..`` (``CHUNK`` rows each) as a
    pairwise tree of fixed shape (rows past the tile count as zero): the order of the additions
    depends on ``CHUNK`` only, not on the tile's sizes or the layout the compiler picks."""
    v = _shifted(v, i, HALO, ROWS, BLOCK_C)
    v = tl.where((i < ROWS - HALO)[:, None], v, 0.0)
    v = tl.reshape(v, (ROWS // CHUNK, CHUNK, BLOCK_C))
    for lvl in tl.static_range(LOG2_CHUNK):
        v = tl.permute(tl.reshape(v, (ROWS // CHUNK, CHUNK >> (lvl + 1), 2, BLOCK_C)), (0, 1, 3, 2))
        lo, hi = tl.split(v)
        v = lo + hi
    return tl.reshape(v, (ROWS // CHUNK, BLOCK_C))


@triton.jit(do_not_specialize=["L", "tiles_per_seq"])
def _dcc_fwd_kernel(
    x_ptr, w_ptr, y_ptr, cu_seqlens_ptr,
    L, tiles_per_seq, C, stride_cu_seqlens_r,
    stride_x_b, stride_x_t, stride_x_c, stride_y_b, stride_y_t, stride_y_c, stride_w_c, stride_w_k,
    K: tl.constexpr, KP: tl.constexpr, DILATION: tl.constexpr, IS_VARLEN: tl.constexpr,
    IS_X_BF16: tl.constexpr, IS_W_BF16: tl.constexpr, IS_FP64: tl.constexpr,
    BLOCK_T: tl.constexpr, ROWS: tl.constexpr, SCAN: tl.constexpr, SUB: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``y = silu(conv(x))`` for one (time tile, ``SUB`` channel blocks) of one sequence, one channel block
    after the other: the ``BLOCK_T`` owned rows and the ``(K-1)*DILATION`` rows before them are loaded
    once; the taps are gathered from registers."""
    XT = x_ptr.dtype.element_ty
    S = (K - 1) * DILATION
    lo, b, n, t0, c0, _ = _tile(cu_seqlens_ptr, stride_cu_seqlens_r, L, tiles_per_seq, C, IS_VARLEN, BLOCK_T, SCAN,
                                BLOCK_C)
    i = tl.arange(0, ROWS)
    q = t0 - S + i
    rows = ((q >= 0) & (q < n))[:, None]
    for h in tl.static_range(SUB):
        c = tl.program_id(1).to(tl.int64) * (SUB - 1) * BLOCK_C + h * BLOCK_C + c0   # block pid1 * SUB + h
        cmask = c < C
        xt = tl.load(x_ptr + b * stride_x_b + (lo + q)[:, None] * stride_x_t + c[None, :] * stride_x_c,
                     mask=rows & cmask[None, :], other=0.0)
        wall = _taps(w_ptr, c, cmask, stride_w_c, stride_w_k, K, KP, IS_W_BF16, IS_FP64)
        a = _preact(xt, wall, i, K, KP, DILATION, IS_X_BF16, IS_FP64, ROWS, BLOCK_C)
        y = down(silu(a), XT, IS_X_BF16)
        tl.store(y_ptr + b * stride_y_b + (lo + q)[:, None] * stride_y_t + c[None, :] * stride_y_c, y,
                 mask=((i >= S) & (q < n))[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["L", "tiles_per_seq"])
def _dcc_bwd_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, cu_seqlens_ptr,
    L, tiles_per_seq, C, stride_cu_seqlens_r,
    stride_x_b, stride_x_t, stride_x_c, stride_dy_b, stride_dy_t, stride_dy_c,
    stride_dx_b, stride_dx_t, stride_dx_c, stride_w_c, stride_w_k,
    K: tl.constexpr, KP: tl.constexpr, DILATION: tl.constexpr, IS_VARLEN: tl.constexpr,
    IS_X_BF16: tl.constexpr, IS_W_BF16: tl.constexpr, IS_FP64: tl.constexpr,
    DETERMINISTIC: tl.constexpr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr, TILES: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr, ROWS: tl.constexpr, SCAN: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``dx`` of the ``BLOCK_T`` owned rows and their share of ``dW``, from ``x``, ``dy`` and ``w`` only.

    Loads ``x`` over ``[t0 - S, t0 + BLOCK_T + S)`` (``S = (K-1)*DILATION``) and ``dy`` over
    ``[t0, t0 + BLOCK_T + S)`` once; recomputes the pre-activation and ``g' = dy * silu'(preact)``
    (rounded to x's dtype) for every row from ``t0`` (the ``S`` rows past the owned ones too: their
    ``g'`` feeds ``dx`` of the owned rows), so ``g'`` is never stored. ``dx_t = sum_j w_j g'_{t+lag_j}``
    (inside the sequence). ``dW``: this tile's ``sum_t g'_t x_{t-lag_j}`` over its owned rows into
    ``dw_ptr`` (``[programs along time, K, C]``), or, ``DETERMINISTIC``, one row per ``CHUNK`` owned
    positions (``[programs along time * BLOCK_T // CHUNK, K, C]``), summed by a fixed tree.
    """
    XT = x_ptr.dtype.element_ty
    S = (K - 1) * DILATION
    lo, b, n, t0_first, c, cmask = _tile(cu_seqlens_ptr, stride_cu_seqlens_r, L, tiles_per_seq, C, IS_VARLEN,
                                          TILES * BLOCK_T, SCAN, BLOCK_C)
    wall = _taps(w_ptr, c, cmask, stride_w_c, stride_w_k, K, KP, IS_W_BF16, IS_FP64)
    i = tl.arange(0, ROWS)
    kk = tl.arange(0, KP)
    pid_t = tl.program_id(0).to(tl.int64)
    dw = tl.zeros([SPLIT, KP, BLOCK_C], dtype=tl.float32)         # this program's dW, by row group
    if IS_FP64:
        dw = dw.to(tl.float64)
    tiles = TILES
    if not DETERMINISTIC:                                           # skip the tiles past the sequence
        tiles = tl.minimum(tl.maximum(tl.cdiv(n - t0_first, BLOCK_T), 0), TILES).to(tl.int32)
    for tile in range(0, tiles):
        q = t0_first + tile * BLOCK_T - S + i
        xt = tl.load(x_ptr + b * stride_x_b + (lo + q)[:, None] * stride_x_t + c[None, :] * stride_x_c,
                     mask=((q >= 0) & (q < n))[:, None] & cmask[None, :], other=0.0)
        a = _preact(xt, wall, i, K, KP, DILATION, IS_X_BF16, IS_FP64, ROWS, BLOCK_C)
        need = ((i >= S) & (q < n))[:, None] & cmask[None, :]      # rows from t0 inside the sequence
        dy = up(tl.load(dy_ptr + b * stride_dy_b + (lo + q)[:, None] * stride_dy_t + c[None, :] * stride_dy_c,
                        mask=need, other=0.0), IS_X_BF16, IS_FP64)
        s = tl.sigmoid(a)
        g = rnd(dy * s * (1.0 + a * (1.0 - s)), XT, IS_X_BF16, IS_FP64)   # torch's silu_backward, then rounded
        gt = down(tl.where(need, g, 0.0), XT, IS_X_BF16)                  # exact: g is already rounded
        own = need & (i < S + BLOCK_T)[:, None]
        acc = tl.zeros([ROWS, BLOCK_C], dtype=tl.float32)
        if IS_FP64:
            acc = acc.to(tl.float64)
        for j in tl.static_range(K):
            gv = up(_shifted(gt, i, (K - 1 - j) * DILATION, ROWS, BLOCK_C), IS_X_BF16, IS_FP64)
            acc = acc + _tap(wall, j, KP)[None, :] * gv
        tl.store(dx_ptr + b * stride_dx_b + (lo + q)[:, None] * stride_dx_t + c[None, :] * stride_dx_c,
                 down(acc, XT, IS_X_BF16), mask=own)
        g_own = tl.where(own, up(gt, IS_X_BF16, IS_FP64), 0.0)
        for j in tl.static_range(K):
            prod = g_own * up(_shifted(xt, i, -(K - 1 - j) * DILATION, ROWS, BLOCK_C), IS_X_BF16, IS_FP64)
            if DETERMINISTIC:
                sums = _chunk_sums(prod, i, S, CHUNK, LOG2_CHUNK, ROWS, BLOCK_C)
                k = tl.arange(0, ROWS // CHUNK).to(tl.int64)
                rows = (pid_t * TILES + tile) * (BLOCK_T // CHUNK) + k
                tl.store(dw_ptr + (rows[:, None] * K + j) * C + c[None, :], sums,
                         mask=(k < BLOCK_T // CHUNK)[:, None] & cmask[None, :])
            else:
                groups = tl.sum(tl.reshape(prod, (SPLIT, ROWS // SPLIT, BLOCK_C)), axis=1)
                dw += tl.where((kk == j)[None, :, None], groups[:, None, :], 0.0)
    if not DETERMINISTIC:                                           # [programs along time, SPLIT, K, C]
        h = tl.arange(0, SPLIT).to(tl.int64)
        tl.store(dw_ptr + ((pid_t * SPLIT + h[:, None, None]) * K + kk[None, :, None]) * C + c[None, None, :], dw,
                 mask=(kk < K)[None, :, None] & cmask[None, None, :])


@triton.jit(do_not_specialize=["N"])
def _dcc_dw_sum_kernel(part_ptr, out_ptr, N, KC, IS_FP64: tl.constexpr, BLOCK: tl.constexpr):
    """``out = sum_r part[r]`` over the ``N`` rows of ``[N, KC]`` partial sums, one row after the other
    (token order): the deterministic second pass."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < KC
    acc = tl.zeros([BLOCK], dtype=tl.float64 if IS_FP64 else tl.float32)
    for r in range(N):
        acc = acc + tl.load(part_ptr + r * KC + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, acc, mask=m)


# ---- launchers -------------------------------------------------------------------------------------

FWD_ROWS = 64                 # rows each forward tile loads (a power of two), its halo rows included
BWD_ROWS = 64                 # rows each backward tile loads (a power of two), its halo rows included
MIN_OWNED = 16                # fewest rows a tile owns: the rows double until the halos leave that many
FWD_CHANNELS = 64             # channels per forward channel block, at most (a power of two)
FWD_SUB = 2                   # channel blocks per forward program, one after the other
BWD_CHANNELS = 32             # channels per backward program, at most (a power of two)
FWD_WARPS = 4                 # warps per forward program
BWD_WARPS = 4                 # warps per backward program
BWD_TILES = 8                 # consecutive tiles per backward program (its dW partial is summed over them)
SUM_BLOCK = 1024              # (tap, channel) sums per program of the deterministic second pass


def _strides(name: str, t: torch.Tensor) -> dict:
    """``stride_<name>_{b,t,c}`` of a ``[B, L, C]`` or ``[T, C]`` tensor (batch stride 0 for 2-D)."""
    b, s_t, s_c = (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 3 else (0, t.stride(0), t.stride(1))
    return {f"stride_{name}_b": b, f"stride_{name}_t": s_t, f"stride_{name}_c": s_c}


def _rows(rows: int, halo: int, chunk: int) -> tuple[int, int]:
    """(rows loaded, rows owned) per tile, with ``halo`` halo rows in all; the owned rows a multiple of
    ``chunk`` if given (the deterministic reduction's chunks then never straddle two tiles)."""
    while rows - halo < max(MIN_OWNED, chunk):
        rows *= 2
    owned = rows - halo
    return rows, owned - owned % chunk if chunk else owned


def _launch(x: torch.Tensor, weight: torch.Tensor, dilation: int, cu_seqlens, rows: int, halos: int, channels: int,
            warps: int, tiles: int = 1, chunk: int = 0, sub: int = 1):
    """(grid, the arguments every training kernel takes), or (None, None) for an empty grid; shapes only.

    A program owns ``tiles`` consecutive tiles of one sequence; ``halos`` = 1 (forward: the rows before)
    or 2 (backward: also the rows after)."""
    C, K = weight.shape
    rows, owned = _rows(rows, halos * (K - 1) * dilation, chunk)
    span = tiles * owned
    bc = pow2_block(C, channels)
    if cu_seqlens is not None:                                  # packed: tiles found on the device
        B = cu_seqlens.numel() - 1
        grid, L, per_seq = (tile_grid(x.shape[0], B, span), triton.cdiv(C, bc * sub)), B, 0
        if B == 0:
            grid = (0, 0)
    else:
        B, L = (x.shape[0], x.shape[1]) if x.dim() == 3 else (1, x.shape[0])
        per_seq = triton.cdiv(L, span)
        grid = (B * per_seq, triton.cdiv(C, bc * sub))
    if grid[0] == 0 or grid[1] == 0:
        return None, None
    is_varlen = cu_seqlens is not None
    if cu_seqlens is None:                                      # placeholder: never read
        cu_seqlens = x.view(-1)
    wt = weight.t().contiguous()        # [K, C]: a tap's weights are contiguous (wide loads), C*K elements
    return grid, dict(
        w_ptr=wt, cu_seqlens_ptr=cu_seqlens, L=L, tiles_per_seq=per_seq, C=C, stride_cu_seqlens_r=cu_seqlens.stride(0),
        stride_w_c=wt.stride(1), stride_w_k=wt.stride(0), K=K, KP=triton.next_power_of_2(K), DILATION=dilation,
        IS_VARLEN=is_varlen, IS_X_BF16=x.dtype == torch.bfloat16,
        IS_W_BF16=weight.dtype == torch.bfloat16, IS_FP64=is_fp64(x.dtype), BLOCK_T=owned, ROWS=rows,
        SCAN=32 * warps, BLOCK_C=bc, num_warps=warps)


def _fwd(x, weight, dilation, cu_seqlens):
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid, common = _launch(x, weight, dilation, cu_seqlens, rows=FWD_ROWS, halos=1, channels=FWD_CHANNELS,
                           warps=FWD_WARPS,
                           sub=FWD_SUB)
    if grid is not None:
        _dcc_fwd_kernel[grid](x_ptr=x, y_ptr=y, **_strides("x", x), **_strides("y", y), SUB=FWD_SUB, **common)
    return y


def _bwd(dy, x, weight, dilation, cu_seqlens):
    """``(dx, dweight)``."""
    acc = acc_dtype(x.dtype)
    det = deterministic()
    chunk = _numerics.DETERMINISTIC_CHUNK if det else 0
    if det and chunk & (chunk - 1):
        raise ValueError(f"DETERMINISTIC_CHUNK must be a power of two, got {chunk}")
    grid, common = _launch(x, weight, dilation, cu_seqlens, rows=BWD_ROWS, halos=2, channels=BWD_CHANNELS,
                           warps=BWD_WARPS,
                           tiles=BWD_TILES, chunk=chunk)
    if grid is None:
        return (torch.zeros(x.shape, dtype=x.dtype, device=x.device),
                torch.zeros(weight.shape, dtype=acc, device=x.device).to(weight.dtype))
    C, K = weight.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # dW partial sums: per program and half tile, or (deterministic) per chunk of positions
    # (not deterministic: SPLIT row groups per program, enough that each thread stores 4 consecutive sums)
    split = min(common["ROWS"],
                triton.next_power_of_2(triton.cdiv(4 * 32 * BWD_WARPS, common["KP"] * common["BLOCK_C"])))
    parts = grid[0] * (BWD_TILES * common["BLOCK_T"] // chunk if det else split)
    partial = torch.empty((parts, K, C), dtype=acc, device=x.device)
    _dcc_bwd_kernel[grid](x_ptr=x, dy_ptr=dy, dx_ptr=dx, dw_ptr=partial, **_strides("x", x),
                          **_strides("dy", dy), **_strides("dx", dx), DETERMINISTIC=det, CHUNK=max(chunk, 1),
                          LOG2_CHUNK=max(chunk, 1).bit_length() - 1, TILES=BWD_TILES, SPLIT=split, **common)
    if det:                                     # second pass: the chunks' sums in token order
        dw = torch.empty((K, C), dtype=acc, device=x.device)
        _dcc_dw_sum_kernel[(triton.cdiv(K * C, SUM_BLOCK),)](partial, dw, parts, K * C, IS_FP64=acc == torch.float64,
                                                              BLOCK=SUM_BLOCK)
    else:
        dw = partial.sum(0)
    return dx, dw.t().contiguous().to(weight.dtype)


# ---- registration ----------------------------------------------------------------------------------


def _bwd_impl(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, dilation: int,
              cu_seqlens: torch.Tensor | None) -> list[torch.Tensor]:
    # The forward validated cu_seqlens (or was told not to); the tiles are found on the device.
    return list(_bwd(dy.contiguous(), x, weight, dilation, cu_seqlens))


def _bwd_fake(dy, x, weight, dilation, cu_seqlens):
    return [torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)]


_bwd_op = register("dilated_causal_conv_backward", _bwd_impl, fake=_bwd_fake)


def _fwd_impl(x: torch.Tensor, weight: torch.Tensor, dilation: int, cu_seqlens: torch.Tensor | None,
              validate: bool) -> torch.Tensor:
    if validate:
        _checks.dilated_causal_conv_values(x, weight, dilation, cu_seqlens)
    return _fwd(x, weight, dilation, cu_seqlens)


def _fwd_fake(x, weight, dilation, cu_seqlens, validate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    x, weight, dilation, cu_seqlens, _ = inputs
    ctx.save_for_backward(x, weight, cu_seqlens)
    ctx.dilation = dilation


def _backward(ctx, dy):
    x, weight, cu_seqlens = ctx.saved_tensors
    dx, dw = _bwd_op(dy, x, weight, ctx.dilation, cu_seqlens)
    return dx, dw, None, None, None


_op = register("dilated_causal_conv", _fwd_impl, fake=_fwd_fake, backward=_backward, setup_context=_setup)


@twin(_reference.dilated_causal_conv)
def dilated_causal_conv(x: torch.Tensor, weight: torch.Tensor, *, dilation: int,
                        cu_seqlens: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """Forward: one kernel over tiles of consecutive positions of one sequence, each loading its rows and the S rows
    before them once (a packed tile finds its sequence by a scan over ``cu_seqlens`` on the device). Backward
    (``torch.ops.ple.dilated_causal_conv_backward``): one kernel for the input's gradient and per-tile partial sums
    of the weight's, which the launcher adds (no atomics); under ``torch.use_deterministic_algorithms(True)`` the
    weight gradient is summed in fixed chunks of positions in token order, so its bits do not depend on the block
    sizes. Float32 accumulation (float64 for float64 inputs). Registered as ``torch.ops.ple.dilated_causal_conv``:
    ``cu_seqlens`` is checked inside the op unless ``validate=False``, then nothing is read back, forward or
    backward. CPU tensors are refused (``ValueError``) while the kernels are compiled; under ``TRITON_INTERPRET=1``
    they run on the CPU."""
    _checks.dilated_causal_conv_meta(x, weight, dilation, cu_seqlens)
    return _op(x, weight, dilation, cu_seqlens, _checks.validating(validate))
