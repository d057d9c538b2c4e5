"""Triton kernels for the serving step of the dilated causal convolution (docs/spec.md sections 5, 6 and 8).

Same names, signatures and numbers as ``ple.reference.conv``; the arguments are
validated by the same checks (``ple._checks``) before any tensor is touched.

Serving step (``ple_conv``). Decode and spec: one launch of the fused kernel of
``conv_decode`` (``_step_fused_kernel``, grid ``(requests, channel blocks)``): each program
loads its slot's old window and its request's rows once, writes the outputs, then (after a
barrier) the shifted window; see that module. Prefill: two launches.

1. ``_step_out_kernel``, grid ``(time tiles, channel blocks)``. A time tile is
   ``PREFILL_BLOCK_T`` consecutive rows of one request, so a long request is spread over many
   programs. The grid is ``num_rows // PREFILL_BLOCK_T + R`` programs, an upper bound from
   shapes alone; each program finds its (request, first position) by a binary search over
   ``query_start_loc`` on the device (``_numerics.tile_of``), and a program past its
   request's rows (at most one per request) returns at once. No table, no host values. Each
   program keeps a rolling window of ``[BLOCK_C]`` vectors (compile-time tuple indices, so
   registers): first the S positions before its tile, each read once, from ``inputs`` (logical
   row -> physical row through ``token_indices``) or, before the step, from the slot's *old*
   state columns ``[0, S)`` (or zeros); with a same-dtype state that is one load whose address
   (and mask) is picked per position. Then, row by row (unrolled), it loads the row's input
   once, forms the K dilated taps from the window, and writes ``residual`` (plus
   ``outer_residual``). So an input row is read once per tile plus S halo rows per tile,
   not K times; only the S halo positions can touch the state. It never writes a state.
2. ``_step_state_kernel``, grid ``(requests, channel blocks)``, launched after (1) on the
   same stream, so no output can read a state this step has already updated. It writes the
   slot's new columns ``[0, S)``: new column i is ``hist[i + n]``, i.e. old state column
   ``n + i`` or an input row. Because the source column is always *after* the destination
   (``n >= 1``; an empty request writes nothing) and the columns are written one at a time in
   increasing order by the same program, a column is read (by the thread that owns that
   channel) before it is overwritten: the in-place shift cannot race. Distinct requests have
   distinct slots (checked), so programs of different requests never share a slot.

``export_conv_checkpoints`` is one copy kernel (inputs -> state columns ``[0, S)``);
it reads no state.

Vector accesses (as in ``conv_decode``): every kernel here takes ``FUSED_BLOCK_C`` channels
over ``FUSED_WARPS`` warps, so a thread owns 8 consecutive channels, and row and slot
indices are scalar loads, so a channel vector of ``inputs``, ``residual``, ``outer_residual``
or a channels-last state (unit channel stride) is one 16-byte access per thread (two for
float32); the weights are read as packed words (``conv_decode.weight_args``). With a
channels-first state (``[slots, C, W]`` contiguous in W) a state column is a strided
gather, one element per channel: a channel's W contiguous elements (W = 9 at the model's
K = 4, dilation 3; S + q - 1 for spec) are neither a power of two nor 16-byte aligned, so
they cannot be read as 128-bit words per channel, and regrouping a thread's 8 x W
contiguous elements into per-column vectors would need a shuffle through shared memory.
The state traffic of a channels-first step therefore stays in 2-byte (4-byte for float32)
accesses; its input and residual rows are still 128-bit. Channels-last is the default
layout.

Numerics (``_numerics``): accumulation in float32 (float64 for float64 inputs), rounded
to the input dtype where the reference rounds; bfloat16 conversions on the bits (NaN ->
0x7FC0 like PyTorch on the CPU). Known gaps: a float64 -> bfloat16 conversion (float64
inputs with a bfloat16 state) rounds twice (through float32), and NaN payloads converted
between dtypes are canonicalised; same-dtype state copies are plain copies, bit for bit.

Recompilation: K, the dilation, the block sizes, the dtypes and the flags are
compile-time constants (model constants); row counts, strides and the null slot are
runtime arguments, so a new batch shape never recompiles (beyond Triton's usual
"== 1 / multiple of 16" integer specialisation). Rows come from ``query_start_loc``
and the tile search; the fused kernel is specialised on ``spec_query_len``.

Interpreter note: per-request predicates (live slot, reads-history, ...) are built
as vectors (``zeros + scalar``) rather than broadcast from scalar comparisons,
which the Triton interpreter mis-types when they are combined into load masks.
``tests/fast/test_compile.py`` compiles every kernel ahead of time for sm_90, so
code the interpreter accepts but the compiler rejects is caught without a GPU.

Registered as ``torch.ops.ple.ple_conv`` and ``torch.ops.ple.export_conv_checkpoints``
(both mutate their outputs in place): the public functions check the metadata
(``ple._checks.ple_conv_meta`` / ``export_meta``), the ops the index values at run time
unless ``validate=False``. Either way the launches take their grids from shapes only and
read index values only on the device, so with ``validate=False`` a call makes no
device-to-host synchronisation (the caller vouches for the values).
The training conv is ``training_conv``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .. import _checks
from ..reference import conv as _reference
from ._library import register, twin
from ._numerics import convert, down, is_fp64, pow2_block, rnd, search_steps, silu, tile_grid, tile_of, up
from .conv_decode import (
    DECODE,
    FUSED_BLOCK_C,
    FUSED_WARPS,
    PREFILL,
    SPEC,
    launch_fused_step,
    load_taps,
    row_of,
    weight_args,
)

__all__ = ["ple_conv", "export_conv_checkpoints"]

_MODES = {"prefill": PREFILL.value, "decode": DECODE.value, "spec": SPEC.value}

PREFILL_BLOCK_T = 64     # rows per prefill time tile (the out kernel's unrolled row loop)
EXPORT_UNROLL = tl.constexpr(8)   # state columns per step of the export kernel's loop


@triton.jit
def _prefill_request(r, query_start_loc_ptr, stride_query_start_loc_r, init_ptr, stride_init_r,
                     HAS_INIT_FLAGS: tl.constexpr):
    """First logical row, row count and has-initial-state flag (nonzero int) of prefill request ``r``."""
    lo = tl.load(query_start_loc_ptr + r * stride_query_start_loc_r).to(tl.int64)
    n = tl.load(query_start_loc_ptr + (r + 1) * stride_query_start_loc_r).to(tl.int64) - lo
    if HAS_INIT_FLAGS:
        flag = tl.load(init_ptr + r * stride_init_r).to(tl.int64)
    else:
        flag = r * 0
    return lo, n, flag


@triton.jit
def _step_out_kernel(
    x_ptr, res_ptr, outer_ptr, state_ptr, w_ptr,
    slot_ptr, query_start_loc_ptr, init_ptr, rows_ptr,
    C, null_slot, R, steps,
    stride_x_t, stride_x_c, stride_res_t, stride_res_c, stride_outer_t, stride_outer_c,
    stride_state_n, stride_state_c, stride_state_w, stride_w_c, stride_w_k,
    stride_slot_r, stride_query_start_loc_r, stride_init_r, stride_rows_t,
    K: tl.constexpr, DILATION: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
    HAS_TOKEN_INDICES: tl.constexpr, HAS_OUTER_RESIDUAL: tl.constexpr,
    IS_X_BF16: tl.constexpr, IS_STATE_BF16: tl.constexpr, IS_W_BF16: tl.constexpr,
    IS_STATE_SAME_DTYPE: tl.constexpr, IS_FP64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Prefill outputs of one time tile: ``residual[rows] += silu(conv(hist))`` (+ ``outer_residual``).

    A rolling window of ``[BLOCK_C]`` vectors: the S positions before the tile first (from
    ``inputs``, or the old state columns for positions before the step), then one input row
    per position, each loaded once and used by the K taps of the rows after it.
    """
    S: tl.constexpr = (K - 1) * DILATION                        # history length (compile-time)
    XT = x_ptr.dtype.element_ty
    pid_c = tl.program_id(1)
    r, t0 = tile_of(tl.program_id(0), query_start_loc_ptr, stride_query_start_loc_r, R, steps, BLOCK_T)
    lo, n, flag = _prefill_request(r, query_start_loc_ptr, stride_query_start_loc_r, init_ptr, stride_init_r,
                                   HAS_INIT_FLAGS)
    if t0 >= n:                                                 # a gap id (or an empty request): no rows
        return
    slot = tl.load(slot_ptr + r * stride_slot_r).to(tl.int64)
    c = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)  # channels                 [BC]
    zc = tl.zeros([BLOCK_C], dtype=tl.int64)                    # predicates as [BC] vectors
    cmask = c < C
    live = cmask & ((zc + slot) != null_slot)                  # null slot: never read, no conv term
    init = live & ((zc + flag) != 0)
    state_at = state_ptr + slot * stride_state_n + c * stride_state_c
    taps = load_taps(w_ptr, c, stride_w_c, stride_w_k, live, K, IS_W_BF16, IS_FP64)

    # The window before the tile: hist[k] = position t0 - S + k, in the inputs' dtype.
    hist = ()
    for k in tl.static_range(S):
        src = t0 - S + k
        in_step = (zc + src) >= 0
        row = row_of(rows_ptr, stride_rows_t, lo, n, tl.maximum(src, 0), HAS_TOKEN_INDICES)
        x_at = x_ptr + row * stride_x_t + c * stride_x_c
        s_at = state_at + (S + src) * stride_state_w
        if IS_STATE_SAME_DTYPE:                                 # one load, from either buffer
            hv = tl.load(tl.where(in_step, x_at, s_at), mask=tl.where(in_step, live, init), other=0.0)
            hist = hist + (hv,)  # type: ignore[assignment]  # Triton: a tuple grown per step
        else:
            xv = tl.load(x_at, mask=live & in_step, other=0.0)
            sv = convert(tl.load(s_at, mask=init & ((zc + src) < 0), other=0.0), XT, IS_STATE_BF16, IS_X_BF16)
            hist = hist + (tl.where(in_step, xv, sv),)  # type: ignore[assignment]  # Triton: a tuple grown per step

    for i in tl.static_range(BLOCK_T):
        p = t0 + i
        m_o = cmask & ((zc + p) < n)
        row = row_of(rows_ptr, stride_rows_t, lo, n, p, HAS_TOKEN_INDICES)
        xv = tl.load(x_ptr + row * stride_x_t + c * stride_x_c, mask=m_o & live, other=0.0)
        hist = hist + (xv,)  # type: ignore[assignment]  # Triton: a tuple grown per step
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        if IS_FP64:
            acc = acc.to(tl.float64)
        for j in tl.static_range(K):                            # tap j: hist[S - lag_j], lag_j = (K-1-j) d
            acc = acc + taps[j] * up(hist[j * DILATION], IS_X_BF16, IS_FP64)
        y = rnd(silu(rnd(acc, XT, IS_X_BF16, IS_FP64)), XT, IS_X_BF16, IS_FP64)
        res_at = res_ptr + row * stride_res_t + c * stride_res_c
        res = up(tl.load(res_at, mask=m_o, other=0.0), IS_X_BF16, IS_FP64)
        out = tl.where(live, rnd(res + y, XT, IS_X_BF16, IS_FP64), res)
        if HAS_OUTER_RESIDUAL:                                  # rows of the null slot add it too
            outer = up(tl.load(outer_ptr + row * stride_outer_t + c * stride_outer_c, mask=m_o, other=0.0),
                       IS_X_BF16, IS_FP64)
            out = rnd(out + outer, XT, IS_X_BF16, IS_FP64)
            tl.store(res_at, down(out, XT, IS_X_BF16), mask=m_o)
        else:
            tl.store(res_at, down(out, XT, IS_X_BF16), mask=m_o & live)
        window = ()                                             # drop the oldest position
        for k in tl.static_range(S):
            window = window + (hist[k + 1],)  # type: ignore[assignment]  # Triton: a tuple grown per step
        hist = window


@triton.jit
def _step_state_kernel(
    x_ptr, state_ptr,
    slot_ptr, query_start_loc_ptr, init_ptr, rows_ptr,
    C, null_slot,
    stride_x_t, stride_x_c, stride_state_n, stride_state_c, stride_state_w,
    stride_slot_r, stride_query_start_loc_r, stride_init_r, stride_rows_t,
    K: tl.constexpr, DILATION: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, HAS_TOKEN_INDICES: tl.constexpr,
    IS_X_BF16: tl.constexpr, IS_STATE_BF16: tl.constexpr, IS_STATE_SAME_DTYPE: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """New state columns of one prefill request: ``state[:, i] = hist[i + n]`` for i < S (none if n == 0).

    Columns go in increasing order and each reads a later column (or an input row), so a
    column is read before this program overwrites it; see the module docstring.
    """
    S: tl.constexpr = (K - 1) * DILATION                        # history length (compile-time)
    XT = x_ptr.dtype.element_ty
    ST = state_ptr.dtype.element_ty
    r = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    lo, n, flag = _prefill_request(r, query_start_loc_ptr, stride_query_start_loc_r, init_ptr, stride_init_r,
                                   HAS_INIT_FLAGS)
    slot = tl.load(slot_ptr + r * stride_slot_r).to(tl.int64)
    if (n == 0) | (slot == null_slot):                          # nothing to write
        return
    c = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    zc = tl.zeros([BLOCK_C], dtype=tl.int64)                    # predicates as [BC] vectors
    write = c < C
    init = (zc + flag) != 0
    state_at = state_ptr + slot * stride_state_n + c * stride_state_c
    for i in tl.static_range(S):
        k = n + i                                               # index into hist (length S + n)
        from_state = (zc + k) < S
        sv = tl.load(state_at + k * stride_state_w, mask=write & from_state & init, other=0.0)
        row = row_of(rows_ptr, stride_rows_t, lo, n, tl.maximum(k - S, 0), HAS_TOKEN_INDICES)
        xv = tl.load(x_ptr + row * stride_x_t + c * stride_x_c, mask=write & ((zc + k) >= S), other=0.0)
        if IS_STATE_SAME_DTYPE:
            v = tl.where(from_state, sv, xv)
        else:
            v = tl.where(from_state,
                         convert(convert(sv, XT, IS_STATE_BF16, IS_X_BF16), ST, IS_X_BF16, IS_STATE_BF16),
                         convert(xv, ST, IS_X_BF16, IS_STATE_BF16))
        tl.store(state_at + i * stride_state_w, v, mask=write)


@triton.jit
def _export_kernel(
    x_ptr, state_ptr, query_start_loc_ptr, off_ptr, slots_ptr, rows_ptr,
    C, null_slot, state_len,
    stride_x_t, stride_x_c, stride_state_n, stride_state_c, stride_state_w,
    stride_query_start_loc_r, stride_off_r, stride_slots_r, stride_rows_t,
    HAS_TOKEN_INDICES: tl.constexpr, IS_X_BF16: tl.constexpr, IS_STATE_BF16: tl.constexpr,
    IS_STATE_SAME_DTYPE: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``state[slots[r], :, i] = inputs[row(query_start_loc[r] + offsets[r] - state_len + i)]`` for i < state_len.

    The column loop is unrolled `EXPORT_UNROLL` times (columns past ``state_len`` masked), so
    the vector copies dominate the per-request scalar loads.
    """
    ST = state_ptr.dtype.element_ty
    r = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    off = tl.load(off_ptr + r * stride_off_r).to(tl.int64)
    slot = tl.load(slots_ptr + r * stride_slots_r).to(tl.int64)
    if (off <= 0) | (slot == null_slot):                        # no checkpoint for this request
        return
    first = tl.load(query_start_loc_ptr + r * stride_query_start_loc_r).to(tl.int64) + off - state_len
    c = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    m = c < C
    state_at = state_ptr + slot * stride_state_n + c * stride_state_c
    zc = tl.zeros([BLOCK_C], dtype=tl.int64)                    # predicates as [BC] vectors
    for i0 in range(0, state_len, EXPORT_UNROLL):
        for u in tl.static_range(EXPORT_UNROLL):
            i = i0 + u
            m_i = m & ((zc + i) < state_len)
            if HAS_TOKEN_INDICES:                               # clamped: the index read stays in the call
                prow = tl.load(rows_ptr + (first + tl.minimum(i, state_len - 1)) * stride_rows_t).to(tl.int64)
            else:
                prow = first + i
            v = tl.load(x_ptr + prow * stride_x_t + c * stride_x_c, mask=m_i, other=0.0)
            if not IS_STATE_SAME_DTYPE:
                v = convert(v, ST, IS_X_BF16, IS_STATE_BF16)
            tl.store(state_at + i * stride_state_w, v, mask=m_i)


# ---- launchers -------------------------------------------------------------------------------------


def _conv_dtype_flags(inputs: torch.Tensor, conv_state: torch.Tensor) -> dict:
    """The dtype flags every conv kernel takes (``ple.fast.gate`` has its own, `_gate_dtype_flags`)."""
    return dict(IS_X_BF16=inputs.dtype == torch.bfloat16, IS_STATE_BF16=conv_state.dtype == torch.bfloat16,
                IS_STATE_SAME_DTYPE=conv_state.dtype == inputs.dtype)


def _ple_conv_fwd(inputs, residual, conv_state, conv_weights, state_indices, mode, dilation, query_start_loc,
                  has_initial_states, num_accepted_tokens, spec_query_len, token_indices, outer_residual,
                  null_slot) -> None:
    """Launch the kernels of one ``ple_conv`` call (see the module docstring); grids from shapes only."""
    C = inputs.shape[1]                  # channels (hc_count * hidden_size)
    R = state_indices.numel()
    num_rows = inputs.shape[0] if token_indices is None else token_indices.numel()
    if R == 0 or C == 0 or num_rows == 0:
        return
    MODE = _MODES[mode]
    placeholder = state_indices                                # for absent index tensors: never read
    if MODE == DECODE.value or query_start_loc is None:        # decode: request r is row r, the offsets unread
        query_start_loc = placeholder
    use_flags = has_initial_states is not None and MODE != SPEC.value
    init = has_initial_states if use_flags else placeholder
    if init.dtype == torch.bool:
        init = init.view(torch.uint8)
    rows = token_indices if token_indices is not None else placeholder
    outer = outer_residual if outer_residual is not None else residual
    args = dict(
        x_ptr=inputs, state_ptr=conv_state, slot_ptr=state_indices, query_start_loc_ptr=query_start_loc, init_ptr=init,
        rows_ptr=rows, C=C, null_slot=null_slot,
        stride_x_t=inputs.stride(0), stride_x_c=inputs.stride(1), stride_state_n=conv_state.stride(0),
        stride_state_c=conv_state.stride(1), stride_state_w=conv_state.stride(2),
        stride_slot_r=state_indices.stride(0), stride_query_start_loc_r=query_start_loc.stride(0),
        stride_init_r=init.stride(0), stride_rows_t=rows.stride(0), K=conv_weights.shape[1], DILATION=dilation,
        HAS_INIT_FLAGS=use_flags, HAS_TOKEN_INDICES=token_indices is not None, **_conv_dtype_flags(inputs, conv_state))
    outputs = dict(
        res_ptr=residual, outer_ptr=outer,
        stride_res_t=residual.stride(0), stride_res_c=residual.stride(1),
        stride_outer_t=outer.stride(0), stride_outer_c=outer.stride(1),
        HAS_OUTER_RESIDUAL=outer_residual is not None, IS_FP64=is_fp64(inputs.dtype), **weight_args(conv_weights))
    if MODE != PREFILL.value:
        nat = num_accepted_tokens if MODE == SPEC.value else placeholder
        launch_fused_step(dict(args, **outputs, nat_ptr=nat, stride_nat_r=nat.stride(0)), R, C, MODE,
                          spec_query_len)
        return
    bc = pow2_block(C, FUSED_BLOCK_C)
    _step_out_kernel[(tile_grid(num_rows, R, PREFILL_BLOCK_T), triton.cdiv(C, bc))](
        R=R, steps=search_steps(R), BLOCK_T=PREFILL_BLOCK_T, BLOCK_C=bc, num_warps=FUSED_WARPS, **outputs, **args)
    if (conv_weights.shape[1] - 1) * dilation > 0:
        # Launched after every output is computed: the outputs above read only old states.
        _step_state_kernel[(R, triton.cdiv(C, bc))](BLOCK_C=bc, num_warps=FUSED_WARPS, **args)


def _export_fwd(inputs, conv_state, query_start_loc, offsets, slots, state_len, token_indices, null_slot) -> None:
    """Launch the copy kernel of one ``export_conv_checkpoints`` call; requests without a checkpoint do nothing."""
    C = inputs.shape[1]
    R = offsets.numel()
    if R == 0 or C == 0:
        return
    rows = token_indices if token_indices is not None else offsets      # placeholder: never read
    bc = pow2_block(C, FUSED_BLOCK_C)
    _export_kernel[(R, triton.cdiv(C, bc))](
        x_ptr=inputs, state_ptr=conv_state, query_start_loc_ptr=query_start_loc, off_ptr=offsets, slots_ptr=slots,
        rows_ptr=rows, C=C, null_slot=null_slot, state_len=state_len,
        stride_x_t=inputs.stride(0), stride_x_c=inputs.stride(1), stride_state_n=conv_state.stride(0),
        stride_state_c=conv_state.stride(1), stride_state_w=conv_state.stride(2),
        stride_query_start_loc_r=query_start_loc.stride(0), stride_off_r=offsets.stride(0),
        stride_slots_r=slots.stride(0), stride_rows_t=rows.stride(0), HAS_TOKEN_INDICES=token_indices is not None,
        **_conv_dtype_flags(inputs, conv_state), BLOCK_C=bc, num_warps=FUSED_WARPS)


# ---- registration ----------------------------------------------------------------------------------


# The keyword arguments of ``ple_conv_values``, in the op's order.
_CONV_KEYWORDS = ("mode", "dilation", "query_start_loc", "has_initial_states", "num_accepted_tokens",
                  "spec_query_len", "token_indices", "outer_residual", "null_slot")


# The registered op's schema names the mode ``conv_mode``, not ``mode``: a mutating custom op is traced as
# ``auto_functionalized(op, **kwargs)``, whose redirect takes a ``mode`` argument of its own, so an op
# argument named ``mode`` breaks ``torch.compile`` (tests/test_compile.py). The public op keeps ``mode``.
def _ple_conv_impl(inputs: torch.Tensor, residual: torch.Tensor, conv_state: torch.Tensor,
                   conv_weights: torch.Tensor, state_indices: torch.Tensor, conv_mode: str, dilation: int,
                   query_start_loc: torch.Tensor | None, has_initial_states: torch.Tensor | None,
                   num_accepted_tokens: torch.Tensor | None, spec_query_len: int,
                   token_indices: torch.Tensor | None, outer_residual: torch.Tensor | None,
                   null_slot: int, validate: bool) -> None:
    args: tuple[Any, ...] = (inputs, residual, conv_state, conv_weights, state_indices, conv_mode, dilation,
                             query_start_loc, has_initial_states, num_accepted_tokens, spec_query_len,
                             token_indices, outer_residual, null_slot)
    if validate:
        _checks.ple_conv_values(*args[:5], **dict(zip(_CONV_KEYWORDS, args[5:], strict=True)))
    _ple_conv_fwd(*args)


def _no_output(*args):
    return None


_ple_conv_op = register("ple_conv", _ple_conv_impl, fake=_no_output, mutates_args=("residual", "conv_state"))


@twin(_reference.ple_conv)
def ple_conv(inputs: torch.Tensor, residual: torch.Tensor, conv_state: torch.Tensor,
             conv_weights: torch.Tensor, state_indices: torch.Tensor, *, mode: str, dilation: int,
             query_start_loc: torch.Tensor | None = None, has_initial_states: torch.Tensor | None = None,
             num_accepted_tokens: torch.Tensor | None = None, spec_query_len: int = 1,
             token_indices: torch.Tensor | None = None, outer_residual: torch.Tensor | None = None,
             null_slot: int = 0, validate: bool = True) -> None:
    """Decode and spec: one launch of the fused kernel (``conv_decode``, a program per request and channel block)
    that loads the slot's old window and the rows once, writes the outputs, then, after a barrier, the shifted
    window. Prefill: two launches, the outputs (time tiles found by a search over ``query_start_loc`` on the
    device), then the states, so no output reads a state the step has written. A ``channels_last`` state moves in
    128-bit accesses, a ``channels_first`` one an element at a time (slower; the same bits). Known gaps: float64
    inputs with a bfloat16 state round twice (through float32), and NaN payloads converted between dtypes are
    canonicalised. No autograd formula. Registered as ``torch.ops.ple.ple_conv`` (mutating ``residual`` and
    ``conv_state``; its schema calls the mode ``conv_mode``): the index values are checked inside the op unless
    ``validate=False``; the launches take their grids from shapes and read index values only on the device, so then
    the call makes no device-to-host synchronisation. CPU tensors are refused (``ValueError``) while the kernels are
    compiled; under ``TRITON_INTERPRET=1`` they run on the CPU."""
    _checks.ple_conv_meta(
        inputs, residual, conv_state, conv_weights, state_indices, mode=mode, dilation=dilation,
        query_start_loc=query_start_loc, has_initial_states=has_initial_states,
        num_accepted_tokens=num_accepted_tokens, spec_query_len=spec_query_len, token_indices=token_indices,
        outer_residual=outer_residual, null_slot=null_slot)
    _ple_conv_op(inputs, residual, conv_state, conv_weights, state_indices, mode, dilation, query_start_loc,
                 has_initial_states, num_accepted_tokens, spec_query_len, token_indices, outer_residual, null_slot,
                 _checks.validating(validate))


def _export_impl(inputs: torch.Tensor, conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                 offsets: torch.Tensor, slots: torch.Tensor, state_len: int, token_indices: torch.Tensor | None,
                 null_slot: int, validate: bool) -> None:
    if validate:
        _checks.export_values(inputs, conv_state, query_start_loc=query_start_loc, offsets=offsets, slots=slots,
                              state_len=state_len, token_indices=token_indices, null_slot=null_slot)
    _export_fwd(inputs, conv_state, query_start_loc, offsets, slots, state_len, token_indices, null_slot)


_export_op = register("export_conv_checkpoints", _export_impl, fake=_no_output, mutates_args=("conv_state",))


@twin(_reference.export_conv_checkpoints)
def export_conv_checkpoints(inputs: torch.Tensor, conv_state: torch.Tensor, *,
                            query_start_loc: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor,
                            state_len: int, token_indices: torch.Tensor | None = None,
                            null_slot: int = 0, validate: bool = True) -> None:
    """One copy kernel (a program per request and channel block): each checkpoint's S input rows go to the slot's
    columns ``[0, S)``, converted to the state's dtype; it reads no state. Registered as
    ``torch.ops.ple.export_conv_checkpoints`` (mutating ``conv_state``): the values are checked inside the op unless
    ``validate=False``; the grid comes from shapes, so then nothing is read back. CPU tensors are refused
    (``ValueError``) while the kernels are compiled; under ``TRITON_INTERPRET=1`` they run on the CPU."""
    _checks.export_meta(inputs, conv_state, query_start_loc=query_start_loc, offsets=offsets, slots=slots,
                        state_len=state_len, token_indices=token_indices, null_slot=null_slot)
    _export_op(inputs, conv_state, query_start_loc, offsets, slots, state_len, token_indices, null_slot,
               _checks.validating(validate))
