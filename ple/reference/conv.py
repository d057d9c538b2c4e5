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

Rounding follows the model: the tap sum is accumulated in float32 and rounded to
the input dtype, then silu, rounded; each residual add is rounded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _checks
from .gate import acc_dtype

__all__ = ["ple_conv", "export_conv_checkpoints", "conv_over_history"]


def conv_over_history(hist: torch.Tensor, weight: torch.Tensor, dilation: int) -> torch.Tensor:
    """Outputs for the last ``L - S`` positions of ``hist`` (``[L, C]``): ``silu(conv)`` in ``hist``'s dtype.

    ``weight`` is ``[C, K]``; positions ``[0, S)`` of ``hist`` are history only.
    """
    K = weight.shape[1]
    S = (K - 1) * dilation
    q = hist.shape[0] - S
    acc = acc_dtype(hist.dtype)
    h = hist.to(acc)
    w = weight.to(acc)
    out = torch.zeros(q, hist.shape[1], dtype=acc, device=hist.device)
    for j in range(K):
        lag = (K - 1 - j) * dilation                      # tap j reads the input `lag` steps back
        out = out + w[:, j] * h[S - lag: S - lag + q]
    return F.silu(out.to(hist.dtype).to(acc)).to(hist.dtype)


def ple_conv(inputs: torch.Tensor, residual: torch.Tensor, conv_state: torch.Tensor,
             conv_weights: torch.Tensor, state_indices: torch.Tensor, *, mode: str, dilation: int,
             query_start_loc: torch.Tensor | None = None, has_initial_states: torch.Tensor | None = None,
             num_accepted_tokens: torch.Tensor | None = None, spec_query_len: int = 1,
             token_indices: torch.Tensor | None = None, outer_residual: torch.Tensor | None = None,
             null_slot: int = 0) -> None:
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
    * ``"decode"``: one row per request; ``has_initial_states`` defaults to all True.
    * ``"spec"``: 1..``spec_query_len`` rows per request; the history is columns
      ``[o, o + S)`` with ``o = num_accepted_tokens[r] - 1``, always read; afterwards
      columns ``[0, S + q - 1)`` hold the history without its first column.

    Rows of a request whose slot is ``null_slot`` get no conv term (``outer_residual``
    is still added) and the null slot is never read or written. Inputs are stored in
    the state's dtype. Every output reads the states as they were before the call.
    The residual adds are rounded one at a time: ``(residual + y) + outer_residual``.
    """
    call = _checks.ple_conv_call(
        inputs, residual, conv_state, conv_weights, state_indices, mode=mode, dilation=dilation,
        query_start_loc=query_start_loc, has_initial_states=has_initial_states,
        num_accepted_tokens=num_accepted_tokens, spec_query_len=spec_query_len,
        token_indices=token_indices, outer_residual=outer_residual, null_slot=null_slot)
    S = call.state_len
    dev = inputs.device
    # Read every history before writing any state, so a state update can never feed another output.
    updates = []
    for r, slot in enumerate(call.slots):
        lo, hi = call.starts[r], call.starts[r + 1]
        if hi == lo:
            continue
        logical = torch.arange(lo, hi, device=dev)
        rows = logical if call.rows is None else torch.tensor(call.rows[lo:hi], device=dev)
        if slot == null_slot:
            if outer_residual is not None:
                residual[rows] = residual[rows] + outer_residual[rows]
            continue
        state = conv_state[slot]                                   # [C, W] view
        x = inputs[rows]                                            # [q, C]
        if mode == "spec":
            o = call.accepted[r] - 1
            prefix = state[:, o:o + S].T
        elif call.has_initial[r]:
            prefix = state[:, :S].T
        else:
            prefix = torch.zeros(S, x.shape[1], dtype=conv_state.dtype, device=dev)
        hist = torch.cat([prefix.to(inputs.dtype), x], dim=0)       # [S + q, C]
        y = conv_over_history(hist, conv_weights, dilation)
        out = residual[rows] + y
        if outer_residual is not None:
            out = out + outer_residual[rows]
        # What the slot holds afterwards: spec keeps every window of the step, the others the last S.
        keep = hist[1:] if mode == "spec" else hist[-S:] if S else hist[:0]
        updates.append((rows, out, slot, keep))
    for rows, out, slot, keep in updates:
        residual[rows] = out
        conv_state[slot, :, : keep.shape[0]] = keep.T.to(conv_state.dtype)


def export_conv_checkpoints(inputs: torch.Tensor, conv_state: torch.Tensor, *,
                            query_start_loc: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor,
                            state_len: int, token_indices: torch.Tensor | None = None,
                            null_slot: int = 0) -> None:
    """Write prefix-cache checkpoints: ``conv_state[slots[r], :, 0:S] = inputs of rows [off - S, off)``.

    For request r (rows cut by ``query_start_loc``, logical rows mapped through
    ``token_indices``) with ``offsets[r] > 0``, the slot receives the state the request
    would have after the first ``offsets[r]`` tokens of this step, provided those rows
    hold at least S inputs: ``0 < offsets[r] < state_len`` or an offset past the
    request's rows is a ``ValueError``. ``offsets[r] == 0`` and ``slots[r] == null_slot``
    write nothing.
    """
    call = _checks.export_call(inputs, conv_state, query_start_loc=query_start_loc,
                                 offsets=offsets, slots=slots, state_len=state_len,
                                 token_indices=token_indices, null_slot=null_slot)
    for r, (off, slot) in enumerate(zip(call.offsets, call.slots)):
        if off == 0 or slot == null_slot:
            continue
        logical = list(range(call.starts[r] + off - state_len, call.starts[r] + off))
        rows = logical if call.rows is None else [call.rows[i] for i in logical]
        conv_state[slot, :, :state_len] = inputs[rows].T.to(conv_state.dtype)
