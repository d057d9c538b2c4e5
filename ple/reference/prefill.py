"""The gate, the padding mask, the conv and both residual adds of whole requests, as one op (SPEC sections 4-6).

``ple_prefill`` is the composition of the reference ops and is its own specification:
``ple_gate`` -> (optional) ``keep`` mask -> ``dilated_causal_conv`` over each request from zero
history (``conv_state=None``: the training / evaluation forward) or ``ple_conv(mode="prefill")``
against the requests' conv states (a serving prefill) -> ``out = (gated + y) + hidden_states``.
``ple.fast.ple_prefill`` computes the same thing in one pass over token tiles.
"""

from __future__ import annotations

import torch

from .. import _checks
from .conv import ple_conv
from .gate import ple_gate
from .training_conv import dilated_causal_conv

__all__ = ["ple_prefill", "prefill_meta", "prefill_values"]


def prefill_meta(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
                 conv_weights, *, dilation, query_start_loc, keep, conv_state, state_indices,
                 has_initial_states, token_indices, null_slot) -> None:
    """Metadata checks of a ``ple_prefill`` call (no tensor values are read)."""
    _checks.gate_call(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps)
    T = key.shape[0]
    if keep is not None:
        _checks.index("keep", keep, device=key.device, shape=(T,), kind="flag")
    if conv_state is None:
        for name, t in (("state_indices", state_indices), ("has_initial_states", has_initial_states),
                        ("token_indices", token_indices)):
            if t is not None:
                raise ValueError(f"{name}: only for a serving prefill (with a conv_state); got one without")
        if query_start_loc is None:
            raise ValueError("query_start_loc: required")
        _checks.dense_conv_meta(key, conv_weights, dilation, query_start_loc)
        _checks.int_arg("null_slot", null_slot)
    else:
        if state_indices is None:
            raise ValueError("state_indices: required with a conv_state")
        _checks.ple_conv_meta(key, key, conv_state, conv_weights, state_indices, mode="prefill", dilation=dilation,
                              query_start_loc=query_start_loc, has_initial_states=has_initial_states,
                              num_accepted_tokens=None, spec_query_len=1, token_indices=token_indices,
                              outer_residual=hidden_states, null_slot=null_slot)


def prefill_values(key, conv_weights, *, dilation, query_start_loc, conv_state, state_indices,
                   has_initial_states, token_indices, null_slot) -> None:
    """Value checks of a ``ple_prefill`` call (offsets, index ranges, distinct slots and rows): host reads."""
    if conv_state is None:
        _checks.dense_conv_values(key, conv_weights, dilation, query_start_loc)
    else:
        _checks.ple_conv_values(key, key, conv_state, conv_weights, state_indices, mode="prefill",
                                dilation=dilation, query_start_loc=query_start_loc,
                                has_initial_states=has_initial_states, num_accepted_tokens=None,
                                spec_query_len=1, token_indices=token_indices, outer_residual=None,
                                null_slot=null_slot)


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
    prefill_meta(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
                 conv_weights, dilation=dilation, query_start_loc=query_start_loc, keep=keep,
                 conv_state=conv_state, state_indices=state_indices, has_initial_states=has_initial_states,
                 token_indices=token_indices, null_slot=null_slot)
    if validate:
        prefill_values(key, conv_weights, dilation=dilation, query_start_loc=query_start_loc,
                       conv_state=conv_state, state_indices=state_indices, has_initial_states=has_initial_states,
                       token_indices=token_indices, null_slot=null_slot)
    gated, conv_input = ple_gate(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight,
                                 eps)
    if keep is not None:
        mask = (keep != 0).to(gated.dtype)[:, None]
        gated, conv_input = gated * mask, conv_input * mask
    if conv_state is None:
        y = dilated_causal_conv(conv_input, conv_weights, dilation=dilation, cu_seqlens=query_start_loc,
                                validate=False)
        return (gated + y) + hidden_states
    out = gated.clone()
    ple_conv(conv_input, out, conv_state, conv_weights, state_indices, mode="prefill", dilation=dilation,
             query_start_loc=query_start_loc, has_initial_states=has_initial_states, token_indices=token_indices,
             outer_residual=hidden_states, null_slot=null_slot, validate=False)
    if token_indices is not None:
        covered = torch.zeros(key.shape[0], dtype=torch.bool, device=key.device)
        covered[token_indices.to(torch.int64)] = True
        out = torch.where(covered[:, None], out, torch.zeros_like(out))
    return out
