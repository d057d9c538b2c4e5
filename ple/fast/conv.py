"""Triton kernels for the dilated depthwise causal convolution (SPEC sections 5, 6 and 8).

Same names, signatures and numbers as ``ple.reference.conv``; the arguments are
validated by the same checks (``ple._checks``) before any tensor is touched.

Serving step (``ple_conv``): two launches.

1. ``_step_out_kernel``, grid ``(time tiles, channel blocks)``. A time tile is
   ``BLOCK_T`` consecutive rows of one request: prefill builds a small per-tile
   table ``[(request, first position)]`` on the host (O(R + T / BLOCK_T) entries,
   one small copy to the device), so a long request is spread over many programs;
   decode uses one single-row tile per request and spec one tile of
   ``next_pow2(spec_query_len)`` rows per request, with no table. Each program
   reads the K dilated taps of its rows: positions inside the step come from
   ``inputs`` (logical row -> physical row through ``token_indices``), positions
   before it from the slot's *old* state columns ``[o, o + S)`` (or zeros), then
   writes ``residual`` (plus ``outer_residual``) for its rows. It never writes a
   state.
2. ``_step_state_kernel``, grid ``(requests, channel blocks)``, launched after (1)
   on the same stream, so no output can read a state this step has already
   updated. It writes the slot's new columns ``[0, n_write)`` from ``hist``:
   new column i is ``hist[i + base]`` (``base = q`` for prefill and decode, 1 for
   spec), i.e. old state column ``o + base + i`` or an input row. Because the
   source column is always *after* the destination (``o + base >= 1``) and the
   columns are written one at a time in increasing order by the same program,
   a column is read (by the thread that owns that channel) before it is
   overwritten: the in-place shift cannot race. Distinct requests have distinct
   slots (checked), so programs of different requests never share a slot.

``export_conv_checkpoints`` is one copy kernel (inputs -> state columns ``[0, S)``);
it reads no state.

Training (``dilated_causal_conv``, whose autograd is registered in ``library.py``): three
kernels, all tiled ``(time tiles, channel blocks)`` like prefill (dense
``[B, L, C]`` tiles are computed from the program id; packed ``[T, C]`` with
``cu_seqlens`` uses a per-tile table). Forward writes ``y``. Backward recomputes the
pre-activation (only ``x`` and ``weight`` are saved), writes
``g' = dy * silu'(preact)`` rounded to ``x``'s dtype (as the reference's autograd
rounds it) and adds each tile's ``sum_t g'_t * x_{t - lag_j}`` into a float32
(float64 for float64 inputs) ``[C, K]`` buffer with ``tl.atomic_add``; a second
kernel computes ``dx_t = sum_j w_j g'_{t + lag_j}`` inside each sequence.

Numerics: accumulation in float32 (float64 for float64 inputs), rounded to the
input dtype where the reference rounds. Conversions to and from bfloat16 are done
on the bits (round to nearest even, NaN -> 0x7FC0 like PyTorch on the CPU) so the
Triton interpreter, whose own float32 -> bfloat16 cast truncates, gives the same
bits as a GPU. Known gaps: a float64 -> bfloat16 conversion (float64 inputs with a
bfloat16 state) rounds twice (through float32), and NaN payloads converted between
dtypes are canonicalised; same-dtype state copies are plain copies, bit for bit.

Recompilation: K, the dilation, the block sizes, the dtypes and the flags are
compile-time constants (model constants); row counts, lengths, strides and the
null slot are runtime arguments, so a new batch shape never recompiles (beyond
Triton's usual "== 1 / multiple of 16" integer specialisation; the training
kernels' length and batch-stride arguments are ``do_not_specialize``). The
serving kernels take no T at all: rows come from ``query_start_loc`` and the tile
table.

Interpreter note: per-request predicates (live slot, reads-history, ...) are built
as vectors (``zeros + scalar``) rather than broadcast from scalar comparisons,
which the Triton interpreter mis-types when they are combined into load masks.
``tests/test_fast_conv.py`` also compiles every kernel ahead of time for sm_90, so
code the interpreter accepts but the compiler rejects is caught without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _checks

__all__ = ["ple_conv", "export_conv_checkpoints"]   # the training conv: ple.fast.dilated_causal_conv (library.py)

PREFILL_BLOCK_T = 32     # rows per prefill / training time tile
MAX_BLOCK_C = 128        # channels per program
_MODES = {"prefill": 0, "decode": 1, "spec": 2}


# ---- dtype helpers (device side) ------------------------------------------------------------------


@triton.jit
def _bf16_to_f32(x):
    """Exact bfloat16 -> float32 on the bits."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16(x):
    """float32 -> bfloat16, round to nearest even on the bits; NaN -> 0x7FC0."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _up(x, SRC_BF16: tl.constexpr, FP64: tl.constexpr):
    """Exact upcast of a loaded value to the accumulation dtype (float32, or float64)."""
    if SRC_BF16:
        x = _bf16_to_f32(x)
    if FP64:
        return x.to(tl.float64)
    else:
        return x.to(tl.float32)


@triton.jit
def _down(x, DT: tl.constexpr, DT_BF16: tl.constexpr):
    """Round a float32 / float64 value to ``DT`` (nearest even) for storing."""
    if DT_BF16:
        return _f32_to_bf16(x.to(tl.float32))
    else:
        return x.to(DT)


@triton.jit
def _rnd(x, DT: tl.constexpr, DT_BF16: tl.constexpr, FP64: tl.constexpr):
    """Round an accumulator value to ``DT`` and back: ``x.to(DT).to(acc)`` of the reference."""
    if DT_BF16:
        return _up(_f32_to_bf16(x.to(tl.float32)), True, FP64)
    else:
        return _up(x.to(DT), False, FP64)


@triton.jit
def _convert(x, DT: tl.constexpr, SRC_BF16: tl.constexpr, DST_BF16: tl.constexpr):
    """``x.to(DT)`` between storage dtypes (state <-> inputs)."""
    if SRC_BF16:
        x = _bf16_to_f32(x)
    return _down(x, DT, DST_BF16)


@triton.jit
def _silu(a):
    return a * tl.sigmoid(a)


# ---- serving step ----------------------------------------------------------------------------------


@triton.jit
def _request(r, qsl_ptr, s_qsl, MODE: tl.constexpr):
    """First logical row and row count of request ``r`` (int64)."""
    if MODE == 1:
        lo = r
        n = r * 0 + 1
    else:
        lo = tl.load(qsl_ptr + r * s_qsl).to(tl.int64)
        n = tl.load(qsl_ptr + (r + 1) * s_qsl).to(tl.int64) - lo
    return lo, n


@triton.jit
def _history_source(r, init_ptr, s_init, nat_ptr, s_nat,
                    MODE: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, INIT_DEFAULT: tl.constexpr):
    """(reads the state? as a nonzero int, first state column of the history) for request ``r``."""
    if MODE == 2:
        off = tl.load(nat_ptr + r * s_nat).to(tl.int64) - 1
        flag = r * 0 + 1                                        # spec always reads its history
    else:
        off = r * 0
        if HAS_INIT_FLAGS:
            flag = tl.load(init_ptr + r * s_init).to(tl.int64)
        else:
            flag = r * 0 + INIT_DEFAULT
    return flag, off


@triton.jit
def _step_out_kernel(
    x_ptr, res_ptr, outer_ptr, state_ptr, w_ptr,
    slot_ptr, qsl_ptr, init_ptr, nat_ptr, rows_ptr, tiles_ptr,
    C, null_slot,
    sx_t, sx_c, sr_t, sr_c, so_t, so_c,
    ss_n, ss_c, ss_w, sw_c, sw_k,
    s_slot, s_qsl, s_init, s_nat, s_rows,
    K: tl.constexpr, DILATION: tl.constexpr, MODE: tl.constexpr,
    HAS_INIT_FLAGS: tl.constexpr, INIT_DEFAULT: tl.constexpr,
    HAS_TOKEN_INDICES: tl.constexpr, HAS_OUTER_RESIDUAL: tl.constexpr,
    X_BF16: tl.constexpr, ST_BF16: tl.constexpr, W_BF16: tl.constexpr,
    STATE_SAME: tl.constexpr, FP64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Outputs of one time tile: ``residual[rows] += silu(conv(hist))`` (+ ``outer_residual``)."""
    S = (K - 1) * DILATION                                      # history length (compile-time)
    XT = x_ptr.dtype.element_ty
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    if MODE == 0:
        r = tl.load(tiles_ptr + 2 * pid_t).to(tl.int64)
        t0 = tl.load(tiles_ptr + 2 * pid_t + 1).to(tl.int64)
    else:
        r = pid_t.to(tl.int64)
        t0 = r * 0
    lo, n = _request(r, qsl_ptr, s_qsl, MODE)
    slot = tl.load(slot_ptr + r * s_slot).to(tl.int64)
    flag, off = _history_source(r, init_ptr, s_init, nat_ptr, s_nat, MODE, HAS_INIT_FLAGS, INIT_DEFAULT)

    p = t0 + tl.arange(0, BLOCK_T)                            # positions in the request   [BT]
    c = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)  # channels                 [BC]
    pmask = p < n
    cmask = c < C
    # Per-request predicates as [BT] vectors (the interpreter mishandles broadcast scalar masks).
    zt = p * 0
    live = (zt + slot) != null_slot                            # null slot: never read, no conv term
    init = live & ((zt + flag) != 0)
    state_row = state_ptr + slot * ss_n

    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if FP64:
        acc = acc.to(tl.float64)
    for j in tl.static_range(K):
        lag = (K - 1 - j) * DILATION              # tap j reads the input `lag` steps back
        src = p - lag
        in_step = src >= 0
        m_x = pmask & in_step & live
        if HAS_TOKEN_INDICES:
            prow = tl.load(rows_ptr + (lo + src) * s_rows, mask=m_x, other=0).to(tl.int64)
        else:
            prow = lo + src
        xv = tl.load(x_ptr + prow[:, None] * sx_t + c[None, :] * sx_c,
                     mask=m_x[:, None] & cmask[None, :], other=0.0)
        m_s = pmask & (src < 0) & init
        col = off + S + src                                     # old state column of hist[S + src]
        sv = tl.load(state_row + col[:, None] * ss_w + c[None, :] * ss_c,
                     mask=m_s[:, None] & cmask[None, :], other=0.0)
        if not STATE_SAME:
            sv = _convert(sv, XT, ST_BF16, X_BF16)
        h = tl.where(in_step[:, None], _up(xv, X_BF16, FP64), _up(sv, X_BF16, FP64))
        wj = _up(tl.load(w_ptr + c * sw_c + j * sw_k, mask=cmask, other=0.0), W_BF16, FP64)
        acc = acc + wj[None, :] * h
    a = _rnd(acc, XT, X_BF16, FP64)                             # conv sum rounded to the input dtype
    y = _rnd(_silu(a), XT, X_BF16, FP64)

    if HAS_TOKEN_INDICES:
        orow = tl.load(rows_ptr + (lo + p) * s_rows, mask=pmask, other=0).to(tl.int64)
    else:
        orow = lo + p
    m_o = pmask[:, None] & cmask[None, :]
    res = _up(tl.load(res_ptr + orow[:, None] * sr_t + c[None, :] * sr_c, mask=m_o, other=0.0), X_BF16, FP64)
    out = tl.where(live[:, None], _rnd(res + y, XT, X_BF16, FP64), res)
    if HAS_OUTER_RESIDUAL:
        outer = _up(tl.load(outer_ptr + orow[:, None] * so_t + c[None, :] * so_c, mask=m_o, other=0.0),
                    X_BF16, FP64)
        out = _rnd(out + outer, XT, X_BF16, FP64)
        tl.store(res_ptr + orow[:, None] * sr_t + c[None, :] * sr_c, _down(out, XT, X_BF16), mask=m_o)
    else:
        tl.store(res_ptr + orow[:, None] * sr_t + c[None, :] * sr_c, _down(out, XT, X_BF16),
                 mask=m_o & live[:, None])


@triton.jit
def _step_state_kernel(
    x_ptr, state_ptr,
    slot_ptr, qsl_ptr, init_ptr, nat_ptr, rows_ptr,
    C, null_slot,
    sx_t, sx_c, ss_n, ss_c, ss_w,
    s_slot, s_qsl, s_init, s_nat, s_rows,
    K: tl.constexpr, DILATION: tl.constexpr, MODE: tl.constexpr, W_OUT: tl.constexpr,
    HAS_INIT_FLAGS: tl.constexpr, INIT_DEFAULT: tl.constexpr, HAS_TOKEN_INDICES: tl.constexpr,
    X_BF16: tl.constexpr, ST_BF16: tl.constexpr, STATE_SAME: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """New state columns of one request: ``state[:, i] = hist[i + base]`` for i < n_write.

    Columns go in increasing order and each reads a later column (or an input row), so a
    column is read before this program overwrites it; see the module docstring.
    """
    S = (K - 1) * DILATION                                      # history length (compile-time)
    XT = x_ptr.dtype.element_ty
    ST = state_ptr.dtype.element_ty
    r = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    lo, n = _request(r, qsl_ptr, s_qsl, MODE)
    slot = tl.load(slot_ptr + r * s_slot).to(tl.int64)
    flag, off = _history_source(r, init_ptr, s_init, nat_ptr, s_nat, MODE, HAS_INIT_FLAGS, INIT_DEFAULT)
    if MODE == 2:
        n_write = S + n - 1                                     # every window of the step
        base = n * 0 + 1
    else:
        n_write = n * 0 + S                                     # the last S entries of hist
        base = n
    c = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    zc = c * 0                                                  # predicates as [BC] vectors
    live = (zc + slot) != null_slot
    active = (c < C) & live & ((zc + n) > 0)
    init = (zc + flag) != 0
    state_row = state_ptr + slot * ss_n
    for i in tl.static_range(W_OUT):
        k = base + i                                            # index into hist (length S + n)
        write = active & ((zc + i) < n_write)
        from_state = (zc + k) < S
        sv = tl.load(state_row + (off + k) * ss_w + c * ss_c, mask=write & from_state & init, other=0.0)
        m_x = write & ((zc + k) >= S)
        if HAS_TOKEN_INDICES:
            prow = tl.load(rows_ptr + (zc + lo + k - S) * s_rows, mask=m_x, other=0).to(tl.int64)
        else:
            prow = lo + k - S
        xv = tl.load(x_ptr + prow * sx_t + c * sx_c, mask=m_x, other=0.0)
        if STATE_SAME:
            v = tl.where(from_state, sv, xv)
        else:
            v = tl.where(from_state, _convert(_convert(sv, XT, ST_BF16, X_BF16), ST, X_BF16, ST_BF16),
                         _convert(xv, ST, X_BF16, ST_BF16))
        tl.store(state_row + i * ss_w + c * ss_c, v, mask=write)


@triton.jit
def _export_kernel(
    x_ptr, state_ptr, qsl_ptr, off_ptr, slots_ptr, rows_ptr,
    C, null_slot, state_len,
    sx_t, sx_c, ss_n, ss_c, ss_w, s_qsl, s_off, s_slots, s_rows,
    HAS_TOKEN_INDICES: tl.constexpr, X_BF16: tl.constexpr, ST_BF16: tl.constexpr,
    STATE_SAME: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``state[slots[r], :, i] = inputs[row(qsl[r] + offsets[r] - state_len + i)]`` for i < state_len."""
    ST = state_ptr.dtype.element_ty
    r = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    off = tl.load(off_ptr + r * s_off).to(tl.int64)
    slot = tl.load(slots_ptr + r * s_slots).to(tl.int64)
    first = tl.load(qsl_ptr + r * s_qsl).to(tl.int64) + off - state_len
    c = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    zc = c * 0                                                  # predicates as [BC] vectors
    m = (c < C) & ((zc + off) > 0) & ((zc + slot) != null_slot)
    for i in range(0, state_len):
        if HAS_TOKEN_INDICES:
            prow = tl.load(rows_ptr + (zc + first + i) * s_rows, mask=m, other=0).to(tl.int64)
        else:
            prow = first + i
        v = tl.load(x_ptr + prow * sx_t + c * sx_c, mask=m, other=0.0)
        if not STATE_SAME:
            v = _convert(v, ST, X_BF16, ST_BF16)
        tl.store(state_ptr + slot * ss_n + i * ss_w + c * ss_c, v, mask=m)


# ---- host side: serving ----------------------------------------------------------------------------


def _block_c(C: int) -> int:
    return min(MAX_BLOCK_C, triton.next_power_of_2(max(C, 1)))


def _tile_table(starts: list[int], block_t: int, device) -> torch.Tensor:
    """``[num_tiles, 2]`` int32 rows ``(request, first position)``: O(R + T / block_t) host work."""
    flat: list[int] = []
    for r in range(len(starts) - 1):
        for t0 in range(0, starts[r + 1] - starts[r], block_t):
            flat += (r, t0)
    return torch.tensor(flat, dtype=torch.int32).view(-1, 2).to(device)


def _flags(inputs: torch.Tensor, state: torch.Tensor) -> dict:
    return dict(X_BF16=inputs.dtype == torch.bfloat16, ST_BF16=state.dtype == torch.bfloat16,
                STATE_SAME=state.dtype == inputs.dtype)


def ple_conv(inputs: torch.Tensor, residual: torch.Tensor, conv_state: torch.Tensor,
             conv_weights: torch.Tensor, state_indices: torch.Tensor, *, mode: str, dilation: int,
             query_start_loc: torch.Tensor | None = None, has_initial_states: torch.Tensor | None = None,
             num_accepted_tokens: torch.Tensor | None = None, spec_query_len: int = 1,
             token_indices: torch.Tensor | None = None, outer_residual: torch.Tensor | None = None,
             null_slot: int = 0) -> None:
    """One serving step of the conv, in place: ``residual += y (+ outer_residual)``; states updated.

    Shapes: ``inputs``, ``residual``, ``outer_residual``: ``[T, C]`` (physical rows, any
    strides); ``conv_state``: ``[num_slots, C, W]``, any strides (e.g. a transposed
    ``[num_slots, W, C]`` buffer), ``W >= S`` (``S + spec_query_len - 1`` for spec);
    ``conv_weights``: ``[C, K]``; ``state_indices``: ``[R]``, any stride (e.g. a column of a
    block table). Logical row i of the call is physical row ``token_indices[i]`` (identity
    if None); rows are never gathered or copied.

    Modes (SPEC section 6), exactly as ``ple.reference.ple_conv``:

    * ``"prefill"``: requests cut by ``query_start_loc``; ``has_initial_states[r]`` (default
      all False) says whether columns ``[0, S)`` are the history or zeros are. Afterwards
      columns ``[0, S)`` hold the last S inputs of the history. Empty requests change nothing.
    * ``"decode"``: one row per request; ``has_initial_states`` defaults to all True.
    * ``"spec"``: 1..``spec_query_len`` rows per request; the history is columns
      ``[o, o + S)``, ``o = num_accepted_tokens[r] - 1``, always read; afterwards columns
      ``[0, S + q - 1)`` hold the history without its first column.

    Rows of a request whose slot is ``null_slot`` get only ``outer_residual``; the null slot
    is never read or written. Every output reads the states as they were before the call
    (outputs and the state update are two launches, see the module docstring).
    """
    call = _checks.ple_conv_args(
        inputs, residual, conv_state, conv_weights, state_indices, mode=mode, dilation=dilation,
        query_start_loc=query_start_loc, has_initial_states=has_initial_states,
        num_accepted_tokens=num_accepted_tokens, spec_query_len=spec_query_len,
        token_indices=token_indices, outer_residual=outer_residual, null_slot=null_slot)
    T, C = inputs.shape                  # physical rows, channels (hc_count * hidden_size)
    R = len(call.slots)
    K = conv_weights.shape[1]
    S = call.state_len
    if R == 0 or C == 0 or call.num_rows == 0:
        return
    MODE = _MODES[mode]
    dev = inputs.device
    if MODE == 0:
        block_t = PREFILL_BLOCK_T
        tiles = _tile_table(call.starts, block_t, dev)
        num_tiles = tiles.shape[0]
    else:
        block_t = 1 if MODE == 1 else triton.next_power_of_2(spec_query_len)
        tiles = state_indices                                  # unused
        num_tiles = R
    if num_tiles == 0:
        return
    dummy = state_indices
    qsl = query_start_loc if (MODE != 1 and query_start_loc is not None) else dummy
    use_flags = has_initial_states is not None and MODE != 2
    init = has_initial_states if use_flags else dummy
    if init.dtype == torch.bool:
        init = init.view(torch.uint8)
    nat = num_accepted_tokens if MODE == 2 else dummy
    rows = token_indices if token_indices is not None else dummy
    outer = outer_residual if outer_residual is not None else residual
    block_c = _block_c(C)
    common = dict(K=K, DILATION=dilation, MODE=MODE, HAS_INIT_FLAGS=use_flags, INIT_DEFAULT=int(MODE != 0),
                  HAS_TOKEN_INDICES=token_indices is not None, **_flags(inputs, conv_state), BLOCK_C=block_c)
    grid = (num_tiles, triton.cdiv(C, block_c))
    _step_out_kernel[grid](
        inputs, residual, outer, conv_state, conv_weights,
        state_indices, qsl, init, nat, rows, tiles,
        C, null_slot,
        inputs.stride(0), inputs.stride(1), residual.stride(0), residual.stride(1),
        outer.stride(0), outer.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        conv_weights.stride(0), conv_weights.stride(1),
        state_indices.stride(0), qsl.stride(0), init.stride(0), nat.stride(0), rows.stride(0),
        HAS_OUTER_RESIDUAL=outer_residual is not None, W_BF16=conv_weights.dtype == torch.bfloat16,
        FP64=inputs.dtype == torch.float64, BLOCK_T=block_t, **common)
    w_out = S + (spec_query_len - 1 if MODE == 2 else 0)
    if w_out == 0:
        return
    # Launched after every output is computed: the outputs above read only old states.
    _step_state_kernel[(R, triton.cdiv(C, block_c))](
        inputs, conv_state, state_indices, qsl, init, nat, rows,
        C, null_slot,
        inputs.stride(0), inputs.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        state_indices.stride(0), qsl.stride(0), init.stride(0), nat.stride(0), rows.stride(0),
        W_OUT=w_out, **common)


def export_conv_checkpoints(inputs: torch.Tensor, conv_state: torch.Tensor, *,
                            query_start_loc: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor,
                            state_len: int, token_indices: torch.Tensor | None = None,
                            null_slot: int = 0) -> None:
    """Write prefix-cache checkpoints: ``conv_state[slots[r], :, 0:S] = inputs of rows [off - S, off)``.

    For request r (rows cut by ``query_start_loc``, logical rows mapped through
    ``token_indices``) with ``offsets[r] > 0``, the slot receives the state the request
    would have after the first ``offsets[r]`` tokens of this step. ``0 < offsets[r] <
    state_len`` or an offset past the request's rows is a ``ValueError``; ``offsets[r] == 0``
    and ``slots[r] == null_slot`` write nothing. One program per (request, channel block)
    copies ``state_len`` rows; no state is read.
    """
    call = _checks.export_checkpoint_args(inputs, conv_state, query_start_loc=query_start_loc,
                                          offsets=offsets, slots=slots, state_len=state_len,
                                          token_indices=token_indices, null_slot=null_slot)
    T, C = inputs.shape
    R = len(call.offsets)
    live = [o > 0 and s != null_slot for o, s in zip(call.offsets, call.slots, strict=True)]
    if R == 0 or C == 0 or not any(live):
        return
    rows = token_indices if token_indices is not None else offsets
    block_c = _block_c(C)
    flags = _flags(inputs, conv_state)
    _export_kernel[(R, triton.cdiv(C, block_c))](
        inputs, conv_state, query_start_loc, offsets, slots, rows,
        C, null_slot, state_len,
        inputs.stride(0), inputs.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        query_start_loc.stride(0), offsets.stride(0), slots.stride(0), rows.stride(0),
        HAS_TOKEN_INDICES=token_indices is not None, X_BF16=flags["X_BF16"], ST_BF16=flags["ST_BF16"],
        STATE_SAME=flags["STATE_SAME"], BLOCK_C=block_c)


# ---- training path ---------------------------------------------------------------------------------


@triton.jit
def _seq_tile(pid, tiles_ptr, cu_ptr, L, tiles_per_seq, VARLEN: tl.constexpr, BLOCK_T: tl.constexpr):
    """(first row of the sequence, batch index, its length, the tile's first position), int64."""
    pid64 = pid.to(tl.int64)
    if VARLEN:
        seq = tl.load(tiles_ptr + 2 * pid64).to(tl.int64)
        t0 = tl.load(tiles_ptr + 2 * pid64 + 1).to(tl.int64)
        lo = tl.load(cu_ptr + seq).to(tl.int64)
        n = tl.load(cu_ptr + seq + 1).to(tl.int64) - lo
        return lo, pid64 * 0, n, t0
    else:
        b = pid64 // tiles_per_seq
        t0 = (pid64 - b * tiles_per_seq) * BLOCK_T
        return pid64 * 0, b, pid64 * 0 + L, t0


@triton.jit
def _preact(x_ptr, w_ptr, xb, p, pmask, c, cmask, sx_t, sx_c, sw_c, sw_k,
            K: tl.constexpr, DILATION: tl.constexpr, X_BF16: tl.constexpr, W_BF16: tl.constexpr,
            FP64: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """The conv sum of the tile, rounded to x's dtype (in the accumulation dtype)."""
    XT = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if FP64:
        acc = acc.to(tl.float64)
    for j in tl.static_range(K):
        lag = (K - 1 - j) * DILATION
        src = p - lag
        m = (pmask & (src >= 0))[:, None] & cmask[None, :]
        xv = _up(tl.load(x_ptr + xb + src[:, None] * sx_t + c[None, :] * sx_c, mask=m, other=0.0),
                 X_BF16, FP64)
        wj = _up(tl.load(w_ptr + c * sw_c + j * sw_k, mask=cmask, other=0.0), W_BF16, FP64)
        acc = acc + wj[None, :] * xv
    return _rnd(acc, XT, X_BF16, FP64)


@triton.jit(do_not_specialize=["L", "tiles_per_seq", "sx_b", "sy_b"])
def _dcc_fwd_kernel(
    x_ptr, w_ptr, y_ptr, cu_ptr, tiles_ptr,
    L, tiles_per_seq, C,
    sx_b, sx_t, sx_c, sy_b, sy_t, sy_c, sw_c, sw_k,
    K: tl.constexpr, DILATION: tl.constexpr, VARLEN: tl.constexpr,
    X_BF16: tl.constexpr, W_BF16: tl.constexpr, FP64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``y = silu(conv(x))`` for one (time tile, channel block) of one sequence."""
    XT = x_ptr.dtype.element_ty
    lo, b, n, t0 = _seq_tile(tl.program_id(0), tiles_ptr, cu_ptr, L, tiles_per_seq, VARLEN, BLOCK_T)
    p = t0 + tl.arange(0, BLOCK_T)
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    pmask = p < n
    cmask = c < C
    a = _preact(x_ptr, w_ptr, b * sx_b + lo * sx_t, p, pmask, c, cmask, sx_t, sx_c, sw_c, sw_k,
                K, DILATION, X_BF16, W_BF16, FP64, BLOCK_T, BLOCK_C)
    y = _down(_silu(a), XT, X_BF16)
    yb = b * sy_b + lo * sy_t
    tl.store(y_ptr + yb + p[:, None] * sy_t + c[None, :] * sy_c, y, mask=pmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["L", "tiles_per_seq", "sx_b", "sd_b", "sg_b"])
def _dcc_bwd_gw_kernel(
    x_ptr, w_ptr, dy_ptr, g_ptr, dw_ptr, cu_ptr, tiles_ptr,
    L, tiles_per_seq, C,
    sx_b, sx_t, sx_c, sd_b, sd_t, sd_c, sg_b, sg_t, sg_c, sw_c, sw_k,
    K: tl.constexpr, DILATION: tl.constexpr, VARLEN: tl.constexpr, NEED_DW: tl.constexpr,
    X_BF16: tl.constexpr, W_BF16: tl.constexpr, FP64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``g' = dy * silu'(preact)`` (rounded to x's dtype) and ``dw[c, j] += sum_t g'_t x_{t-lag_j}``."""
    XT = x_ptr.dtype.element_ty
    lo, b, n, t0 = _seq_tile(tl.program_id(0), tiles_ptr, cu_ptr, L, tiles_per_seq, VARLEN, BLOCK_T)
    p = t0 + tl.arange(0, BLOCK_T)
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    pmask = p < n
    cmask = c < C
    m = pmask[:, None] & cmask[None, :]
    xb = b * sx_b + lo * sx_t
    a = _preact(x_ptr, w_ptr, xb, p, pmask, c, cmask, sx_t, sx_c, sw_c, sw_k,
                K, DILATION, X_BF16, W_BF16, FP64, BLOCK_T, BLOCK_C)
    dy_rows = dy_ptr + b * sd_b + lo * sd_t
    dy = _up(tl.load(dy_rows + p[:, None] * sd_t + c[None, :] * sd_c, mask=m, other=0.0), X_BF16, FP64)
    s = tl.sigmoid(a)
    g = _rnd(dy * s * (1.0 + a * (1.0 - s)), XT, X_BF16, FP64)   # torch's silu_backward, then rounded
    g = tl.where(m, g, 0.0)
    g_rows = g_ptr + b * sg_b + lo * sg_t
    tl.store(g_rows + p[:, None] * sg_t + c[None, :] * sg_c, _down(g, XT, X_BF16), mask=m)
    if NEED_DW:
        for j in tl.static_range(K):
            lag = (K - 1 - j) * DILATION
            src = p - lag
            ms = (pmask & (src >= 0))[:, None] & cmask[None, :]
            xv = _up(tl.load(x_ptr + xb + src[:, None] * sx_t + c[None, :] * sx_c, mask=ms, other=0.0),
                     X_BF16, FP64)
            tl.atomic_add(dw_ptr + c * K + j, tl.sum(g * xv, axis=0), mask=cmask)


@triton.jit(do_not_specialize=["L", "tiles_per_seq", "sg_b", "sd_b"])
def _dcc_bwd_dx_kernel(
    g_ptr, w_ptr, dx_ptr, cu_ptr, tiles_ptr,
    L, tiles_per_seq, C,
    sg_b, sg_t, sg_c, sd_b, sd_t, sd_c, sw_c, sw_k,
    K: tl.constexpr, DILATION: tl.constexpr, VARLEN: tl.constexpr,
    X_BF16: tl.constexpr, W_BF16: tl.constexpr, FP64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``dx_t = sum_j w_j g'_{t + lag_j}`` over the taps that stay inside the sequence."""
    XT = dx_ptr.dtype.element_ty
    lo, b, n, t0 = _seq_tile(tl.program_id(0), tiles_ptr, cu_ptr, L, tiles_per_seq, VARLEN, BLOCK_T)
    p = t0 + tl.arange(0, BLOCK_T)
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    pmask = p < n
    cmask = c < C
    gb = b * sg_b + lo * sg_t
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if FP64:
        acc = acc.to(tl.float64)
    for j in tl.static_range(K):
        lag = (K - 1 - j) * DILATION
        dst = p + lag
        m = (pmask & (dst < n))[:, None] & cmask[None, :]
        gv = _up(tl.load(g_ptr + gb + dst[:, None] * sg_t + c[None, :] * sg_c, mask=m, other=0.0),
                 X_BF16, FP64)
        wj = _up(tl.load(w_ptr + c * sw_c + j * sw_k, mask=cmask, other=0.0), W_BF16, FP64)
        acc = acc + wj[None, :] * gv
    tl.store(dx_ptr + b * sd_b + lo * sd_t + p[:, None] * sd_t + c[None, :] * sd_c, _down(acc, XT, X_BF16),
             mask=pmask[:, None] & cmask[None, :])


def _layout(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, time, channel) strides of a ``[B, L, C]`` or ``[T, C]`` tensor."""
    if t.dim() == 3:
        return t.stride(0), t.stride(1), t.stride(2)
    return 0, t.stride(0), t.stride(1)


def _grid_args(x: torch.Tensor, tiles: torch.Tensor | None):
    """Grid, sequence length L and tiles per sequence for the training kernels."""
    C = x.shape[-1]
    block_c = _block_c(C)
    if tiles is not None:                                       # packed with cu_seqlens
        return (tiles.shape[0], triton.cdiv(C, block_c)), 0, 0, block_c
    B, L = (x.shape[0], x.shape[1]) if x.dim() == 3 else (1, x.shape[0])
    per_seq = triton.cdiv(L, PREFILL_BLOCK_T)
    return (B * per_seq, triton.cdiv(C, block_c)), L, per_seq, block_c


def _fwd(x, weight, dilation, cu_seqlens, tiles):
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid, L, per_seq, block_c = _grid_args(x, tiles)
    if grid[0] == 0 or grid[1] == 0:
        return y
    varlen = tiles is not None
    _dcc_fwd_kernel[grid](
        x, weight, y, cu_seqlens if varlen else x, tiles if varlen else x,
        L, per_seq, x.shape[-1], *_layout(x, varlen), *_layout(y, varlen), weight.stride(0), weight.stride(1),
        K=weight.shape[1], DILATION=dilation, VARLEN=varlen, X_BF16=x.dtype == torch.bfloat16,
        W_BF16=weight.dtype == torch.bfloat16, FP64=x.dtype == torch.float64,
        BLOCK_T=PREFILL_BLOCK_T, BLOCK_C=block_c)
    return y


def _bwd(dy, x, weight, dilation, cu_seqlens, tiles, need_dx, need_dw):
    acc = torch.promote_types(x.dtype, torch.float32)
    C, K = weight.shape
    dw_acc = torch.zeros((C, K), dtype=acc, device=x.device)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx else None
    grid, L, per_seq, block_c = _grid_args(x, tiles)
    if grid[0] > 0 and grid[1] > 0:
        varlen = tiles is not None
        cu = cu_seqlens if varlen else x
        tt = tiles if varlen else x
        g = torch.empty(x.shape, dtype=x.dtype, device=x.device)      # g' = dy * silu'(preact)
        flags = dict(K=K, DILATION=dilation, VARLEN=varlen, X_BF16=x.dtype == torch.bfloat16,
                     W_BF16=weight.dtype == torch.bfloat16, FP64=x.dtype == torch.float64,
                     BLOCK_T=PREFILL_BLOCK_T, BLOCK_C=block_c)
        _dcc_bwd_gw_kernel[grid](
            x, weight, dy, g, dw_acc, cu, tt, L, per_seq, C,
            *_layout(x, varlen), *_layout(dy, varlen), *_layout(g, varlen),
            weight.stride(0), weight.stride(1), NEED_DW=need_dw, **flags)
        if need_dx:
            _dcc_bwd_dx_kernel[grid](
                g, weight, dx, cu, tt, L, per_seq, C,
                *_layout(g, varlen), *_layout(dx, varlen), weight.stride(0), weight.stride(1), **flags)
    elif need_dx:
        dx.zero_()
    dw = dw_acc.to(weight.dtype) if need_dw else None
    return dx, dw
