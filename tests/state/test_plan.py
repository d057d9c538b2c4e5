"""The plan `PLECache.schedule` returns: host twins equal to the device tensors, one upload, and padded
plans (``pad_to``) that reuse one persistent buffer and give the unpadded outputs."""

from __future__ import annotations

import pytest
import torch

import ple
from ple.state import Decode, PLECache, Prefill, Spec
from ple.state.batch import StepHost
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal, assert_close

TINY = ple.PLEConfig.preset("tiny")
C = TINY.hc_hidden_size


def started(num_requests, *, num_spec_tokens=2, num_slots=8, seed=1):
    layer = random_layer(TINY, 0, torch.float32, seed=seed)
    cache = PLECache(TINY, num_slots, num_spec_tokens=num_spec_tokens, num_layers=1)
    slots = [cache.allocate() for _ in range(num_requests)]
    g = torch.Generator().manual_seed(seed)
    items = [Prefill(s, [int(t) for t in torch.randint(0, 500, (3 + i,), generator=g)]) for i, s in enumerate(slots)]
    batch = cache.schedule(items)
    layer.step(torch.randn(batch.num_tokens, C, generator=g), batch, cache)
    return layer, cache, slots


def test_host_twins_equal_the_device_tensors_and_share_one_buffer():
    layer, cache, (a, b, c) = started(3)
    layer.step(torch.randn(3, C), cache.schedule([Spec(a, [1, 2, 3])]), cache)
    cache.accept(a, 2)
    batch = cache.schedule([Decode(b, 4), Spec(c, [5, 6]), Prefill(a, [7, 8, 9, 10], checkpoint_at=None)])
    storages = set()
    for name in StepHost.__dataclass_fields__:
        t = getattr(batch, name)
        want = getattr(batch.host, name)
        assert t.dtype == torch.int64 and t.tolist() == want, name
        storages.add(t.untyped_storage().data_ptr())
    assert len(storages) == 1                                           # one buffer, one upload
    assert batch.host.num_accepted_tokens == [1] and batch.realign == [(a, 1)]
    assert "1 prefill, 1 decode, 1 spec" in repr(batch) and len(repr(batch)) < 120


@pytest.mark.parametrize("kind", ["decode", "spec"])
def test_padded_plans_reuse_one_buffer_and_equal_unpadded_outputs(kind):
    """Two caches in the same state step the same items, one padded to 6 requests: equal outputs and
    states (to float32 rounding: the projections are matmuls over different row counts, which round
    differently); every padded plan of that shape has the same device tensors; padding rows get no conv
    term."""
    q = 3 if kind == "spec" else 1
    runs = []
    for pad in (None, 6):
        layer, cache, slots = started(4, num_spec_tokens=2, seed=3)
        g = torch.Generator().manual_seed(5)
        g_pad = torch.Generator().manual_seed(6)                       # padding rows: not from g
        outs, ptrs = [], []
        for step in range(3):
            live = slots[: 2 + step % 3]
            toks = torch.randint(0, 500, (len(live), q), generator=g).tolist()
            items = [Decode(s, t[0]) if kind == "decode" else Spec(s, t) for s, t in zip(live, toks)]
            batch = cache.schedule(items, pad_to=pad)
            h = torch.randn(len(live) * q, C, generator=g)
            if pad is not None:
                assert batch.num_tokens == pad * q
                h = torch.cat([h, torch.randn(batch.num_tokens - h.shape[0], C, generator=g_pad)])
                ptrs.append(batch.input_ids.untyped_storage().data_ptr())
            out = layer.step(h, batch, cache)
            if pad is not None:
                padding = out[len(live) * q:]
                gated, _ = layer.gate(layer.embed(layer.ops.ngram_ids(
                    batch.input_ids, layer.ple_embedding.hash_params(), heads_per_ngram=TINY.heads_per_ngram,
                    eos_token_id=TINY.eos_token_id, query_start_loc=batch.query_start_loc,
                    ngram_context=batch.ngram_context), h.dtype), h)
                assert_bitwise_equal(padding, gated[len(live) * q:] + h[len(live) * q:], name="padding rows")
            outs.append(out[: len(live) * q])
            if kind == "spec":
                for s in live:
                    cache.accept(s, 2)
        runs.append((outs, cache.conv_states.clone(), ptrs))
    (o1, s1, _), (o2, s2, ptrs) = runs
    for x, y in zip(o1, o2, strict=True):
        assert_close(y, x, name="padded outputs")
    assert_close(s2, s1, name="states")
    assert len(set(ptrs)) == 1, "every padded plan of one shape uses the same buffer"


def test_pad_to_errors_and_a_reused_buffer_makes_the_earlier_plan_stale():
    layer, cache, (a, b) = started(2)
    with pytest.raises(ValueError, match="^pad_to: .*decode-only or spec-only"):
        cache.schedule([Decode(a, 1), Spec(b, [1, 2, 3])], pad_to=4)
    with pytest.raises(ValueError, match="^pad_to: .*3 tokens per request"):
        cache.schedule([Spec(a, [1, 2])], pad_to=4)
    with pytest.raises(ValueError, match="^pad_to: .*more than pad_to=1"):
        cache.schedule([Decode(a, 1), Decode(b, 2)], pad_to=1)
    first = cache.schedule([Decode(a, 1)], pad_to=4)
    second = cache.schedule([Decode(b, 2)], pad_to=4)
    with pytest.raises(ValueError, match="^batch: stale; a later schedule\\(pad_to=4\\)"):
        layer.step(torch.randn(4, C), first, cache)
    layer.step(torch.randn(4, C), second, cache)
