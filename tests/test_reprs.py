"""Short, informative reprs: a cache, a step plan, hash parameters, a replay result (no tensor dumps)."""

from __future__ import annotations

import random

import ple
from ple.state import PLECache, Prefill
from ple.testing.serving import random_script, replay


def test_reprs_are_short_and_say_what_matters():
    config = ple.PLEConfig.preset("tiny")
    cache = PLECache(config, 4, num_spec_tokens=2)
    a = cache.allocate()
    batch = cache.schedule([Prefill(a, list(range(40)))])
    params = ple.reference.hash_params(config, 0)
    layers = [ple.PLELayer(config, i) for i in range(config.num_ple_layers)]
    result = replay(layers, PLECache(config, 4, num_spec_tokens=2),
                    random_script(random.Random(0), vocab_size=config.vocab_size, eos_token_id=config.eos_token_id,
                                  num_requests=2, max_live=2, num_spec_tokens=2))
    texts = {"cache": repr(cache), "batch": repr(batch), "params": repr(params), "result": repr(result)}
    for name, text in texts.items():
        assert len(text) < 300 and "object at 0x" not in text and "tensor(" not in text, (name, text)
    assert "1 live: [1]" in texts["cache"] and "channels_last" in texts["cache"]
    assert "1 prefill" in texts["batch"] and "40 rows" in texts["batch"]
    assert f"num_rows={params.num_rows}" in texts["params"]
    assert "2 requests" in texts["result"]
