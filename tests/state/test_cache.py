"""PLECache, the step scheduler and PLELayer.step (docs/spec.md section 7.13), on the reference backend."""

from __future__ import annotations

import random

import pytest
import torch
from _helpers import assert_cache_unchanged, cache_snapshot, nonzero_layers
from hypothesis import given, note
from hypothesis import strategies as st

import ple
from ple.state import Decode, PLECache, Prefill, Spec
from ple.testing import strategies as pst
from ple.testing.numerics import assert_bitwise_equal
from ple.testing.serving import check_replay, conv_inputs_of_step, random_script, replay


def make_layers(config, num_layers, seed, backend="reference", dtype=torch.float32):
    """Layers with every parameter non-zero, so each part of the layer shows in the output."""
    return nonzero_layers(config, num_layers, seed=seed, dtype=dtype, draw_dtype=torch.float32, backend=backend)


@given(config=pst.configs(), data=st.data(), seed=pst.seeds(),
       num_layers=st.integers(1, 2), layout=st.sampled_from(["channels_first", "channels_last"]),
       num_spec_tokens=st.integers(0, 4))
def test_schedule_property(config, data, seed, num_layers, layout, num_spec_tokens):
    """Every accepted token of any schedule equals forward over the whole accepted sequence, and no
    step turns a tensor into a Python value (the plan carries every host value: docs/spec.md section 7.13)."""
    script = data.draw(pst.serving_scripts(config, num_spec_tokens=num_spec_tokens), label="script")
    note(f"config={config}")
    note(f"script={script}")
    layers = make_layers(config, num_layers, seed, backend="torch")      # sync-free: the step makes no host read
    cache = PLECache(config, 4, num_spec_tokens=num_spec_tokens, num_layers=num_layers, layout=layout)
    result = replay(layers, cache, script, generator=torch.Generator().manual_seed(seed), count_conversions=True)
    check_replay(layers, result)
    assert result.conversions == [], f"layer.step turned tensors into Python values: {result.conversions[:5]}"
    assert sorted(result.finished) == sorted(result.tokens)
    assert cache.active_slots() == []


def test_permuted_rows_give_permuted_outputs():
    config = ple.PLEConfig.preset("tiny")
    layer, = make_layers(config, 1, 0)
    g = torch.Generator().manual_seed(1)

    def run(order):
        cache = PLECache(config, 5, num_spec_tokens=2, num_layers=1)
        slots = [cache.allocate() for _ in range(3)]
        warm = cache.schedule([Prefill(slots[0], list(range(10, 21))), Prefill(slots[1], [3, 4, 5]),
                               Prefill(slots[2], [7])])
        layer.step(torch.randn(15, config.hc_hidden_size, generator=torch.Generator().manual_seed(2)), warm, cache)
        items = [Spec(slots[0], [1, 2, 3]), Decode(slots[1], 9), Prefill(slots[2], [8, 2, 4, 6])]
        rows = {0: [0, 1, 2], 1: [3], 2: [4, 5, 6, 7]}
        batch = cache.schedule([items[i] for i in order])
        perm = [r for i in order for r in rows[i]]
        out = layer.step(hidden[perm], batch, cache)
        back = torch.empty_like(out)
        back[perm] = out
        return back, cache.conv_states.clone()

    hidden = torch.randn(8, config.hc_hidden_size, generator=g)
    base, states = run([0, 1, 2])
    for order in ([2, 1, 0], [1, 2, 0], [2, 0, 1]):
        out, st_ = run(order)
        torch.testing.assert_close(out, base, rtol=1e-6, atol=1e-6)
        assert_bitwise_equal(st_, states)


def test_slot_reuse_is_isolated():
    config = ple.PLEConfig.preset("tiny")
    layer, = make_layers(config, 1, 3)
    C = config.hc_hidden_size
    h = torch.randn(6, C, generator=torch.Generator().manual_seed(4))
    fresh = PLECache(config, 3, num_spec_tokens=2, num_layers=1)
    s = fresh.allocate()
    expected = layer.step(h, fresh.schedule([Prefill(s, [5, 6, 7, 8, 9, 10])]), fresh)

    used = PLECache(config, 2, num_spec_tokens=2, num_layers=1)          # one usable slot: reuse is forced
    s = used.allocate()
    b = used.schedule([Prefill(s, [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21])])
    layer.step(torch.randn(11, C), b, used)
    layer.step(torch.randn(3, C), used.schedule([Spec(s, [1, 2, 3])]), used)
    used.accept(s, 2)
    used.free(s)
    s2 = used.allocate()
    assert s2 == s
    assert used.context(s2) == [config.eos_token_id] * config.context_len
    assert not used.conv_states[:, s2].any()
    got = layer.step(h, used.schedule([Prefill(s2, [5, 6, 7, 8, 9, 10])]), used)
    assert_bitwise_equal(got, expected, name="output of a reused slot")
    assert_bitwise_equal(used.conv_states[:, s2], fresh.conv_states[:, 1])


def test_checkpoint_and_restore_equal_never_stopping():
    config = ple.PLEConfig.preset("tiny")
    S = config.conv_state_len
    layers = make_layers(config, 2, 5)
    C = config.hc_hidden_size
    g = torch.Generator().manual_seed(6)
    prompt = [int(t) for t in torch.randint(0, config.vocab_size, (S + 5,), generator=g)]
    k = S + 2
    rest = [4, 5, config.eos_token_id, 6, 7]
    h_prompt = torch.randn(len(prompt), C, generator=g)
    h_rest = torch.randn(len(rest), C, generator=g)

    def run_layers(cache, batch, h):
        for layer in layers:
            h = layer.step(h, batch, cache)
        return h

    # A request that prefills the prompt, checkpointing after k tokens, then a fork continues from it.
    cache = PLECache(config, 5, num_layers=2)
    a, ck = cache.allocate(), cache.allocate()
    batch = cache.schedule([Prefill(a, prompt, checkpoint_at=k, checkpoint_slot=ck)])
    h, conv_inputs = h_prompt, []
    for layer in layers:
        conv_inputs.append(conv_inputs_of_step(layer, h, batch))
        h = layer.step(h, batch, cache)
    for li, ci in enumerate(conv_inputs):        # the checkpoint is a copy of the S inputs before k
        assert_bitwise_equal(cache.conv_state(li)[ck, :, :S], ci[k - S:k].T, name=f"checkpoint, layer {li}")
    assert cache.length(ck) == k and cache.context(ck) == prompt[:k][-config.context_len:]
    b = cache.fork(ck)
    assert_bitwise_equal(cache.conv_states[:, b], cache.conv_states[:, ck], name="forked state")
    out_b = run_layers(cache, cache.schedule([Prefill(b, rest)]), h_rest)

    # The same request that never stopped: prompt[:k] then rest.
    ref = PLECache(config, 3, num_layers=2)
    r = ref.allocate()
    run_layers(ref, ref.schedule([Prefill(r, prompt[:k])]), h_prompt[:k])
    out_r = run_layers(ref, ref.schedule([Prefill(r, rest)]), h_rest)
    torch.testing.assert_close(out_b, out_r, rtol=1e-5, atol=1e-5)
    # And both equal forward over the whole sequence.
    whole = torch.cat([h_prompt[:k], h_rest])[None]
    ids = torch.tensor(prompt[:k] + rest)[None]
    expected = layers[1](layers[0](whole, ids), ids)[0, k:]
    torch.testing.assert_close(out_b, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_save_and_load_are_exact(tmp_path, layout):
    config = ple.PLEConfig.preset("tiny")
    layer, = make_layers(config, 1, 7)
    script = random_script(random.Random(3), vocab_size=config.vocab_size, eos_token_id=config.eos_token_id,
                           num_requests=4, num_spec_tokens=2, max_generate=10)
    half = len(script) // 2
    cache = PLECache(config, 4, num_spec_tokens=2, layout=layout, num_layers=1)
    replay([layer], cache, script[:half], generator=torch.Generator().manual_seed(0), check_states=False)
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    loaded = PLECache.load(path)
    assert loaded.layout == layout and loaded.conv_states.shape == cache.conv_states.shape
    assert_bitwise_equal(loaded.conv_states, cache.conv_states)
    assert loaded._slots == cache._slots
    assert torch.equal(loaded.contexts, cache.contexts)
    # Both continue identically: one decode step on every live request.
    items = [Decode(s, 1) for s in cache.active_slots()]
    assert items, "the first half of the script should leave live requests"
    h = torch.randn(len(items), config.hc_hidden_size)
    o1 = layer.step(h, cache.schedule(items), cache)
    o2 = layer.step(h, loaded.schedule(items), loaded)
    assert_bitwise_equal(o1, o2)
    assert_bitwise_equal(loaded.conv_states, cache.conv_states)


def test_load_rejects_foreign_file(tmp_path):
    from safetensors.torch import save_file

    p = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(1)}, str(p))
    with pytest.raises(ValueError, match="path"):
        PLECache.load(p)


def _warm_cache(config, layer):
    cache = PLECache(config, 4, num_spec_tokens=2, num_layers=1)
    a, b = cache.allocate(), cache.allocate()
    layer.step(torch.randn(5, config.hc_hidden_size), cache.schedule([Prefill(a, [1, 2, 3]), Prefill(b, [4, 5])]),
               cache)
    layer.step(torch.randn(3, config.hc_hidden_size), cache.schedule([Spec(a, [6, 7, 8])]), cache)
    return cache, a, b


@pytest.mark.parametrize("make_items, error, match", [
    (lambda a, b, c: [Decode(9, 1)], ValueError, "unknown slot"),
    (lambda a, b, c: [Decode(0, 1)], ValueError, "null slot"),
    (lambda a, b, c: [Decode(c, 1)], ValueError, "not allocated"),
    (lambda a, b, c: [Decode(a, 1), Spec(a, [1])], ValueError, "twice"),
    (lambda a, b, c: [Spec(a, [1, 2, 3, 4])], ValueError, "num_spec_tokens"),
    (lambda a, b, c: [Spec(b, [])], ValueError, "num_spec_tokens"),
    (lambda a, b, c: [Decode(b, [1, 2])], ValueError, "exactly one"),
    (lambda a, b, c: [Decode(b, 10_000)], ValueError, "token ids"),
    (lambda a, b, c: [Decode(b, 1.5)], TypeError, "token"),
    (lambda a, b, c: [Prefill(a, [1, 2]), "x"], TypeError, "items"),
    (lambda a, b, c: [], ValueError, "at least one"),
    (lambda a, b, c: [Prefill(a, list(range(20)), checkpoint_at=3, checkpoint_slot=b)], ValueError, "checkpoint"),
    (lambda a, b, c: [Prefill(a, list(range(20)), checkpoint_at=12)], ValueError, "together"),
    (lambda a, b, c: [Prefill(a, list(range(12)), checkpoint_at=10, checkpoint_slot=a)], ValueError,
     "checkpoint_slot"),
])
def test_invalid_schedules_leave_the_cache_unchanged(make_items, error, match):
    config = ple.PLEConfig.preset("tiny")
    layer, = make_layers(config, 1, 8)
    cache, a, b = _warm_cache(config, layer)
    c = cache.allocate()
    cache.free(c)
    snap = cache_snapshot(cache)
    with pytest.raises(error, match=match):
        cache.schedule(make_items(a, b, c))
    assert_cache_unchanged(cache, snap)


def test_decode_or_spec_before_prefill_is_an_error():
    config = ple.PLEConfig.preset("tiny")
    cache = PLECache(config, 3, num_spec_tokens=1, num_layers=1)
    s = cache.allocate()
    snap = cache_snapshot(cache)
    for item in (Decode(s, 1), Spec(s, [1, 2])):
        with pytest.raises(ValueError, match="no prefill"):
            cache.schedule([item])
    assert_cache_unchanged(cache, snap)


def test_accept_errors_leave_the_cache_unchanged():
    config = ple.PLEConfig.preset("tiny")
    layer, = make_layers(config, 1, 9)
    cache, a, b = _warm_cache(config, layer)
    snap = cache_snapshot(cache)
    for n in (0, 4, -1):
        with pytest.raises(ValueError, match="n:"):
            cache.accept(a, n)
    with pytest.raises(ValueError, match="not a spec step"):
        cache.accept(b, 1)
    with pytest.raises(TypeError):
        cache.accept(a, 1.0)
    assert_cache_unchanged(cache, snap)
    cache.accept(a, 2)
    assert cache.length(a) == 5 and cache.context(a) == [1, 2, 3, 6, 7][-config.context_len:]


def test_slot_table_errors():
    config = ple.PLEConfig.preset("tiny")
    cache = PLECache(config, 3, num_layers=1)
    a, b = cache.allocate(), cache.allocate()
    assert {a, b} == {1, 2}
    with pytest.raises(RuntimeError, match="full"):
        cache.allocate()
    cache.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(a)
    with pytest.raises(ValueError, match="unknown slot"):
        cache.free(7)
    with pytest.raises(ValueError, match="null slot"):
        cache.free(0)
    with pytest.raises(ValueError, match="num_slots"):
        PLECache(config, 1, num_layers=1)
    with pytest.raises(ValueError, match="layout"):
        PLECache(config, 3, layout="wc")


def test_capacity_for_a_scheduler_num_slots_free_slots_active_slots(tmp_path):
    """docs/spec.md section 7: ``num_slots`` counts the null slot; ``free_slots`` (an int property) is how many more
    requests `allocate` can take now; ``active_slots()`` lists the live slots, in order, never the null slot."""
    config = ple.PLEConfig.preset("tiny")
    cache = PLECache(config, 5, num_layers=1)
    assert isinstance(PLECache.__dict__["free_slots"], property)
    assert (cache.num_slots, cache.free_slots, cache.active_slots()) == (5, 4, [])
    assert type(cache.free_slots) is int
    a, b, c = cache.allocate(), cache.allocate(), cache.allocate()
    assert (cache.free_slots, cache.active_slots()) == (1, [1, 2, 3])
    cache.free(b)
    assert (cache.free_slots, cache.active_slots()) == (2, [1, 3])
    d = cache.fork(a)                                       # a fork takes a slot
    assert (d, cache.free_slots, cache.active_slots()) == (2, 1, [1, 2, 3])
    cache.allocate()
    assert (cache.free_slots, cache.active_slots()) == (0, [1, 2, 3, 4])
    with pytest.raises(RuntimeError, match="full"):         # free_slots == 0: allocate refuses
        cache.allocate()
    cache.free(c)
    cache.save(tmp_path / "cache.safetensors")
    loaded = PLECache.load(tmp_path / "cache.safetensors")  # the slot table comes back with the file
    assert (loaded.free_slots, loaded.active_slots()) == (1, [1, 2, 4])
    for live in (cache, loaded):
        assert live.free_slots + len(live.active_slots()) == live.num_slots - 1


def test_stale_batches_and_bad_hidden_are_rejected():
    config = ple.PLEConfig.preset("tiny")
    layer, = make_layers(config, 1, 10)
    cache = PLECache(config, 3, num_layers=1)
    s = cache.allocate()
    batch = cache.schedule([Prefill(s, [1, 2, 3])])
    snap = cache_snapshot(cache)
    with pytest.raises(ValueError, match="hidden_states"):
        layer.step(torch.randn(4, config.hc_hidden_size), batch, cache)
    with pytest.raises(TypeError, match="hidden_states"):
        layer.step(torch.randn(3, config.hc_hidden_size, dtype=torch.float64), batch, cache)
    assert_cache_unchanged(cache, snap)
    layer.step(torch.randn(3, config.hc_hidden_size), batch, cache)
    with pytest.raises(ValueError, match="stale"):
        layer.step(torch.randn(3, config.hc_hidden_size), batch, cache)


def two_layers_one_prefill(seed):
    """The tiny preset's two PLE layers (`make_layers`), a cache for both, request ``s`` and its prefill of
    ``[5, 6, 7]`` scheduled: (config, layers, cache, s, batch)."""
    config = ple.PLEConfig.preset("tiny")
    layers = make_layers(config, 2, seed)
    cache = PLECache(config, 3, num_layers=2)
    s = cache.allocate()
    return config, layers, cache, s, cache.schedule([Prefill(s, [5, 6, 7])])


def test_multi_layer_contexts_advance_once_per_step():
    config, layers, cache, s, batch = two_layers_one_prefill(11)
    h = layers[0].step(torch.randn(3, config.hc_hidden_size), batch, cache)
    assert cache.context(s) == [config.eos_token_id] * config.context_len       # not yet: layer 1 pending
    with pytest.raises(RuntimeError, match="in flight"):
        cache.schedule([Decode(s, 1)])
    with pytest.raises(ValueError, match="already run"):
        layers[0].step(h, batch, cache)
    layers[1].step(h, batch, cache)
    assert cache.context(s) == [6, 7][-config.context_len:]


def test_a_failed_step_can_be_retried_without_moving_the_window_twice(monkeypatch):
    """Realignment (spec -> decode) is recorded per slot and layer, so a retry after a failure is exact."""
    config = ple.PLEConfig.preset("tiny")
    layer, = make_layers(config, 1, 12)
    cache = PLECache(config, 3, num_spec_tokens=3, num_layers=1)
    s = cache.allocate()
    C = config.hc_hidden_size
    g = torch.Generator().manual_seed(13)
    tokens, hidden, outs = [], [], []

    def run(item, h, keep=None):
        out = layer.step(h, cache.schedule([item]), cache)
        n = keep or h.shape[0]
        if keep:
            cache.accept(s, keep)
        tokens.extend((item.tokens if hasattr(item, "tokens") else [item.token])[:n])
        hidden.append(h[:n])
        outs.append(out[:n])

    run(Prefill(s, list(range(20, 32))), torch.randn(12, C, generator=g))
    run(Spec(s, [3, 4, 5, 6]), torch.randn(4, C, generator=g), keep=3)
    batch = cache.schedule([Decode(s, 7)])
    h = torch.randn(1, C, generator=g)
    real = ple.reference.ple_conv

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(ple.reference, "ple_conv", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        layer.step(h, batch, cache)
    monkeypatch.setattr(ple.reference, "ple_conv", real)
    outs.append(layer.step(h, batch, cache))
    tokens.append(7)
    hidden.append(h)
    expected = layer(torch.cat(hidden)[None], torch.tensor(tokens)[None])[0]
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-5, atol=1e-5)


def test_the_cache_advances_when_the_last_ple_index_has_run():
    config, layers, cache, s, batch = two_layers_one_prefill(14)
    layers[1].step(torch.randn(3, config.hc_hidden_size), batch, cache)      # the last PLE index: advance
    assert cache.context(s) == [6, 7][-config.context_len:]
    with pytest.raises(ValueError, match="stale"):
        layers[0].step(torch.randn(3, config.hc_hidden_size), batch, cache)
