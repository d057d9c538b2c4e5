"""The gate, the padding mask, the conv and both residual adds of whole requests, as one op.

Specified in ``docs/spec.md`` (``../../docs/spec.md`` from this file), sections 4-6 (the math) and 7.11
(``ple_prefill``).

``ple_prefill`` is the composition of the reference ops and is its own specification:
``ple_gate`` -> (optional) ``keep`` mask -> ``dilated_causal_conv`` over each request from zero
history (``conv_state=None``: the training / evaluation forward) or ``ple_conv(mode="prefill")``
against the requests' conv states (a serving prefill) -> ``out = (gated + y) + hidden_states``.
``ple.fast.ple_prefill`` computes the same thing in one pass over token tiles.

Nothing is checked twice: the call is checked once, as a whole (``ple._checks.prefill_call``),
and the composed ops' bodies (``_ple_gate``, ``_dilated_causal_conv``, ``_ple_conv``) run unchecked.
"""

from __future__ import annotations

from typing import cast

import torch

from .. import _checks
from .conv import _ple_conv
from .gate import _ple_gate
from .training_conv import _dilated_causal_conv

__all__ = ["ple_prefill"]


def ple_prefill(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
                norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor,
                eps: float, conv_weights: torch.Tensor, *, dilation: int, query_start_loc: torch.Tensor,
                keep: torch.Tensor | None = None, conv_state: torch.Tensor | None = None,
                state_indices: torch.Tensor | None = None, has_initial_states: torch.Tensor | None = None,
                token_indices: torch.Tensor | None = None, null_slot: int = 0, conv_eps: float | None = None,
                unit_offset: bool = True, validate: bool = True) -> torch.Tensor:
    """Gate, mask, conv and residual adds of whole requests: ``out = (gated + y) + hidden_states``, ``[T, C]``.

    Specified in docs/spec.md section 7.11. ``keep`` (physical rows; non-zero keeps): where it is 0,
    ``gated`` and ``conv_input`` are multiplied by 0 before the conv, as ``PLELayer.forward`` does
    with its padding mask.

    * ``conv_state=None`` (the forward): every request starts from zero history;
      ``y = dilated_causal_conv(conv_input, conv_weights, cu_seqlens=query_start_loc)``;
      ``query_start_loc`` must end at T. Differentiable in key, value, hidden_states, the
      three norm weights and conv_weights.
    * ``conv_state`` given (a serving prefill, ``[num_slots, C, W]``, any strides): exactly
      ``ple_conv(conv_input, gated, conv_state, conv_weights, state_indices, mode="prefill",
      has_initial_states=..., token_indices=..., outer_residual=hidden_states, null_slot=...)``:
      outputs read the slots' old columns ``[0, S)`` where ``has_initial_states[r]`` (zeros
      otherwise), rows of a request on ``null_slot`` get no conv term, and afterwards columns
      ``[0, S)`` of each live request's slot hold the last S conv inputs of its history
      (empty requests change nothing). Logical row i is physical row ``token_indices[i]``;
      physical rows no logical row maps to are 0 in ``out``. Not differentiable.

    Rounding is the composed ops': the gate's, then ``gated * keep``, the conv sum and silu
    rounded, then ``(gated + y)`` rounded and ``+ hidden_states`` rounded.

    ``conv_eps`` and ``unit_offset`` are ``ple_gate``'s: the conv norm's epsilon (None: ``eps``) and the
    norms' scale, ``1 + w`` (True, the Qwen4Exp family) or ``w`` (False, the Engram family, docs/spec.md
    section 15).

    Args:
        key: floating-point ``[T, C]``, ``C = M * H``, physical rows.
        value: ``[T, H]``, ``key``'s dtype and device.
        hidden_states: ``[T, C]``, ``key``'s dtype and device: the residual streams.
        norm_key_weight, norm_query_weight, norm_conv_weight: floating-point ``[C]`` on ``key``'s device.
        eps: a positive Python number, the key and query norms' epsilon (the conv norm's too, unless
            ``conv_eps`` is given).
        conv_weights: floating-point ``[C, K]``, ``K >= 1``, on ``key``'s device.
        dilation: d, an int ``>= 1``.
        query_start_loc: int32 or int64 ``[R+1]`` over the logical rows: from 0, non-decreasing, ending
            at T (at the number of logical rows with ``token_indices``). Required.
        keep: bool or integer ``[T]`` on ``key``'s device, non-zero keeps. Default: every row kept.
        conv_state: floating-point ``[num_slots, C, W]``, ``W >= S``, any strides and float dtype, or
            None (the forward). Updated in place when given.
        state_indices: int32 or int64 ``[R]``; required with ``conv_state``, refused without. Slots
            other than ``null_slot`` distinct and in ``[0, num_slots)``.
        has_initial_states: bool or integer ``[R]``, 0 or 1; only with ``conv_state`` (default all 0).
        token_indices: int32 or int64, distinct rows in ``[0, T)``; only with ``conv_state``.
        null_slot: any int (default 0); only meaningful with ``conv_state``.
        conv_eps: a positive finite Python number, the conv norm's epsilon, or None (default): ``eps``.
        unit_offset: True (default): the norms scale by ``1 + w``; False (the Engram family): by ``w``.
        validate: False skips the value checks (offsets, index ranges, distinct slots and rows, flags;
            the metadata checks still run); out-of-range values are then undefined behaviour.

    Returns:
        ``out``, ``[T, C]`` in ``key``'s dtype.

    Raises:
        TypeError, ValueError: every error of ``ple_gate`` for the gate's arguments.
        TypeError: ``keep`` is not a bool or integer tensor.
        ValueError: ``keep`` is not ``[T]``, or is on another device (or the meta device).
        ValueError: ``query_start_loc`` is missing.
        ValueError: without ``conv_state``: ``state_indices``, ``has_initial_states`` or
            ``token_indices`` is given.
        TypeError, ValueError: without ``conv_state``: every error of ``dilated_causal_conv`` for
            ``conv_weights``, ``dilation`` and ``query_start_loc`` as ``cu_seqlens`` (offsets ending at T);
            ``null_slot`` is not an int.
        ValueError: with ``conv_state``: ``state_indices`` is missing.
        TypeError, ValueError: with ``conv_state``: every error of ``ple_conv(mode="prefill")`` for
            ``conv_state``, ``conv_weights``, ``state_indices``, ``dilation``, ``query_start_loc``,
            ``has_initial_states``, ``token_indices`` and ``null_slot``.

    Example::

        >>> T, C, H = 5, 8, 4                                         # two requests of 2 and 3 rows; M = 2
        >>> out = ple_prefill(torch.randn(T, C), torch.randn(T, H), torch.randn(T, C), *torch.zeros(3, C), 1e-6,
        ...                   torch.randn(C, 4), dilation=3, query_start_loc=torch.tensor([0, 2, 5]))
    """
    check = _checks.prefill_call if _checks.validating(validate) else _checks.prefill_meta
    check(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps, conv_weights,
          dilation=dilation, query_start_loc=query_start_loc, keep=keep, conv_state=conv_state,
          state_indices=state_indices, has_initial_states=has_initial_states, token_indices=token_indices,
          null_slot=null_slot, conv_eps=conv_eps, unit_offset=unit_offset)
    # The composition (docs/spec.md sections 4-6), each op with its own rounding points. The call was checked
    # once, whole, above, so the ops' bodies run unchecked (nothing is checked twice).
    H = value.shape[1]
    gated, conv_input = _ple_gate(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight,
                                  eps, H, conv_eps=conv_eps, unit_offset=unit_offset)
    if keep is not None:                            # padding rows times 0 (exact; a non-finite value gives NaN)
        mask = (keep != 0).to(gated.dtype)[:, None]
        gated, conv_input = gated * mask, conv_input * mask
    if conv_state is None:
        y = _dilated_causal_conv(conv_input, conv_weights, dilation, query_start_loc)
        return (gated + y) + hidden_states          # docs/spec.md 5: the layer's term rounded, then the residual add
    out = gated.clone()                             # ple_conv adds into it: (gated + y) + hidden_states
    # state_indices comes with conv_state (checked above).
    _ple_conv(conv_input, out, conv_state, conv_weights, cast(torch.Tensor, state_indices), mode="prefill",
              dilation=dilation, query_start_loc=query_start_loc, has_initial_states=has_initial_states,
              num_accepted_tokens=None, token_indices=token_indices, outer_residual=hidden_states,
              null_slot=null_slot)
    if token_indices is not None:
        covered = torch.zeros(key.shape[0], dtype=torch.bool, device=key.device)
        covered[token_indices.to(torch.int64)] = True
        out = torch.where(covered[:, None], out, torch.zeros_like(out))
    return out
