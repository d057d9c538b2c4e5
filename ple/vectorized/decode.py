"""`ple_conv` of decode rows, one per request (SPEC section 6), the hot serving path; see ``conv``.

A request's history is its slot's columns ``0..S-1`` (``S = (K-1) * d``), then its input ``x``; tap j
reads column ``j * d`` (tap K-1: ``x``); afterwards the slot holds columns ``1..S-1`` then ``x``
(zeros before ``x`` for a request without history); a request on the null slot gets no conv term
and writes its S columns back unchanged, so the null slot's bits do not change.

With the state's columns as rows (``rows.state_rows``; ``PLECache``'s default ``channels_last``
layout) the window shift is two passes over the windows, a gather and a scatter (the least a shift
of every column can take), in a fixed number of ops whatever R is (about 45, most of them on a few
index values; `_decode`):

* one ``index_select`` of ``(S + 1) * R`` state rows into a table of S + 1 blocks of R rows (row
  ``b * R + r``: block b of request r): block b is column b, block S is where ``x`` goes (read from
  column S-1, then ``x`` put in); a request on the null slot reads column ``b - 1`` into block b, so
  blocks ``1..S``, the new windows, are its columns unshifted;
* requests without history (``has_initial_states`` given and 0) get every block but ``x``'s zeroed by
  one bitwise ``and`` over the table's bits;
* tap j is block ``j * d`` (tap K-1: block S, ``x``), cast to float32 ``[R, C]`` at a time (small
  temporaries that stay in cache, rather than one multi-MiB cast of all K); the tap sum is K
  multiply-adds into a zeroed accumulator (the reference's ``0 + w0 x0 + ...``); silu; the residual
  adds, rounded one at a time;
* one scatter (``rows.copy_rows_``) writes blocks ``1..S`` over the slots' columns ``0..S-1``.

Under ``torch.compile`` (`_decode_compiled`) the same arithmetic is written as inductor fuses it: the
taps and the new windows are indexed loads from the state inside its fused kernels (one buffer of new
windows, no table), the window written back with ``ple_torch::copy_rows_``. Other layouts, a state
dtype other than the inputs', an out-of-range null slot and ``S = 0`` take `_decode_general`: the
windows gathered as ``[R, S, C]`` and written back whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..reference.gate import acc_dtype
from .rows import bits, copy_rows_, state_rows
from .training_conv import LOW_PRECISION, conv_activation, multiply_add_

__all__ = ["decode_conv"]


def decode_conv(inputs: torch.Tensor, residual: torch.Tensor, conv_state: torch.Tensor, conv_weights: torch.Tensor,
                state_indices: torch.Tensor, dilation: int, has_initial_states: torch.Tensor | None,
                token_indices: torch.Tensor | None, outer_residual: torch.Tensor | None, null_slot: int) -> None:
    """`ple_conv` of decode rows after its checks; dispatches to `_decode`, `_decode_compiled` or
    `_decode_general` (see the module docstring)."""
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    R = state_indices.numel()
    num_slots, W = conv_state.shape[0], conv_state.shape[2]
    rows = state_rows(conv_state) if S > 0 and R > 0 else None
    if rows is None or conv_state.dtype != inputs.dtype or not 0 <= null_slot < num_slots:
        _decode_general(inputs, residual, conv_state, conv_weights, state_indices, dilation, has_initial_states,
                        token_indices, outer_residual, null_slot)
        return
    fn = _decode_compiled if torch.compiler.is_compiling() else _decode
    fn(inputs, residual, rows, W, conv_weights, state_indices, dilation, has_initial_states, token_indices,
       outer_residual, null_slot)


def _requests(inputs, state_indices, has_initial_states, token_indices, null_slot):
    """``(slots, live, reads, rows)``: each request's slot, whether it is not on the null slot, whether it
    reads a history, and its physical row."""
    R = state_indices.numel()
    slots = state_indices.to(torch.int64)
    live = slots != null_slot                                                   # [R]
    reads = live if has_initial_states is None else live & (has_initial_states != 0)
    rows = torch.arange(R, device=inputs.device) if token_indices is None else token_indices.to(torch.int64)
    return slots, live, reads, rows


def _residual_(residual, rows, live, y, outer_residual) -> None:
    """``residual[rows] = (residual[rows] + y) + outer_residual[rows]`` (``+ y`` for live requests only), each
    add rounded."""
    res = residual.index_select(0, rows)
    new_res = torch.where(live[:, None], res + y, res)
    if outer_residual is not None:
        new_res.add_(outer_residual.index_select(0, rows))
    copy_rows_(residual, rows, new_res)


def _decode(inputs, residual, state, W, conv_weights, state_indices, dilation, has_initial_states,
            token_indices, outer_residual, null_slot) -> None:
    """The eager decode step on the state's rows ``state`` (see the module docstring)."""
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    R, C = state_indices.numel(), inputs.shape[1]
    dev, dt = inputs.device, inputs.dtype
    slots, live, reads, rows = _requests(inputs, state_indices, has_initial_states, token_indices, null_slot)
    b = torch.arange(S + 1, device=dev)
    first = slots * W                                                           # column 0's row (null: its own)
    # Block b: column b (x's block: column S-1, overwritten); on the null slot column b - 1 (block 0: any).
    read = (b[:, None] - (~live).to(torch.int64)).clamp(0, S - 1)               # [S+1, R]
    table = state.index_select(0, (first + read).flatten())                    # [(S+1)*R, C]
    blocks = table.view(S + 1, R, C)
    if has_initial_states is not None:                                          # no history: zeros but x
        keep = ~(live & ~reads)[None, :] | (b == S)[:, None]                    # [S+1, R]
        tb = _words(blocks)
        tb.bitwise_and_(torch.where(keep, -1, 0).to(tb.dtype)[:, :, None])
    xb = _words(blocks[S])                                                      # x, but on the null slot
    torch.where(live[:, None], _words(inputs.index_select(0, rows)), xb, out=xb)
    acc = acc_dtype(dt)
    wt = torch.empty(K, C, dtype=acc, device=dev).copy_(conv_weights.t())      # [K, C], tap j: wt[j]
    u = inputs.new_zeros(R, C, dtype=acc)
    for j in range(K):                                                          # tap j: block j * d
        multiply_add_(u, blocks[j * dilation].to(acc), wt[j])                   # small casts: no fresh pages
    y = conv_activation(u, dt, inplace=True)
    _residual_(residual, rows, live, y, outer_residual)
    copy_rows_(state, (first + b[:S, None]).flatten(), table[R:])


def _words(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t`` (``[..., C]``, contiguous rows) as 8-byte words where ``C`` allows, else as integers of
    its element size: for bit operations in fewer elements."""
    return t.view(torch.int64) if (t.shape[-1] * t.element_size()) % 8 == 0 else bits(t)


def _decode_compiled(inputs, residual, state, W, conv_weights, state_indices, dilation, has_initial_states,
                     token_indices, outer_residual, null_slot) -> None:
    """`_decode` as inductor fuses it: the taps and the new windows are indexed loads from the state (one
    ``[R*S, C]`` buffer of new windows, no table), the taps' weights stacked (a buffer it realises; a
    transposed view it would gather element by element), the windows written with ``ple_torch::copy_rows_``."""
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    R, C = state_indices.numel(), inputs.shape[1]
    dev, dt = inputs.device, inputs.dtype
    acc = acc_dtype(dt)
    slots, live, reads, rows = _requests(inputs, state_indices, has_initial_states, token_indices, null_slot)
    c = torch.arange(S, device=dev)
    first = (slots * W)[:, None]                                                # [R, 1]: column 0's row
    x = inputs[rows]
    wt = torch.stack(conv_weights.to(acc).unbind(1))                            # [K, C]
    u = x.new_zeros(R, C, dtype=acc)
    for j in range(K - 1):
        u = u + torch.where(reads[:, None], state[first[:, 0] + j * dilation].to(acc), 0.0) * wt[j]
    u = u + x.to(acc) * wt[K - 1]
    y = F.silu(u.to(dt).to(acc)).to(dt)
    res = residual[rows]
    new_res = torch.where(live[:, None], res + y, res)
    if outer_residual is not None:
        new_res = new_res + outer_residual[rows]
    residual.index_copy_(0, rows, new_res)
    # Column c afterwards: column c + 1 (zeros without history) for c < S-1, then x; on the null slot column c.
    shift = live[:, None] & (c < S - 1)                                         # [R, S]
    # bfloat16 / float16 selected as integers (the bits): inductor computes their select in float32, and the
    # round trip would make every NaN the canonical one; float32 / float64 are selected as they are (faster).
    as_bits = bits if dt in LOW_PRECISION else (lambda t: t)
    old = as_bits(state)[(first + torch.where(shift, c + 1, c)).flatten()].view(R, S, C)
    new = torch.where((live[:, None] & (c == S - 1))[:, :, None], as_bits(x)[:, None],
                      torch.where((shift & ~reads[:, None])[:, :, None], old.new_zeros(()), old))
    copy_rows_(state, (first + c).flatten(), new.view(R * S, C).view(dt))


def _decode_general(inputs, residual, conv_state, conv_weights, state_indices, dilation, has_initial_states,
                    token_indices, outer_residual, null_slot) -> None:
    """The decode step for any layout and state dtype: the windows gathered as ``[R, S, C]`` and written back
    whole."""
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    R, C = state_indices.numel(), inputs.shape[1]
    dt, st = inputs.dtype, conv_state.dtype
    acc = acc_dtype(dt)
    num_slots = conv_state.shape[0]
    slots, live, _, rows = _requests(inputs, state_indices, None, token_indices, null_slot)
    x = inputs.index_select(0, rows)                                            # [R, C]
    wt = conv_weights.to(acc).t().contiguous()                                  # [K, C], tap j: wt[j]
    u = x.new_zeros(R, C, dtype=acc)
    sv = conv_state.transpose(1, 2)[:, :S]                                      # [num_slots, S, C]
    z = null_slot if 0 <= null_slot < num_slots else 0
    if S > 0 and num_slots > 0 and R > 0:
        target = torch.where(live, slots, z)
        raw = sv.index_select(0, target)                                        # [R, S, C], the bits before
        old = raw if st == dt else raw.to(dt)
        if has_initial_states is not None:                                      # no history: zeros
            old = torch.where((live & (has_initial_states != 0))[:, None, None], old, old.new_zeros(()))
        taps = old[:, ::dilation].to(acc)                                       # [R, K-1, C]: rows j * d
        for j in range(K - 1):
            multiply_add_(u, taps[:, j], wt[j])
    multiply_add_(u, x.to(acc), wt[K - 1])
    y = conv_activation(u, dt, inplace=True)
    res = residual.index_select(0, rows)
    new_res = torch.where(live[:, None], res + y, res)
    if outer_residual is not None:
        new_res = new_res + outer_residual.index_select(0, rows)
    residual.index_copy_(0, rows, new_res)
    if S == 0 or num_slots == 0 or R == 0:
        return
    new = torch.cat([old[:, 1:], x[:, None]], 1)
    new = torch.where(live[:, None, None], new if st == dt else new.to(st), raw)
    if not 0 <= null_slot < num_slots:                                          # stand-in slot 0: see conv
        hit = live & (target == 0)
        z_final = torch.where(hit.any(), new[hit.to(torch.int8).argmax()], new[(~live).to(torch.int8).argmax()])
        new = torch.where(live[:, None, None], new, z_final)
    sv.index_copy_(0, target, new)
