"""The gate, the padding mask, the conv and both residual adds of whole requests, as one op (SPEC sections 4-6).

``ple_prefill`` is the composition of the reference ops and is its own specification:
``ple_gate`` -> (optional) ``keep`` mask -> ``dilated_causal_conv`` over each request from zero
history (``conv_state=None``: the training / evaluation forward) or ``ple_conv(mode="prefill")``
against the requests' conv states (a serving prefill) -> ``out = (gated + y) + hidden_states``.
``ple.fast.ple_prefill`` computes the same thing in one pass over token tiles.
"""

from __future__ import annotations

from typing import cast

import torch

from .. import _checks
from .conv import ple_conv
from .gate import ple_gate
from .training_conv import dilated_causal_conv

__all__ = ["ple_prefill"]


def ple_prefill(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
                norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor,
                eps: float, conv_weights: torch.Tensor, *, dilation: int, query_start_loc: torch.Tensor,
                keep: torch.Tensor | None = None, conv_state: torch.Tensor | None = None,
                state_indices: torch.Tensor | None = None, has_initial_states: torch.Tensor | None = None,
                token_indices: torch.Tensor | None = None, null_slot: int = 0,
                validate: bool = True) -> torch.Tensor:
    """Gate, mask, conv and residual adds of whole requests: ``out = (gated + y) + hidden_states``, ``[T, C]``.

    Shapes: ``key``, ``hidden_states`` ``[T, C]``, ``value`` ``[T, H]`` (``C = M * H``), norm
    weights ``[C]``, ``conv_weights`` ``[C, K]``; ``query_start_loc`` ``[R+1]`` cuts the (logical)
    rows into requests. ``keep`` (``[T]``, bool or integer, physical rows; non-zero keeps): where
    it is 0, ``gated`` and ``conv_input`` are multiplied by 0 before the conv, as ``PLELayer.forward``
    does with its padding mask.

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

    ``validate=False`` skips the value checks (offsets, index ranges, distinct slots); out-of-range
    values are then undefined behaviour.
    """
    check = _checks.prefill_call if validate else _checks.prefill_meta
    check(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps, conv_weights,
          dilation=dilation, query_start_loc=query_start_loc, keep=keep, conv_state=conv_state,
          state_indices=state_indices, has_initial_states=has_initial_states, token_indices=token_indices,
          null_slot=null_slot)
    # The composition (SPEC sections 4-6), each op with its own rounding points; the checks ran above.
    gated, conv_input = ple_gate(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight,
                                 eps)
    if keep is not None:                            # padding rows times 0, as the layer's mask does
        mask = (keep != 0).to(gated.dtype)[:, None]
        gated, conv_input = gated * mask, conv_input * mask
    if conv_state is None:
        y = dilated_causal_conv(conv_input, conv_weights, dilation=dilation, cu_seqlens=query_start_loc,
                                validate=False)
        return (gated + y) + hidden_states          # SPEC 5: the layer's term rounded, then the residual add
    out = gated.clone()                             # ple_conv adds into it: (gated + y) + hidden_states
    # state_indices comes with conv_state (checked above).
    ple_conv(conv_input, out, conv_state, conv_weights, cast(torch.Tensor, state_indices), mode="prefill",
             dilation=dilation, query_start_loc=query_start_loc, has_initial_states=has_initial_states,
             token_indices=token_indices, outer_residual=hidden_states, null_slot=null_slot, validate=False)
    if token_indices is not None:
        covered = torch.zeros(key.shape[0], dtype=torch.bool, device=key.device)
        covered[token_indices.to(torch.int64)] = True
        out = torch.where(covered[:, None], out, torch.zeros_like(out))
    return out
