"""The public ``ple.fast`` ops, registered with ``torch.library`` so ``torch.compile`` sees through them.

Each op is a ``torch.library.custom_op`` in the ``ple`` namespace (``torch.ops.ple.*``)
with a fake (meta) implementation for tracing and, where it has gradients, a
``register_autograd`` formula whose backward is itself a custom op. Validation
(which reads index tensors on the host) runs inside the ops, so a compiled graph
calls it at run time without a graph break. The Python functions exported here
keep the reference's signatures: they unpack `HashParams` and forward keyword
arguments to the ops.

=============================  ==========================================  ===============
op                             implementation                              mutates
=============================  ==========================================  ===============
``ple::ngram_ids``             ``hashing.ngram_ids``                       -
``ple::ngram_embedding``       ``hashing.ngram_embedding`` (fused)         -
``ple::embedding_lookup``      ``embedding.embedding_lookup``              -
``ple::ple_gate``              ``gate._gate_fwd`` / ``gate._gate_bwd``     -
``ple::dilated_causal_conv``   ``conv._fwd`` / ``conv._bwd``               -
``ple::ple_conv``              ``conv.ple_conv``                           residual, conv_state
``ple::export_conv_checkpoints``  ``conv.export_conv_checkpoints``         conv_state
=============================  ==========================================  ===============
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from .. import _checks
from ..reference.conv import check_dense_conv_args
from ..reference.embedding import check_lookup_args
from ..reference.gate import check_gate_args
from ..reference.hashing import HashParams
from . import conv as _conv
from . import embedding as _embedding
from . import gate as _gate
from . import hashing as _hashing

__all__ = ["ngram_ids", "ngram_embedding", "embedding_lookup", "ple_gate", "ple_conv",
           "export_conv_checkpoints", "dilated_causal_conv"]


def _tensors(**named) -> None:
    """TypeError naming the argument for anything that is not a tensor (None allowed: optional)."""
    for name, t in named.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def _params(multipliers, head_sizes, head_offsets, num_rows, vocab_size) -> HashParams:
    return HashParams(multipliers, head_sizes, head_offsets, num_rows, vocab_size)


# ---- n-gram ids ---------------------------------------------------------------------------------


@custom_op("ple::ngram_ids", mutates_args=())
def _ngram_ids_op(input_ids: torch.Tensor, multipliers: torch.Tensor, head_sizes: torch.Tensor,
                  head_offsets: torch.Tensor, num_rows: int, vocab_size: int, heads_per_ngram: int,
                  eos_token_id: int, query_start_loc: torch.Tensor | None,
                  ngram_context: torch.Tensor | None) -> torch.Tensor:
    params = _params(multipliers, head_sizes, head_offsets, num_rows, vocab_size)
    return _hashing.ngram_ids(input_ids, params, heads_per_ngram=heads_per_ngram, eos_token_id=eos_token_id,
                              query_start_loc=query_start_loc, ngram_context=ngram_context)


@_ngram_ids_op.register_fake
def _(input_ids, multipliers, head_sizes, head_offsets, num_rows, vocab_size, heads_per_ngram, eos_token_id,
      query_start_loc, ngram_context):
    return input_ids.new_empty((input_ids.shape[0], head_sizes.shape[0]), dtype=torch.int64)


def ngram_ids(input_ids: torch.Tensor, params: HashParams, *, heads_per_ngram: int, eos_token_id: int,
              query_start_loc: torch.Tensor | None = None,
              ngram_context: torch.Tensor | None = None) -> torch.Tensor:
    """Table rows of every token's NH hash heads, ``[T, NH]`` int64 (see ``ple.reference.ngram_ids``)."""
    if not isinstance(params, HashParams):
        raise TypeError(f"params: expected HashParams, got {type(params).__name__}")
    _checks.tensor("input_ids", input_ids)
    _tensors(query_start_loc=query_start_loc, ngram_context=ngram_context)
    _checks.int_arg("heads_per_ngram", heads_per_ngram)
    _checks.int_arg("eos_token_id", eos_token_id)
    return _ngram_ids_op(input_ids, params.multipliers, params.head_sizes, params.head_offsets, params.num_rows,
                         params.vocab_size, heads_per_ngram, eos_token_id, query_start_loc, ngram_context)


# ---- embedding lookup ---------------------------------------------------------------------------


@custom_op("ple::embedding_lookup", mutates_args=())
def _lookup_op(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    check_lookup_args(weight, ids)
    return _embedding._lookup_fwd(weight, ids)


@_lookup_op.register_fake
def _(weight, ids):
    return weight.new_empty((ids.shape[0], ids.shape[1] * weight.shape[1]))


@custom_op("ple::embedding_lookup_backward", mutates_args=())
def _lookup_bwd_op(grad: torch.Tensor, ids: torch.Tensor, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    return _embedding._lookup_bwd(grad, ids, num_rows, dtype)


@_lookup_bwd_op.register_fake
def _(grad, ids, num_rows, dtype):
    D = grad.shape[1] // max(ids.shape[1], 1)
    return grad.new_empty((num_rows, D), dtype=dtype)


def _lookup_setup(ctx, inputs, output):
    weight, ids = inputs
    ctx.save_for_backward(ids)
    ctx.num_rows, ctx.dtype = weight.shape[0], weight.dtype


def _lookup_backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    return _lookup_bwd_op(grad.contiguous(), ids, ctx.num_rows, ctx.dtype), None


_lookup_op.register_autograd(_lookup_backward, setup_context=_lookup_setup)


def embedding_lookup(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``weight[ids]`` flattened per token, ``[T, NH * D]`` (see ``ple.reference.embedding_lookup``)."""
    _checks.tensor("weight", weight)
    _checks.tensor("ids", ids)
    return _lookup_op(weight, ids)


# ---- fused hash + gather (an extra of ple.fast) -------------------------------------------------


@custom_op("ple::ngram_embedding", mutates_args=())
def _ngram_embedding_op(weight: torch.Tensor, input_ids: torch.Tensor, multipliers: torch.Tensor,
                        head_sizes: torch.Tensor, head_offsets: torch.Tensor, num_rows: int, vocab_size: int,
                        heads_per_ngram: int, eos_token_id: int, query_start_loc: torch.Tensor | None,
                        ngram_context: torch.Tensor | None) -> torch.Tensor:
    params = _params(multipliers, head_sizes, head_offsets, num_rows, vocab_size)
    return _hashing.ngram_embedding(weight, input_ids, params, heads_per_ngram=heads_per_ngram,
                                    eos_token_id=eos_token_id, query_start_loc=query_start_loc,
                                    ngram_context=ngram_context)


@_ngram_embedding_op.register_fake
def _(weight, input_ids, multipliers, head_sizes, head_offsets, num_rows, vocab_size, heads_per_ngram,
      eos_token_id, query_start_loc, ngram_context):
    return weight.new_empty((input_ids.shape[0], head_sizes.shape[0] * weight.shape[1]))


def _ngram_embedding_setup(ctx, inputs, output):
    weight, input_ids, mult, sizes, offsets, num_rows, vocab, P, eos, qsl, ctx_tokens = inputs
    ctx.save_for_backward(input_ids, mult, sizes, offsets, qsl, ctx_tokens)
    ctx.meta = (weight.shape[0], weight.dtype, num_rows, vocab, P, eos)


def _ngram_embedding_backward(ctx, grad):
    input_ids, mult, sizes, offsets, qsl, ctx_tokens = ctx.saved_tensors
    rows, dtype, num_rows, vocab, P, eos = ctx.meta
    ids = _ngram_ids_op(input_ids, mult, sizes, offsets, num_rows, vocab, P, eos, qsl, ctx_tokens)
    return (_lookup_bwd_op(grad.contiguous(), ids, rows, dtype),) + (None,) * 10


_ngram_embedding_op.register_autograd(_ngram_embedding_backward, setup_context=_ngram_embedding_setup)


def ngram_embedding(weight: torch.Tensor, input_ids: torch.Tensor, params: HashParams, *,
                    heads_per_ngram: int, eos_token_id: int, query_start_loc: torch.Tensor | None = None,
                    ngram_context: torch.Tensor | None = None) -> torch.Tensor:
    """Hash and gather in one kernel, ``[T, NH * D]``: equal bit for bit to
    ``embedding_lookup(weight, ngram_ids(input_ids, params, ...))`` (an extra of ``ple.fast``)."""
    if not isinstance(params, HashParams):
        raise TypeError(f"params: expected HashParams, got {type(params).__name__}")
    _checks.tensor("weight", weight)
    _checks.tensor("input_ids", input_ids)
    _tensors(query_start_loc=query_start_loc, ngram_context=ngram_context)
    _checks.int_arg("heads_per_ngram", heads_per_ngram)
    _checks.int_arg("eos_token_id", eos_token_id)
    return _ngram_embedding_op(weight, input_ids, params.multipliers, params.head_sizes, params.head_offsets,
                               params.num_rows, params.vocab_size, heads_per_ngram, eos_token_id,
                               query_start_loc, ngram_context)


# ---- gate ---------------------------------------------------------------------------------------


@custom_op("ple::ple_gate", mutates_args=())
def _gate_op(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor, norm_key_weight: torch.Tensor,
             norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_gate_args(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps)
    return _gate._gate_fwd(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps)


@_gate_op.register_fake
def _(key, value, hidden_states, wk, wq, wc, eps):
    return torch.empty_like(key, memory_format=torch.contiguous_format), \
        torch.empty_like(key, memory_format=torch.contiguous_format)


@custom_op("ple::ple_gate_backward", mutates_args=())
def _gate_bwd_op(dgated: torch.Tensor, dconv: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 hidden_states: torch.Tensor, norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor,
                 norm_conv_weight: torch.Tensor, eps: float) -> list[torch.Tensor]:
    grads = list(_gate._gate_bwd(dgated, dconv, key, value, hidden_states, norm_key_weight, norm_query_weight,
                                 norm_conv_weight, eps))
    # The three weight gradients can be views of one reduction buffer; outputs of an op must not alias.
    return grads[:3] + [g.clone() for g in grads[3:]]


@_gate_bwd_op.register_fake
def _(dgated, dconv, key, value, hidden_states, wk, wq, wc, eps):
    return [torch.empty_like(key, memory_format=torch.contiguous_format),
            torch.empty_like(value, memory_format=torch.contiguous_format),
            torch.empty_like(hidden_states, memory_format=torch.contiguous_format),
            torch.empty_like(wk), torch.empty_like(wq), torch.empty_like(wc)]


def _gate_setup(ctx, inputs, output):
    *tensors, eps = inputs
    ctx.save_for_backward(*tensors)
    ctx.eps = eps


def _gate_backward(ctx, dgated, dconv):
    tensors = ctx.saved_tensors
    dgated = torch.zeros_like(tensors[0]) if dgated is None else dgated
    dconv = torch.zeros_like(tensors[0]) if dconv is None else dconv
    grads = _gate_bwd_op(dgated, dconv, *tensors, ctx.eps)
    return (*grads, None)


_gate_op.register_autograd(_gate_backward, setup_context=_gate_setup)


def ple_gate(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
             norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor,
             norm_conv_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gated, conv_input)``, both ``[T, C]`` (see ``ple.reference.ple_gate``); differentiable."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise ValueError(f"eps: expected a positive float, got {eps!r}")
    for name, t in (("key", key), ("value", value), ("hidden_states", hidden_states),
                    ("norm_key_weight", norm_key_weight), ("norm_query_weight", norm_query_weight),
                    ("norm_conv_weight", norm_conv_weight)):
        _checks.tensor(name, t)
    return _gate_op(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, float(eps))


# ---- training conv ------------------------------------------------------------------------------


def _tiles(x, weight, dilation, cu_seqlens):
    starts = check_dense_conv_args(x, weight, dilation, cu_seqlens)
    return _conv._tile_table(starts, _conv.PREFILL_BLOCK_T, x.device) if starts is not None else None


@custom_op("ple::dilated_causal_conv", mutates_args=())
def _dcc_op(x: torch.Tensor, weight: torch.Tensor, dilation: int,
            cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    return _conv._fwd(x, weight, dilation, cu_seqlens, _tiles(x, weight, dilation, cu_seqlens))


@_dcc_op.register_fake
def _(x, weight, dilation, cu_seqlens):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@custom_op("ple::dilated_causal_conv_backward", mutates_args=())
def _dcc_bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, dilation: int,
                cu_seqlens: torch.Tensor | None) -> list[torch.Tensor]:
    tiles = _tiles(x, weight, dilation, cu_seqlens)
    dx, dw = _conv._bwd(dy.contiguous(), x, weight, dilation, cu_seqlens, tiles, True, True)
    return [dx, dw]


@_dcc_bwd_op.register_fake
def _(dy, x, weight, dilation, cu_seqlens):
    return [torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)]


def _dcc_setup(ctx, inputs, output):
    x, weight, dilation, cu_seqlens = inputs
    ctx.save_for_backward(x, weight, cu_seqlens)
    ctx.dilation = dilation


def _dcc_backward(ctx, dy):
    x, weight, cu_seqlens = ctx.saved_tensors
    dx, dw = _dcc_bwd_op(dy, x, weight, ctx.dilation, cu_seqlens)
    return dx, dw, None, None


_dcc_op.register_autograd(_dcc_backward, setup_context=_dcc_setup)


def dilated_causal_conv(x: torch.Tensor, weight: torch.Tensor, *, dilation: int,
                        cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(causal dilated depthwise conv(x))``, dense or packed (see ``ple.reference.dilated_causal_conv``)."""
    _checks.tensor("x", x)
    _checks.tensor("weight", weight)
    _tensors(cu_seqlens=cu_seqlens)
    _checks.int_arg("dilation", dilation, minimum=1)
    return _dcc_op(x, weight, dilation, cu_seqlens)


# ---- serving conv -------------------------------------------------------------------------------


@custom_op("ple::ple_conv", mutates_args=("residual", "conv_state"))
def _ple_conv_op(inputs: torch.Tensor, residual: torch.Tensor, conv_state: torch.Tensor,
                 conv_weights: torch.Tensor, state_indices: torch.Tensor, conv_mode: str, dilation: int,
                 query_start_loc: torch.Tensor | None, has_initial_states: torch.Tensor | None,
                 num_accepted_tokens: torch.Tensor | None, spec_query_len: int,
                 token_indices: torch.Tensor | None, outer_residual: torch.Tensor | None,
                 null_slot: int) -> None:
    _conv.ple_conv(inputs, residual, conv_state, conv_weights, state_indices, mode=conv_mode, dilation=dilation,
                   query_start_loc=query_start_loc, has_initial_states=has_initial_states,
                   num_accepted_tokens=num_accepted_tokens, spec_query_len=spec_query_len,
                   token_indices=token_indices, outer_residual=outer_residual, null_slot=null_slot)


@_ple_conv_op.register_fake
def _(inputs, residual, conv_state, conv_weights, state_indices, conv_mode, dilation, query_start_loc,
      has_initial_states, num_accepted_tokens, spec_query_len, token_indices, outer_residual, null_slot):
    return None


def ple_conv(inputs: torch.Tensor, residual: torch.Tensor, conv_state: torch.Tensor,
             conv_weights: torch.Tensor, state_indices: torch.Tensor, *, mode: str, dilation: int,
             query_start_loc: torch.Tensor | None = None, has_initial_states: torch.Tensor | None = None,
             num_accepted_tokens: torch.Tensor | None = None, spec_query_len: int = 1,
             token_indices: torch.Tensor | None = None, outer_residual: torch.Tensor | None = None,
             null_slot: int = 0) -> None:
    """One serving step of the conv, in place (see ``ple.reference.ple_conv``)."""
    if not isinstance(mode, str):
        raise ValueError(f"mode: expected 'prefill', 'decode' or 'spec', got {mode!r}")
    for name, value in (("dilation", dilation), ("spec_query_len", spec_query_len), ("null_slot", null_slot)):
        _checks.int_arg(name, value)
    for name, t in (("inputs", inputs), ("residual", residual), ("conv_state", conv_state),
                    ("conv_weights", conv_weights), ("state_indices", state_indices)):
        _checks.tensor(name, t)
    _tensors(query_start_loc=query_start_loc, has_initial_states=has_initial_states,
             num_accepted_tokens=num_accepted_tokens, token_indices=token_indices, outer_residual=outer_residual)
    _ple_conv_op(inputs, residual, conv_state, conv_weights, state_indices, mode, dilation, query_start_loc,
                 has_initial_states, num_accepted_tokens, spec_query_len, token_indices, outer_residual,
                 null_slot)


@custom_op("ple::export_conv_checkpoints", mutates_args=("conv_state",))
def _export_op(inputs: torch.Tensor, conv_state: torch.Tensor, query_start_loc: torch.Tensor,
               offsets: torch.Tensor, slots: torch.Tensor, state_len: int, token_indices: torch.Tensor | None,
               null_slot: int) -> None:
    _conv.export_conv_checkpoints(inputs, conv_state, query_start_loc=query_start_loc, offsets=offsets,
                                  slots=slots, state_len=state_len, token_indices=token_indices,
                                  null_slot=null_slot)


@_export_op.register_fake
def _(inputs, conv_state, query_start_loc, offsets, slots, state_len, token_indices, null_slot):
    return None


def export_conv_checkpoints(inputs: torch.Tensor, conv_state: torch.Tensor, *, query_start_loc: torch.Tensor,
                            offsets: torch.Tensor, slots: torch.Tensor, state_len: int,
                            token_indices: torch.Tensor | None = None, null_slot: int = 0) -> None:
    """Write prefix-cache checkpoints (see ``ple.reference.export_conv_checkpoints``)."""
    for name, value in (("state_len", state_len), ("null_slot", null_slot)):
        _checks.int_arg(name, value)
    for name, t in (("query_start_loc", query_start_loc), ("offsets", offsets), ("slots", slots)):
        _checks.tensor(name, t)
    _checks.tensor("inputs", inputs)
    _checks.tensor("conv_state", conv_state)
    _tensors(token_indices=token_indices)
    _export_op(inputs, conv_state, query_start_loc, offsets, slots, state_len, token_indices, null_slot)
