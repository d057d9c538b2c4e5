"""`CompiledStep`: ``layer.step`` with only its tensor work under ``torch.compile``.

``torch.compile(layer.step, fullgraph=True)`` traces the whole step, the cache's host bookkeeping
included (``begin_layer``'s staleness checks, the realignment record, ``end_layer``'s context
updates), so its guards pin every item of the plan it first saw: each request's slot, the cache's
version. In serving, where slots change every step, that recompiles (or runs the slow path) step
after step. `CompiledStep` compiles ``compute_step`` alone (the part that reads nothing back from
the device, as ``ple.state.graphs`` captures it) and runs the host parts eagerly around it::

    step = CompiledStep(layer)                         # torch.compile(compute_step, fullgraph=True)
    out = step(hidden, cache.schedule(items), cache)   # as layer.step(hidden, batch, cache)

Its graphs specialise on what ``compute_step`` reads: the counts of the plan (how many decode, spec
and prefill requests and tokens, whether it has checkpoints) and the tensors' shapes, not which
slots the requests hold; ``schedule(..., pad_to=N)`` fixes the counts of decode plans. Results are
those of the compiled ops (on ``"torch"`` inductor's fused rounding, within the tolerance table;
states bit for bit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .step import begin_step, compute_step

if TYPE_CHECKING:
    from ..layer import PLELayer
    from .batch import StepBatch
    from .cache import PLECache

__all__ = ["CompiledStep"]


class CompiledStep:
    """``layer.step`` whose tensor work runs through ``torch.compile(compute_step, **compile_kwargs)``
    (``fullgraph=True`` unless given); checks and bookkeeping run eagerly."""

    def __init__(self, layer: PLELayer, **compile_kwargs: Any) -> None:
        self.layer = layer
        self.compute = torch.compile(compute_step, **{"fullgraph": True, **compile_kwargs})

    @torch.no_grad()
    def __call__(self, hidden_states: torch.Tensor, batch: StepBatch, cache: PLECache) -> torch.Tensor:
        begin_step(self.layer, hidden_states, batch, cache)
        out = self.compute(self.layer, hidden_states, batch, cache)
        cache.end_layer(batch, self.layer.ple_layer_index)
        return out

    def __repr__(self) -> str:
        return f"CompiledStep({self.layer.__class__.__name__}(ple_layer_index={self.layer.ple_layer_index}))"
