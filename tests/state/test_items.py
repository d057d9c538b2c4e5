"""``Prefill`` / ``Decode`` / ``Spec`` tokens: ints, lists, 1-D tensors and numpy arrays; clear errors else."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _helpers import assert_cache_unchanged, cache_snapshot

import ple
from ple.state import Decode, PLECache, Prefill, Spec


@pytest.mark.parametrize("tokens", [[3, 4, 5], (3, 4, 5), torch.tensor([3, 4, 5]),
                                    torch.tensor([3, 4, 5], dtype=torch.int32),
                                    np.array([3, 4, 5]), np.array([3, 4, 5], dtype=np.int32),
                                    [np.int64(3), np.int32(4), 5]])
def test_token_forms_schedule_alike(tokens):
    config = ple.PLEConfig.preset("tiny")
    cache = PLECache(config, 3, num_spec_tokens=2)
    a = cache.allocate()
    batch = cache.schedule([Prefill(a, tokens)])
    assert batch.input_ids.tolist() == [3, 4, 5]


@pytest.mark.parametrize("token", [7, torch.tensor(7), np.int64(7), np.array(7), [7]])
def test_one_token_forms(token):
    config = ple.PLEConfig.preset("tiny")
    cache = PLECache(config, 3, num_spec_tokens=2)
    a, b = cache.allocate(), cache.allocate()
    first = cache.schedule([Prefill(a, [1, 2]), Prefill(b, [1, 2])])
    for i in range(cache.num_layers):
        ple.PLELayer(config, i).step(torch.zeros(4, config.hc_hidden_size), first, cache)
    batch = cache.schedule([Spec(b, token), Decode(a, token)])
    assert batch.input_ids.tolist() == [7, 7]


BAD_TOKENS = [
    (torch.tensor([[3, 4]]), ValueError, "tokens[0]"), (np.array([[3, 4]]), ValueError, "tokens[0]"),
    (np.array([1.0]), TypeError, "integer"), (torch.tensor([1.0]), TypeError, "integer"),
    ([True, 3], TypeError, "ints"), (3.0, TypeError, "float"),
    (torch.tensor([3, 4], device="meta"), ValueError, "meta"), (torch.tensor([True]), TypeError, "integer"),
    (torch.tensor([1 + 2j]), TypeError, "integer"), ([torch.tensor(3)], TypeError, "ints"),
    ("12", TypeError, "str"), (None, TypeError, "NoneType"),
]
BAD_TOKEN = [(torch.tensor(3, device="meta"), ValueError, "meta"), (torch.tensor(True), TypeError, "integer"),
             (torch.tensor(2.0), TypeError, "integer"), (np.float32(2.0), TypeError, "float"),
             (True, TypeError, "bool"), ("7", TypeError, "str")]


@pytest.mark.parametrize("item,tokens,err,words", [("prefill", *c) for c in BAD_TOKENS]
                         + [("spec", *c) for c in BAD_TOKENS] + [("decode", *c) for c in BAD_TOKEN])
def test_bad_token_forms_are_clear_errors(item, tokens, err, words):
    config = ple.PLEConfig.preset("tiny")
    cache = PLECache(config, 3, num_spec_tokens=2)
    a = cache.allocate()
    cache.schedule([Prefill(a, [1, 2])])          # a batch scheduled and never stepped: stays valid on error
    before = cache_snapshot(cache)
    make = {"prefill": Prefill, "spec": Spec, "decode": Decode}[item]
    name = "token" if item == "decode" else "tokens"
    with pytest.raises(err, match=name) as e:
        cache.schedule([make(a, tokens)])
    assert words in str(e.value)
    assert_cache_unchanged(cache, before)
