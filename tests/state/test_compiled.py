"""`CompiledStep`: the step's tensor work compiled once per plan shape, whichever slots the requests hold;
its results are those of ``layer.step`` (here through a backend that runs dynamo's graph as traced, so bit
for bit; inductor's rounding is the tolerance table's business, tests/test_compile.py)."""

from __future__ import annotations

import torch

from ple import PLEConfig
from ple.state import CompiledStep, Decode, PLECache, Prefill
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

CONFIG = PLEConfig.preset("tiny")


def test_new_slots_do_not_recompile_and_results_equal_the_eager_step():
    graphs = []

    def count(gm, example_inputs):                     # a dynamo backend: count the graphs, run them as traced
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    layer = random_layer(CONFIG, dtype=torch.bfloat16, backend="torch")
    step = CompiledStep(layer, backend=count)
    caches = [PLECache(CONFIG, 8, num_layers=1, dtype=torch.bfloat16) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    C, V = CONFIG.hc_hidden_size, CONFIG.vocab_size

    def both(items_of):
        """Schedule the same items on both caches; the compiled step on one, layer.step on the other."""
        batches = [c.schedule(items_of(c)) for c in caches]
        h = torch.randn(batches[0].num_tokens, C, generator=gen).to(torch.bfloat16)
        got = step(h, batches[0], caches[0])
        want = layer.step(h, batches[1], caches[1])
        assert_bitwise_equal(got, want, name="step output")
        assert_bitwise_equal(caches[0].conv_states, caches[1].conv_states, name="conv states")

    def tokens(n):
        return torch.randint(0, V, (n,), generator=gen).tolist()

    slots = [[c.allocate() for _ in range(3)] for c in caches]
    prompts = [tokens(n) for n in (5, 2, 7)]
    both(lambda c: [Prefill(s, p) for s, p in zip(slots[caches.index(c)], prompts)])
    after_prefill = len(graphs)
    orders = ([0, 1, 2], [2, 0, 1], [1, 2, 0], [0, 2, 1])
    for order in orders:                               # the same three requests, their slots in a new order
        toks = tokens(3)
        both(lambda c, order=order, toks=toks: [Decode(slots[caches.index(c)][i], toks[i]) for i in order])
    for i, c in enumerate(caches):                     # one request leaves, a new one takes another slot
        new = c.allocate()
        c.free(slots[i][1])
        slots[i][1] = new
    prompt = tokens(4)
    both(lambda c: [Prefill(slots[caches.index(c)][1], prompt)])
    for _ in range(2):
        toks = tokens(3)
        both(lambda c, toks=toks: [Decode(s, t) for s, t in zip(slots[caches.index(c)], toks)])
    # One graph for the prefills of the first step, one for every decode step (whatever the slots), one
    # for the single prefill: the counts of the plan, not the slots, decide.
    assert after_prefill == 1
    assert len(graphs) == 3, f"{len(graphs)} graphs compiled"
