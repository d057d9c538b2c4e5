"""The fast path of `ple_conv` for decode rows, one per request (docs/spec.md section 6), the hot serving path.

A request's history is its slot's columns ``0..S-1`` (``S = (K-1) * d``), then its input ``x``; tap j
reads column ``j * d`` (tap K-1: ``x``); afterwards the slot holds columns ``1..S-1`` then ``x``
(zeros before ``x`` for a request without history); a request on the null slot gets no conv term
and writes its S columns back unchanged, so the null slot's bits do not change.

With the state's columns as rows (``rows.state_rows``; ``PLECache``'s default ``channels_last``
layout) the window shift is two passes over the windows, a gather and a scatter (the least a shift
of every column can take), in a fixed number of ops whatever R is (about 45, most of them on a few
index values; `decode_conv`):

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

It runs where `takes_row_path` says: eagerly, on a state in the inputs' dtype whose columns are rows,
with ``S > 0``, at least one request and the null slot inside the state. Everything else (other layouts
or state dtypes, ``S = 0``, an out-of-range null slot, and every call under ``torch.compile``, where the
general path is as fast as the compiled decode path it replaced) takes ``conv.ple_conv``'s general path.
"""

from __future__ import annotations

import torch

from ..reference.gate import acc_dtype
from .rows import bits, copy_rows_, state_rows
from .training_conv import conv_activation, multiply_add_

__all__ = ["takes_row_path", "decode_conv"]


def takes_row_path(inputs: torch.Tensor, conv_state: torch.Tensor, conv_weights: torch.Tensor,
                   state_indices: torch.Tensor, null_slot: int) -> bool:
    """Whether a decode call takes `decode_conv` (see the module docstring)."""
    return (not torch.compiler.is_compiling() and conv_weights.shape[1] > 1 and state_indices.numel() > 0
            and conv_state.dtype == inputs.dtype and 0 <= null_slot < conv_state.shape[0]
            and state_rows(conv_state) is not None)


def _decode_rows(inputs, state_indices, has_initial_states, token_indices, null_slot):
    """``(state_indices, live, reads, rows)``: each request's slot (int64), whether it is not on the null slot,
    whether it reads a history, and its physical row."""
    R = state_indices.numel()
    state_indices = state_indices.to(torch.int64)
    live = state_indices != null_slot                                           # [R]
    reads = live if has_initial_states is None else live & (has_initial_states != 0)
    rows = torch.arange(R, device=inputs.device) if token_indices is None else token_indices.to(torch.int64)
    return state_indices, live, reads, rows


def _residual_(residual, rows, live, y, outer_residual) -> None:
    """``residual[rows] = (residual[rows] + y) + outer_residual[rows]`` (``+ y`` for live requests only), each
    add rounded."""
    res = residual.index_select(0, rows)
    new_res = torch.where(live[:, None], res + y, res)
    if outer_residual is not None:
        new_res.add_(outer_residual.index_select(0, rows))
    copy_rows_(residual, rows, new_res)


def decode_conv(inputs: torch.Tensor, residual: torch.Tensor, conv_state: torch.Tensor, conv_weights: torch.Tensor,
                state_indices: torch.Tensor, dilation: int, has_initial_states: torch.Tensor | None,
                token_indices: torch.Tensor | None, outer_residual: torch.Tensor | None, null_slot: int) -> None:
    """`ple_conv` of decode rows after its checks, where `takes_row_path` (see the module docstring)."""
    state = state_rows(conv_state)                                             # [num_slots * W, C]
    assert state is not None
    W = conv_state.shape[2]
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    R, C = state_indices.numel(), inputs.shape[1]
    dev, dt = inputs.device, inputs.dtype
    state_indices, live, reads, rows = _decode_rows(inputs, state_indices, has_initial_states, token_indices,
                                                    null_slot)
    b = torch.arange(S + 1, device=dev)
    first = state_indices * W                                                   # column 0's row (null: its own)
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
