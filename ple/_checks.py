"""Argument validation shared by `ple.reference` and `ple.fast` (SPEC section 9).

Every public op validates all of its arguments here before it touches a tensor, so
a failed call leaves every cache exactly as it was. Messages name the argument and
say what was expected. Checks that need tensor values (ranges, uniqueness) copy
small index tensors to the host once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_INT_DTYPES = (torch.int32, torch.int64)


def tensor(name: str, t, *, ndim: int | None = None, kind: str | None = None, device=None,
           shape: tuple | None = None) -> torch.Tensor:
    """Check that ``t`` is a tensor of the given rank, kind ("int", "float", "bool") and device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if kind == "int" and t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name}: expected an int32 or int64 tensor, got {t.dtype}")
    if kind == "anyint" and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise TypeError(f"{name}: expected an integer tensor, got {t.dtype}")
    if kind == "float" and not t.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    return t


def int_arg(name: str, value, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def host_list(t: torch.Tensor) -> list[int]:
    return t.detach().to("cpu", torch.int64).tolist()


def offsets_arg(name: str, qsl, *, total: int, device, num_requests: int | None = None) -> list[int]:
    """Validate cumulative row offsets ``[R+1]``: start at 0, non-decreasing, end at ``total``."""
    tensor(name, qsl, ndim=1, kind="int", device=device)
    if qsl.numel() < 1:
        raise ValueError(f"{name}: expected at least one entry (R + 1 offsets), got an empty tensor")
    if num_requests is not None and qsl.numel() != num_requests + 1:
        raise ValueError(f"{name}: expected {num_requests + 1} entries (one per request + 1), got {qsl.numel()}")
    q = host_list(qsl)
    if q[0] != 0:
        raise ValueError(f"{name}: expected to start at 0, got {q[0]}")
    if any(b < a for a, b in zip(q, q[1:])):
        raise ValueError(f"{name}: expected non-decreasing offsets, got {q}")
    if q[-1] != total:
        raise ValueError(f"{name}: expected to end at the number of rows {total}, got {q[-1]}")
    return q


class ConvCall(NamedTuple):
    """A validated ``ple_conv`` call, with the index tensors copied to the host."""

    num_rows: int               # logical rows of the call
    state_len: int              # S
    slots: list[int]            # state_indices, per request
    starts: list[int]           # query_start_loc, per request + 1 (logical rows)
    has_initial: list[bool]     # per request
    accepted: list[int]         # num_accepted_tokens per request (spec), else all 1
    rows: list[int] | None      # token_indices on the host, or None for identity


def ple_conv_args(inputs, residual, conv_state, conv_weights, state_indices, *, mode, dilation,
                  query_start_loc, has_initial_states, num_accepted_tokens, spec_query_len,
                  token_indices, outer_residual, null_slot) -> ConvCall:
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
    if mode not in ("prefill", "decode", "spec"):
        raise ValueError(f"mode: expected 'prefill', 'decode' or 'spec', got {mode!r}")
    int_arg("dilation", dilation, minimum=1)
    int_arg("null_slot", null_slot)
    K = conv_weights.shape[1]
    if K < 1:
        raise ValueError("conv_weights: expected at least one tap, got shape (C, 0)")
    S = (K - 1) * dilation
    num_slots, _, W = conv_state.shape
    tensor("state_indices", state_indices, ndim=1, kind="int", device=dev)
    R = state_indices.numel()

    rows = None
    num_rows = T
    if token_indices is not None:
        tensor("token_indices", token_indices, ndim=1, kind="int", device=dev)
        rows = host_list(token_indices)
        num_rows = len(rows)
        if any(not 0 <= r < T for r in rows):
            raise ValueError(f"token_indices: expected rows in [0, {T}), got {rows}")
        if len(set(rows)) != len(rows):
            raise ValueError("token_indices: expected distinct rows, got repeats")

    if mode == "decode":
        if query_start_loc is not None:
            tensor("query_start_loc", query_start_loc, ndim=1, kind="int", device=dev)
            if host_list(query_start_loc) != list(range(R + 1)):
                raise ValueError(f"query_start_loc: decode takes one row per request, got "
                                 f"{host_list(query_start_loc)}")
        if num_rows != R:
            raise ValueError(f"state_indices: decode takes one row per request: {num_rows} rows but {R} indices")
        starts = list(range(R + 1))
    else:
        if query_start_loc is None:
            raise ValueError(f"query_start_loc: required for mode={mode!r}")
        starts = offsets_arg("query_start_loc", query_start_loc, total=num_rows, device=dev,
                                              num_requests=R)

    if W < S:
        raise ValueError(f"conv_state: expected a window of at least S = {S} columns, got {W}")

    has_initial = [mode != "prefill"] * R
    if has_initial_states is not None:
        tensor("has_initial_states", has_initial_states, ndim=1, device=dev, shape=(R,))
        if has_initial_states.dtype.is_floating_point:
            raise TypeError(f"has_initial_states: expected a bool or int tensor, got {has_initial_states.dtype}")
        has_initial = [bool(v) for v in host_list(has_initial_states)]

    accepted = [1] * R
    if mode == "spec":
        int_arg("spec_query_len", spec_query_len, minimum=1)
        if num_accepted_tokens is None:
            raise ValueError("num_accepted_tokens: required for mode='spec'")
        tensor("num_accepted_tokens", num_accepted_tokens, ndim=1, kind="int", device=dev, shape=(R,))
        accepted = host_list(num_accepted_tokens)
        if any(not 1 <= a <= spec_query_len for a in accepted):
            raise ValueError(f"num_accepted_tokens: expected values in [1, spec_query_len={spec_query_len}], "
                             f"got {accepted}")
        lens = [b - a for a, b in zip(starts, starts[1:])]
        if any(not 1 <= n <= spec_query_len for n in lens):
            raise ValueError(f"query_start_loc: spec requests take 1..spec_query_len={spec_query_len} rows, "
                             f"got lengths {lens}")
        if W < S + spec_query_len - 1:
            raise ValueError(f"conv_state: spec steps of up to {spec_query_len} tokens need a window of "
                             f"S + spec_query_len - 1 = {S + spec_query_len - 1} columns, got {W}")

    slots = host_list(state_indices)
    live = [s for s in slots if s != null_slot]
    if any(not 0 <= s < num_slots for s in live):
        raise ValueError(f"state_indices: expected slots in [0, {num_slots}) or the null slot {null_slot}, "
                         f"got {slots}")
    if len(set(live)) != len(live):
        raise ValueError(f"state_indices: a slot appears twice in one call: {slots}")
    return ConvCall(num_rows, S, slots, starts, has_initial, accepted, rows)


class CheckpointCall(NamedTuple):
    starts: list[int]
    offsets: list[int]
    slots: list[int]
    rows: list[int] | None


def export_checkpoint_args(inputs, conv_state, *, query_start_loc, offsets, slots, state_len,
                           token_indices, null_slot) -> CheckpointCall:
    tensor("inputs", inputs, ndim=2, kind="float")
    T, C = inputs.shape
    dev = inputs.device
    tensor("conv_state", conv_state, ndim=3, kind="float", device=dev, shape=(None, C, None))
    int_arg("state_len", state_len, minimum=1)
    int_arg("null_slot", null_slot)
    if conv_state.shape[2] < state_len:
        raise ValueError(f"conv_state: expected at least state_len={state_len} columns, got {conv_state.shape[2]}")
    rows = None
    num_rows = T
    if token_indices is not None:
        tensor("token_indices", token_indices, ndim=1, kind="int", device=dev)
        rows = host_list(token_indices)
        num_rows = len(rows)
        if any(not 0 <= r < T for r in rows):
            raise ValueError(f"token_indices: expected rows in [0, {T}), got {rows}")
    tensor("offsets", offsets, ndim=1, kind="int", device=dev)
    tensor("slots", slots, ndim=1, kind="int", device=dev, shape=(offsets.numel(),))
    R = offsets.numel()
    starts = offsets_arg("query_start_loc", query_start_loc, total=num_rows, device=dev,
                                          num_requests=R)
    off = host_list(offsets)
    sl = host_list(slots)
    for r in range(R):
        n = starts[r + 1] - starts[r]
        if off[r] == 0:
            continue
        if off[r] < state_len:
            raise ValueError(f"offsets: request {r} has offset {off[r]}; a checkpoint needs 0 (none) or an offset "
                             f">= state_len={state_len}")
        if off[r] > n:
            raise ValueError(f"offsets: request {r} has offset {off[r]} past its {n} rows")
    live = [s for o, s in zip(off, sl) if o > 0 and s != null_slot]
    if any(not 0 <= s < conv_state.shape[0] for s in live):
        raise ValueError(f"slots: expected slots in [0, {conv_state.shape[0]}), got {sl}")
    if len(set(live)) != len(live):
        raise ValueError(f"slots: a slot appears twice: {sl}")
    return CheckpointCall(starts, off, sl, rows)
