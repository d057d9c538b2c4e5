"""The checks of ``ple_prefill``: the gate's, then the training conv's (``conv_state=None``) or the serving
conv's (a serving prefill), each by its own op's check."""

from __future__ import annotations

from .args import index, int_arg
from .conv import dilated_causal_conv_meta, dilated_causal_conv_values, ple_conv_meta, ple_conv_values
from .ops import gate_call

_NAMES = ("key", "conv_weights", "query_start_loc")     # dilated_causal_conv's x, weight, cu_seqlens


def prefill_meta(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
                 conv_weights, *, dilation, query_start_loc, keep, conv_state, state_indices,
                 has_initial_states, token_indices, null_slot, conv_eps=None, unit_offset=True) -> None:
    """Metadata checks of a ``ple_prefill`` call (no tensor values are read)."""
    gate_call(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
              conv_eps=conv_eps, unit_offset=unit_offset)
    T = key.shape[0]
    if keep is not None:
        index("keep", keep, device=key.device, shape=(T,), kind="flag")
    if conv_state is None:
        for name, t in (("state_indices", state_indices), ("has_initial_states", has_initial_states),
                        ("token_indices", token_indices)):
            if t is not None:
                raise ValueError(f"{name}: only for a serving prefill (with a conv_state); got one without")
        if query_start_loc is None:
            raise ValueError("query_start_loc: required")
        dilated_causal_conv_meta(key, conv_weights, dilation, query_start_loc, names=_NAMES)
        int_arg("null_slot", null_slot)
    else:
        if state_indices is None:
            raise ValueError("state_indices: required with a conv_state")
        ple_conv_meta(key, key, conv_state, conv_weights, state_indices, mode="prefill", dilation=dilation,
                      query_start_loc=query_start_loc, has_initial_states=has_initial_states,
                      num_accepted_tokens=None, spec_query_len=1, token_indices=token_indices,
                      outer_residual=hidden_states, null_slot=null_slot)


def prefill_values(key, conv_weights, *, dilation, query_start_loc, conv_state, state_indices,
                   has_initial_states, token_indices, null_slot) -> None:
    """Value checks of a ``ple_prefill`` call (offsets, index ranges, distinct slots and rows): host reads."""
    if conv_state is None:
        dilated_causal_conv_values(key, conv_weights, dilation, query_start_loc, names=_NAMES)
    else:
        ple_conv_values(key, key, conv_state, conv_weights, state_indices, mode="prefill", dilation=dilation,
                        query_start_loc=query_start_loc, has_initial_states=has_initial_states,
                        num_accepted_tokens=None, spec_query_len=1, token_indices=token_indices,
                        outer_residual=None, null_slot=null_slot)


def prefill_call(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
                 conv_weights, *, dilation, query_start_loc, keep, conv_state, state_indices, has_initial_states,
                 token_indices, null_slot, conv_eps=None, unit_offset=True) -> None:
    """Validate a ``ple_prefill`` call: `prefill_meta`, then `prefill_values`."""
    prefill_meta(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps, conv_weights,
                 dilation=dilation, query_start_loc=query_start_loc, keep=keep, conv_state=conv_state,
                 state_indices=state_indices, has_initial_states=has_initial_states, token_indices=token_indices,
                 null_slot=null_slot, conv_eps=conv_eps, unit_offset=unit_offset)
    prefill_values(key, conv_weights, dilation=dilation, query_start_loc=query_start_loc, conv_state=conv_state,
                   state_indices=state_indices, has_initial_states=has_initial_states, token_indices=token_indices,
                   null_slot=null_slot)
