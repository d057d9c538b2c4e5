"""The dilated depthwise causal convolution of a serving step (SPEC sections 5 and 6), as the specification.

For one request with conv inputs ``u`` (``[q, C]``) and history ``hist`` (the S inputs before
them, oldest first, then ``u``)::

    y_t = silu( sum_{j=0..K-1} w[:, j] * hist[S + t - (K-1-j) * d] )      S = (K-1) * d

``w[:, K-1]`` is the tap on the current token. Two entry points here (the training path,
``dilated_causal_conv``, is in ``training_conv``):

* ``ple_conv``: one serving step of prefill, decode or spec rows, reading and writing
  per-request conv states in place, adding ``y`` (and ``outer_residual``) into ``residual``.
* ``export_conv_checkpoints``: copy the S inputs before a position into a slot.

Written to be read, in the manner of causal-conv1d's ``causal_conv1d_ref``: a Python loop over
the requests that reads the index tensors on the host (``.tolist()``), builds each request's
``hist`` and applies the formula above. It is therefore neither sync-free nor
``torch.compile``-friendly; ``ple.vectorized`` (the ``"torch"`` backend) computes the same bits
with device-side index arithmetic, and ``ple.fast`` with Triton kernels.

Rounding points (SPEC section 8), the model's: the tap sum is accumulated in ``acc_dtype``
(float32; float64 for float64 inputs) in tap order and rounded to the input dtype, silu is
computed in ``acc_dtype`` and rounded, and each residual add is rounded.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from .. import _checks
from .gate import acc_dtype

__all__ = ["ple_conv", "export_conv_checkpoints"]


def conv_sums(hist: torch.Tensor, weight: torch.Tensor, dilation: int) -> torch.Tensor:
    """The tap sums of the last ``q`` rows of ``hist`` (``[S + q, C]``), before silu: ``[q, C]``.

    ``sum_j w[:, j] * hist[S + t - (K-1-j) * d]`` (SPEC section 5), in the dtype of ``hist`` and
    ``weight`` (the callers pass both in ``acc_dtype`` and round the result). Autograd flows
    through it (``dilated_causal_conv`` uses it too).
    """
    K = weight.shape[1]
    S = (K - 1) * dilation
    q = hist.shape[0] - S
    # SPEC 8: accumulated from zero in tap order j = 0..K-1 (a product, then a sum, each rounded to the
    # acc dtype), as the model's conv does; another order would change the float32 bits.
    out = hist.new_zeros(q, hist.shape[1])
    for j in range(K):
        lag = (K - 1 - j) * dilation                # tap j reads the input `lag` steps back
        out = out + weight[:, j] * hist[S - lag : S - lag + q]
    return out


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
    Logical row i of the call is physical row ``token_indices[i]`` (identity if None); physical
    rows no logical row maps to are left alone.

    For request r on slot ``state_indices[r]`` with q rows ``x`` (its logical rows, cut by
    ``query_start_loc``), the step reads a history ``hist = (S old columns) ++ x``, gives each
    row ``y_t = silu(sum_j w[:, j] * hist[S + t - (K-1-j) * d])`` and then rewrites the slot's
    first columns from ``hist``. Modes (SPEC section 6):

    * ``"prefill"``: requests cut by ``query_start_loc`` (``[R+1]``, logical rows);
      the old columns are the slot's ``[0, S)`` where ``has_initial_states[r]`` (default: all
      False, i.e. new sequences), zeros otherwise. Afterwards columns ``[0, S)`` hold the last
      S columns of ``hist``. Empty requests change nothing.
    * ``"decode"``: one row per request (logical row r is request r; ``query_start_loc``
      may be given, as ``[0, 1, ..., R]``); as prefill, but ``has_initial_states`` defaults
      to all True.
    * ``"spec"``: 1..``spec_query_len`` rows per request; the old columns are
      ``[o, o + S)`` with ``o = num_accepted_tokens[r] - 1``, always read (whatever
      ``has_initial_states`` says); afterwards columns ``[0, S + q - 1)`` hold ``hist[1:]``
      and later columns keep their bits.

    Every output reads the states as they were before the call. Inputs are stored in the
    state's dtype; a history read from the state goes through the input dtype first (so a
    column shifted by the step is rounded through the input dtype; columns the step does not
    write keep their bits).

    Rows of a request whose slot is ``null_slot`` get no conv term (``outer_residual`` is
    still added); the null slot is never read nor written. Rounding: the tap sum accumulated
    in float32 (float64 for float64 inputs) in tap order and rounded to the input dtype,
    silu computed in float32 and rounded, then the residual adds rounded one at a time:
    ``(residual + y) + outer_residual``.

    ``validate=False`` skips the value checks (index ranges, offsets, distinct slots);
    for callers that validated on the host, e.g. ``PLECache.schedule``; out-of-range
    values are then undefined behaviour.
    """
    check = _checks.ple_conv_call if validate else _checks.ple_conv_meta
    check(inputs, residual, conv_state, conv_weights, state_indices, mode=mode, dilation=dilation,
          query_start_loc=query_start_loc, has_initial_states=has_initial_states,
          num_accepted_tokens=num_accepted_tokens, spec_query_len=spec_query_len,
          token_indices=token_indices, outer_residual=outer_residual, null_slot=null_slot)
    S = (conv_weights.shape[1] - 1) * dilation
    C, dt = inputs.shape[1], inputs.dtype
    slots = state_indices.tolist()
    R = len(slots)
    rows = list(range(inputs.shape[0])) if token_indices is None else token_indices.tolist()   # logical -> physical
    # query_start_loc (prefill, spec) and num_accepted_tokens (spec) are required there: checked above.
    starts = list(range(R + 1)) if mode == "decode" else cast(torch.Tensor, query_start_loc).tolist()
    if mode == "spec":                 # SPEC 6: the history starts at column num_accepted - 1, always read
        first_col, reads = [a - 1 for a in cast(torch.Tensor, num_accepted_tokens).tolist()], [True] * R
    else:                              # SPEC 6: columns [0, S), or zeros; decode defaults to reading them
        first_col = [0] * R
        reads = [mode == "decode"] * R if has_initial_states is None else [bool(f) for f in has_initial_states.tolist()]

    # Read: every request's history, its tap sums and its new state, from the states before the step.
    acc = acc_dtype(dt)                             # float32 (float64 for float64 inputs)
    w = conv_weights.to(acc)
    sums = inputs.new_zeros(len(rows), C)           # logical rows; rows without a conv term stay 0 (unused)
    conv_spans, new_states = [], []
    for r, slot in enumerate(slots):
        lo, hi = starts[r], starts[r + 1]
        if lo == hi or slot == null_slot:          # empty request: nothing; null slot: never read or written
            continue
        o = first_col[r]
        old = conv_state[slot, :, o : o + S].T if reads[r] else conv_state.new_zeros(S, C)
        hist = torch.cat([old.to(dt), inputs[rows[lo:hi]]])     # [S + q, C]; old columns through the input dtype
        sums[lo:hi] = conv_sums(hist.to(acc), w, dilation).to(dt)     # SPEC 8: the tap sum, rounded
        conv_spans.append((lo, hi))
        new_states.append((slot, hist[1:] if mode == "spec" else hist[hi - lo :]))   # spec: S + q - 1; else S
    # silu once over all logical rows, not per request: the CPU kernel's vector body and scalar tail may
    # differ by an ulp in float32, and this keeps the bits of the vectorised backends (SPEC 8: silu in
    # acc dtype, rounded; in bfloat16 the rounded result is the same either way).
    y = F.silu(sums.to(acc)).to(dt)
    phys = torch.tensor(rows, dtype=torch.int64, device=inputs.device)
    out = residual[phys]                            # a copy, in logical order
    for lo, hi in conv_spans:
        out[lo:hi] = out[lo:hi] + y[lo:hi]          # SPEC 5: residual + y, rounded
    if outer_residual is not None:
        out = out + outer_residual[phys]            # then + outer_residual, rounded (also on null-slot rows)

    # Write: only now, so no output read a state this step wrote.
    residual[phys] = out
    for slot, cols in new_states:
        conv_state[slot, :, : cols.shape[0]] = cols.T.to(conv_state.dtype)   # stored in the state's dtype


def export_conv_checkpoints(inputs: torch.Tensor, conv_state: torch.Tensor, *,
                            query_start_loc: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor,
                            state_len: int, token_indices: torch.Tensor | None = None,
                            null_slot: int = 0, validate: bool = True) -> None:
    """Write prefix-cache checkpoints: ``conv_state[slots[r], :, 0:S] = inputs of rows [off - S, off)``.

    For request r (rows cut by ``query_start_loc``, logical rows mapped to physical rows of
    ``inputs`` through ``token_indices``, repeats allowed) with ``offsets[r] > 0``, the slot
    receives the state the request would have after the first ``offsets[r]`` tokens of this
    step (SPEC section 6), in the state's dtype, provided those rows hold at least S inputs:
    ``0 < offsets[r] < state_len`` or an offset past the request's rows is a ``ValueError``.
    ``offsets[r] == 0`` and ``slots[r] == null_slot`` write nothing; no other bit of any slot
    changes (columns from ``state_len`` on included).

    ``validate=False`` skips the value checks (index ranges, offsets, distinct slots);
    for callers that validated on the host, e.g. ``PLECache.schedule``; out-of-range
    values are then undefined behaviour.
    """
    check = _checks.export_call if validate else _checks.export_meta
    check(inputs, conv_state, query_start_loc=query_start_loc, offsets=offsets, slots=slots,
          state_len=state_len, token_indices=token_indices, null_slot=null_slot)
    S = state_len
    rows = list(range(inputs.shape[0])) if token_indices is None else token_indices.tolist()   # logical -> physical
    for start, off, slot in zip(query_start_loc.tolist(), offsets.tolist(), slots.tolist()):
        if off == 0 or slot == null_slot:
            continue
        window = rows[start + off - S : start + off]        # the S logical rows before position `off`
        conv_state[slot, :, :S] = inputs[window].T.to(conv_state.dtype)
