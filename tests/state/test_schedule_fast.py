"""`PLECache.schedule`'s path for the commonest step, a batch of plain decodes: the same plan as the general one.

``schedule`` parses a list of ``Decode`` items with ``int`` tokens on live, started, distinct slots in one
short pass (``PLECache._plain_decodes``) and lays it out with ``ple.state.batch.decode_layout``; anything else
(another item kind, a tensor token, a bad slot or token, ``pad_to``) takes the general parse and
``general_layout``. Here random serving histories (spec steps accepted in part, so some windows need a
realignment) end in a decode batch whose fast plan is compared field by field with the general one.
"""

from __future__ import annotations

import pytest
import torch
from _tier import examples
from hypothesis import given, note, settings
from hypothesis import strategies as st

import ple
from ple.state import Decode, PLECache, Prefill, Spec
from ple.state import batch as plan
from ple.testing.layers import random_layer

TINY = ple.PLEConfig.preset("tiny")
C = TINY.hc_hidden_size


@given(data=st.data(), num_requests=st.integers(1, 5), seed=st.integers(0, 1000))
@settings(max_examples=examples(15), deadline=None)
def test_plain_decodes_get_the_general_plan(data, num_requests, seed):
    layer = random_layer(TINY, 0, torch.float32, seed=seed)
    cache = PLECache(TINY, num_requests + 2, num_spec_tokens=2, num_layers=1)
    slots = [cache.allocate() for _ in range(num_requests)]
    g = torch.Generator().manual_seed(seed)

    def run(items):
        batch = cache.schedule(items)
        layer.step(torch.randn(batch.num_tokens, C, generator=g), batch, cache)

    run([Prefill(s, data.draw(st.lists(st.integers(0, 499), min_size=1, max_size=6))) for s in slots])
    for s in slots:                                     # some requests speculate, keeping a prefix
        if data.draw(st.booleans()):
            run([Spec(s, data.draw(st.lists(st.integers(0, 499), min_size=1, max_size=3)))])
            cache.accept(s, data.draw(st.integers(1, len(cache._slots[s].spec_tokens))))
    chosen = data.draw(st.permutations(slots)).__getitem__(slice(0, data.draw(st.integers(1, num_requests))))
    items = [Decode(s, data.draw(st.integers(0, TINY.vocab_size - 1))) for s in chosen]
    note(f"decodes {items}")
    parsed = cache._plain_decodes(items)
    assert parsed == [(item, [item.token]) for item in items]
    fast_host, fast_scalars = plan.decode_layout(cache, parsed)
    host, scalars = plan.general_layout(cache, parsed, None)
    assert fast_host == host
    assert fast_scalars == scalars
    assert bool(scalars["realign"]) == any(cache._slots[s].num_accepted > 1 for s in chosen)
    assert cache.schedule(items).host == host           # schedule takes the fast path


@pytest.mark.parametrize("items", [
    lambda a, b: [Decode(a, torch.tensor(3))],          # a tensor token
    lambda a, b: [Decode(a, 3), Decode(a, 4)],          # a slot twice
    lambda a, b: [Decode(a, 3), Spec(b, [1])],          # another kind
    lambda a, b: [Decode(a, TINY.vocab_size)],          # a token out of range
    lambda a, b: [Decode(True, 3)],                     # a bool slot
    lambda a, b: [Decode(b + 1, 3)],                    # a slot not allocated
    lambda a, b: [],
])
def test_anything_else_takes_the_general_path(items):
    cache = PLECache(TINY, 6, num_spec_tokens=2, num_layers=1)
    a, b = cache.allocate(), cache.allocate()
    layer = random_layer(TINY, 0, torch.float32, seed=0)
    batch = cache.schedule([Prefill(a, [1, 2]), Prefill(b, [3])])
    layer.step(torch.randn(batch.num_tokens, C), batch, cache)
    assert cache._plain_decodes(items(a, b)) is None


def test_a_started_slot_is_required():
    cache = PLECache(TINY, 4, num_layers=1)
    a = cache.allocate()
    assert cache._plain_decodes([Decode(a, 1)]) is None
    with pytest.raises(ValueError, match="no prefill yet"):
        cache.schedule([Decode(a, 1)])
