"""The dilated depthwise causal convolution of a serving step, as the specification.

Specified in ``docs/spec.md`` (``../../docs/spec.md`` from this file), sections 5 (the convolution), 6 (conv
states and the serving modes), 7.8 (``ple_conv``), 7.9 (``export_conv_checkpoints``) and 8 (rounding).

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

Rounding points (docs/spec.md section 8), the model's: the tap sum is accumulated in ``acc_dtype``
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


def conv_sums(hist: torch.Tensor, conv_weights: torch.Tensor, dilation: int) -> torch.Tensor:
    """The tap sums of the last ``q`` rows of ``hist`` (``[S + q, C]``), before silu: ``[q, C]``.

    ``sum_j w[:, j] * hist[S + t - (K-1-j) * d]`` (docs/spec.md section 5) with ``w = conv_weights``
    (``[C, K]``), in the dtype of ``hist`` and ``conv_weights`` (the callers pass both in ``acc_dtype``
    and round the result). Autograd flows through it (``dilated_causal_conv`` uses it too).
    """
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    q = hist.shape[0] - S
    # docs/spec.md 8: accumulated from zero in tap order j = 0..K-1 (a product, then a sum, each rounded to the
    # acc dtype; no fused multiply-add), as the model's conv does; another order would change the float32 bits.
    out = hist.new_zeros(q, hist.shape[1])
    for j in range(K):
        lag = (K - 1 - j) * dilation                # tap j reads the input `lag` steps back
        out = out + conv_weights[:, j] * hist[S - lag : S - lag + q]
    return out


def ple_conv(inputs: torch.Tensor, residual: torch.Tensor, conv_state: torch.Tensor,
             conv_weights: torch.Tensor, state_indices: torch.Tensor, *, mode: str, dilation: int,
             query_start_loc: torch.Tensor | None = None, has_initial_states: torch.Tensor | None = None,
             num_accepted_tokens: torch.Tensor | None = None, spec_query_len: int = 1,
             token_indices: torch.Tensor | None = None, outer_residual: torch.Tensor | None = None,
             null_slot: int = 0, validate: bool = True) -> None:
    """One serving step of the conv, in place: ``residual += y (+ outer_residual)``; states updated.

    Specified in docs/spec.md sections 5, 6 and 7.8. Logical row i of the call is physical row
    ``token_indices[i]`` (identity if None); physical rows no logical row maps to are left alone.

    For request r on slot ``state_indices[r]`` with q rows ``x`` (its logical rows, cut by
    ``query_start_loc``), the step reads a history ``hist = (S old columns) ++ x``, gives each
    row ``y_t = silu(sum_j w[:, j] * hist[S + t - (K-1-j) * d])`` and then rewrites the slot's
    first columns from ``hist``. Modes (docs/spec.md section 6):

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

    Args:
        inputs: floating-point ``[T, C]``, the conv inputs (``conv_input`` of ``ple_gate``), physical rows.
        residual: ``[T, C]``, ``inputs``' dtype and device; updated in place on the call's rows.
        conv_state: floating-point ``[num_slots, C, W]`` on ``inputs``' device, any strides (a
            transposed ``[num_slots, W, C]`` buffer is fine), any float dtype; ``W >= S``, and
            ``W >= S + spec_query_len - 1`` for spec. Updated in place.
        conv_weights: floating-point ``[C, K]``, ``K >= 1``: tap ``K - 1`` is on the current token.
        state_indices: int32 or int64 ``[R]``, any stride: each request's slot (or ``null_slot``).
        mode: ``"prefill"``, ``"decode"`` or ``"spec"``.
        dilation: d, an int ``>= 1``; ``S = (K - 1) * d``.
        query_start_loc: int32 or int64 ``[R+1]`` over the call's logical rows: from 0, non-decreasing,
            ending at the number of logical rows. Required for prefill and spec; for decode optional and,
            if given, ``[0, 1, ..., R]``.
        has_initial_states: bool or integer ``[R]``, 0 or 1: read the slot's history (1) or zeros (0).
            Default: all 0 for prefill, all 1 for decode; ignored by spec (always read).
        num_accepted_tokens: int32 or int64 ``[R]`` in ``1..spec_query_len`` (spec only, required): the
            tokens kept of the request's previous step, 1 after a prefill or decode.
        spec_query_len: an int; for spec the most rows a request may have (``>= 1``).
        token_indices: int32 or int64 ``[n]``, distinct rows in ``[0, T)``: logical row i is physical
            row ``token_indices[i]``. Default: the identity over T rows.
        outer_residual: ``[T, C]``, ``inputs``' dtype and device: added after ``y`` (also on null-slot rows).
        null_slot: any int (default 0): requests on it are padding. It need not lie in ``[0, num_slots)``.
        validate: False skips the value checks (index ranges, offsets, distinct slots and rows, flags; the
            metadata checks still run), for callers that validated on the host, e.g.
            ``PLECache.schedule``; out-of-range values are then undefined behaviour.

    Returns:
        None. ``residual`` and ``conv_state`` are updated in place.

    Raises:
        TypeError: ``inputs``, ``residual``, ``outer_residual``, ``conv_state`` or ``conv_weights`` is not
            a floating-point tensor; ``residual`` or ``outer_residual`` has another dtype than ``inputs``.
        TypeError: ``state_indices``, ``query_start_loc``, ``num_accepted_tokens`` or ``token_indices`` is
            not an int32 / int64 tensor; ``has_initial_states`` is not a bool or integer tensor.
        TypeError: ``dilation``, ``null_slot`` or ``spec_query_len`` is not an int; ``mode`` is not a str.
        ValueError: ``inputs`` is not 2-D; ``residual`` or ``outer_residual`` is not ``[T, C]``.
        ValueError: ``conv_state`` is not ``[num_slots, C, W]``, or ``W < S``, or (spec)
            ``W < S + spec_query_len - 1``.
        ValueError: ``conv_weights`` is not ``[C, K]`` with ``K >= 1``.
        ValueError: ``mode`` is a str but not one of the three; ``dilation`` is below 1; (spec) ``spec_query_len``
            is below 1.
        ValueError: a tensor argument is on another device than ``inputs``, or an index or flag tensor
            is on the meta device.
        ValueError: ``state_indices`` is not 1-D; a slot other than ``null_slot`` lies outside
            ``[0, num_slots)``; a slot other than ``null_slot`` appears twice.
        ValueError: (decode) the number of logical rows differs from R; ``query_start_loc``, if given,
            is not ``[0, 1, ..., R]``.
        ValueError: (prefill, spec) ``query_start_loc`` is missing, does not have R + 1 entries, does
            not start at 0, decreases, or does not end at the number of logical rows.
        ValueError: (spec) ``num_accepted_tokens`` is missing, is not ``[R]``, or has a value outside
            ``1..spec_query_len``; a request has no rows or more than ``spec_query_len``.
        ValueError: ``has_initial_states`` is not ``[R]`` or holds a value other than 0 and 1.
        ValueError: ``token_indices`` is not 1-D, holds a row outside ``[0, T)``, or repeats a row.

    Example::

        >>> residual, conv_state = torch.zeros(2, 4), torch.zeros(3, 4, 6)    # slots 0 (null), 1, 2; C = 4, W = 6
        >>> ple_conv(torch.randn(2, 4), residual, conv_state, torch.randn(4, 3), torch.tensor([1, 2]),
        ...          mode="decode", dilation=3)                 # K = 3, d = 3: S = 6; one token per request
    """
    check = _checks.ple_conv_call if _checks.validating(validate) else _checks.ple_conv_meta
    check(inputs, residual, conv_state, conv_weights, state_indices, mode=mode, dilation=dilation,
          query_start_loc=query_start_loc, has_initial_states=has_initial_states,
          num_accepted_tokens=num_accepted_tokens, spec_query_len=spec_query_len,
          token_indices=token_indices, outer_residual=outer_residual, null_slot=null_slot)
    _ple_conv(inputs, residual, conv_state, conv_weights, state_indices, mode=mode, dilation=dilation,
              query_start_loc=query_start_loc, has_initial_states=has_initial_states,
              num_accepted_tokens=num_accepted_tokens, token_indices=token_indices,
              outer_residual=outer_residual, null_slot=null_slot)


def _ple_conv(inputs: torch.Tensor, residual: torch.Tensor, conv_state: torch.Tensor,
              conv_weights: torch.Tensor, state_indices: torch.Tensor, *, mode: str, dilation: int,
              query_start_loc: torch.Tensor | None, has_initial_states: torch.Tensor | None,
              num_accepted_tokens: torch.Tensor | None, token_indices: torch.Tensor | None,
              outer_residual: torch.Tensor | None, null_slot: int) -> None:
    """The body of `ple_conv`, for a call already checked (by it, or by ``ple_prefill``'s one check)."""
    S = (conv_weights.shape[1] - 1) * dilation
    C, dt = inputs.shape[1], inputs.dtype
    state_indices_list = state_indices.tolist()
    R = len(state_indices_list)
    # logical row -> physical row
    token_indices_list = list(range(inputs.shape[0])) if token_indices is None else token_indices.tolist()
    # query_start_loc (prefill, spec) and num_accepted_tokens (spec) are required there: checked by the caller.
    query_start_loc_list = list(range(R + 1)) if mode == "decode" else cast(torch.Tensor, query_start_loc).tolist()
    if mode == "spec":                 # docs/spec.md 6: the history starts at column num_accepted - 1, always read
        first_col, reads = [a - 1 for a in cast(torch.Tensor, num_accepted_tokens).tolist()], [True] * R
    else:                              # docs/spec.md 6: columns [0, S), or zeros; decode defaults to reading them
        first_col = [0] * R
        reads = [mode == "decode"] * R if has_initial_states is None else [bool(f) for f in has_initial_states.tolist()]

    # Read: every request's history, its tap sums and its new state, from the states before the step.
    acc = acc_dtype(dt)                             # float32 (float64 for float64 inputs)
    w = conv_weights.to(acc)
    sums = inputs.new_zeros(len(token_indices_list), C)   # logical rows; rows without a conv term stay 0 (unused)
    conv_spans, new_states = [], []
    for r, slot in enumerate(state_indices_list):
        lo, hi = query_start_loc_list[r], query_start_loc_list[r + 1]
        if lo == hi or slot == null_slot:          # empty request: nothing; null slot: never read or written
            continue
        o = first_col[r]
        old = conv_state[slot, :, o : o + S].T if reads[r] else conv_state.new_zeros(S, C)
        hist = torch.cat([old.to(dt), inputs[token_indices_list[lo:hi]]])   # [S + q, C]; old columns via input dtype
        sums[lo:hi] = conv_sums(hist.to(acc), w, dilation).to(dt)     # docs/spec.md 8: the tap sum, rounded
        conv_spans.append((lo, hi))
        new_states.append((slot, hist[1:] if mode == "spec" else hist[hi - lo :]))   # spec: S + q - 1; else S
    # silu once over all logical rows, not per request: the CPU kernel's vector body and scalar tail may
    # differ by an ulp in float32, and this keeps the bits of the vectorised backends (docs/spec.md 8: silu in
    # acc dtype, rounded; in bfloat16 the rounded result is the same either way).
    y = F.silu(sums.to(acc)).to(dt)
    phys = torch.tensor(token_indices_list, dtype=torch.int64, device=inputs.device)
    out = residual[phys]                            # a copy, in logical order
    for lo, hi in conv_spans:
        out[lo:hi] = out[lo:hi] + y[lo:hi]          # docs/spec.md 5: residual + y, rounded
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

    Specified in docs/spec.md sections 6 and 7.9. For request r (rows cut by ``query_start_loc``,
    logical rows mapped to physical rows of ``inputs`` through ``token_indices``, repeats allowed)
    with ``offsets[r] > 0``, the slot receives the state the request would have after the first
    ``offsets[r]`` tokens of this step, in the state's dtype (a copy: no other rounding), provided
    those rows hold at least S = ``state_len`` inputs. ``offsets[r] == 0`` and
    ``slots[r] == null_slot`` write nothing; no other bit of any slot changes (columns from
    ``state_len`` on included).

    Args:
        inputs: floating-point ``[T, C]``, the step's conv inputs (physical rows).
        conv_state: floating-point ``[num_slots, C, W]`` on ``inputs``' device, any strides, any float
            dtype, ``W >= state_len``. Updated in place.
        query_start_loc: int32 or int64 ``[R+1]`` over the logical rows: from 0, non-decreasing, ending
            at the number of logical rows.
        offsets: int32 or int64 ``[R]``: 0 (no checkpoint) or a position in ``[state_len, q_r]``, q_r
            the request's row count.
        slots: int32 or int64 ``[R]``: the slot each checkpoint goes to; those of requests with an
            offset, other than ``null_slot``, distinct and in ``[0, num_slots)``.
        state_len: S, an int ``>= 1``.
        token_indices: int32 or int64 ``[n]``, rows in ``[0, T)``; repeats allowed (unlike ``ple_conv``).
            Default: the identity over T rows.
        null_slot: any int (default 0); a checkpoint to it writes nothing.
        validate: False skips the value checks (offsets, index ranges, distinct slots; the metadata
            checks still run), for callers that validated on the host, e.g. ``PLECache.schedule``;
            out-of-range values are then undefined behaviour.

    Returns:
        None. ``conv_state`` is updated in place.

    Raises:
        TypeError: ``inputs`` or ``conv_state`` is not a floating-point tensor; ``query_start_loc``,
            ``offsets``, ``slots`` or ``token_indices`` is not an int32 / int64 tensor.
        TypeError: ``state_len`` or ``null_slot`` is not an int.
        ValueError: ``inputs`` is not 2-D; ``conv_state`` is not ``[num_slots, C, W]`` or has
            ``W < state_len``; ``state_len`` is below 1.
        ValueError: a tensor argument is on another device than ``inputs``, or an index tensor is on
            the meta device.
        ValueError: ``offsets`` is not 1-D; ``slots`` is not shaped like ``offsets``.
        ValueError: ``query_start_loc`` does not have R + 1 entries, does not start at 0, decreases, or
            does not end at the number of logical rows.
        ValueError: ``offsets[r]`` is neither 0 nor in ``[state_len, q_r]``.
        ValueError: a slot of a request with an offset lies outside ``[0, num_slots)`` (``null_slot``
            excepted) or appears twice.
        ValueError: ``token_indices`` is not 1-D or holds a row outside ``[0, T)``.

    Example::

        >>> conv_state = torch.zeros(3, 4, 6)                     # slots 0 (null), 1, 2; C = 4; S = W = 6
        >>> export_conv_checkpoints(torch.randn(10, 4), conv_state, query_start_loc=torch.tensor([0, 10]),
        ...     offsets=torch.tensor([8]), slots=torch.tensor([2]), state_len=6)    # slot 2 <- rows 2..7
    """
    check = _checks.export_call if _checks.validating(validate) else _checks.export_meta
    check(inputs, conv_state, query_start_loc=query_start_loc, offsets=offsets, slots=slots,
          state_len=state_len, token_indices=token_indices, null_slot=null_slot)
    S = state_len
    # logical row -> physical row
    token_indices_list = list(range(inputs.shape[0])) if token_indices is None else token_indices.tolist()
    for start, off, slot in zip(query_start_loc.tolist(), offsets.tolist(), slots.tolist()):
        if off == 0 or slot == null_slot:
            continue
        window = token_indices_list[start + off - S : start + off]     # the S logical rows before position `off`
        conv_state[slot, :, :S] = inputs[window].T.to(conv_state.dtype)
