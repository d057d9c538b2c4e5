"""The checks of the hashing, lookup and gate ops: ``ngram_ids`` / ``ngram_embedding`` (`NgramCall`),
``embedding_lookup`` (`LookupCall`), ``ple_gate`` (`GateCall`; metadata only)."""

from __future__ import annotations

from typing import NamedTuple

from ..params import HashParams
from . import args
from .args import Host, bool_arg, float_arg, full_check, host_values, index, int_arg, tensor, value_range


class NgramCall(NamedTuple):
    num_requests: int                   # R
    query_start_loc_list: list[int]     # per request + 1 ([0, T] without a query_start_loc)


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
    _family_meta(params)
    R = 1 if query_start_loc is None else args.offsets_meta("query_start_loc", query_start_loc, device=dev)
    if ngram_context is not None:
        index("ngram_context", ngram_context, ndim=2, device=dev, shape=(R, N - 1))
    if weight is not None:
        tensor("weight", weight, ndim=2, device=dev)


def _family_meta(params: HashParams) -> None:
    """The family fields of ``params`` (docs/spec.md section 15): ``eos_rule`` a bool; ``token_map`` None or an
    int32 / int64 ``[V]`` tensor whose values are there (not on the meta device). Like the multipliers, it may
    live on another device than the ids (``hash_params`` makes CPU tensors): the op copies it to theirs, a copy a
    layer avoids by keeping it as a buffer on its device."""
    bool_arg("params.eos_rule", params.eos_rule)
    if params.token_map is not None:
        index("params.token_map", params.token_map, ndim=1, shape=(params.vocab_size,))


def ngram_values(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context, *,
                 weight=None, host: Host = None) -> NgramCall:
    """Values of ``ngram_ids`` (with ``weight``: also that the table holds every row the hash addresses). Any
    multipliers are accepted: products wrap modulo 2**64 and the floor remainder keeps every row inside its head
    (docs/spec.md section 3). A ``params.token_map`` holds ids ``>= 0`` (any size: the products wrap as above);
    its minimum is one reduction on its device and one scalar read back (``host["params.token_map"]``: those
    values instead)."""
    T, V = input_ids.numel(), params.vocab_size
    tmap = params.token_map
    if tmap is not None and tmap.numel():
        if host is not None and "params.token_map" in host:
            low = int(host_values("params.token_map", tmap, host).min())
        else:
            low = int(tmap.min())
        if low < 0:
            raise ValueError(f"params.token_map: expected mapped ids >= 0, got {low}")
    query_start_loc_list = ([0, T] if query_start_loc is None
                            else args.offsets_values("query_start_loc", query_start_loc, total=T, host=host))
    if ngram_context is not None:
        value_range("ngram_context", host_values("ngram_context", ngram_context, host), V, "token ids")
    value_range("input_ids", host_values("input_ids", input_ids, host), V, "token ids")
    if weight is not None and params.head_sizes.numel():
        last = host_values("head_offsets", params.head_offsets, host)[-1]
        needed = int(last + host_values("head_sizes", params.head_sizes, host)[-1])
        if weight.shape[0] < needed:
            raise ValueError(f"weight: the hash addresses rows up to {needed - 1}, so the table needs at "
                             f"least {needed} rows, got {weight.shape[0]}")
    return NgramCall(len(query_start_loc_list) - 1, query_start_loc_list)


ngram_call = full_check(ngram_meta, ngram_values, "ngram_ids")


class LookupCall(NamedTuple):
    num_tokens: int             # T
    num_heads: int              # NH
    dim: int                    # D


def lookup_meta(weight, ids) -> None:
    tensor("weight", weight, ndim=2)
    index("ids", ids, ndim=2, device=weight.device)


def lookup_values(weight, ids, *, host: Host = None) -> LookupCall:
    value_range("ids", host_values("ids", ids, host), weight.shape[0], "rows")
    return LookupCall(ids.shape[0], ids.shape[1], weight.shape[1])


lookup_call = full_check(lookup_meta, lookup_values, "embedding_lookup")


class GateCall(NamedTuple):
    num_tokens: int             # T
    channels: int               # C = M * H
    group_size: int             # H


def gate_call(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps, *,
              conv_eps=None, unit_offset=True) -> GateCall:
    """Validate a ``ple_gate`` call: metadata only (the gate reads no index values). ``conv_eps`` a positive
    finite float or None, ``unit_offset`` a bool (the Engram family's options, docs/spec.md section 15)."""
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
    float_arg("eps", eps, above=0)
    if conv_eps is not None:
        float_arg("conv_eps", conv_eps, above=0, finite=True)
    bool_arg("unit_offset", unit_offset)
    return GateCall(T, C, value.shape[1])
