"""Serving state: per-request conv-state caches, n-gram contexts and the step scheduler.

>>> cache = PLECache(config, num_slots=8, num_spec_tokens=3)
>>> a = cache.allocate()
>>> batch = cache.schedule([Prefill(a, prompt)])
>>> out = layer.step(hidden_states, batch, cache)       # [T, C]
>>> batch = cache.schedule([Spec(a, [t0, t1, t2])]); out = layer.step(h, batch, cache)
>>> cache.accept(a, 2)                                   # keep the first two

``cache.schedule`` validates on the host and returns the step's plan (``ple.state.batch``);
``layer.step`` then reads nothing back from the device. ``schedule(..., pad_to=N)`` and
`GraphedStep` replay decode / spec steps from CUDA graphs (``ple.state.graphs``); `CompiledStep` runs a
step's tensor work through ``torch.compile`` (``ple.state.compiled``).
"""

from .batch import StepBatch, StepHost
from .cache import LAYOUTS, PLECache
from .compiled import CompiledStep
from .graphs import GraphedStep
from .items import Decode, Prefill, Spec

__all__ = ["PLECache", "StepBatch", "StepHost", "Prefill", "Decode", "Spec", "LAYOUTS", "GraphedStep", "CompiledStep"]
