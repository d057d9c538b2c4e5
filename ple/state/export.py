"""A decode step as a module of tensors only, for ``torch.export`` / AOTInductor: `DecodeStep`.

``layer.step(hidden, batch, cache)`` takes Python objects (a `StepBatch`, a `PLECache`) and does
host bookkeeping around the tensor work, so it cannot be exported as it is. A serving engine that
exports its model exports the tensor work of a fixed plan shape and keeps the bookkeeping in
Python; `DecodeStep` is that for a decode-only plan of ``num_requests`` requests::

    step = DecodeStep(layer, cache, num_requests=64)
    program = torch.export.export(step, step.example_inputs())
    batch = cache.schedule([Decode(s, t) for s, t in live])          # 64 decodes, as usual
    out = program.module()(*step.inputs_of(hidden, batch))           # the cache's states updated in place
    cache.end_layer(batch, layer.ple_layer_index)                    # the host bookkeeping, as step does

The conv states are an input the program mutates in place (``cache.conv_state(layer_index)``'s
storage, passed by `inputs_of`). Spec and prefill plans are not covered: their row counts per
request vary, so a fixed-shape program would need the padding an engine chooses. The outputs are
those of ``layer.step`` on the same plan, bit for bit (the same ops, in the same order).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from .batch import StepBatch
from .cache import PLECache
from .step import begin_step, compute_step

if TYPE_CHECKING:
    from ..layer import PLELayer

__all__ = ["DecodeStep"]


class DecodeStep(nn.Module):
    """The tensor work of a decode step of ``num_requests`` requests on ``layer``, for ``torch.export``.

    ``forward(hidden_states [R, C], input_ids [R], ngram_context [R, N-1], state_indices [R],
    has_initial_states [R], conv_states)`` -> ``[R, C]``; ``conv_states`` is the cache's whole
    ``conv_states`` tensor (`inputs_of` passes it), updated in place. Inference only.
    """

    def __init__(self, layer: PLELayer, cache: PLECache, num_requests: int) -> None:
        super().__init__()
        if not isinstance(cache, PLECache):
            raise TypeError(f"cache: expected a PLECache, got {type(cache).__name__}")
        self.layer = layer
        self.num_requests = int(num_requests)
        self._cache = cache
        self._layout = cache.layout

    def _cache_view(self, conv_states: torch.Tensor) -> SimpleNamespace:
        cache, index = self._cache, self.layer.ple_layer_index
        conv_state = conv_states[index]
        view = conv_state if self._layout == "channels_first" else conv_state.transpose(1, 2)
        return SimpleNamespace(config=cache.config, null_slot=cache.null_slot, conv_state=lambda _i: view)

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, ngram_context: torch.Tensor,
                state_indices: torch.Tensor, has_initial_states: torch.Tensor,
                conv_states: torch.Tensor) -> torch.Tensor:
        R = self.num_requests
        rows = torch.arange(R, device=hidden_states.device)
        batch = SimpleNamespace(input_ids=input_ids, query_start_loc=torch.arange(R + 1, device=rows.device),
                                ngram_context=ngram_context, num_spec_decodes=0, num_decodes=R, num_decode_tokens=R,
                                num_prefills=0, has_checkpoints=False, state_indices=state_indices,
                                has_initial_states_d=has_initial_states, non_spec_token_indices=rows)
        # Namespaces with the fields compute_step reads of a decode-only plan and of the cache.
        return compute_step(self.layer, hidden_states, cast(StepBatch, batch),
                            cast(PLECache, self._cache_view(conv_states)))

    def inputs_of(self, hidden_states: torch.Tensor, batch: StepBatch) -> tuple[torch.Tensor, ...]:
        """The program's inputs for ``hidden_states`` and a decode-only ``batch`` of this cache, checked as
        ``layer.step`` checks them (on the host; a spec -> decode window realignment is done here)."""
        if batch.num_decodes != self.num_requests or batch.num_prefills or batch.num_spec_decodes:
            raise ValueError(f"batch: expected a plan of {self.num_requests} decodes only, got {batch!r}")
        begin_step(self.layer, hidden_states, batch, self._cache)
        return (hidden_states, batch.input_ids, batch.ngram_context, batch.state_indices[:self.num_requests],
                batch.has_initial_states_d, self._cache.conv_states)

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        """Inputs of the right shapes and dtypes for ``torch.export.export`` (``num_requests`` fresh decodes
        on slot-0-free slots; the values do not matter for tracing)."""
        cache, R = self._cache, self.num_requests
        C, n = self.layer.config.hc_hidden_size, self.layer.config.context_len
        dev = cache.device
        hidden = torch.zeros(R, C, dtype=self.layer.key_proj.weight.dtype, device=dev)
        ids = torch.zeros(R, dtype=torch.int64, device=dev)
        ctx = torch.full((R, n), self.layer.config.eos_token_id, dtype=torch.int64, device=dev)
        state_indices = (torch.arange(R, device=dev) % max(cache.num_slots - 1, 1)) + 1
        return hidden, ids, ctx, state_indices, torch.ones(R, dtype=torch.int64, device=dev), cache.conv_states
