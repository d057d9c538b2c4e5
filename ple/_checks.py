"""Argument validation of every public op, shared by ``ple.reference`` and ``ple.fast`` (SPEC section 9).

Every op validates all of its arguments here before it touches a tensor (so a failed call
changes nothing); messages start with the argument's name and say what was expected. One
function per op validates a call and returns its description, a ``NamedTuple`` with the
host values the op needs: ``ngram_call`` -> `NgramCall` (``ngram_ids``; with ``weight=``
``ple.fast.ngram_embedding``), ``lookup_call`` -> `LookupCall`, ``gate_call`` -> `GateCall`,
``ple_conv_call`` -> `ConvCall`, ``export_call`` -> `CheckpointCall`, ``dense_conv_call`` ->
`DenseConvCall` (``dilated_causal_conv``).

Split by cost: ``<op>_call(*args, host=None)`` is ``<op>_meta(*args)`` then
``<op>_values(*args, host=host)``. *Metadata* (free: Python types, ranks, shapes, dtypes,
devices; a tensor on another device than the first, or an index tensor whose values are
needed on the meta device, is a ``ValueError``) never reads a value, so it traces with fake
tensors under ``torch.compile``. *Values* (index ranges, distinct slots and token rows,
offsets non-decreasing from 0 to the row count, ``num_accepted_tokens`` in range, token
ids in ``[0, V)``, flags 0 or 1) trust the metadata and read each index tensor once
through `host_values`; ``host`` maps argument names to values the caller already holds on
the host (a scheduler's), used instead of a device-to-host copy.

Who calls what: ``ple.reference`` calls ``<op>_call``. ``ple.fast``'s public function calls
``<op>_meta`` (at trace time under ``torch.compile``, and before dispatch, so a meta tensor
among real ones never reaches the fake kernel); its registered op (``torch.ops.ple.*``)
trusts that and calls only ``<op>_values``, at run time inside the op, so a compiled graph
has no graph break. Nothing is checked twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from .params import HashParams

_INDEX_DTYPES = (torch.int32, torch.int64)

Host = Mapping[str, Sequence[int]] | None
"""Host values by argument name (see the module docstring); None: copy what is needed."""


def _kind_ok(dtype: torch.dtype, kind: str) -> tuple[bool, str]:
    if kind in ("index", "int"):
        return dtype in _INDEX_DTYPES, "an int32 or int64 tensor"
    if kind == "anyint":
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool), "an integer tensor"
    if kind == "flag":
        return not (dtype.is_floating_point or dtype.is_complex), "a bool or integer tensor"
    if kind == "float":
        return dtype.is_floating_point, "a floating-point tensor"
    raise AssertionError(f"unknown tensor kind {kind!r}")


def tensor(name: str, t, *, ndim: int | None = None, kind: str | None = None, device=None,
           shape: tuple | None = None) -> torch.Tensor:
    """Check ``t``'s rank, kind, device and shape (``None`` entries: any); a wrong kind is a ``TypeError``.

    Kinds: ``"index"`` (int32 / int64 only; ``"int"`` the same), ``"anyint"`` (any integer
    dtype but bool), ``"flag"`` (bool or any integer dtype), ``"float"``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if kind is not None:
        ok, want = _kind_ok(t.dtype, kind)
        if not ok:
            raise TypeError(f"{name}: expected {want}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            wanted = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {wanted}, got {tuple(t.shape)}")
    return t


def index(name: str, t, *, ndim: int = 1, device=None, shape: tuple | None = None,
          kind: str = "index") -> torch.Tensor:
    """An index (or flag) tensor whose values the op needs: ``tensor`` checks, and not on the meta device."""
    tensor(name, t, ndim=ndim, kind=kind, device=device, shape=shape)
    if t.device.type == "meta":
        raise ValueError(f"{name}: its values are needed, so it cannot be on the meta device")
    return t


def int_arg(name: str, value, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def host_list(t: torch.Tensor) -> list[int]:
    """The values of an integer tensor as a Python list (one device-to-host copy)."""
    return t.detach().to("cpu", torch.int64).tolist()


def host_values(name: str, t: torch.Tensor, host: Host = None) -> torch.Tensor:
    """Argument ``name``'s values as a CPU int64 tensor: ``host[name]`` if given (with ``t``'s shape), else a copy."""
    if host is not None and name in host:
        v = torch.as_tensor(host[name], dtype=torch.int64)
        if tuple(v.shape) != tuple(t.shape):
            raise ValueError(f"{name}: host values of shape {tuple(v.shape)} given for a tensor of shape "
                             f"{tuple(t.shape)}")
        return v
    return t.detach().to("cpu", torch.int64)


def _range(name: str, v: torch.Tensor, hi: int, what: str) -> None:
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= hi):
        raise ValueError(f"{name}: {what} must lie in [0, {hi}), got min {int(v.min())} and max {int(v.max())}")


def offsets_meta(name: str, t, *, device, num_requests: int | None = None) -> int:
    """Metadata of cumulative row offsets ``[R+1]``; returns R."""
    index(name, t, device=device)
    if t.numel() < 1:
        raise ValueError(f"{name}: expected at least one entry (R + 1 offsets), got an empty tensor")
    if num_requests is not None and t.numel() != num_requests + 1:
        raise ValueError(f"{name}: expected {num_requests + 1} entries (one per request + 1), got {t.numel()}")
    return t.numel() - 1


def offsets_values(name: str, t: torch.Tensor, *, total: int, host: Host = None) -> list[int]:
    """Values of cumulative row offsets: start at 0, non-decreasing, end at ``total``; returns them."""
    q = host_values(name, t, host).tolist()
    if q[0] != 0:
        raise ValueError(f"{name}: expected to start at 0, got {q[0]}")
    if any(b < a for a, b in zip(q, q[1:])):
        raise ValueError(f"{name}: expected non-decreasing offsets, got {q}")
    if q[-1] != total:
        raise ValueError(f"{name}: expected to end at the number of rows {total}, got {q[-1]}")
    return q


def offsets_arg(name: str, qsl, *, total: int, device, num_requests: int | None = None,
                host: Host = None) -> list[int]:
    """Validate cumulative row offsets ``[R+1]``: start at 0, non-decreasing, end at ``total``."""
    offsets_meta(name, qsl, device=device, num_requests=num_requests)
    return offsets_values(name, qsl, total=total, host=host)


def _rows_values(t: torch.Tensor, T: int, host: Host, *, distinct: bool) -> list[int]:
    rows = host_values("token_indices", t, host).tolist()
    if any(not 0 <= r < T for r in rows):
        raise ValueError(f"token_indices: expected rows in [0, {T}), got {rows}")
    if distinct and len(set(rows)) != len(rows):
        raise ValueError("token_indices: expected distinct rows, got repeats")
    return rows


def _full_check(meta, values, what: str):
    """``<op>_call``: ``meta(*args, **kwargs)`` then ``values(*args, host=host, **kwargs)`` (the op's arguments)."""

    def call(*args, host: Host = None, **kwargs):
        meta(*args, **kwargs)
        return values(*args, host=host, **kwargs)

    call.__doc__ = f"Validate a ``{what}`` call (its arguments, and ``host``): metadata, then values."
    return call


class NgramCall(NamedTuple):
    num_requests: int           # R
    starts: list[int]           # query_start_loc on the host ([0, T] without one)


def ngram_meta(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context, *,
               weight=None) -> None:
    """Metadata of ``ngram_ids`` (and, with ``weight``, of ``ple.fast.ngram_embedding``)."""
    index("input_ids", input_ids, ndim=1)
    if not isinstance(params, HashParams):
        raise TypeError(f"params: expected HashParams, got {type(params).__name__}")
    N = params.multipliers.numel()
    int_arg("heads_per_ngram", heads_per_ngram, minimum=1)
    if params.head_sizes.numel() != (N - 1) * heads_per_ngram:
        raise ValueError(f"heads_per_ngram: {heads_per_ngram} heads per order and {N} multipliers need "
                         f"{(N - 1) * heads_per_ngram} head sizes, params has {params.head_sizes.numel()}")
    V = params.vocab_size
    int_arg("eos_token_id", eos_token_id)
    if not 0 <= eos_token_id < V:
        raise ValueError(f"eos_token_id: expected an id in [0, {V}), got {eos_token_id}")
    dev = input_ids.device
    R = 1 if query_start_loc is None else offsets_meta("query_start_loc", query_start_loc, device=dev)
    if ngram_context is not None:
        index("ngram_context", ngram_context, ndim=2, device=dev, shape=(R, N - 1))
    if weight is not None:
        tensor("weight", weight, ndim=2, device=dev)


def ngram_values(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context, *,
                 weight=None, host: Host = None) -> NgramCall:
    """Values of ``ngram_ids`` (with ``weight``: also that the table holds every row the hash addresses)."""
    T, V = input_ids.numel(), params.vocab_size
    starts = [0, T] if query_start_loc is None else offsets_values("query_start_loc", query_start_loc,
                                                                    total=T, host=host)
    if ngram_context is not None:
        _range("ngram_context", host_values("ngram_context", ngram_context, host), V, "token ids")
    _range("input_ids", host_values("input_ids", input_ids, host), V, "token ids")
    if weight is not None and params.head_sizes.numel():
        last = host_values("head_offsets", params.head_offsets, host)[-1]
        needed = int(last + host_values("head_sizes", params.head_sizes, host)[-1])
        if weight.shape[0] < needed:
            raise ValueError(f"weight: the hash addresses rows up to {needed - 1}, so the table needs at "
                             f"least {needed} rows, got {weight.shape[0]}")
    return NgramCall(len(starts) - 1, starts)


ngram_call = _full_check(ngram_meta, ngram_values, "ngram_ids")


class LookupCall(NamedTuple):
    num_tokens: int             # T
    num_heads: int              # NH
    dim: int                    # D


def lookup_meta(weight, ids) -> None:
    tensor("weight", weight, ndim=2)
    index("ids", ids, ndim=2, device=weight.device)


def lookup_values(weight, ids, *, host: Host = None) -> LookupCall:
    _range("ids", host_values("ids", ids, host), weight.shape[0], "rows")
    return LookupCall(ids.shape[0], ids.shape[1], weight.shape[1])


lookup_call = _full_check(lookup_meta, lookup_values, "embedding_lookup")


class GateCall(NamedTuple):
    num_tokens: int             # T
    channels: int               # C = M * H
    group_size: int             # H


def gate_call(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps) -> GateCall:
    """Validate a ``ple_gate`` call: metadata only (the gate reads no index values)."""
    tensor("key", key, ndim=2, kind="float")
    T, C = key.shape
    dev, dt = key.device, key.dtype
    tensor("value", value, ndim=2, kind="float", device=dev)
    if value.shape[0] != T or value.shape[1] == 0 or C % value.shape[1] != 0:
        raise ValueError(f"value: expected shape ({T}, H) with H dividing C={C}, got {tuple(value.shape)}")
    tensor("hidden_states", hidden_states, kind="float", device=dev, shape=(T, C))
    for name, t in (("value", value), ("hidden_states", hidden_states)):
        if t.dtype != dt:
            raise TypeError(f"{name}: expected dtype {dt} (that of key), got {t.dtype}")
    for name, w in (("norm_key_weight", norm_key_weight), ("norm_query_weight", norm_query_weight),
                    ("norm_conv_weight", norm_conv_weight)):
        tensor(name, w, kind="float", device=dev, shape=(C,))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps: expected a positive float, got {eps!r}")
    return GateCall(T, C, value.shape[1])


class ConvCall(NamedTuple):
    num_rows: int               # logical rows of the call
    state_len: int              # S
    slots: list[int]            # state_indices, per request
    starts: list[int]           # query_start_loc, per request + 1 (logical rows)
    has_initial: list[bool]     # per request
    accepted: list[int]         # num_accepted_tokens per request (spec), else all 1
    rows: list[int] | None      # token_indices on the host, or None for identity


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
    if not isinstance(mode, str) or mode not in ("prefill", "decode", "spec"):
        raise ValueError(f"mode: expected 'prefill', 'decode' or 'spec', got {mode!r}")
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
    rows = None if token_indices is None else _rows_values(token_indices, T, host, distinct=True)
    num_rows = T if rows is None else len(rows)
    if mode == "decode":
        starts = list(range(R + 1))
        if query_start_loc is not None:
            q = host_values("query_start_loc", query_start_loc, host).tolist()
            if q != starts:
                raise ValueError(f"query_start_loc: decode takes one row per request, got {q}")
    else:
        starts = offsets_values("query_start_loc", query_start_loc, total=num_rows, host=host)
    has_initial = [mode != "prefill"] * R
    if has_initial_states is not None:
        flags = host_values("has_initial_states", has_initial_states, host).tolist()
        if any(f not in (0, 1) for f in flags):
            raise ValueError(f"has_initial_states: expected flags 0 or 1, got {flags}")
        has_initial = [bool(f) for f in flags]
    accepted = [1] * R
    if mode == "spec":
        accepted = host_values("num_accepted_tokens", num_accepted_tokens, host).tolist()
        if any(not 1 <= a <= spec_query_len for a in accepted):
            raise ValueError(f"num_accepted_tokens: expected values in [1, spec_query_len={spec_query_len}], "
                             f"got {accepted}")
        lens = [b - a for a, b in zip(starts, starts[1:])]
        if any(not 1 <= n <= spec_query_len for n in lens):
            raise ValueError(f"query_start_loc: spec requests take 1..spec_query_len={spec_query_len} rows, "
                             f"got lengths {lens}")
    slots = host_values("state_indices", state_indices, host).tolist()
    live = [s for s in slots if s != null_slot]
    if any(not 0 <= s < num_slots for s in live):
        raise ValueError(f"state_indices: expected slots in [0, {num_slots}) or the null slot {null_slot}, "
                         f"got {slots}")
    if len(set(live)) != len(live):
        raise ValueError(f"state_indices: a slot appears twice in one call: {slots}")
    return ConvCall(num_rows, S, slots, starts, has_initial, accepted, rows)


ple_conv_call = _full_check(ple_conv_meta, ple_conv_values, "ple_conv")


class CheckpointCall(NamedTuple):
    starts: list[int]           # query_start_loc (logical rows)
    offsets: list[int]          # per request; 0: no checkpoint
    slots: list[int]            # per request
    rows: list[int] | None      # token_indices, or None for identity


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
    rows = None if token_indices is None else _rows_values(token_indices, T, host, distinct=False)
    num_rows = T if rows is None else len(rows)
    starts = offsets_values("query_start_loc", query_start_loc, total=num_rows, host=host)
    off = host_values("offsets", offsets, host).tolist()
    sl = host_values("slots", slots, host).tolist()
    for r, o in enumerate(off):
        n = starts[r + 1] - starts[r]
        if o == 0:
            continue
        if o < state_len:
            raise ValueError(f"offsets: request {r} has offset {o}; a checkpoint needs 0 (none) or an offset "
                             f">= state_len={state_len}")
        if o > n:
            raise ValueError(f"offsets: request {r} has offset {o} past its {n} rows")
    live = [s for o, s in zip(off, sl) if o > 0 and s != null_slot]
    if any(not 0 <= s < conv_state.shape[0] for s in live):
        raise ValueError(f"slots: expected slots in [0, {conv_state.shape[0]}), got {sl}")
    if len(set(live)) != len(live):
        raise ValueError(f"slots: a slot appears twice: {sl}")
    return CheckpointCall(starts, off, sl, rows)


export_call = _full_check(export_meta, export_values, "export_conv_checkpoints")


class DenseConvCall(NamedTuple):
    starts: list[int] | None    # cu_seqlens on the host, or None (dense, or one packed sequence)


def dense_conv_meta(x, weight, dilation, cu_seqlens) -> None:
    tensor("x", x, kind="float")
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected [B, L, C] or packed [T, C], got shape {tuple(x.shape)}")
    C = x.shape[-1]
    tensor("weight", weight, ndim=2, kind="float", device=x.device, shape=(C, None))
    if weight.shape[1] < 1:
        raise ValueError("weight: expected at least one tap, got shape (C, 0)")
    int_arg("dilation", dilation, minimum=1)
    if cu_seqlens is not None:
        if x.dim() != 2:
            raise ValueError(f"x: cu_seqlens needs packed [T, C] input, got shape {tuple(x.shape)}")
        offsets_meta("cu_seqlens", cu_seqlens, device=x.device)


def dense_conv_values(x, weight, dilation, cu_seqlens, *, host: Host = None) -> DenseConvCall:
    if cu_seqlens is None:
        return DenseConvCall(None)
    return DenseConvCall(offsets_values("cu_seqlens", cu_seqlens, total=x.shape[0], host=host))


dense_conv_call = _full_check(dense_conv_meta, dense_conv_values, "dilated_causal_conv")


def prefill_meta(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
                 conv_weights, *, dilation, query_start_loc, keep, conv_state, state_indices,
                 has_initial_states, token_indices, null_slot) -> None:
    """Metadata checks of a ``ple_prefill`` call (no tensor values are read)."""
    gate_call(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps)
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
        dense_conv_meta(key, conv_weights, dilation, query_start_loc)
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
        dense_conv_values(key, conv_weights, dilation, query_start_loc)
    else:
        ple_conv_values(key, key, conv_state, conv_weights, state_indices, mode="prefill",
                                dilation=dilation, query_start_loc=query_start_loc,
                                has_initial_states=has_initial_states, num_accepted_tokens=None,
                                spec_query_len=1, token_indices=token_indices, outer_residual=None,
                                null_slot=null_slot)


def prefill_call(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
                 conv_weights, *, dilation, query_start_loc, keep, conv_state, state_indices, has_initial_states,
                 token_indices, null_slot) -> None:
    """Validate a ``ple_prefill`` call: `prefill_meta`, then `prefill_values`."""
    prefill_meta(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps, conv_weights,
                 dilation=dilation, query_start_loc=query_start_loc, keep=keep, conv_state=conv_state,
                 state_indices=state_indices, has_initial_states=has_initial_states, token_indices=token_indices,
                 null_slot=null_slot)
    prefill_values(key, conv_weights, dilation=dilation, query_start_loc=query_start_loc, conv_state=conv_state,
                   state_indices=state_indices, has_initial_states=has_initial_states, token_indices=token_indices,
                   null_slot=null_slot)
