"""``ple_prefill`` as Triton kernels: gate, norm_conv, mask, conv, silu and both residual adds in one pass.

Same name, signature and semantics as ``ple.reference.prefill.ple_prefill`` (the composition of the
reference gate and conv ops); ``conv_input`` and ``gated`` never go to memory.

``_prefill_kernel``, grid ``(time tiles, M)``. A tile is ``BLOCK_T = ROWS - S`` consecutive
positions of one request (found on the device by ``_numerics.tile_of``, as the conv kernels do;
a program past its request's rows writes nothing), for one stream m (H channels). Its rows block is
``ROWS`` positions: the S before the tile (the halo) and the tile. Four loops over the H
channels in chunks of ``BLOCK_H``:

1. ``sum(key^2)``, ``sum(hidden^2)`` per row -> the two RMS factors;
2. ``sum(round(kn * qn))`` per row -> the score and the gate ``g``;
3. ``sum(round(g * value)^2)`` per row -> the conv norm's RMS factor ``r_x``.
   ``g`` and ``r_x`` of the block's rows stay in registers; the values at row ``i - lag`` are
   taken exactly with a one-hot select and sum (``_shift``), once per tap, outside the loop;
4. per tap j, the conv input of row ``p - lag_j`` is recomputed from ``value`` and that row's
   ``g``, ``r_x`` (``round(round(round(g v) r_x a_c)) * keep``, ``a_c`` the conv norm's scale); a position before the
   request's start reads the slot's old column (serving, ``has_initial_states``) or zero. Then
   ``y = round(silu(round(sum_j w_j u_j)))`` and ``out = round(round(gated + y) + hidden)``.

Tiles: ``ROWS = rows_per_program(S)`` (64 for S = 9: 55 outputs, 9 halo rows recomputed),
``BLOCK_H = 32`` channels, 4 warps; the conv weights are passed transposed (``[K, C]``, one small
copy per call) so each tap's channel slice is contiguous. DRAM traffic per token, roughly: key
and hidden read in loop 1 and again in loop 2 (from L2 or DRAM: 64 rows of H exceed L1), value in loops 3 and 4, hidden
once more and ``out`` written in loop 4; the halo adds S / BLOCK_T to the first three loops.

Serving prefill: ``_prefill_state_kernel`` (grid ``(R, M)``), launched after, writes the slot's new
columns ``[0, S)``: column i is ``hist[n + i]``, the conv input of position ``n + i - S``
(recomputed the same way, so the bits are the outputs' own) or, for a request shorter than S,
old column ``n + i``; all of a chunk's values are loaded before a barrier, then stored, so the
in-place shift cannot race. Rows of a request on the null slot get no conv term and its slot is
neither read nor written. With ``token_indices``, physical rows no logical row maps to are zeroed.

The family (docs/spec.md section 15): the norms' scale, ``1 + w`` or ``w``, is the kernels' ``UNIT_OFFSET``
constexpr and the conv norm's epsilon a runtime argument (``ceps_hi``, ``ceps_lo``), as in ``ple.fast.gate``.

Numerics: the gate's and the conv's rounding points (``ple.fast._gate_math``: the gate's arithmetic, the
helpers the fast gate calls too, e.g. ``row_scalars`` for loops 1-3; ``ple.fast.conv``), with
reductions in float32 (float64 for float64 inputs); only the order of the float32 sums over H
differs from the reference (chunked here), as it does for the fast gate.

Autograd (``conv_state=None`` only): the backward recomputes ``gated`` and ``conv_input`` with the
fast gate's forward, then calls the training conv's backward (``training_conv._bwd``) and the
gate's backward (``gate._gate_bwd``); ``dhidden`` adds the residual's ``dout``.

Registered as ``torch.ops.ple.ple_prefill`` (functional, with autograd; backward
``ple.ple_prefill_backward``) and ``torch.ops.ple.ple_prefill_serving`` (mutates ``conv_state``).
``prefill_conv_inputs`` (the conv inputs the state kernel writes, for tests) lives in
``ple.fast.prefill_inputs`` and is re-exported here.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import _checks
from ..reference import prefill as _reference
from . import _numerics
from . import gate as _gate
from . import training_conv as _tconv
from ._gate_math import BLOCK_H, STATE_WARPS, conv_inputs_chunk, conv_norm_chunk, conv_rows, row_scalars
from ._library import register, twin
from ._numerics import convert, down, rnd, scalars, silu, tile_of, up
from .prefill_inputs import prefill_conv_inputs

__all__ = ["ple_prefill", "prefill_conv_inputs"]

NUM_WARPS = 4           # the main kernel's warps (BLOCK_H, STATE_WARPS: ``_gate_math``, shared with prefill_inputs)


def rows_per_program(state_len: int) -> int:
    """``ROWS``, the rows a program loads (the S-row halo + its ``BLOCK_T`` tile): a power of two with at least
    32 rows past the halo."""
    return max(64, triton.next_power_of_2(state_len + 32))


@triton.jit
def _shift(x, i, lag: tl.constexpr):
    """``x[i - lag]`` of a per-row vector (0 where ``i < lag``), exactly: a one-hot select and sum, in registers."""
    pick = i[None, :] == (i - lag)[:, None]
    return tl.sum(tl.where(pick, x[None, :], 0.0), 1)


@triton.jit
def _physical(rows_ptr, stride_rows_t, logical, mask, HAS_TOKEN_INDICES: tl.constexpr):
    """Physical rows of logical rows (``token_indices``, or the identity)."""
    if HAS_TOKEN_INDICES:
        prow = tl.load(rows_ptr + logical * stride_rows_t, mask=mask, other=0).to(tl.int64)
    else:
        prow = logical
    return prow


@triton.jit
def _keep_of(keep_ptr, stride_keep_t, prow, mask, HAS_KEEP: tl.constexpr, IS_FP64: tl.constexpr):
    """The mask factor of physical rows: 1.0 (kept) or 0.0."""
    if HAS_KEEP:
        kf = tl.where(tl.load(keep_ptr + prow * stride_keep_t, mask=mask, other=0) != 0, 1.0, 0.0)
    else:
        kf = tl.where(mask, 1.0, 1.0)
    if IS_FP64:
        kf = kf.to(tl.float64)
    return kf


@triton.jit(do_not_specialize=["R", "steps", "null_slot"])
def _prefill_kernel(
    key_ptr, value_ptr, hid_ptr, wk_ptr, wq_ptr, wc_ptr, w_ptr, out_ptr,
    state_ptr, slot_ptr, query_start_loc_ptr, init_ptr, rows_ptr, keep_ptr,
    H, R, steps, null_slot, eps_hi, eps_lo, ceps_hi, ceps_lo, sqrt_h,
    stride_key_t, stride_key_c, stride_value_t, stride_value_h, stride_hid_t, stride_hid_c,
    stride_wk_c, stride_wq_c, stride_wc_c, stride_w_c, stride_w_k, stride_out_t, stride_out_c,
    stride_state_n, stride_state_c, stride_state_w,
    stride_slot_r, stride_query_start_loc_r, stride_init_r, stride_rows_t, stride_keep_t,
    K: tl.constexpr, DILATION: tl.constexpr, SERVING: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
    HAS_TOKEN_INDICES: tl.constexpr, HAS_KEEP: tl.constexpr,
    IS_BF16: tl.constexpr, IS_W_BF16: tl.constexpr, IS_STATE_BF16: tl.constexpr,
    IS_STATE_SAME_DTYPE: tl.constexpr, IS_FP64: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):
    """Outputs of one tile of ``ROWS - S`` positions of one request, stream ``program_id(1)``."""
    S: tl.constexpr = (K - 1) * DILATION
    BLOCK_T: tl.constexpr = ROWS - S
    XT = key_ptr.dtype.element_ty
    eps, root = scalars(H, eps_hi, eps_lo, sqrt_h, IS_FP64)
    ceps, _ = scalars(H, ceps_hi, ceps_lo, sqrt_h, IS_FP64)
    m = tl.program_id(1).to(tl.int64)
    r, t0 = tile_of(tl.program_id(0), query_start_loc_ptr, stride_query_start_loc_r, R, steps, BLOCK_T)
    lo = tl.load(query_start_loc_ptr + r * stride_query_start_loc_r).to(tl.int64)
    n = tl.load(query_start_loc_ptr + (r + 1) * stride_query_start_loc_r).to(tl.int64) - lo

    i = tl.arange(0, ROWS)
    p = t0 - S + i                                   # position in the request of each row of the block
    rmask = (p >= 0) & (p < n)                       # rows whose gate is needed (halo and tile)
    omask = (i >= S) & (p < n)                       # rows this program writes
    prow = _physical(rows_ptr, stride_rows_t, lo + p, rmask, HAS_TOKEN_INDICES)
    g, r_x = row_scalars(key_ptr, value_ptr, hid_ptr, wk_ptr, wq_ptr, prow, rmask, m, H,
                         stride_key_t, stride_key_c, stride_value_t, stride_value_h, stride_hid_t, stride_hid_c,
                         stride_wk_c, stride_wq_c, eps, ceps, root, XT, IS_BF16, IS_FP64, ROWS, BLOCK_H, UNIT_OFFSET)
    zt = p * 0
    if SERVING:
        slot = tl.load(slot_ptr + r * stride_slot_r).to(tl.int64)
        live = (zt + slot) != null_slot
        if HAS_INIT_FLAGS:
            init = live & ((zt + tl.load(init_ptr + r * stride_init_r).to(tl.int64)) != 0)
        else:
            init = zt != zt
        state_row = state_ptr + slot * stride_state_n
    kf0 = _keep_of(keep_ptr, stride_keep_t, prow, omask, HAS_KEEP, IS_FP64)
    hh = tl.arange(0, BLOCK_H).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + hh
        hm, c, wc1 = conv_norm_chunk(wc_ptr, stride_wc_c, m, H, h, IS_FP64, UNIT_OFFSET)
        acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
        if IS_FP64:
            acc = acc.to(tl.float64)
        x0 = acc
        for j in tl.static_range(K):
            lag = (K - 1 - j) * DILATION
            src = p - lag
            in_req = omask & (src >= 0)
            if lag == 0:
                srow = prow
                kf = kf0
                gs = g
                rs = r_x
            else:
                srow = _physical(rows_ptr, stride_rows_t, lo + src, in_req, HAS_TOKEN_INDICES)
                kf = _keep_of(keep_ptr, stride_keep_t, srow, in_req, HAS_KEEP, IS_FP64)
                gs = _shift(g, i, lag)
                rs = _shift(r_x, i, lag)
            x, u = conv_rows(value_ptr, stride_value_t, stride_value_h, srow, in_req, h, hm, gs, rs, wc1,
                             XT, IS_BF16, IS_FP64)
            if HAS_KEEP:
                u = u * kf[:, None]
            if SERVING:
                from_state = omask & (src < 0) & init
                sv = tl.load(state_row + (S + src)[:, None] * stride_state_w + c[None, :] * stride_state_c,
                             mask=from_state[:, None] & hm[None, :], other=0.0)
                if not IS_STATE_SAME_DTYPE:
                    sv = convert(sv, XT, IS_STATE_BF16, IS_BF16)
                u = tl.where(in_req[:, None], u, up(sv, IS_BF16, IS_FP64))
            wj = up(tl.load(w_ptr + j * stride_w_k + c * stride_w_c, mask=hm, other=0.0), IS_W_BF16, IS_FP64)
            acc = acc + wj[None, :] * u
            if lag == 0:
                x0 = x
                if HAS_KEEP:
                    x0 = x * kf[:, None]
        y = rnd(silu(rnd(acc, XT, IS_BF16, IS_FP64)), XT, IS_BF16, IS_FP64)
        m_o = omask[:, None] & hm[None, :]
        hid = up(tl.load(hid_ptr + prow[:, None] * stride_hid_t + c[None, :] * stride_hid_c, mask=m_o,
                         other=0.0), IS_BF16, IS_FP64)
        res = rnd(x0 + y, XT, IS_BF16, IS_FP64)
        if SERVING:
            res = tl.where(live[:, None], res, x0)
        out = rnd(res + hid, XT, IS_BF16, IS_FP64)
        tl.store(out_ptr + prow[:, None] * stride_out_t + c[None, :] * stride_out_c, down(out, XT, IS_BF16),
                 mask=m_o)


@triton.jit(do_not_specialize=["null_slot"])
def _prefill_state_kernel(
    key_ptr, value_ptr, hid_ptr, wk_ptr, wq_ptr, wc_ptr,
    state_ptr, slot_ptr, query_start_loc_ptr, init_ptr, rows_ptr, keep_ptr,
    H, null_slot, eps_hi, eps_lo, ceps_hi, ceps_lo, sqrt_h,
    stride_key_t, stride_key_c, stride_value_t, stride_value_h, stride_hid_t, stride_hid_c,
    stride_wk_c, stride_wq_c, stride_wc_c,
    stride_state_n, stride_state_c, stride_state_w,
    stride_slot_r, stride_query_start_loc_r, stride_init_r, stride_rows_t, stride_keep_t,
    K: tl.constexpr, DILATION: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
    HAS_TOKEN_INDICES: tl.constexpr, HAS_KEEP: tl.constexpr,
    IS_BF16: tl.constexpr, IS_STATE_BF16: tl.constexpr, IS_STATE_SAME_DTYPE: tl.constexpr, IS_FP64: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):
    """New columns ``[0, S)`` of request ``program_id(0)``'s slot, stream ``program_id(1)``'s channels."""
    S: tl.constexpr = (K - 1) * DILATION
    XT = key_ptr.dtype.element_ty
    ST = state_ptr.dtype.element_ty
    eps, root = scalars(H, eps_hi, eps_lo, sqrt_h, IS_FP64)
    ceps, _ = scalars(H, ceps_hi, ceps_lo, sqrt_h, IS_FP64)
    r = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1).to(tl.int64)
    lo = tl.load(query_start_loc_ptr + r * stride_query_start_loc_r).to(tl.int64)
    n = tl.load(query_start_loc_ptr + (r + 1) * stride_query_start_loc_r).to(tl.int64) - lo
    slot = tl.load(slot_ptr + r * stride_slot_r).to(tl.int64)
    i = tl.arange(0, BLOCK_S)                        # new column i = hist[n + i]
    zi = i * 0
    write = (i < S) & ((zi + slot) != null_slot) & ((zi + n) > 0)
    p = n - S + i                                    # its position in the request (< 0: an old column)
    from_x = write & (p >= 0)
    from_state = write & (p < 0)
    if HAS_INIT_FLAGS:
        from_state = from_state & ((zi + tl.load(init_ptr + r * stride_init_r).to(tl.int64)) != 0)
    else:
        from_state = from_state & (zi != zi)
    prow = _physical(rows_ptr, stride_rows_t, lo + p, from_x, HAS_TOKEN_INDICES)
    g, r_x = row_scalars(key_ptr, value_ptr, hid_ptr, wk_ptr, wq_ptr, prow, from_x, m, H,
                         stride_key_t, stride_key_c, stride_value_t, stride_value_h, stride_hid_t, stride_hid_c,
                         stride_wk_c, stride_wq_c, eps, ceps, root, XT, IS_BF16, IS_FP64, BLOCK_S, BLOCK_H,
                         UNIT_OFFSET)
    kf = _keep_of(keep_ptr, stride_keep_t, prow, from_x, HAS_KEEP, IS_FP64)
    state_row = state_ptr + slot * stride_state_n
    hh = tl.arange(0, BLOCK_H).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + hh
        hm, c, u = conv_inputs_chunk(value_ptr, stride_value_t, stride_value_h, wc_ptr, stride_wc_c, prow, from_x,
                                     m, H, h, g, r_x, XT, IS_BF16, IS_FP64, UNIT_OFFSET)
        u = down(u * kf[:, None], XT, IS_BF16)
        sv = tl.load(state_row + (n + i)[:, None] * stride_state_w + c[None, :] * stride_state_c,
                     mask=from_state[:, None] & hm[None, :], other=0.0)
        if IS_STATE_SAME_DTYPE:
            new = tl.where(from_x[:, None], u, sv)
        else:
            new = tl.where(from_x[:, None], convert(u, ST, IS_BF16, IS_STATE_BF16),
                           convert(convert(sv, XT, IS_STATE_BF16, IS_BF16), ST, IS_BF16, IS_STATE_BF16))
        tl.debug_barrier()                           # every old column of this chunk is read before any write
        tl.store(state_row + i[:, None] * stride_state_w + c[None, :] * stride_state_c, new,
                 mask=write[:, None] & hm[None, :])
        tl.debug_barrier()


# ---- launchers -------------------------------------------------------------------------------------


def _common(key, value, hidden_states, wk, wq, wc, eps, keep, token_indices, placeholder, conv_eps=None,
            unit_offset=True) -> dict:
    H = value.shape[1]
    eps_hi, eps_lo = _numerics.eps_parts(eps)
    ceps_hi, ceps_lo = _numerics.eps_parts(eps if conv_eps is None else conv_eps)
    rows = token_indices if token_indices is not None else placeholder
    kp = keep if keep is not None else placeholder
    if kp.dtype == torch.bool:
        kp = kp.view(torch.uint8)
    return dict(
        key_ptr=key, value_ptr=value, hid_ptr=hidden_states, wk_ptr=wk, wq_ptr=wq, wc_ptr=wc,
        rows_ptr=rows, keep_ptr=kp, H=H, eps_hi=eps_hi, eps_lo=eps_lo, ceps_hi=ceps_hi, ceps_lo=ceps_lo,
        sqrt_h=math.sqrt(H), UNIT_OFFSET=bool(unit_offset),
        stride_key_t=key.stride(0), stride_key_c=key.stride(1), stride_value_t=value.stride(0),
        stride_value_h=value.stride(1), stride_hid_t=hidden_states.stride(0), stride_hid_c=hidden_states.stride(1),
        stride_wk_c=wk.stride(0), stride_wq_c=wq.stride(0), stride_wc_c=wc.stride(0),
        stride_rows_t=rows.stride(0), stride_keep_t=kp.stride(0),
        HAS_TOKEN_INDICES=token_indices is not None, HAS_KEEP=keep is not None,
        IS_BF16=key.dtype == torch.bfloat16, IS_FP64=_numerics.is_fp64(key.dtype), BLOCK_H=BLOCK_H,
        num_warps=NUM_WARPS)


def _prefill_fwd(key, value, hidden_states, wk, wq, wc, eps, conv_weights, dilation, query_start_loc, keep,
                 conv_state, state_indices, has_initial_states, token_indices, null_slot, conv_eps=None,
                 unit_offset=True) -> torch.Tensor:
    """Launch the kernels of one ``ple_prefill`` call; grids from shapes only (no host reads)."""
    T, C = key.shape
    H = value.shape[1]
    M = C // H
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    R = query_start_loc.numel() - 1
    num_rows = T if token_indices is None else token_indices.numel()
    make = torch.zeros if token_indices is not None else torch.empty
    out = make((T, C), dtype=key.dtype, device=key.device)
    if R == 0 or C == 0 or num_rows == 0:
        return out
    serving = conv_state is not None
    placeholder = query_start_loc
    common = _common(key, value, hidden_states, wk, wq, wc, eps, keep, token_indices, placeholder, conv_eps,
                     unit_offset)
    conv_state = conv_state if serving else key.unsqueeze(2)            # placeholder: never read
    state_indices = state_indices if serving else placeholder
    init = has_initial_states if has_initial_states is not None else placeholder
    if init.dtype == torch.bool:
        init = init.view(torch.uint8)
    index_args = dict(
        state_ptr=conv_state, slot_ptr=state_indices, query_start_loc_ptr=query_start_loc, init_ptr=init,
        null_slot=null_slot, stride_state_n=conv_state.stride(0), stride_state_c=conv_state.stride(1),
        stride_state_w=conv_state.stride(2), stride_slot_r=state_indices.stride(0),
        stride_query_start_loc_r=query_start_loc.stride(0), stride_init_r=init.stride(0),
        K=K, DILATION=dilation, HAS_INIT_FLAGS=has_initial_states is not None,
        IS_STATE_BF16=conv_state.dtype == torch.bfloat16, IS_STATE_SAME_DTYPE=conv_state.dtype == key.dtype)
    loaded = rows_per_program(S)                                        # ROWS: halo + tile
    grid0 = _numerics.tile_grid(num_rows, R, loaded - S)                # tiles of BLOCK_T = ROWS - S positions
    wt = conv_weights.t().contiguous()              # [K, C]: the taps' channel rows contiguous
    _prefill_kernel[(grid0, M)](
        w_ptr=wt, out_ptr=out, R=R, steps=_numerics.search_steps(R), stride_w_c=wt.stride(1), stride_w_k=wt.stride(0),
        stride_out_t=out.stride(0), stride_out_c=out.stride(1), SERVING=serving,
        IS_W_BF16=conv_weights.dtype == torch.bfloat16, ROWS=loaded, **index_args, **common)
    if serving and S > 0:
        # Launched after every output is computed: the outputs above read only old states.
        _prefill_state_kernel[(R, M)](
            BLOCK_S=triton.next_power_of_2(S), **index_args,
            **dict(common, num_warps=STATE_WARPS))
    return out


def _prefill_bwd(dout, key, value, hidden_states, wk, wq, wc, eps, conv_weights, dilation, query_start_loc, keep,
                 conv_eps=None, unit_offset=True):
    """Gradients of key, value, hidden_states, the three norm weights and conv_weights (forward case)."""
    gated, conv_input = _gate._gate_fwd(key, value, hidden_states, wk, wq, wc, eps, conv_eps, unit_offset)
    dout = dout.contiguous()
    mask = None
    if keep is not None:
        mask = (keep != 0).to(key.dtype)[:, None]
        conv_input = conv_input * mask
    dconv, dw = _tconv._bwd(dout, conv_input, conv_weights, dilation, query_start_loc)
    dgated = dout
    if mask is not None:
        dgated, dconv = dout * mask, dconv * mask
    dk, dv, dh, dwk, dwq, dwc = _gate._gate_bwd(dgated, dconv, key, value, hidden_states, wk, wq, wc, eps, conv_eps,
                                                unit_offset)
    return [dk, dv, dh + dout, dwk.clone(), dwq.clone(), dwc.clone(), dw]


# ---- registration ----------------------------------------------------------------------------------


def _check_values(key, conv_weights, dilation, query_start_loc, conv_state, state_indices, has_initial_states,
                  token_indices, null_slot):
    _checks.prefill_values(key, conv_weights, dilation=dilation, query_start_loc=query_start_loc,
                           conv_state=conv_state, state_indices=state_indices,
                           has_initial_states=has_initial_states, token_indices=token_indices, null_slot=null_slot)


def _fwd_impl(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor, norm_key_weight: torch.Tensor,
              norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor, eps: float,
              conv_weights: torch.Tensor, dilation: int, query_start_loc: torch.Tensor,
              keep: torch.Tensor | None, conv_eps: float, unit_offset: bool, validate: bool) -> torch.Tensor:
    if validate:
        _check_values(key, conv_weights, dilation, query_start_loc, None, None, None, None, 0)
    return _prefill_fwd(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
                        conv_weights, dilation, query_start_loc, keep, None, None, None, None, 0, conv_eps, unit_offset)


def _fwd_fake(key, value, hidden_states, wk, wq, wc, eps, conv_weights, dilation, query_start_loc, keep, conv_eps,
              unit_offset, validate):
    return torch.empty_like(key, memory_format=torch.contiguous_format)


def _bwd_impl(dout: torch.Tensor, key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
              norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor,
              eps: float, conv_weights: torch.Tensor, dilation: int, query_start_loc: torch.Tensor,
              keep: torch.Tensor | None, conv_eps: float, unit_offset: bool) -> list[torch.Tensor]:
    return _prefill_bwd(dout, key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
                        conv_weights, dilation, query_start_loc, keep, conv_eps, unit_offset)


def _bwd_fake(dout, key, value, hidden_states, wk, wq, wc, eps, conv_weights, dilation, query_start_loc, keep,
              conv_eps, unit_offset):
    cf = torch.contiguous_format
    return [torch.empty_like(key, memory_format=cf), torch.empty_like(value, memory_format=cf),
            torch.empty_like(hidden_states, memory_format=cf), torch.empty_like(wk), torch.empty_like(wq),
            torch.empty_like(wc), torch.empty_like(conv_weights, memory_format=cf)]


_bwd_op = register("ple_prefill_backward", _bwd_impl, fake=_bwd_fake)


def _setup(ctx, inputs, output):
    key, value, hidden, wk, wq, wc, eps, conv_weights, dilation, query_start_loc, keep, conv_eps, unit_offset, _ = \
        inputs
    ctx.save_for_backward(key, value, hidden, wk, wq, wc, conv_weights, query_start_loc, keep)
    ctx.eps, ctx.dilation, ctx.conv_eps, ctx.unit_offset = eps, dilation, conv_eps, unit_offset


def _backward(ctx, dout):
    key, value, hidden, wk, wq, wc, conv_weights, query_start_loc, keep = ctx.saved_tensors
    grads = _bwd_op(dout, key, value, hidden, wk, wq, wc, ctx.eps, conv_weights, ctx.dilation, query_start_loc, keep,
                    ctx.conv_eps, ctx.unit_offset)
    return (*grads[:6], None, grads[6], None, None, None, None, None, None)


_fwd_op = register("ple_prefill", _fwd_impl, fake=_fwd_fake, backward=_backward, setup_context=_setup)


def _serving_impl(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
                  norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor,
                  eps: float, conv_weights: torch.Tensor, dilation: int, query_start_loc: torch.Tensor,
                  keep: torch.Tensor | None, conv_state: torch.Tensor, state_indices: torch.Tensor,
                  has_initial_states: torch.Tensor | None, token_indices: torch.Tensor | None, null_slot: int,
                  conv_eps: float, unit_offset: bool, validate: bool) -> torch.Tensor:
    if validate:
        _check_values(key, conv_weights, dilation, query_start_loc, conv_state, state_indices, has_initial_states,
                      token_indices, null_slot)
    return _prefill_fwd(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
                        conv_weights, dilation, query_start_loc, keep, conv_state, state_indices,
                        has_initial_states, token_indices, null_slot, conv_eps, unit_offset)


def _serving_fake(key, *args):
    return torch.empty_like(key, memory_format=torch.contiguous_format)


_serving_op = register("ple_prefill_serving", _serving_impl, fake=_serving_fake, mutates_args=("conv_state",))


@twin(_reference.ple_prefill)
def ple_prefill(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
                norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor,
                eps: float, conv_weights: torch.Tensor, *, dilation: int, query_start_loc: torch.Tensor,
                keep: torch.Tensor | None = None, conv_state: torch.Tensor | None = None,
                state_indices: torch.Tensor | None = None, has_initial_states: torch.Tensor | None = None,
                token_indices: torch.Tensor | None = None, null_slot: int = 0, conv_eps: float | None = None,
                unit_offset: bool = True, validate: bool = True) -> torch.Tensor:
    """Fused: one kernel (``_prefill_kernel``, a program per time tile and stream) does the gate, ``keep``, the
    conv, silu and both adds, so ``gated`` and ``conv_input`` never go to memory (each tap's conv input is
    recomputed from ``value`` and its row's gate). Without a conv state (``torch.ops.ple.ple_prefill``) the backward
    recomputes the gate and runs the training conv's and the gate's backward kernels. With one
    (``torch.ops.ple.ple_prefill_serving``, mutating ``conv_state``, no autograd formula) a second kernel then
    writes the slots' new columns, recomputed the same way (``prefill_conv_inputs`` gives them). The sums over H run
    in chunks, in another order than the reference's (within the tolerance, as the fast gate). The values are
    checked inside the op unless ``validate=False``, which reads nothing back. CPU tensors are refused
    (``ValueError``) while the kernels are compiled; under ``TRITON_INTERPRET=1`` they run on the CPU."""
    _checks.prefill_meta(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
                         conv_weights, dilation=dilation, query_start_loc=query_start_loc, keep=keep,
                         conv_state=conv_state, state_indices=state_indices,
                         has_initial_states=has_initial_states, token_indices=token_indices, null_slot=null_slot,
                         conv_eps=conv_eps, unit_offset=unit_offset)
    ceps = float(eps if conv_eps is None else conv_eps)
    if conv_state is None:
        return _fwd_op(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, float(eps),
                       conv_weights, dilation, query_start_loc, keep, ceps, unit_offset, _checks.validating(validate))
    return _serving_op(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, float(eps),
                       conv_weights, dilation, query_start_loc, keep, conv_state, state_indices, has_initial_states,
                       token_indices, null_slot, ceps, unit_offset, _checks.validating(validate))
