"""CUDA-graph capture of padded decode and spec steps (``ple.state.graphs.GraphedStep``): replay equals eager
over a stream of steps with slots allocated and freed between them. Needs a GPU."""

from __future__ import annotations

import pytest
import torch

import ple
from ple.state import Decode, PLECache, Prefill, Spec
from ple.state.graphs import GraphedStep
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

pytestmark = pytest.mark.gpu

TINY = ple.PLEConfig.preset("tiny")
C = TINY.hc_hidden_size


@pytest.mark.parametrize("kind", ["decode", "spec"])
def test_graph_replay_equals_eager_with_slots_coming_and_going(kind):
    dev = torch.device("cuda")
    layer = random_layer(TINY, 0, torch.bfloat16, seed=1).to(dev)
    layer.set_backend("triton")
    caches = [PLECache(TINY, 10, num_spec_tokens=2, num_layers=1, dtype=torch.bfloat16, device=dev)
              for _ in range(2)]
    graphed = GraphedStep(layer, caches[0])
    g = torch.Generator().manual_seed(2)
    q = 3 if kind == "spec" else 1
    live = [[], []]
    outs = [[], []]

    def admit(k, cache):                                  # a new request: allocate and prefill eagerly
        s = cache.allocate()
        toks = torch.randint(0, 500, (5,), generator=torch.Generator().manual_seed(len(live[k]) + 7)).tolist()
        b = cache.schedule([Prefill(s, toks)])
        layer.step(torch.ones(5, C, device=dev, dtype=torch.bfloat16), b, cache)
        live[k].append(s)

    for k, cache in enumerate(caches):
        for _ in range(3):
            admit(k, cache)
    for step in range(8):
        toks = torch.randint(0, 500, (len(live[0]), q), generator=g).tolist()
        h = torch.randn(6 * q, C, generator=g).to(torch.bfloat16).to(dev)
        for k, cache in enumerate(caches):
            items = [Decode(s, t[0]) if kind == "decode" else Spec(s, t) for s, t in zip(live[k], toks)]
            batch = cache.schedule(items, pad_to=6)
            run = graphed if k == 0 else (lambda hh, bb, c=cache: layer.step(hh, bb, c))
            outs[k].append(run(h, batch)[: len(items) * q])
            if kind == "spec":
                for s in live[k]:
                    cache.accept(s, 1 + step % q)
            if step % 3 == 1:                             # slots come and go between steps
                cache.free(live[k].pop(0))
                admit(k, cache)
            if step == 4:
                admit(k, cache)
    for a, b in zip(*outs, strict=True):
        assert_bitwise_equal(a, b, name="replayed step")
    assert_bitwise_equal(caches[0].conv_states, caches[1].conv_states, name="states")
    assert len(graphed._graphs) == 1
