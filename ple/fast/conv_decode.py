"""The fused decode / spec kernel of the serving conv step (docs/spec.md section 6), and what it shares with prefill.

``_step_fused_kernel``, grid ``(requests, channel blocks)``, one launch per decode or spec call.
Each program owns one request and a block of ``BLOCK_C`` channels, i.e. one (slot, channel
block), and in this order:

1. **loads** everything it needs once: the slot's old window ``hist[0:S] = state[:, o : o + S]``
   (``o = num_accepted_tokens[r] - 1`` for spec, 0 for decode; zeros without an initial state),
   the request's ``Q`` input rows ``hist[S : S + n]`` (``Q`` = 1 for decode, ``spec_query_len``
   for spec; rows past the request's ``n`` are masked), their residual (and outer residual)
   rows and the K taps. ``hist`` is a tuple of ``[BLOCK_C]`` vectors indexed by compile-time
   column numbers, so every tap ``hist[S + i - lag_j]`` of every row i is a register;
2. computes and stores the outputs of the request's rows from ``hist`` (the old state);
3. after a CTA barrier (``tl.debug_barrier``), writes the shifted window
   ``state[:, m] = hist[m + 1]`` for ``m < S + n - 1`` (decode: ``n = 1``, so ``m < S``).

Race-free: every load of the slot precedes the barrier and every store follows it, and
distinct requests have distinct slots (checked), so no program reads what another writes.
No serialised load/store chain: all the loads can be in flight together.

Vector accesses: a ``[BLOCK_C]`` vector is contiguous in memory when its channel stride is 1,
which Triton specialises on (``== 1``, divisibility by 16 of the other strides), so inputs,
residuals and a channels-last state (a ``[slots, W, C]`` buffer viewed as ``[slots, C, W]``)
move in 128-bit accesses; rows and slots are scalar loads so the channel vector keeps its
contiguity. The ``[C, K]`` weights (tap stride 1, so a channel vector of one tap would be a
stride-K gather) are read as one packed word per channel where `weight_args` can view them so
(bfloat16, K = 2 or 4: a thread's 8 channels are 32 / 64 contiguous bytes) and split into
taps by `load_taps`. A channels-first state (contiguous in W) is read and written one
element per channel and column: a channel's W elements are not 16-byte aligned (see the
``conv`` module docstring), so there the state moves in 2- or 4-byte accesses.
``FUSED_BLOCK_C`` channels over ``FUSED_WARPS`` warps give each thread 8 consecutive channels
(16 bytes of bfloat16, two 16-byte vectors of float32).

Interpreter note: as in ``conv``, per-request predicates are ``[BLOCK_C]`` vectors (a splat
``tl.zeros`` plus the scalar), which the compiler still sees as constant along the vector.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._numerics import convert, down, pow2_block, rnd, silu, up

__all__ = ["PREFILL", "DECODE", "SPEC", "history_source", "weight_args", "load_taps", "row_of", "launch_fused_step",
           "FUSED_BLOCK_C", "FUSED_WARPS"]

PREFILL = tl.constexpr(0)
DECODE = tl.constexpr(1)
SPEC = tl.constexpr(2)

FUSED_BLOCK_C = 1024     # channels per fused program: 8 per thread over FUSED_WARPS warps
FUSED_WARPS = 4


@triton.jit
def history_source(r, init_ptr, stride_init_r, nat_ptr, stride_nat_r, MODE: tl.constexpr,
                   HAS_INIT_FLAGS: tl.constexpr):
    """(reads the state? as a nonzero int, first state column of the history) for decode / spec request ``r``
    (decode without ``has_initial_states``: every request reads its state)."""
    if MODE == SPEC:
        off = tl.load(nat_ptr + r * stride_nat_r).to(tl.int64) - 1
        flag = r * 0 + 1                                        # spec always reads its history
    else:
        off = r * 0
        if HAS_INIT_FLAGS:
            flag = tl.load(init_ptr + r * stride_init_r).to(tl.int64)
        else:
            flag = r * 0 + 1
    return flag, off


@triton.jit
def row_of(rows_ptr, stride_rows_t, lo, n, i, HAS_TOKEN_INDICES: tl.constexpr):
    """Physical row of the request's row ``i`` (a scalar, so a channel vector stays contiguous).

    ``i`` is clamped to the request's last row, so the index read stays inside ``token_indices``.
    """
    if HAS_TOKEN_INDICES:
        return tl.load(rows_ptr + (lo + tl.minimum(n - 1, i)) * stride_rows_t).to(tl.int64)
    else:
        return lo + i


def weight_args(conv_weights: torch.Tensor) -> dict:
    """The kernels' weight arguments: ``[C, K]`` taps, as one packed word per channel where possible.

    With bfloat16 weights, K = 2 or 4 and each channel's K taps contiguous and word-aligned
    (a ``[C, K]`` tensor with a unit tap stride), the kernels get ``conv_weights`` viewed as
    one int32 / int64 word per channel (a view: no copy, no launch), so 8 consecutive
    channels are 32 / 64 contiguous bytes (128-bit loads), and `load_taps` splits each word
    into its K taps with shifts. Otherwise (other dtypes or K, a ``[K, C]`` buffer
    transposed) the taps are read one element at a time.
    """
    K = conv_weights.shape[1]
    words = {2: torch.int32, 4: torch.int64}.get(K)
    packable = (conv_weights.dtype == torch.bfloat16 and words is not None and conv_weights.stride(1) == 1
                and conv_weights.stride(0) % K == 0 and conv_weights.storage_offset() % K == 0)
    w = conv_weights.detach().view(words) if packable and words is not None else conv_weights
    return dict(w_ptr=w, stride_w_c=w.stride(0), stride_w_k=w.stride(1),
                IS_W_BF16=conv_weights.dtype == torch.bfloat16)


@triton.jit
def load_taps(w_ptr, c, stride_w_c, stride_w_k, mask, K: tl.constexpr, IS_W_BF16: tl.constexpr,
              IS_FP64: tl.constexpr):
    """The K taps of channels ``c``, a tuple of vectors in the accumulation dtype (see `weight_args`).

    An integer ``w_ptr`` holds one word per channel (the packed bfloat16 taps): tap j is bits
    ``[16 j, 16 j + 16)`` (little-endian), put in the high half of a float32 (the exact
    bfloat16 -> float32 conversion). Otherwise ``w_ptr`` is the ``[C, K]`` weights themselves.
    """
    taps = ()
    if w_ptr.dtype.element_ty.is_int():
        word = tl.load(w_ptr + c * stride_w_c, mask=mask, other=0)
        for j in tl.static_range(K):
            bits = ((word >> (16 * j)) & 0xFFFF).to(tl.uint32) << 16
            tap = up(bits.to(tl.float32, bitcast=True), False, IS_FP64)
            taps = taps + (tap,)  # type: ignore[assignment]  # Triton: a tuple grown per step
    else:
        for j in tl.static_range(K):
            tap = up(tl.load(w_ptr + c * stride_w_c + j * stride_w_k, mask=mask, other=0.0), IS_W_BF16, IS_FP64)
            taps = taps + (tap,)  # type: ignore[assignment]  # Triton: a tuple grown per step
    return taps


@triton.jit
def _step_fused_kernel(
    x_ptr, res_ptr, outer_ptr, state_ptr, w_ptr,
    slot_ptr, query_start_loc_ptr, init_ptr, nat_ptr, rows_ptr,
    C, null_slot,
    stride_x_t, stride_x_c, stride_res_t, stride_res_c, stride_outer_t, stride_outer_c,
    stride_state_n, stride_state_c, stride_state_w, stride_w_c, stride_w_k,
    stride_slot_r, stride_query_start_loc_r, stride_init_r, stride_nat_r, stride_rows_t,
    K: tl.constexpr, DILATION: tl.constexpr, MODE: tl.constexpr, Q: tl.constexpr,
    HAS_INIT_FLAGS: tl.constexpr, HAS_TOKEN_INDICES: tl.constexpr, HAS_OUTER_RESIDUAL: tl.constexpr,
    IS_X_BF16: tl.constexpr, IS_STATE_BF16: tl.constexpr, IS_W_BF16: tl.constexpr,
    IS_STATE_SAME_DTYPE: tl.constexpr, IS_FP64: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One decode / spec request on one channel block: outputs from the old window, then the new window."""
    S: tl.constexpr = (K - 1) * DILATION                        # history length (compile-time)
    XT = x_ptr.dtype.element_ty
    ST = state_ptr.dtype.element_ty
    r = tl.program_id(0).to(tl.int64)
    if MODE == DECODE:
        lo = r
        n = r * 0 + 1
    else:
        lo = tl.load(query_start_loc_ptr + r * stride_query_start_loc_r).to(tl.int64)
        n = tl.load(query_start_loc_ptr + (r + 1) * stride_query_start_loc_r).to(tl.int64) - lo
    slot = tl.load(slot_ptr + r * stride_slot_r).to(tl.int64)
    flag, off = history_source(r, init_ptr, stride_init_r, nat_ptr, stride_nat_r, MODE, HAS_INIT_FLAGS)
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    zc = tl.zeros([BLOCK_C], dtype=tl.int64)                    # predicates as [BC] vectors
    live = ((zc + slot) != null_slot) & (c < C)                 # null slot: never read or written
    state_at = state_ptr + slot * stride_state_n + c * stride_state_c

    # 1. Loads. hist[k] (k < S): old state column off + k, in the inputs' dtype (zeros without history).
    init = live & ((zc + flag) != 0)
    hist = ()
    for k in tl.static_range(S):
        sv = tl.load(state_at + (off + k) * stride_state_w, mask=init, other=0.0)
        if not IS_STATE_SAME_DTYPE:
            sv = convert(sv, XT, IS_STATE_BF16, IS_X_BF16)
        hist = hist + (sv,)  # type: ignore[assignment]  # Triton: a tuple grown per step
    res = ()
    outer = ()
    for i in tl.static_range(Q):                                # hist[S + i]: the request's row i
        row = row_of(rows_ptr, stride_rows_t, lo, n, i, HAS_TOKEN_INDICES)
        m_i = (c < C) & ((zc + i) < n)
        xv = tl.load(x_ptr + row * stride_x_t + c * stride_x_c, mask=m_i & live, other=0.0)
        hist = hist + (xv,)  # type: ignore[assignment]  # Triton: a tuple grown per step
        rv = tl.load(res_ptr + row * stride_res_t + c * stride_res_c, mask=m_i, other=0.0)
        res = res + (rv,)  # type: ignore[assignment]  # Triton: a tuple grown per step
        if HAS_OUTER_RESIDUAL:
            ov = tl.load(outer_ptr + row * stride_outer_t + c * stride_outer_c, mask=m_i, other=0.0)
            outer = outer + (ov,)  # type: ignore[assignment]  # Triton: a tuple grown per step

    taps = load_taps(w_ptr, c, stride_w_c, stride_w_k, live, K, IS_W_BF16, IS_FP64)

    # 2. Outputs of rows i < n, from the old window: residual += silu(conv) (+ outer_residual).
    for i in tl.static_range(Q):
        m_i = (c < C) & ((zc + i) < n)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        if IS_FP64:
            acc = acc.to(tl.float64)
        for j in tl.static_range(K):                            # tap j of row i: hist[S + i - lag_j]
            acc = acc + taps[j] * up(hist[S + i - (K - 1 - j) * DILATION], IS_X_BF16, IS_FP64)
        y = rnd(silu(rnd(acc, XT, IS_X_BF16, IS_FP64)), XT, IS_X_BF16, IS_FP64)
        r_i = up(res[i], IS_X_BF16, IS_FP64)
        out = tl.where(live, rnd(r_i + y, XT, IS_X_BF16, IS_FP64), r_i)
        row = row_of(rows_ptr, stride_rows_t, lo, n, i, HAS_TOKEN_INDICES)
        res_at = res_ptr + row * stride_res_t + c * stride_res_c
        if HAS_OUTER_RESIDUAL:                                  # rows of the null slot add it too
            out = rnd(out + up(outer[i], IS_X_BF16, IS_FP64), XT, IS_X_BF16, IS_FP64)
            tl.store(res_at, down(out, XT, IS_X_BF16), mask=m_i)
        else:
            tl.store(res_at, down(out, XT, IS_X_BF16), mask=m_i & live)

    # 3. The shifted window, after every load of the slot: state[:, m] = hist[m + 1], m < S + n - 1.
    tl.debug_barrier()
    for m in tl.static_range(S + Q - 1):
        v = hist[m + 1]  # type: ignore[var-annotated]  # Triton: an item of that tuple
        if not IS_STATE_SAME_DTYPE:
            v = convert(v, ST, IS_X_BF16, IS_STATE_BF16)
        tl.store(state_at + m * stride_state_w, v, mask=live & ((zc + m) < S + n - 1))


def launch_fused_step(args: dict, num_requests: int, C: int, mode: int, spec_query_len: int) -> None:
    """Launch the fused kernel of one decode / spec call; ``args`` are its pointer, stride and flag arguments."""
    bc = pow2_block(C, FUSED_BLOCK_C)
    q = 1 if mode == DECODE.value else spec_query_len
    _step_fused_kernel[(num_requests, triton.cdiv(C, bc))](MODE=mode, Q=q, BLOCK_C=bc, num_warps=FUSED_WARPS,
                                                           **args)
