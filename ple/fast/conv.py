"""Triton kernels for the serving step of the dilated causal convolution (SPEC sections 5, 6 and 8).

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

Numerics (``_numerics``): accumulation in float32 (float64 for float64 inputs), rounded
to the input dtype where the reference rounds; bfloat16 conversions on the bits (NaN ->
0x7FC0 like PyTorch on the CPU). Known gaps: a float64 -> bfloat16 conversion (float64
inputs with a bfloat16 state) rounds twice (through float32), and NaN payloads converted
between dtypes are canonicalised; same-dtype state copies are plain copies, bit for bit.

Recompilation: K, the dilation, the block sizes, the dtypes and the flags are
compile-time constants (model constants); row counts, strides and the null slot are
runtime arguments, so a new batch shape never recompiles (beyond Triton's usual
"== 1 / multiple of 16" integer specialisation). The kernels take no T at all: rows
come from ``query_start_loc`` and the tile table.

Interpreter note: per-request predicates (live slot, reads-history, ...) are built
as vectors (``zeros + scalar``) rather than broadcast from scalar comparisons,
which the Triton interpreter mis-types when they are combined into load masks.
``tests/fast/test_compile.py`` compiles every kernel ahead of time for sm_90, so
code the interpreter accepts but the compiler rejects is caught without a GPU.

Registered as ``torch.ops.ple.ple_conv`` and ``torch.ops.ple.export_conv_checkpoints``
(both mutate their outputs in place): the public functions check the metadata
(``ple._checks.ple_conv_meta`` / ``export_meta``), the ops the index values at run time.
The training conv is ``training_conv``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _checks
from ..reference import conv as _reference
from ._library import register, twin
from ._numerics import TIME_BLOCK, block_c, convert, down, is_fp64, rnd, silu, tile_table, up

__all__ = ["ple_conv", "export_conv_checkpoints"]

PREFILL = tl.constexpr(0)
DECODE = tl.constexpr(1)
SPEC = tl.constexpr(2)
_MODES = {"prefill": PREFILL.value, "decode": DECODE.value, "spec": SPEC.value}


@triton.jit
def _request(r, qsl_ptr, stride_qsl_r, MODE: tl.constexpr):
    """First logical row and row count of request ``r`` (int64)."""
    if MODE == DECODE:
        lo = r
        n = r * 0 + 1
    else:
        lo = tl.load(qsl_ptr + r * stride_qsl_r).to(tl.int64)
        n = tl.load(qsl_ptr + (r + 1) * stride_qsl_r).to(tl.int64) - lo
    return lo, n


@triton.jit
def _history_source(r, init_ptr, stride_init_r, nat_ptr, stride_nat_r,
                    MODE: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, IS_INIT_DEFAULT: tl.constexpr):
    """(reads the state? as a nonzero int, first state column of the history) for request ``r``."""
    if MODE == SPEC:
        off = tl.load(nat_ptr + r * stride_nat_r).to(tl.int64) - 1
        flag = r * 0 + 1                                        # spec always reads its history
    else:
        off = r * 0
        if HAS_INIT_FLAGS:
            flag = tl.load(init_ptr + r * stride_init_r).to(tl.int64)
        else:
            flag = r * 0 + IS_INIT_DEFAULT
    return flag, off


@triton.jit
def _step_out_kernel(
    x_ptr, res_ptr, outer_ptr, state_ptr, w_ptr,
    slot_ptr, qsl_ptr, init_ptr, nat_ptr, rows_ptr, tiles_ptr,
    C, null_slot,
    stride_x_t, stride_x_c, stride_res_t, stride_res_c, stride_outer_t, stride_outer_c,
    stride_state_n, stride_state_c, stride_state_w, stride_w_c, stride_w_k,
    stride_slot_r, stride_qsl_r, stride_init_r, stride_nat_r, stride_rows_t,
    K: tl.constexpr, DILATION: tl.constexpr, MODE: tl.constexpr,
    HAS_INIT_FLAGS: tl.constexpr, IS_INIT_DEFAULT: tl.constexpr,
    HAS_TOKEN_INDICES: tl.constexpr, HAS_OUTER_RESIDUAL: tl.constexpr,
    IS_X_BF16: tl.constexpr, IS_STATE_BF16: tl.constexpr, IS_W_BF16: tl.constexpr,
    IS_STATE_SAME_DTYPE: tl.constexpr, IS_FP64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Outputs of one time tile: ``residual[rows] += silu(conv(hist))`` (+ ``outer_residual``)."""
    S = (K - 1) * DILATION                                      # history length (compile-time)
    XT = x_ptr.dtype.element_ty
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    if MODE == PREFILL:
        r = tl.load(tiles_ptr + 2 * pid_t).to(tl.int64)
        t0 = tl.load(tiles_ptr + 2 * pid_t + 1).to(tl.int64)
    else:
        r = pid_t.to(tl.int64)
        t0 = r * 0
    lo, n = _request(r, qsl_ptr, stride_qsl_r, MODE)
    slot = tl.load(slot_ptr + r * stride_slot_r).to(tl.int64)
    flag, off = _history_source(r, init_ptr, stride_init_r, nat_ptr, stride_nat_r, MODE, HAS_INIT_FLAGS,
                                IS_INIT_DEFAULT)

    p = t0 + tl.arange(0, BLOCK_T)                            # positions in the request   [BT]
    c = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)  # channels                 [BC]
    pmask = p < n
    cmask = c < C
    # Per-request predicates as [BT] vectors (the interpreter mishandles broadcast scalar masks).
    zt = p * 0
    live = (zt + slot) != null_slot                            # null slot: never read, no conv term
    init = live & ((zt + flag) != 0)
    state_row = state_ptr + slot * stride_state_n

    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if IS_FP64:
        acc = acc.to(tl.float64)
    for j in tl.static_range(K):
        lag = (K - 1 - j) * DILATION              # tap j reads the input `lag` steps back
        src = p - lag
        in_step = src >= 0
        m_x = pmask & in_step & live
        if HAS_TOKEN_INDICES:
            prow = tl.load(rows_ptr + (lo + src) * stride_rows_t, mask=m_x, other=0).to(tl.int64)
        else:
            prow = lo + src
        xv = tl.load(x_ptr + prow[:, None] * stride_x_t + c[None, :] * stride_x_c,
                     mask=m_x[:, None] & cmask[None, :], other=0.0)
        m_s = pmask & (src < 0) & init
        col = off + S + src                                     # old state column of hist[S + src]
        sv = tl.load(state_row + col[:, None] * stride_state_w + c[None, :] * stride_state_c,
                     mask=m_s[:, None] & cmask[None, :], other=0.0)
        if not IS_STATE_SAME_DTYPE:
            sv = convert(sv, XT, IS_STATE_BF16, IS_X_BF16)
        h = tl.where(in_step[:, None], up(xv, IS_X_BF16, IS_FP64), up(sv, IS_X_BF16, IS_FP64))
        wj = up(tl.load(w_ptr + c * stride_w_c + j * stride_w_k, mask=cmask, other=0.0), IS_W_BF16, IS_FP64)
        acc = acc + wj[None, :] * h
    a = rnd(acc, XT, IS_X_BF16, IS_FP64)                        # conv sum rounded to the input dtype
    y = rnd(silu(a), XT, IS_X_BF16, IS_FP64)

    if HAS_TOKEN_INDICES:
        orow = tl.load(rows_ptr + (lo + p) * stride_rows_t, mask=pmask, other=0).to(tl.int64)
    else:
        orow = lo + p
    m_o = pmask[:, None] & cmask[None, :]
    res_at = res_ptr + orow[:, None] * stride_res_t + c[None, :] * stride_res_c
    res = up(tl.load(res_at, mask=m_o, other=0.0), IS_X_BF16, IS_FP64)
    out = tl.where(live[:, None], rnd(res + y, XT, IS_X_BF16, IS_FP64), res)
    if HAS_OUTER_RESIDUAL:
        outer = up(tl.load(outer_ptr + orow[:, None] * stride_outer_t + c[None, :] * stride_outer_c, mask=m_o,
                           other=0.0), IS_X_BF16, IS_FP64)
        out = rnd(out + outer, XT, IS_X_BF16, IS_FP64)
        tl.store(res_at, down(out, XT, IS_X_BF16), mask=m_o)
    else:
        tl.store(res_at, down(out, XT, IS_X_BF16), mask=m_o & live[:, None])


@triton.jit
def _step_state_kernel(
    x_ptr, state_ptr,
    slot_ptr, qsl_ptr, init_ptr, nat_ptr, rows_ptr,
    C, null_slot,
    stride_x_t, stride_x_c, stride_state_n, stride_state_c, stride_state_w,
    stride_slot_r, stride_qsl_r, stride_init_r, stride_nat_r, stride_rows_t,
    K: tl.constexpr, DILATION: tl.constexpr, MODE: tl.constexpr, W_OUT: tl.constexpr,
    HAS_INIT_FLAGS: tl.constexpr, IS_INIT_DEFAULT: tl.constexpr, HAS_TOKEN_INDICES: tl.constexpr,
    IS_X_BF16: tl.constexpr, IS_STATE_BF16: tl.constexpr, IS_STATE_SAME_DTYPE: tl.constexpr,
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
    lo, n = _request(r, qsl_ptr, stride_qsl_r, MODE)
    slot = tl.load(slot_ptr + r * stride_slot_r).to(tl.int64)
    flag, off = _history_source(r, init_ptr, stride_init_r, nat_ptr, stride_nat_r, MODE, HAS_INIT_FLAGS,
                                IS_INIT_DEFAULT)
    if MODE == SPEC:
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
    state_row = state_ptr + slot * stride_state_n
    for i in tl.static_range(W_OUT):
        k = base + i                                            # index into hist (length S + n)
        write = active & ((zc + i) < n_write)
        from_state = (zc + k) < S
        sv = tl.load(state_row + (off + k) * stride_state_w + c * stride_state_c, mask=write & from_state & init,
                     other=0.0)
        m_x = write & ((zc + k) >= S)
        if HAS_TOKEN_INDICES:
            prow = tl.load(rows_ptr + (zc + lo + k - S) * stride_rows_t, mask=m_x, other=0).to(tl.int64)
        else:
            prow = lo + k - S
        xv = tl.load(x_ptr + prow * stride_x_t + c * stride_x_c, mask=m_x, other=0.0)
        if IS_STATE_SAME_DTYPE:
            v = tl.where(from_state, sv, xv)
        else:
            v = tl.where(from_state,
                         convert(convert(sv, XT, IS_STATE_BF16, IS_X_BF16), ST, IS_X_BF16, IS_STATE_BF16),
                         convert(xv, ST, IS_X_BF16, IS_STATE_BF16))
        tl.store(state_row + i * stride_state_w + c * stride_state_c, v, mask=write)


@triton.jit
def _export_kernel(
    x_ptr, state_ptr, qsl_ptr, off_ptr, slots_ptr, rows_ptr,
    C, null_slot, state_len,
    stride_x_t, stride_x_c, stride_state_n, stride_state_c, stride_state_w,
    stride_qsl_r, stride_off_r, stride_slots_r, stride_rows_t,
    HAS_TOKEN_INDICES: tl.constexpr, IS_X_BF16: tl.constexpr, IS_STATE_BF16: tl.constexpr,
    IS_STATE_SAME_DTYPE: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``state[slots[r], :, i] = inputs[row(qsl[r] + offsets[r] - state_len + i)]`` for i < state_len."""
    ST = state_ptr.dtype.element_ty
    r = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    off = tl.load(off_ptr + r * stride_off_r).to(tl.int64)
    slot = tl.load(slots_ptr + r * stride_slots_r).to(tl.int64)
    first = tl.load(qsl_ptr + r * stride_qsl_r).to(tl.int64) + off - state_len
    c = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    zc = c * 0                                                  # predicates as [BC] vectors
    m = (c < C) & ((zc + off) > 0) & ((zc + slot) != null_slot)
    for i in range(0, state_len):
        if HAS_TOKEN_INDICES:
            prow = tl.load(rows_ptr + (zc + first + i) * stride_rows_t, mask=m, other=0).to(tl.int64)
        else:
            prow = first + i
        v = tl.load(x_ptr + prow * stride_x_t + c * stride_x_c, mask=m, other=0.0)
        if not IS_STATE_SAME_DTYPE:
            v = convert(v, ST, IS_X_BF16, IS_STATE_BF16)
        tl.store(state_ptr + slot * stride_state_n + i * stride_state_w + c * stride_state_c, v, mask=m)


# ---- launchers -------------------------------------------------------------------------------------


def _dtype_flags(inputs: torch.Tensor, state: torch.Tensor) -> dict:
    return dict(IS_X_BF16=inputs.dtype == torch.bfloat16, IS_STATE_BF16=state.dtype == torch.bfloat16,
                IS_STATE_SAME_DTYPE=state.dtype == inputs.dtype)


def _ple_conv_fwd(call: _checks.ConvCall, inputs, residual, conv_state, conv_weights, state_indices, mode,
                  dilation, query_start_loc, has_initial_states, num_accepted_tokens, spec_query_len,
                  token_indices, outer_residual, null_slot) -> None:
    """Launch the two kernels of one validated ``ple_conv`` call (see the module docstring)."""
    C = inputs.shape[1]                  # channels (hc_count * hidden_size)
    R = len(call.slots)
    K = conv_weights.shape[1]
    if R == 0 or C == 0 or call.num_rows == 0:
        return
    MODE = _MODES[mode]
    dev = inputs.device
    if MODE == PREFILL.value:
        block_t = TIME_BLOCK
        tiles = tile_table(call.starts, block_t, dev)
        num_tiles = tiles.shape[0]
    else:
        block_t = 1 if MODE == DECODE.value else triton.next_power_of_2(spec_query_len)
        tiles = state_indices                                  # never read
        num_tiles = R
    if num_tiles == 0:
        return
    placeholder = state_indices                                # for absent index tensors: never read
    qsl = query_start_loc if (MODE != DECODE.value and query_start_loc is not None) else placeholder
    use_flags = has_initial_states is not None and MODE != SPEC.value
    init = has_initial_states if use_flags else placeholder
    if init.dtype == torch.bool:
        init = init.view(torch.uint8)
    nat = num_accepted_tokens if MODE == SPEC.value else placeholder
    rows = token_indices if token_indices is not None else placeholder
    bc = block_c(C)
    shared = dict(
        x_ptr=inputs, state_ptr=conv_state, slot_ptr=state_indices, qsl_ptr=qsl, init_ptr=init, nat_ptr=nat,
        rows_ptr=rows, C=C, null_slot=null_slot,
        stride_x_t=inputs.stride(0), stride_x_c=inputs.stride(1), stride_state_n=conv_state.stride(0),
        stride_state_c=conv_state.stride(1), stride_state_w=conv_state.stride(2),
        stride_slot_r=state_indices.stride(0), stride_qsl_r=qsl.stride(0), stride_init_r=init.stride(0),
        stride_nat_r=nat.stride(0), stride_rows_t=rows.stride(0),
        K=K, DILATION=dilation, MODE=MODE, HAS_INIT_FLAGS=use_flags, IS_INIT_DEFAULT=int(MODE != PREFILL.value),
        HAS_TOKEN_INDICES=token_indices is not None, **_dtype_flags(inputs, conv_state), BLOCK_C=bc)
    outer = outer_residual if outer_residual is not None else residual
    _step_out_kernel[(num_tiles, triton.cdiv(C, bc))](
        res_ptr=residual, outer_ptr=outer, w_ptr=conv_weights, tiles_ptr=tiles,
        stride_res_t=residual.stride(0), stride_res_c=residual.stride(1),
        stride_outer_t=outer.stride(0), stride_outer_c=outer.stride(1),
        stride_w_c=conv_weights.stride(0), stride_w_k=conv_weights.stride(1),
        HAS_OUTER_RESIDUAL=outer_residual is not None, IS_W_BF16=conv_weights.dtype == torch.bfloat16,
        IS_FP64=is_fp64(inputs.dtype), BLOCK_T=block_t, **shared)
    w_out = call.state_len + (spec_query_len - 1 if MODE == SPEC.value else 0)
    if w_out == 0:
        return
    # Launched after every output is computed: the outputs above read only old states.
    _step_state_kernel[(R, triton.cdiv(C, bc))](W_OUT=w_out, **shared)


def _export_fwd(call: _checks.CheckpointCall, inputs, conv_state, query_start_loc, offsets, slots, state_len,
                token_indices, null_slot) -> None:
    """Launch the copy kernel of one validated ``export_conv_checkpoints`` call."""
    C = inputs.shape[1]
    R = len(call.offsets)
    live = [o > 0 and s != null_slot for o, s in zip(call.offsets, call.slots, strict=True)]
    if R == 0 or C == 0 or not any(live):
        return
    rows = token_indices if token_indices is not None else offsets      # placeholder: never read
    bc = block_c(C)
    _export_kernel[(R, triton.cdiv(C, bc))](
        x_ptr=inputs, state_ptr=conv_state, qsl_ptr=query_start_loc, off_ptr=offsets, slots_ptr=slots,
        rows_ptr=rows, C=C, null_slot=null_slot, state_len=state_len,
        stride_x_t=inputs.stride(0), stride_x_c=inputs.stride(1), stride_state_n=conv_state.stride(0),
        stride_state_c=conv_state.stride(1), stride_state_w=conv_state.stride(2),
        stride_qsl_r=query_start_loc.stride(0), stride_off_r=offsets.stride(0), stride_slots_r=slots.stride(0),
        stride_rows_t=rows.stride(0), HAS_TOKEN_INDICES=token_indices is not None,
        **_dtype_flags(inputs, conv_state), BLOCK_C=bc)


# ---- registration ----------------------------------------------------------------------------------


def _ple_conv_impl(inputs: torch.Tensor, residual: torch.Tensor, conv_state: torch.Tensor,
                   conv_weights: torch.Tensor, state_indices: torch.Tensor, conv_mode: str, dilation: int,
                   query_start_loc: torch.Tensor | None, has_initial_states: torch.Tensor | None,
                   num_accepted_tokens: torch.Tensor | None, spec_query_len: int,
                   token_indices: torch.Tensor | None, outer_residual: torch.Tensor | None,
                   null_slot: int) -> None:
    call = _checks.ple_conv_values(
        inputs, residual, conv_state, conv_weights, state_indices, mode=conv_mode, dilation=dilation,
        query_start_loc=query_start_loc, has_initial_states=has_initial_states,
        num_accepted_tokens=num_accepted_tokens, spec_query_len=spec_query_len, token_indices=token_indices,
        outer_residual=outer_residual, null_slot=null_slot)
    _ple_conv_fwd(call, inputs, residual, conv_state, conv_weights, state_indices, conv_mode, dilation,
                  query_start_loc, has_initial_states, num_accepted_tokens, spec_query_len, token_indices,
                  outer_residual, null_slot)


def _no_output(*args):
    return None


_ple_conv_op = register("ple_conv", _ple_conv_impl, fake=_no_output, mutates_args=("residual", "conv_state"))


@twin(_reference.ple_conv)
def ple_conv(inputs, residual, conv_state, conv_weights, state_indices, *, mode, dilation, query_start_loc=None,
             has_initial_states=None, num_accepted_tokens=None, spec_query_len=1, token_indices=None,
             outer_residual=None, null_slot=0):
    _checks.ple_conv_meta(
        inputs, residual, conv_state, conv_weights, state_indices, mode=mode, dilation=dilation,
        query_start_loc=query_start_loc, has_initial_states=has_initial_states,
        num_accepted_tokens=num_accepted_tokens, spec_query_len=spec_query_len, token_indices=token_indices,
        outer_residual=outer_residual, null_slot=null_slot)
    _ple_conv_op(inputs, residual, conv_state, conv_weights, state_indices, mode, dilation, query_start_loc,
                 has_initial_states, num_accepted_tokens, spec_query_len, token_indices, outer_residual, null_slot)


def _export_impl(inputs: torch.Tensor, conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                 offsets: torch.Tensor, slots: torch.Tensor, state_len: int, token_indices: torch.Tensor | None,
                 null_slot: int) -> None:
    call = _checks.export_values(inputs, conv_state, query_start_loc=query_start_loc, offsets=offsets,
                                 slots=slots, state_len=state_len, token_indices=token_indices,
                                 null_slot=null_slot)
    _export_fwd(call, inputs, conv_state, query_start_loc, offsets, slots, state_len, token_indices, null_slot)


_export_op = register("export_conv_checkpoints", _export_impl, fake=_no_output, mutates_args=("conv_state",))


@twin(_reference.export_conv_checkpoints)
def export_conv_checkpoints(inputs, conv_state, *, query_start_loc, offsets, slots, state_len, token_indices=None,
                            null_slot=0):
    _checks.export_meta(inputs, conv_state, query_start_loc=query_start_loc, offsets=offsets, slots=slots,
                        state_len=state_len, token_indices=token_indices, null_slot=null_slot)
    _export_op(inputs, conv_state, query_start_loc, offsets, slots, state_len, token_indices, null_slot)
