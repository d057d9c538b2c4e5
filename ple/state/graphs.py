"""CUDA-graph replay of decode and spec steps: `GraphedStep`.

A serving engine captures its decode batches once per size and replays them. Here a
step splits into host work (``begin_step``: checks and the spec -> non-spec realignment;
``cache.end_layer``: the bookkeeping) and tensor work (``compute_step``), which reads
nothing back from the device and, on a plan padded with ``schedule(..., pad_to=N)``,
always reads the same metadata tensors. `GraphedStep` captures ``compute_step`` once per
padded shape and replays it::

    step = GraphedStep(layer, cache)
    batch = cache.schedule([Decode(s, t) for s, t in live], pad_to=64)
    out = step(hidden, batch)          # hidden: [batch.num_tokens, C]; as layer.step(hidden, batch, cache)

The first call of a shape runs eagerly (it compiles the Triton kernels), the second
captures and replays, later ones replay. Each call copies ``hidden`` into the graph's
input, runs the host work around the replay and returns a copy of the graph's output.
Needs CUDA and the Triton backend (or any backend whose ops make no host syncs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .batch import StepBatch
from .step import begin_step, compute_step

if TYPE_CHECKING:
    from ..layer import PLELayer
    from .cache import PLECache

__all__ = ["GraphedStep"]


class GraphedStep:
    """``layer.step`` for padded decode / spec plans of one cache, replayed from CUDA graphs."""

    def __init__(self, layer: PLELayer, cache: PLECache) -> None:
        self.layer, self.cache = layer, cache
        # pad_key -> (graph, static hidden, static output)
        self._graphs: dict[tuple[int, bool, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._seen: set[tuple[int, bool, int]] = set()              # shapes already run eagerly once

    @torch.no_grad()
    def __call__(self, hidden_states: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        if not isinstance(batch, StepBatch) or batch.pad_key is None:
            raise ValueError("batch: GraphedStep replays padded plans; schedule them with pad_to=N")
        layer, cache = self.layer, self.cache
        begin_step(layer, hidden_states, batch, cache)
        key = batch.pad_key
        if key not in self._seen:                                    # eager once: kernels compile here
            out = compute_step(layer, hidden_states, batch, cache)
            self._seen.add(key)
        else:
            if key not in self._graphs:
                static_h = hidden_states.clone()
                graph = torch.cuda.CUDAGraph()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):                        # recorded, not run
                    static_out = compute_step(layer, static_h, batch, cache)
                self._graphs[key] = (graph, static_h, static_out)
            graph, static_h, static_out = self._graphs[key]
            static_h.copy_(hidden_states)
            graph.replay()
            out = static_out.clone()
        cache.end_layer(batch, layer.ple_layer_index)
        return out
