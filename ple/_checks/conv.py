"""The checks of the conv ops: ``ple_conv`` (`ConvCall`), ``export_conv_checkpoints`` (`CheckpointCall`),
``dilated_causal_conv`` (`DilatedCausalConvCall`)."""

from __future__ import annotations

from typing import NamedTuple

from .args import (
    Host,
    choice_arg,
    full_check,
    host_values,
    index,
    int_arg,
    offsets_meta,
    offsets_values,
    rows_values,
    tensor,
)


class ConvCall(NamedTuple):
    num_rows: int                           # logical rows of the call
    state_len: int                          # S
    state_indices_list: list[int]           # per request
    query_start_loc_list: list[int]         # per request + 1 (logical rows; decode: 0, 1, ..., R)
    has_initial_states_list: list[bool]     # per request (the mode's default where not given)
    num_accepted_tokens_list: list[int]     # per request (spec), else all 1
    token_indices_list: list[int] | None    # None for identity


def ple_conv_meta(inputs, residual, conv_state, conv_weights, state_indices, *, mode, dilation,
                  query_start_loc, has_initial_states, num_accepted_tokens, spec_query_len,
                  token_indices, outer_residual, null_slot) -> None:
    tensor("inputs", inputs, ndim=2, kind="float")
    T, C = inputs.shape
    dev = inputs.device
    tensor("residual", residual, ndim=2, kind="float", device=dev, shape=(T, C))
    if residual.dtype != inputs.dtype:
        raise TypeError(f"residual: expected dtype {inputs.dtype} (that of inputs), got {residual.dtype}")
    if outer_residual is not None:
        tensor("outer_residual", outer_residual, ndim=2, kind="float", device=dev, shape=(T, C))
        if outer_residual.dtype != inputs.dtype:
            raise TypeError(f"outer_residual: expected dtype {inputs.dtype}, got {outer_residual.dtype}")
    tensor("conv_state", conv_state, ndim=3, kind="float", device=dev, shape=(None, C, None))
    tensor("conv_weights", conv_weights, ndim=2, kind="float", device=dev, shape=(C, None))
    choice_arg("mode", mode, ("prefill", "decode", "spec"))
    int_arg("dilation", dilation, minimum=1)
    int_arg("null_slot", null_slot)
    K = conv_weights.shape[1]
    if K < 1:
        raise ValueError("conv_weights: expected at least one tap, got shape (C, 0)")
    S = (K - 1) * dilation
    W = conv_state.shape[2]
    index("state_indices", state_indices, device=dev)
    R = state_indices.numel()
    num_rows = T
    if token_indices is not None:
        index("token_indices", token_indices, device=dev)
        num_rows = token_indices.numel()
    if mode == "decode":
        if query_start_loc is not None:
            index("query_start_loc", query_start_loc, device=dev)
        if num_rows != R:
            raise ValueError(f"state_indices: decode takes one row per request: {num_rows} rows but {R} indices")
    else:
        if query_start_loc is None:
            raise ValueError(f"query_start_loc: required for mode={mode!r}")
        offsets_meta("query_start_loc", query_start_loc, device=dev, num_requests=R)
    if W < S:
        raise ValueError(f"conv_state: expected a window of at least S = {S} columns, got {W}")
    if has_initial_states is not None:
        index("has_initial_states", has_initial_states, kind="flag", device=dev, shape=(R,))
    if mode == "spec":
        int_arg("spec_query_len", spec_query_len, minimum=1)
        if num_accepted_tokens is None:
            raise ValueError("num_accepted_tokens: required for mode='spec'")
        index("num_accepted_tokens", num_accepted_tokens, device=dev, shape=(R,))
        if W < S + spec_query_len - 1:
            raise ValueError(f"conv_state: spec steps of up to {spec_query_len} tokens need a window of "
                             f"S + spec_query_len - 1 = {S + spec_query_len - 1} columns, got {W}")
    else:
        int_arg("spec_query_len", spec_query_len)


def ple_conv_values(inputs, residual, conv_state, conv_weights, state_indices, *, mode, dilation,
                    query_start_loc, has_initial_states, num_accepted_tokens, spec_query_len, token_indices,
                    outer_residual, null_slot, host: Host = None) -> ConvCall:
    T = inputs.shape[0]
    S = (conv_weights.shape[1] - 1) * dilation
    num_slots = conv_state.shape[0]
    R = state_indices.numel()
    token_indices_list = None if token_indices is None else rows_values(token_indices, T, host, distinct=True)
    num_rows = T if token_indices_list is None else len(token_indices_list)
    if mode == "decode":
        query_start_loc_list = list(range(R + 1))
        if query_start_loc is not None:
            q = host_values("query_start_loc", query_start_loc, host).tolist()
            if q != query_start_loc_list:
                raise ValueError(f"query_start_loc: decode takes one row per request, got {q}")
    else:
        query_start_loc_list = offsets_values("query_start_loc", query_start_loc, total=num_rows, host=host)
    has_initial_states_list = [mode != "prefill"] * R
    if has_initial_states is not None:
        flags = host_values("has_initial_states", has_initial_states, host).tolist()
        if any(f not in (0, 1) for f in flags):
            raise ValueError(f"has_initial_states: expected flags 0 or 1, got {flags}")
        has_initial_states_list = [bool(f) for f in flags]
    num_accepted_tokens_list = [1] * R
    if mode == "spec":
        num_accepted_tokens_list = host_values("num_accepted_tokens", num_accepted_tokens, host).tolist()
        if any(not 1 <= a <= spec_query_len for a in num_accepted_tokens_list):
            raise ValueError(f"num_accepted_tokens: expected values in [1, spec_query_len={spec_query_len}], "
                             f"got {num_accepted_tokens_list}")
        lens = [b - a for a, b in zip(query_start_loc_list, query_start_loc_list[1:])]
        if any(not 1 <= n <= spec_query_len for n in lens):
            raise ValueError(f"query_start_loc: spec requests take 1..spec_query_len={spec_query_len} rows, "
                             f"got lengths {lens}")
    state_indices_list = host_values("state_indices", state_indices, host).tolist()
    live = [s for s in state_indices_list if s != null_slot]
    if any(not 0 <= s < num_slots for s in live):
        raise ValueError(f"state_indices: expected slots in [0, {num_slots}) or the null slot {null_slot}, "
                         f"got {state_indices_list}")
    if len(set(live)) != len(live):
        raise ValueError(f"state_indices: a slot appears twice in one call: {state_indices_list}")
    return ConvCall(num_rows, S, state_indices_list, query_start_loc_list, has_initial_states_list,
                    num_accepted_tokens_list, token_indices_list)


ple_conv_call = full_check(ple_conv_meta, ple_conv_values, "ple_conv")


class CheckpointCall(NamedTuple):
    query_start_loc_list: list[int]         # per request + 1 (logical rows)
    offsets_list: list[int]                 # per request; 0: no checkpoint
    slots_list: list[int]                   # per request
    token_indices_list: list[int] | None    # None for identity


def export_meta(inputs, conv_state, *, query_start_loc, offsets, slots, state_len, token_indices,
                null_slot) -> None:
    tensor("inputs", inputs, ndim=2, kind="float")
    C = inputs.shape[1]
    dev = inputs.device
    tensor("conv_state", conv_state, ndim=3, kind="float", device=dev, shape=(None, C, None))
    int_arg("state_len", state_len, minimum=1)
    int_arg("null_slot", null_slot)
    if conv_state.shape[2] < state_len:
        raise ValueError(f"conv_state: expected at least state_len={state_len} columns, got {conv_state.shape[2]}")
    if token_indices is not None:
        index("token_indices", token_indices, device=dev)
    index("offsets", offsets, device=dev)
    index("slots", slots, device=dev, shape=(offsets.numel(),))
    offsets_meta("query_start_loc", query_start_loc, device=dev, num_requests=offsets.numel())


def export_values(inputs, conv_state, *, query_start_loc, offsets, slots, state_len, token_indices, null_slot,
                  host: Host = None) -> CheckpointCall:
    T = inputs.shape[0]
    token_indices_list = None if token_indices is None else rows_values(token_indices, T, host, distinct=False)
    num_rows = T if token_indices_list is None else len(token_indices_list)
    query_start_loc_list = offsets_values("query_start_loc", query_start_loc, total=num_rows, host=host)
    offsets_list = host_values("offsets", offsets, host).tolist()
    slots_list = host_values("slots", slots, host).tolist()
    for r, o in enumerate(offsets_list):
        n = query_start_loc_list[r + 1] - query_start_loc_list[r]
        if o == 0:
            continue
        if o < state_len:
            raise ValueError(f"offsets: request {r} has offset {o}; a checkpoint needs 0 (none) or an offset "
                             f">= state_len={state_len}")
        if o > n:
            raise ValueError(f"offsets: request {r} has offset {o} past its {n} rows")
    live = [s for o, s in zip(offsets_list, slots_list) if o > 0 and s != null_slot]
    if any(not 0 <= s < conv_state.shape[0] for s in live):
        raise ValueError(f"slots: expected slots in [0, {conv_state.shape[0]}), got {slots_list}")
    if len(set(live)) != len(live):
        raise ValueError(f"slots: a slot appears twice: {slots_list}")
    return CheckpointCall(query_start_loc_list, offsets_list, slots_list, token_indices_list)


export_call = full_check(export_meta, export_values, "export_conv_checkpoints")


class DilatedCausalConvCall(NamedTuple):
    cu_seqlens_list: list[int] | None       # None: dense [B, L, C], or one packed sequence


_TRAINING_CONV_NAMES = ("x", "weight", "cu_seqlens")


def dilated_causal_conv_meta(x, weight, dilation, cu_seqlens, *,
                             names: tuple[str, str, str] = _TRAINING_CONV_NAMES) -> None:
    """Metadata of ``dilated_causal_conv``. ``names``: what the caller calls ``x``, ``weight`` and ``cu_seqlens``
    (``ple_prefill`` passes ``("key", "conv_weights", "query_start_loc")``), so a message names its argument."""
    x_name, weight_name, offsets_name = names
    tensor(x_name, x, kind="float")
    if x.dim() not in (2, 3):
        raise ValueError(f"{x_name}: expected [B, L, C] or packed [T, C], got shape {tuple(x.shape)}")
    C = x.shape[-1]
    tensor(weight_name, weight, ndim=2, kind="float", device=x.device, shape=(C, None))
    if weight.shape[1] < 1:
        raise ValueError(f"{weight_name}: expected at least one tap, got shape (C, 0)")
    int_arg("dilation", dilation, minimum=1)
    if cu_seqlens is not None:
        if x.dim() != 2:
            raise ValueError(f"{x_name}: {offsets_name} needs packed [T, C] input, got shape {tuple(x.shape)}")
        offsets_meta(offsets_name, cu_seqlens, device=x.device)


def dilated_causal_conv_values(x, weight, dilation, cu_seqlens, *,
                               names: tuple[str, str, str] = _TRAINING_CONV_NAMES,
                               host: Host = None) -> DilatedCausalConvCall:
    """Values of ``dilated_causal_conv`` (the offsets); ``names`` as for `dilated_causal_conv_meta`."""
    if cu_seqlens is None:
        return DilatedCausalConvCall(None)
    return DilatedCausalConvCall(offsets_values(names[2], cu_seqlens, total=x.shape[0], host=host))


dilated_causal_conv_call = full_check(dilated_causal_conv_meta, dilated_causal_conv_values, "dilated_causal_conv")
