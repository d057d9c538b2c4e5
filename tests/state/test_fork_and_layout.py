"""Fork after a partially accepted spec step, and the raw buffer of each state layout.

* A fork taken right after a spec step whose draft was only partly accepted must carry the
  whole window (the history sits at columns ``[o, o + S)`` with ``o = accepted - 1``, not at
  ``[0, S)``) and the accepted count: then the fork and the original, fed the same decodes,
  give the same bits, and both equal ``forward`` over the accepted sequence.
* ``PLECache.conv_states`` is documented as ``[num_layers, num_slots, W, C]`` (channels_last) or
  ``[num_layers, num_slots, C, W]`` (channels_first): after real steps the raw buffer must hold
  each slot's last S conv inputs at those positions, not only the ``conv_state(i)`` view.
"""

from __future__ import annotations

import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import ple
from ple.state import Decode, PLECache, Prefill, Spec
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal
from ple.testing.serving import conv_inputs_of_step


def _layers(config, dtype=torch.float32, seed=0):
    return [random_layer(config, i, dtype=dtype, seed=seed + i) for i in range(config.num_ple_layers)]


def _step(layers, cache, items, hidden):
    batch = cache.schedule(items)
    h = hidden
    conv_in = []
    with torch.no_grad():
        for layer in layers:
            conv_in.append(conv_inputs_of_step(layer, h, batch))
            h = layer.step(h, batch, cache)
    return h, conv_in


@settings(max_examples=12, deadline=None)
@given(prompt=st.integers(1, 9), q=st.integers(2, 3), data=st.data(), decodes=st.integers(2, 4),
       seed=st.integers(0, 2**16), layout=st.sampled_from(["channels_last", "channels_first"]))
def test_fork_after_partial_spec_then_decodes(prompt, q, data, decodes, seed, layout):
    accepted = data.draw(st.integers(1, q - 1))              # partial acceptance: the window moves
    note(dict(prompt=prompt, q=q, accepted=accepted, decodes=decodes, seed=seed, layout=layout))
    config = ple.PLEConfig.preset("tiny")
    C = config.hc_hidden_size
    layers = _layers(config, seed=seed)
    cache = PLECache(config, 4, num_spec_tokens=q, layout=layout)
    g = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(0, config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    a = cache.allocate()
    toks = tok(prompt)
    rows = [torch.randn(prompt, C, generator=g)]
    outs = [_step(layers, cache, [Prefill(a, toks)], rows[-1])[0]]
    draft = tok(q)
    rows.append(torch.randn(q, C, generator=g))
    outs.append(_step(layers, cache, [Spec(a, draft)], rows[-1])[0][:accepted])
    rows[-1] = rows[-1][:accepted]
    cache.accept(a, accepted)
    toks += draft[:accepted]
    b = cache.fork(a)
    out_a, out_b = [], []
    for _ in range(decodes):
        t = tok(1)[0]
        h = torch.randn(1, C, generator=g)
        oa = _step(layers, cache, [Decode(a, t)], h)[0]
        ob = _step(layers, cache, [Decode(b, t)], h)[0]
        out_a.append(oa)
        out_b.append(ob)
        toks.append(t)
        rows.append(h)
    assert_bitwise_equal(torch.cat(out_b), torch.cat(out_a), name="the fork's decode outputs")
    with torch.no_grad():
        expected = torch.cat(rows)[None]
        for layer in layers:
            expected = layer(expected, torch.tensor([toks]))
    got = torch.cat(outs + out_a)
    torch.testing.assert_close(got, expected[0], rtol=1e-5, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(lens=st.lists(st.integers(1, 12), min_size=1, max_size=3), spec=st.booleans(),
       seed=st.integers(0, 2**16), layout=st.sampled_from(["channels_last", "channels_first"]))
def test_raw_buffer_holds_the_documented_layout(lens, spec, seed, layout):
    config = ple.PLEConfig.preset("tiny")
    S, C = config.conv_state_len, config.hc_hidden_size
    layers = _layers(config, seed=seed)
    cache = PLECache(config, len(lens) + 1, num_spec_tokens=2, layout=layout)
    g = torch.Generator().manual_seed(seed)
    slots = [cache.allocate() for _ in lens]
    items = [Prefill(s, torch.randint(0, config.vocab_size, (n,), generator=g).tolist())
             for s, n in zip(slots, lens, strict=True)]
    hidden = torch.randn(sum(lens), C, generator=g)
    _, conv_in = _step(layers, cache, items, hidden)
    history = {}
    start = 0
    for s, n in zip(slots, lens, strict=True):
        history[s] = [ci[start:start + n] for ci in conv_in]
        start += n
    o = 0
    if spec:                                                  # a spec step moves the window (all accepted)
        items = [Spec(s, torch.randint(0, config.vocab_size, (2,), generator=g).tolist()) for s in slots]
        hidden = torch.randn(2 * len(slots), C, generator=g)
        _, conv_in = _step(layers, cache, items, hidden)
        for i, s in enumerate(slots):
            history[s] = [torch.cat([hst, ci[2 * i:2 * i + 2]]) for hst, ci in zip(history[s], conv_in, strict=True)]
        o = 1
    raw = cache.conv_states
    assert raw.shape == ((config.num_ple_layers, len(lens) + 1, S + 2, C) if layout == "channels_last"
                         else (config.num_ple_layers, len(lens) + 1, C, S + 2))
    for s in slots:
        for li in range(config.num_ple_layers):
            want = torch.cat([torch.zeros(S, C), history[s][li]])[-S:]           # [S, C], oldest first
            got = raw[li, s, o:o + S, :] if layout == "channels_last" else raw[li, s, :, o:o + S].T
            assert_bitwise_equal(got, want, name=f"raw {layout} buffer, PLE layer {li}, slot {s}")
