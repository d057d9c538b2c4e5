"""The dilated depthwise causal convolution of a serving step (SPEC sections 5 and 6).

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

Decode rows (the hot serving path) take `_decode`: a fixed ~30 ops whatever R is, with the
state's columns read and written as rows (`_state_rows`) and every row scatter done on a 16-byte
view of the rows (`_copy_rows_`: ATen's CPU ``index_copy_`` costs per element). Under
``torch.compile`` state writes go through the custom op ``ple_torch::copy_rows_``, so the
compiled step mutates the cache's conv states in place instead of rebuilding them (see there).
Prefill and spec rows take the general gather formulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _checks
from .. import reference as _reference
from ..backends import twin
from ..reference.gate import acc_dtype
from .training_conv import conv_activation, exact_products, multiply_add_

__all__ = ["ple_conv", "export_conv_checkpoints"]


def _row_requests(query_start_loc: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per logical row: its request and the request's first row (``query_start_loc`` ``[R+1]``, on the device)."""
    qsl = query_start_loc.to(torch.int64)
    rows = torch.arange(num_rows, device=qsl.device)
    req = torch.searchsorted(qsl[1:], rows, right=True).clamp(max=max(qsl.numel() - 2, 0))
    return req, qsl[req]


def _read_windows(conv_state: torch.Tensor, slots: torch.Tensor, owns: torch.Tensor, width: int,
                  null_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's slot to read and write, and its columns ``[0, width)`` as ``[R, width, C]`` (raw bits).

    The write has a fixed shape, so every request has a slot: an owner (``owns``: its slots
    are distinct) its own, every other request a stand-in ``z``, the null slot when it
    lies in ``[0, num_slots)``, else slot 0; see `_write_windows`.
    """
    z = null_slot if 0 <= null_slot < conv_state.shape[0] else 0
    target = torch.where(owns, slots, z)
    if conv_state.shape[0] == 0:                        # no slots: every request is on the null slot
        return target, conv_state.new_zeros(slots.numel(), conv_state.shape[1], width).transpose(1, 2)
    return target, conv_state[target[:, None], :, torch.arange(width, device=slots.device)]


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
    rows = _state_rows(conv_state)
    if rows is None:
        conv_state[target[:, None], :, torch.arange(width, device=target.device)] = new
    else:                                                                     # columns as rows: one row copy
        c = torch.arange(width, device=target.device)
        _copy_rows_(rows, (target[:, None] * conv_state.shape[2] + c).flatten(), new.reshape(R * width, -1))


@twin(_reference.ple_conv)
def ple_conv(inputs: torch.Tensor, residual: torch.Tensor, conv_state: torch.Tensor,
             conv_weights: torch.Tensor, state_indices: torch.Tensor, *, mode: str, dilation: int,
             query_start_loc: torch.Tensor | None = None, has_initial_states: torch.Tensor | None = None,
             num_accepted_tokens: torch.Tensor | None = None, spec_query_len: int = 1,
             token_indices: torch.Tensor | None = None, outer_residual: torch.Tensor | None = None,
             null_slot: int = 0, validate: bool = True) -> None:
    """One serving step of the conv, in place: ``residual += y (+ outer_residual)``; states updated.

    Shapes: ``inputs``, ``residual``, ``outer_residual``: ``[T, C]`` (physical rows);
    ``conv_state``: ``[num_slots, C, W]``, any strides, ``W >= S`` (``S + spec_query_len - 1``
    for spec); ``conv_weights``: ``[C, K]``; ``state_indices``: ``[R]``, any stride.
    Logical row i of the call is physical row ``token_indices[i]`` (identity if None).

    Modes (SPEC section 6):

    * ``"prefill"``: requests cut by ``query_start_loc`` (``[R+1]``, logical rows);
      ``has_initial_states[r]`` (default: all False, i.e. new sequences) says whether
      the slot's columns ``[0, S)`` are the request's history or zeros are. After the
      call, columns ``[0, S)`` hold the last S inputs of the history. Empty requests
      change nothing.
    * ``"decode"``: one row per request (logical row r is request r; ``query_start_loc``
      may be given, as ``[0, 1, ..., R]``); ``has_initial_states`` defaults to all True.
    * ``"spec"``: 1..``spec_query_len`` rows per request; the history is columns
      ``[o, o + S)`` with ``o = num_accepted_tokens[r] - 1``, always read; afterwards
      columns ``[0, S + q - 1)`` hold the history without its first column.

    All requests at once: logical row i finds its request r (``searchsorted`` on
    ``query_start_loc``) and its position p; tap j reads ``hist_r[S + p - lag_j]``,
    from ``inputs`` or from the slot's old columns. The new columns
    ``new[:, c] = hist_r[base + c]`` for ``c < n_write`` (``base = q_r``, ``n_write = S``;
    spec: ``base = 1``, ``n_write = S + q_r - 1``) are computed from the states as they
    were before the call, then written. Inputs are stored in the state's dtype (a history
    read from the state goes through the input dtype first).

    Rows of a request whose slot is ``null_slot`` get no conv term (``outer_residual``
    is still added); their outputs do not depend on the null slot's contents and its bits
    are unchanged (the write has a fixed shape, so the null slot's own bits, read before
    the call, are written back to it; see ``_write_windows``). The residual adds are
    rounded one at a time: ``(residual + y) + outer_residual``.

    ``validate=False`` skips the value checks (index ranges, offsets, distinct slots);
    for callers that validated on the host, e.g. ``PLECache.schedule``; out-of-range
    values are then undefined behaviour. Either way no tensor is turned into a Python
    value after the checks.
    """
    check = _checks.ple_conv_call if validate else _checks.ple_conv_meta
    check(inputs, residual, conv_state, conv_weights, state_indices, mode=mode, dilation=dilation,
          query_start_loc=query_start_loc, has_initial_states=has_initial_states,
          num_accepted_tokens=num_accepted_tokens, spec_query_len=spec_query_len,
          token_indices=token_indices, outer_residual=outer_residual, null_slot=null_slot)
    if mode == "decode":
        _decode(inputs, residual, conv_state, conv_weights, state_indices, dilation, has_initial_states,
                token_indices, outer_residual, null_slot)
        return
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    C = inputs.shape[1]
    dev, dt = inputs.device, inputs.dtype
    R = state_indices.numel()
    N = inputs.shape[0] if token_indices is None else token_indices.numel()    # logical rows
    rows = torch.arange(N, device=dev) if token_indices is None else token_indices.to(torch.int64)
    if mode == "decode":
        req, first = torch.arange(N, device=dev), torch.arange(N, device=dev)
        starts = torch.arange(R + 1, device=dev)
    else:
        assert query_start_loc is not None                                      # checked by ple_conv_meta
        req, first = _row_requests(query_start_loc, N)
        starts = query_start_loc.to(torch.int64)
    pos = torch.arange(N, device=dev) - first                                   # position in its request
    q = starts[1:] - starts[:-1]                                                # [R] rows per request

    slots = state_indices.to(torch.int64)
    live = slots != null_slot                                                   # [R]
    if mode == "spec":
        assert num_accepted_tokens is not None                                  # checked by ple_conv_meta
        reads = live
        o = num_accepted_tokens.to(torch.int64) - 1
    else:
        default = mode == "decode"
        flags = torch.full((R,), default, device=dev) if has_initial_states is None else has_initial_states != 0
        reads = live & flags
        o = torch.zeros(R, dtype=torch.int64, device=dev)

    # Every request's old columns [0, width): its history is read from them, the new state written over them.
    width = S + spec_query_len - 1 if mode == "spec" else S
    target, old = _read_windows(conv_state, slots, live, width, null_slot)
    old = old.reshape(R * width, C)                                             # row r*width + c: column c of r
    # All histories in one table: row 0 zeros (no history), rows 1 + [r*width, (r+1)*width) the old columns
    # of request r (so hist_r[k] = row 1 + r*width + o_r + k for k < S), then row 1 + R*width + i: logical row i.
    hist = torch.cat([inputs.new_zeros(1, C), old.to(dt), inputs.index_select(0, rows)])

    def hist_row(r, k):
        """Row of ``hist_r[k]``: ``k < S`` its old column ``o_r + k`` (or zeros), else logical row
        ``starts[r] + k - S``."""
        return torch.where(k < S, torch.where(reads[r], 1 + r * width + o[r] + k, 0), 1 + R * width + starts[r] + k - S)

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


def _wide_type(*ts: torch.Tensor) -> torch.dtype | None:
    """The widest element type (16 or 8 bytes) every ``[n, C]`` tensor of ``ts`` can be viewed as, or None."""
    if torch.compiler.is_compiling():
        return None
    isz = ts[0].element_size()
    for wide in (torch.complex128, torch.int64):
        w = wide.itemsize
        if w > isz and all(t.dim() == 2 and t.element_size() == isz and not t.is_complex() and t.shape[1] > 0
                           and t.stride(1) == 1 and (t.shape[1] * isz) % w == 0 and (t.stride(0) * isz) % w == 0
                           and (t.storage_offset() * isz) % w == 0 for t in ts):
            return wide
    return None


def _copy_rows_eager(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    wide = _wide_type(dst, src)
    if wide is None:
        dst.index_copy_(0, index, src)
    else:
        dst.view(wide).index_copy_(0, index, src.view(wide))


@torch.library.custom_op("ple_torch::copy_rows_", mutates_args=("dst",))
def _copy_rows_op(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """`_copy_rows_` as an opaque op that mutates ``dst`` (see there)."""
    _copy_rows_eager(dst, index, src)


def _copy_rows_(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(0, index, src)`` for ``[n, C]`` rows, on a wide view of both where they allow one.

    ATen's CPU ``index_copy_`` / ``index_put_`` cost per *element* (a 2 MiB bfloat16 row scatter takes
    ~10x an ``index_select`` of it); reinterpreting the rows as 16-byte elements copies the same bits
    8x fewer times. Bits are copied, never computed on.

    Under ``torch.compile`` it is the custom op ``ple_torch::copy_rows_`` (declared as mutating ``dst``):
    ``dst`` is a view of a slice of ``PLECache.conv_states``, a graph input, and a plain in-place op on
    such a view makes AOTAutograd rebuild and copy back the *whole* input (every slot of every layer,
    twice, each step); the op's mutation of the view is applied in place.
    """
    if torch.compiler.is_compiling():
        _copy_rows_op(dst, index, src)
    else:
        _copy_rows_eager(dst, index, src)


def _state_rows(conv_state: torch.Tensor) -> torch.Tensor | None:
    """``conv_state`` (``[num_slots, C, W]``) as its ``[num_slots * W, C]`` rows (column w of slot s is row
    ``s * W + w``), a view; None where the layout has no such view (``channels_first``)."""
    n, C, W = conv_state.shape
    sv = conv_state.transpose(1, 2)                                             # [num_slots, W, C]
    if n * W == 0 or (n > 1 and W > 1 and sv.stride(0) != W * sv.stride(1)):
        return None
    return sv.view(n * W, C)


def _decode(inputs, residual, conv_state, conv_weights, state_indices, dilation, has_initial_states,
            token_indices, outer_residual, null_slot) -> None:
    """`ple_conv` of decode rows (one per request), in a fixed number of ops (about 30) whatever R is.

    A request's history is its slot's columns ``0..S-1``, then its input. With the state's columns as
    rows (`_state_rows`; ``PLECache``'s default ``channels_last`` layout) the step is three gathers and
    one scatter of rows: every request's S columns are read into a table (followed by the inputs and a
    zero row); the K taps of every request (columns ``j * d``, then the input; the zero row for a request
    without history) are gathered from it, and so is every new window (columns ``1..S-1`` then the
    input; zeros before the input without history; a request on the null slot takes its S columns
    unshifted, so the null slot's bits do not change), which one ``index_copy_`` writes back. Other
    layouts, a state dtype other than the inputs' and an out-of-range null slot take `_decode_general`.
    """
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    R, C = state_indices.numel(), inputs.shape[1]
    num_slots, W = conv_state.shape[0], conv_state.shape[2]
    state_rows = _state_rows(conv_state) if S > 0 and R > 0 else None
    if state_rows is None or conv_state.dtype != inputs.dtype or not 0 <= null_slot < num_slots:
        _decode_general(inputs, residual, conv_state, conv_weights, state_indices, dilation, has_initial_states,
                        token_indices, outer_residual, null_slot)
        return
    if torch.compiler.is_compiling():
        _decode_compiled(inputs, residual, state_rows, W, conv_weights, state_indices, dilation, has_initial_states,
                         token_indices, outer_residual, null_slot)
        return
    dev, dt = inputs.device, inputs.dtype
    acc = acc_dtype(dt)
    slots = state_indices.to(torch.int64)
    live = slots != null_slot                                                   # [R]
    reads = live if has_initial_states is None else live & (has_initial_states != 0)
    rows = torch.arange(R, device=dev) if token_indices is None else token_indices.to(torch.int64)
    c = torch.arange(S, device=dev)
    r = torch.arange(R, device=dev)[:, None]
    first = (torch.where(live, slots, null_slot) * W)[:, None]                  # [R, 1]: column 0's row
    # The table: rows r*S + c the S columns read, R*S + r the inputs, R*S + R zeros.
    table = state_rows.new_empty(R * S + R + 1, C)
    torch.index_select(state_rows, 0, (first + c).flatten(), out=table[:R * S])
    torch.index_select(inputs, 0, rows, out=table[R * S:R * S + R])
    table[R * S + R].zero_()
    zero, x_row = R * S + R, R * S + r
    tap = torch.where(reads[:, None], r * S + torch.arange(K - 1, device=dev) * dilation, zero)
    taps = table.index_select(0, torch.cat([tap, x_row], 1).flatten()).to(acc).view(R, K, C)
    wt = conv_weights.to(acc).t().contiguous()                                  # [K, C], tap j: wt[j]
    u = taps.new_zeros(R, C)
    exact = exact_products(dt, conv_weights.dtype)
    for j in range(K):
        multiply_add_(u, taps[:, j], wt[j], exact)
    y = conv_activation(u, dt, inplace=True)
    res = residual.index_select(0, rows)
    new_res = torch.where(live[:, None], res + y, res)
    if outer_residual is not None:
        new_res = new_res + outer_residual.index_select(0, rows)
    _copy_rows_(residual, rows, new_res)
    # Window column c afterwards: column c + 1 (zeros without history) for c < S-1, then the input;
    # on the null slot column c itself.
    shifted = torch.where(c < S - 1, torch.where(reads[:, None], r * S + c + 1, zero), x_row)
    new = table.index_select(0, torch.where(live[:, None], shifted, r * S + c).flatten())
    _copy_rows_(state_rows, (first + c).flatten(), new)


def _decode_compiled(inputs, residual, state_rows, W, conv_weights, state_indices, dilation, has_initial_states,
                     token_indices, outer_residual, null_slot) -> None:
    """`_decode` as inductor fuses it: gathers and selects it fuses into one pass, the taps' weights stacked
    (a buffer it realises; a transposed view it would gather element by element), the window written back
    with ``ple_torch::copy_rows_`` (see `_copy_rows_`)."""
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    R, C = state_indices.numel(), inputs.shape[1]
    dev, dt = inputs.device, inputs.dtype
    acc = acc_dtype(dt)
    slots = state_indices.to(torch.int64)
    live = slots != null_slot
    reads = live if has_initial_states is None else live & (has_initial_states != 0)
    rows = torch.arange(R, device=dev) if token_indices is None else token_indices.to(torch.int64)
    c = torch.arange(S, device=dev)
    first = (torch.where(live, slots, null_slot) * W)[:, None]
    old = state_rows[(first + c).flatten()].view(R, S, C)                       # the S columns read
    x = inputs[rows]
    wt = torch.stack(conv_weights.to(acc).unbind(1))                            # [K, C]
    u = x.new_zeros(R, C, dtype=acc)
    for j in range(K - 1):
        u = u + torch.where(reads[:, None], old[:, j * dilation].to(acc), 0.0) * wt[j]
    u = u + x.to(acc) * wt[K - 1]
    y = F.silu(u.to(dt).to(acc)).to(dt)
    res = residual[rows]
    new_res = torch.where(live[:, None], res + y, res)
    if outer_residual is not None:
        new_res = new_res + outer_residual[rows]
    residual.index_copy_(0, rows, new_res)
    shifted = torch.cat([torch.where(reads[:, None, None], old[:, 1:], old.new_zeros(())), x[:, None]], 1)
    new = torch.where(live[:, None, None], shifted, old)
    _copy_rows_(state_rows, (first + c).flatten(), new.view(R * S, C))


def _decode_general(inputs, residual, conv_state, conv_weights, state_indices, dilation, has_initial_states,
                    token_indices, outer_residual, null_slot) -> None:
    """`_decode` for any layout and state dtype: the windows gathered as ``[R, S, C]`` and written back whole."""
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    R, C = state_indices.numel(), inputs.shape[1]
    dev, dt, st = inputs.device, inputs.dtype, conv_state.dtype
    acc = acc_dtype(dt)
    num_slots = conv_state.shape[0]
    slots = state_indices.to(torch.int64)
    live = slots != null_slot                                                   # [R]
    rows = torch.arange(R, device=dev) if token_indices is None else token_indices.to(torch.int64)
    x = inputs.index_select(0, rows)                                            # [R, C]
    wt = conv_weights.to(acc).t().contiguous()                                  # [K, C], tap j: wt[j]
    u = x.new_zeros(R, C, dtype=acc)
    exact = exact_products(dt, conv_weights.dtype)
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
            multiply_add_(u, taps[:, j], wt[j], exact)
    multiply_add_(u, x.to(acc), wt[K - 1], exact)
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
    if not 0 <= null_slot < num_slots:                                          # stand-in slot 0: see _write_windows
        hit = live & (target == 0)
        z_final = torch.where(hit.any(), new[hit.to(torch.int8).argmax()], new[(~live).to(torch.int8).argmax()])
        new = torch.where(live[:, None, None], new, z_final)
    sv.index_copy_(0, target, new)


@twin(_reference.export_conv_checkpoints)
def export_conv_checkpoints(inputs: torch.Tensor, conv_state: torch.Tensor, *,
                            query_start_loc: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor,
                            state_len: int, token_indices: torch.Tensor | None = None,
                            null_slot: int = 0, validate: bool = True) -> None:
    """Write prefix-cache checkpoints: ``conv_state[slots[r], :, 0:S] = inputs of rows [off - S, off)``.

    For request r (rows cut by ``query_start_loc``, logical rows mapped through
    ``token_indices``) with ``offsets[r] > 0``, the slot receives the state the request
    would have after the first ``offsets[r]`` tokens of this step, provided those rows
    hold at least S inputs: ``0 < offsets[r] < state_len`` or an offset past the
    request's rows is a ``ValueError``. ``offsets[r] == 0`` and ``slots[r] == null_slot``
    write nothing (no bit of any slot changes; see ``ple_conv`` for how the fixed-shape
    write leaves other slots alone). All requests at once, on the device.

    ``validate=False`` skips the value checks (index ranges, offsets, distinct slots);
    for callers that validated on the host, e.g. ``PLECache.schedule``; out-of-range
    values are then undefined behaviour.
    """
    check = _checks.export_call if validate else _checks.export_meta
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
