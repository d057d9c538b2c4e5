"""`PLELayer.step`: one serving step of one PLE layer over a `StepBatch`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import _checks
from .._deprecation import deprecated_parameter
from .batch import StepBatch

if TYPE_CHECKING:
    from types import ModuleType

    from ..backends import CustomOps
    from ..config import PLEConfig
    from ..layer import PLELayer
    from .cache import PLECache

__all__ = ["layer_step", "begin_step", "compute_step", "step_conv", "uses_fused_prefill", "check_same_config",
           "STEP_FIELDS"]


STEP_FIELDS = ("vocab_size", "hidden_size", "hc_count", "eos_token_id", "ngram_size", "ple_conv_kernel_size",
               "ple_layer_ids", "family", "token_map")
"""The config fields a step's cache depends on: token range, widths, the EOS rule (or the Engram family's pad
and token map), contexts and states."""


def _shown(value: object) -> str:
    return f"a map of {len(value)} ids" if isinstance(value, tuple) and len(value) > 8 else repr(value)


def check_same_config(layer_config: PLEConfig, cache_config: PLEConfig) -> None:
    """``ValueError`` naming ``layer`` if its config differs from the cache's in a field the step uses (the same
    config object, the usual case, costs nothing: an Engram token map is a tuple of every token id)."""
    if layer_config is cache_config:
        return
    diff = [f"{f} ({_shown(getattr(layer_config, f))} vs the cache's {_shown(getattr(cache_config, f))})"
            for f in STEP_FIELDS if getattr(layer_config, f) != getattr(cache_config, f)]
    if diff:
        raise ValueError(f"layer: its config differs from the cache's in {', '.join(diff)}")


@torch.no_grad()
def layer_step(layer: PLELayer, hidden_states: torch.Tensor, batch: StepBatch, cache: PLECache) -> torch.Tensor:
    """Run ``layer`` on the ``[T, C]`` rows of ``batch``; conv states of ``cache`` updated in place.

    The n-gram ids come from the batch's contexts; the gate runs once over all rows;
    the conv runs once for the spec rows and once per non-spec mode (decodes, then
    prefills), each through ``token_indices`` into the caller's row order, with the
    outer residual (``hidden_states``) fused. Inference only (no autograd).

    Three parts: `begin_step` (checks on the host, the spec -> non-spec realignment),
    `compute_step` (the tensor work: it reads nothing back from the device and changes no
    Python state, so a CUDA graph can capture it, see ``ple.state.graphs``) and
    ``cache.end_layer`` (the bookkeeping).
    """
    begin_step(layer, hidden_states, batch, cache)
    out = compute_step(layer, hidden_states, batch, cache)
    cache.end_layer(batch, layer.ple_layer_index)
    return out


def begin_step(layer: PLELayer, hidden_states: torch.Tensor, batch: StepBatch, cache: PLECache) -> None:
    """Everything a step checks, on the host (metadata only), then the realignment of its windows."""
    if not callable(getattr(cache, "begin_layer", None)):              # a PLECache (this module cannot import it)
        raise TypeError(f"cache: expected a PLECache, got {type(cache).__name__}")
    index = layer.ple_layer_index
    cache.begin_layer(batch, index)
    layer._check_hidden(hidden_states, 2)
    T = hidden_states.shape[0]  # tokens of the step (padding rows included)
    if T != batch.num_tokens:
        raise ValueError(f"hidden_states: expected {batch.num_tokens} rows (the batch's tokens), got {T}")
    check_same_config(layer.config, cache.config)
    _checks.tensor("hidden_states", hidden_states, device=cache.device)
    cache.realign_windows(batch, index, cache.conv_state(index))


def compute_step(layer: PLELayer, hidden_states: torch.Tensor, batch: StepBatch, cache: PLECache) -> torch.Tensor:
    """The step's tensor work, ``[T, C] -> [T, C]``: the ops run with ``validate=False`` (the plan was
    validated on the host by ``cache.schedule``), so no tensor becomes a Python value. The same ops in
    the same order on every backend: the rows' embeddings (``layer.hashed_rows``), the projections,
    then a step of prefills only (no checkpoints) is one ``ple_prefill`` (``ple.fast`` fuses it);
    any other step gates all rows once (``ple_gate``) and runs a ``ple_conv`` per mode (`step_conv`)."""
    ops = layer.ops
    emb = layer.hashed_rows(batch.input_ids, hidden_states.dtype, query_start_loc=batch.query_start_loc,
                            ngram_context=batch.ngram_context, validate=False)   # [T, E]
    conv_state = cache.conv_state(layer.ple_layer_index)                 # [num_slots, C, W] view
    weights = layer.conv_weights.to(hidden_states.dtype)
    if uses_fused_prefill(batch):                                        # prefills only: one op
        key, value = layer.project(emb)
        return ops.ple_prefill(key, value, hidden_states, *layer.norm_weights,
                               layer.config.gate_eps(hidden_states.dtype), weights,
                               dilation=cache.config.conv_dilation, query_start_loc=batch.query_start_loc_p,
                               conv_state=conv_state, state_indices=batch.state_indices,
                               has_initial_states=batch.has_initial_states_p,
                               token_indices=batch.non_spec_token_indices, null_slot=cache.null_slot,
                               validate=False, **layer.config.gate_options())
    out, conv_input = layer.gate(emb, hidden_states)                     # gated becomes the output in place
    step_conv(ops, conv_input, out, conv_state, weights, batch, cache, outer_residual=hidden_states)
    return out


def uses_fused_prefill(batch: StepBatch) -> bool:
    """Whether `compute_step` runs ``batch`` as one ``ple_prefill`` (prefills only, no prefix-cache
    checkpoints: those need the conv inputs in memory), on every backend."""
    return not batch.num_spec_decodes and not batch.num_decodes and not batch.has_checkpoints


@deprecated_parameter("state", "conv_state", since="0.1.0")
def step_conv(ops: ModuleType | CustomOps, conv_input: torch.Tensor, residual: torch.Tensor,
              conv_state: torch.Tensor, weights: torch.Tensor, batch: StepBatch, cache: PLECache, *,
              outer_residual: torch.Tensor | None = None) -> None:
    """The conv calls of one step, as a serving engine makes them, all through ``token_indices``.

    One ``ple_conv`` for the spec rows, one for the decodes, one for the prefills (then
    their prefix-cache checkpoints); ``residual += y (+ outer_residual)`` in place. ``conv_state``
    is the layer's ``[num_slots, C, W]`` view (``cache.conv_state(i)``; the keyword ``state=`` still
    works and warns: deprecated).
    """
    cfg = cache.config
    common: dict[str, Any] = dict(dilation=cfg.conv_dilation, outer_residual=outer_residual, null_slot=cache.null_slot,
                  validate=False)                              # the plan was validated by cache.schedule
    if batch.num_spec_decodes:
        ops.ple_conv(conv_input, residual, conv_state, weights, batch.spec_state_indices, mode="spec",
                     query_start_loc=batch.spec_query_start_loc, num_accepted_tokens=batch.num_accepted_tokens,
                     spec_query_len=batch.spec_query_len, token_indices=batch.spec_token_indices, **common)
    nd = batch.num_decode_tokens
    if batch.num_decodes:
        ops.ple_conv(conv_input, residual, conv_state, weights, batch.state_indices[:batch.num_decodes],
                     mode="decode",
                     has_initial_states=None,          # every decode of a PLECache plan reads its history
                     token_indices=batch.non_spec_token_indices[:nd], **common)
    if batch.num_prefills:
        prefill_rows = batch.non_spec_token_indices[nd:]
        ops.ple_conv(conv_input, residual, conv_state, weights, batch.state_indices[batch.num_decodes:],
                     mode="prefill", query_start_loc=batch.query_start_loc_p,
                     has_initial_states=batch.has_initial_states_p, token_indices=prefill_rows, **common)
        if batch.has_checkpoints:
            ops.export_conv_checkpoints(conv_input, conv_state, query_start_loc=batch.query_start_loc_p,
                                        offsets=batch.checkpoint_offsets, slots=batch.checkpoint_slots,
                                        state_len=cfg.conv_state_len, token_indices=prefill_rows,
                                        null_slot=cache.null_slot, validate=False)
