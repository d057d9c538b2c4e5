"""``layer(..., return_intermediates=True)`` and mapping table rows back to n-grams."""

from __future__ import annotations

import torch

import ple
from ple import reference as ref
from ple.testing.layers import random_layer


def test_intermediates_are_the_values_on_the_way():
    config = ple.PLEConfig.preset("tiny")
    layer = random_layer(config, 0, dtype=torch.float32, seed=1)
    g = torch.Generator().manual_seed(0)
    B, L, C, H, M = 2, 7, config.hc_hidden_size, config.hidden_size, config.hc_count
    hidden = torch.randn(B, L, C, generator=g)
    ids = torch.randint(0, config.vocab_size, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.int64)
    mask[1, :2] = 0
    r = layer(hidden, ids, mask, return_intermediates=True)
    assert torch.equal(r.output, layer(hidden, ids, mask))
    assert torch.equal(r.embeddings, ref.embedding_lookup(layer.table.weight, r.ngram_ids.reshape(B * L, -1))
                       .reshape(B, L, -1))
    torch.testing.assert_close(r.key, r.embeddings @ layer.key_proj.weight.T)
    torch.testing.assert_close(r.value, r.embeddings @ layer.value_proj.weight.T)
    keep = mask.bool()[..., None]
    for m in range(M):
        torch.testing.assert_close(r.gated[..., m * H:(m + 1) * H], r.gates[..., m:m + 1] * r.value * keep)
    s = r.scores
    torch.testing.assert_close(r.gates, torch.sigmoid(s.sign() * s.abs().clamp_min(ref.gate.GATE_CLAMP).sqrt()))
    assert torch.equal(r.conv, ref.dilated_causal_conv(r.conv_input, layer.conv_weights, dilation=config.conv_dilation))
    assert torch.equal(r.output, (r.gated + r.conv) + hidden)
    assert torch.equal(r.conv_input[1, :2], torch.zeros(2, C))            # padding: zeroed before the conv


def test_rows_map_back_to_the_ngrams_that_hit_them():
    config = ple.PLEConfig.preset("tiny")
    params = ref.hash_params(config, 0)
    eos, P = config.eos_token_id, config.heads_per_ngram
    toks = torch.tensor([5, 6, 7, eos, 5, 6, 7])
    kw = dict(heads_per_ngram=P, eos_token_id=eos)
    hits = ref.hashing.ngrams_of_rows(toks, params, **kw)
    rows = ref.ngram_ids(toks, params, **kw)
    # token 2's trigram (5, 6, 7) and token 6's: the same row of every trigram head, hit twice
    for h in range(P, 2 * P):
        assert rows[2, h] == rows[6, h]
        assert hits[(h, int(rows[2, h]))].get((5, 6, 7)) == 2
    # token 4 follows an EOS: its bigram is (EOS, 5), like token 0's
    assert hits[(0, int(rows[4, 0]))].get((eos, 5)) == 2
    assert sum(sum(v.values()) for v in hits.values()) == toks.numel() * config.num_ngram_heads
