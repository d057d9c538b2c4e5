"""`CompiledStep`: the step's tensor work compiled once per plan shape, whichever slots the requests hold;
its results are those of ``layer.step`` (here through a backend that runs dynamo's graph as traced, so bit
for bit; inductor's rounding is the tolerance table's business, tests/test_compile.py)."""

from __future__ import annotations

import pytest
import torch

from ple import PLEConfig
from ple.state import CompiledStep, Decode, PLECache, Prefill, Spec
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


def test_spec_with_partial_acceptance_then_decode_equals_the_eager_step_and_bad_hidden_states_change_nothing():
    """A spec step whose requests keep fewer tokens than they proposed (``cache.accept``), then a decode step,
    whose start moves each request's window back to columns ``[0, S)``: every output and state bit is
    ``layer.step``'s. A ``hidden_states`` of the wrong shape, given where that move is pending, is a
    ``ValueError`` naming it, and changes nothing: the right call after it still equals the eager step."""
    from _helpers import assert_cache_unchanged, cache_snapshot

    def as_traced(gm, example_inputs):                 # a dynamo backend: the graphs run as traced (eager rounding)
        return gm.forward

    torch._dynamo.reset()
    layer = random_layer(CONFIG, dtype=torch.bfloat16, seed=1, backend="torch")
    step = CompiledStep(layer, backend=as_traced)
    caches = [PLECache(CONFIG, 6, num_spec_tokens=2, num_layers=1, dtype=torch.bfloat16) for _ in range(2)]
    gen = torch.Generator().manual_seed(1)
    C, V = CONFIG.hc_hidden_size, CONFIG.vocab_size
    assert CONFIG.conv_state_len > 1                    # windows that move by more than one column

    def tokens(n):
        return torch.randint(0, V, (n,), generator=gen).tolist()

    slots = [[c.allocate() for _ in range(3)] for c in caches]

    def both(make_items, hidden=None):
        """The same items on both caches: the compiled step on caches[0], layer.step on caches[1]."""
        batches = [c.schedule(make_items(s)) for c, s in zip(caches, slots, strict=True)]
        h = torch.randn(batches[0].num_tokens, C, generator=gen).to(torch.bfloat16) if hidden is None else hidden
        assert_bitwise_equal(step(h, batches[0], caches[0]), layer.step(h, batches[1], caches[1]), name="output")
        assert_bitwise_equal(caches[0].conv_states, caches[1].conv_states, name="conv states")
        assert caches[0]._slots == caches[1]._slots

    prompts = [tokens(n) for n in (7, 3, 5)]
    both(lambda s: [Prefill(x, p) for x, p in zip(s, prompts, strict=True)])
    proposed = [tokens(3) for _ in range(3)]
    both(lambda s: [Spec(x, p) for x, p in zip(s, proposed, strict=True)])
    for c, s in zip(caches, slots, strict=True):
        for x, kept in zip(s, (1, 2, 3), strict=True):   # partial, partial, all
            c.accept(x, kept)
    decoded = tokens(3)
    batch = caches[0].schedule([Decode(x, t) for x, t in zip(slots[0], decoded, strict=True)])
    assert batch.realign                                 # the decode reads windows a spec step left elsewhere
    good = torch.randn(batch.num_tokens, C, generator=gen).to(torch.bfloat16)
    snap = cache_snapshot(caches[0])
    for bad in (good[:-1], torch.cat([good, good[:1]]), good[:, :-1], good[0], good[None]):
        with pytest.raises(ValueError, match=r"^hidden_states: "):
            step(bad, batch, caches[0])
        assert_cache_unchanged(caches[0], snap)
    with pytest.raises(TypeError, match=r"^hidden_states: "):
        step(good.float(), batch, caches[0])
    assert_cache_unchanged(caches[0], snap)
    both(lambda s: [Decode(x, t) for x, t in zip(s, decoded, strict=True)], hidden=good)
    decoded = tokens(3)
    both(lambda s: [Decode(x, t) for x, t in zip(s, decoded, strict=True)])     # the windows stay where they are
