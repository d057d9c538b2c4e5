"""The dilated depthwise causal convolution of a serving step (docs/spec.md sections 5 and 6).

For one request with conv inputs ``u`` (``[L, C]``) and history ``hist`` (the S
inputs before them, oldest first, then ``u``)::

    y_t = silu( sum_{j=0..K-1} w[:, j] * hist[S + t - (K-1-j) * d] )      S = (K-1) * d

``w[:, K-1]`` is the tap on the current token. Two entry points here (the training
path, ``dilated_causal_conv``, is in ``training_conv``):

* ``ple_conv``: one serving step of prefill, decode or spec rows, reading and
  writing per-request conv states in place, adding ``y`` (and ``outer_residual``)
  into ``residual``.
* ``export_conv_checkpoints``: copy the S inputs before a position into a slot.

Both are vectorised over requests and read index values only on the device (each
logical row finds its request with ``torch.searchsorted`` on ``query_start_loc``),
so with ``validate=False`` they turn no tensor into a Python value and trace under
``torch.compile(fullgraph=True)``.

Rounding follows the model: the tap sum is accumulated in float32 and rounded to
the input dtype, then silu, rounded; each residual add is rounded.

``ple_conv`` has two paths (``ple/vectorized/__init__.py`` has the measurements): the general one
below, for every mode, layout, dtype and device, eager or compiled, and, for eager decode rows on
``PLECache``'s layout (``decode.takes_row_path``), ``decode.decode_conv``: a gather and a scatter of the
windows in a fixed number of ops (about 45, most on a few index values) whatever R is. States are
written as rows where the layout allows (``rows.state_rows``, ``rows.copy_rows_``: under
``torch.compile`` the operator ``ple_torch::copy_rows_``, which mutates the cache's conv states in
place).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _checks
from .. import reference as _reference
from ..backends import twin
from ..reference.gate import acc_dtype
from .decode import decode_conv, takes_row_path
from .rows import copy_rows_, state_rows

__all__ = ["ple_conv", "export_conv_checkpoints"]


def _row_requests(query_start_loc: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per logical row: its request and the request's first row (``query_start_loc`` ``[R+1]`` int64, on the
    device)."""
    rows = torch.arange(num_rows, device=query_start_loc.device)
    req = torch.searchsorted(query_start_loc[1:], rows, right=True).clamp(max=max(query_start_loc.numel() - 2, 0))
    return req, query_start_loc[req]


def _read_windows(conv_state: torch.Tensor, state_indices: torch.Tensor, owns: torch.Tensor, width: int,
                  null_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's slot to read and write, and its columns ``[0, width)`` as ``[R, width, C]`` (raw bits).

    The write has a fixed shape, so every request has a slot: an owner (``owns``: its slots
    are distinct) its own, every other request a stand-in ``z``, the null slot when it
    lies in ``[0, num_slots)``, else slot 0; see `_write_windows`.
    """
    z = null_slot if 0 <= null_slot < conv_state.shape[0] else 0
    target = torch.where(owns, state_indices, z)
    if conv_state.shape[0] == 0:                        # no slots: every request is on the null slot
        return target, conv_state.new_zeros(state_indices.numel(), conv_state.shape[1], width).transpose(1, 2)
    return target, conv_state[target[:, None], :, torch.arange(width, device=state_indices.device)]


def _write_windows(conv_state: torch.Tensor, target: torch.Tensor, owns: torch.Tensor, new: torch.Tensor,
                   null_slot: int) -> None:
    """``conv_state[target[r], :, c] = new[r, c]`` for ``c < width``: owners' new windows, no other bit changed.

    ``target`` and ``new`` (``[R, width, C]``, state dtype) come from `_read_windows`, with
    every non-owner's ``new`` the window it read. Those rewrite the stand-in ``z`` with the
    bits it had: its own, unless (``z`` = slot 0 standing in for an out-of-range null slot)
    an owner writes it, then that owner's. Rewriting a slot's own bits changes nothing, so
    the null slot's bits are unchanged.
    """
    R, width = new.shape[:2]
    num_slots = conv_state.shape[0]
    if R == 0 or width == 0 or num_slots == 0:
        return
    if not 0 <= null_slot < num_slots:
        hit = owns & (target == 0)                                            # at most one owner of slot 0
        z_final = torch.where(hit.any(), new[hit.to(torch.int8).argmax()], new[(~owns).to(torch.int8).argmax()])
        new = torch.where(owns[:, None, None], new, z_final)
    rows = state_rows(conv_state)
    if rows is None:
        conv_state[target[:, None], :, torch.arange(width, device=target.device)] = new
    else:                                                                     # columns as rows: one row copy
        c = torch.arange(width, device=target.device)
        copy_rows_(rows, (target[:, None] * conv_state.shape[2] + c).flatten(), new.reshape(R * width, -1))


@twin(_reference.ple_conv)
def ple_conv(inputs: torch.Tensor, residual: torch.Tensor, conv_state: torch.Tensor,
             conv_weights: torch.Tensor, state_indices: torch.Tensor, *, mode: str, dilation: int,
             query_start_loc: torch.Tensor | None = None, has_initial_states: torch.Tensor | None = None,
             num_accepted_tokens: torch.Tensor | None = None, spec_query_len: int = 1,
             token_indices: torch.Tensor | None = None, outer_residual: torch.Tensor | None = None,
             null_slot: int = 0, validate: bool = True) -> None:
    """Eager decode rows on a state with a row view (``PLECache``'s layout) go to ``decode.decode_conv``
    (``decode.takes_row_path``); every other call takes the general path, all requests at once: logical
    row i finds its request r (``searchsorted`` on ``query_start_loc``; decode: one row per request) and
    its position p, tap j reads ``hist_r[S + p - lag_j]`` from ``inputs`` or from the slot's old columns,
    and the new columns (``new[:, c] = hist_r[base + c]``, ``base = q_r`` and S of them; spec: ``base = 1``,
    ``S + q_r - 1`` of them) are computed from the states as they were before the call, then written with a
    fixed shape: the null slot's own bits, read first, are written back to it (``_write_windows``). No
    tensor becomes a Python value after the checks.

    States are written as rows (``rows.copy_rows_``; under ``torch.compile`` the operator
    ``ple_torch::copy_rows_``, which mutates the cache in place) where the state has a row view
    (``rows.state_rows``: ``channels_last``, or one slot, column or channel), else by advanced indexing
    (``channels_first``). A state of another dtype than the inputs keeps the raw bits of every column the
    step does not write. ``ple/vectorized/__init__.py`` lists every branch."""
    check = _checks.ple_conv_call if _checks.validating(validate) else _checks.ple_conv_meta
    check(inputs, residual, conv_state, conv_weights, state_indices, mode=mode, dilation=dilation,
          query_start_loc=query_start_loc, has_initial_states=has_initial_states,
          num_accepted_tokens=num_accepted_tokens, spec_query_len=spec_query_len,
          token_indices=token_indices, outer_residual=outer_residual, null_slot=null_slot)
    _ple_conv(inputs, residual, conv_state, conv_weights, state_indices, mode, dilation, query_start_loc,
              has_initial_states, num_accepted_tokens, spec_query_len, token_indices, outer_residual, null_slot)


def _ple_conv(inputs: torch.Tensor, residual: torch.Tensor, conv_state: torch.Tensor, conv_weights: torch.Tensor,
              state_indices: torch.Tensor, mode: str, dilation: int, query_start_loc: torch.Tensor | None,
              has_initial_states: torch.Tensor | None, num_accepted_tokens: torch.Tensor | None,
              spec_query_len: int, token_indices: torch.Tensor | None, outer_residual: torch.Tensor | None,
              null_slot: int) -> None:
    """`ple_conv` after its checks (a composition that checked its whole call, ``ple_prefill``, calls this)."""
    R = state_indices.numel()
    if mode == "decode":
        if takes_row_path(inputs, conv_state, conv_weights, state_indices, null_slot):
            decode_conv(inputs, residual, conv_state, conv_weights, state_indices, dilation, has_initial_states,
                        token_indices, outer_residual, null_slot)
            return
        query_start_loc = torch.arange(R + 1, device=inputs.device)             # one row per request
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    C = inputs.shape[1]
    dev, dt = inputs.device, inputs.dtype
    N = inputs.shape[0] if token_indices is None else token_indices.numel()    # logical rows
    rows = torch.arange(N, device=dev) if token_indices is None else token_indices.to(torch.int64)
    assert query_start_loc is not None                                          # checked by ple_conv_meta
    query_start_loc = query_start_loc.to(torch.int64)
    req, first = _row_requests(query_start_loc, N)
    pos = torch.arange(N, device=dev) - first                                   # position in its request
    q = query_start_loc[1:] - query_start_loc[:-1]                              # [R] rows per request

    state_indices = state_indices.to(torch.int64)
    live = state_indices != null_slot                                           # [R]
    if mode == "spec":
        assert num_accepted_tokens is not None                                  # checked by ple_conv_meta
        reads = live
        o = num_accepted_tokens.to(torch.int64) - 1
    else:
        # has_initial_states defaults to all False in prefill (new sequences), all True in decode
        flags = has_initial_states != 0 if has_initial_states is not None else torch.full((R,), mode == "decode",
                                                                                            device=dev)
        reads = live & flags
        o = torch.zeros(R, dtype=torch.int64, device=dev)

    # Every request's old columns [0, width): its history is read from them, the new state written over them.
    width = S + spec_query_len - 1 if mode == "spec" else S
    target, old = _read_windows(conv_state, state_indices, live, width, null_slot)
    old = old.reshape(R * width, C)                                             # row r*width + c: column c of r
    # All histories in one table: row 0 zeros (no history), rows 1 + [r*width, (r+1)*width) the old columns
    # of request r (so hist_r[k] = row 1 + r*width + o_r + k for k < S), then row 1 + R*width + i: logical row i.
    hist = torch.cat([inputs.new_zeros(1, C), old.to(dt), inputs.index_select(0, rows)])

    def hist_row(r, k):
        """Row of ``hist_r[k]``: ``k < S`` its old column ``o_r + k`` (or zeros), else logical row
        ``query_start_loc[r] + k - S``."""
        return torch.where(k < S, torch.where(reads[r], 1 + r * width + o[r] + k, 0),
                           1 + R * width + query_start_loc[r] + k - S)

    acc = acc_dtype(dt)
    w = conv_weights.to(acc)
    out = torch.zeros(N, C, dtype=acc, device=dev)
    for j in range(K):
        lag = (K - 1 - j) * dilation                      # tap j reads the input `lag` steps back
        out = out + w[:, j] * hist.index_select(0, hist_row(req, S + pos - lag)).to(acc)
    y = F.silu(out.to(dt).to(acc)).to(dt)

    res = residual.index_select(0, rows)
    new_res = torch.where(live[req][:, None], res + y, res)
    if outer_residual is not None:
        new_res = new_res + outer_residual.index_select(0, rows)

    # What each slot holds afterwards: spec keeps every window of the step, the others the last S;
    # a column not written (null slot, empty request, spec past S + q - 1) keeps its old bits.
    c = torch.arange(width, device=dev)
    base, n_write = (torch.ones_like(q), S + q - 1) if mode == "spec" else (q, torch.full_like(q, S))
    write = (c < n_write[:, None]) & (q[:, None] > 0) & live[:, None]                # [R, width]
    table, first_old = hist, 1                                                  # rows of the old bits
    if conv_state.dtype != dt:        # then hist's old columns went through the input dtype: keep the raw ones
        table, first_old = torch.cat([hist.to(conv_state.dtype), old]), hist.shape[0]
    r = torch.arange(R, device=dev)[:, None]
    src = torch.where(write, hist_row(r, base[:, None] + c), first_old + r * width + c)
    new = table.index_select(0, src.flatten()).to(conv_state.dtype).reshape(R, width, C)

    residual.index_copy_(0, rows, new_res)
    _write_windows(conv_state, target, live, new, null_slot)


@twin(_reference.export_conv_checkpoints)
def export_conv_checkpoints(inputs: torch.Tensor, conv_state: torch.Tensor, *,
                            query_start_loc: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor,
                            state_len: int, token_indices: torch.Tensor | None = None,
                            null_slot: int = 0, validate: bool = True) -> None:
    """All requests at once, on the device, with no host read after the checks: each owner's S new
    columns are gathered from ``inputs`` and written with ``ple_conv``'s fixed-shape write
    (`_write_windows`: as rows where the state has a row view, else by advanced indexing), which leaves
    the bits of every other slot alone. A call with no logical rows returns at once."""
    check = _checks.export_call if _checks.validating(validate) else _checks.export_meta
    check(inputs, conv_state, query_start_loc=query_start_loc, offsets=offsets, slots=slots,
          state_len=state_len, token_indices=token_indices, null_slot=null_slot)
    num_logical = inputs.shape[0] if token_indices is None else token_indices.numel()
    if num_logical == 0:                                # no rows: every offset is 0
        return
    dev = inputs.device
    S = state_len
    off = offsets.to(torch.int64)
    sl = slots.to(torch.int64)
    owns = (off > 0) & (sl != null_slot)
    target, old = _read_windows(conv_state, sl, owns, S, null_slot)
    logical = query_start_loc.to(torch.int64)[:-1, None] + off[:, None] - S + torch.arange(S, device=dev)
    logical = logical.clamp(0, num_logical - 1)                                 # rows of non-owners: any
    rows = logical if token_indices is None else token_indices.to(torch.int64)[logical]
    new = torch.where(owns[:, None, None], inputs[rows].to(conv_state.dtype), old)     # [R, S, C]
    _write_windows(conv_state, target, owns, new, null_slot)
