"""The batch protocol (docs/spec.md section 7, last paragraph): a batch belongs to the cache that scheduled it and
to that moment; every hole is a ``ValueError`` naming ``batch``, ``layer``, ``cache`` or ``num_layers``,
with nothing modified. Also the cache's own constructor and ``load`` errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _helpers import assert_cache_unchanged, cache_snapshot

import ple
from ple.state import Decode, PLECache, Prefill, Spec
from ple.testing.layers import random_layer

TINY = ple.PLEConfig.preset("tiny")      # 2 PLE layers
C = TINY.hc_hidden_size


def started_cache(num_spec_tokens=2):
    """A one-layer cache with one started request ``a`` (and the layer)."""
    layer = random_layer(TINY, 0, torch.float32, seed=1)
    cache = PLECache(TINY, 4, num_spec_tokens=num_spec_tokens, num_layers=1)
    a = cache.allocate()
    layer.step(torch.randn(4, C), cache.schedule([Prefill(a, [5, 6, 7, 8])]), cache)
    return layer, cache, a


def refused(layer, batch, cache, match, rows=1):
    snap = cache_snapshot(cache)
    with pytest.raises(ValueError, match=match):
        layer.step(torch.randn(rows, C), batch, cache)
    assert_cache_unchanged(cache, snap)


def test_a_batch_runs_only_on_the_cache_that_scheduled_it():
    layer, cache, a = started_cache()
    other = PLECache(TINY, 4, num_spec_tokens=2, num_layers=1)
    batch = cache.schedule([Decode(a, 9)])
    refused(layer, batch, other, "^batch: .*another PLECache")
    assert other.active_slots() == []                                   # its unallocated slot untouched
    layer.step(torch.randn(1, C), batch, cache)                          # still good on its own cache


@pytest.mark.parametrize("change", ["free", "free+allocate", "allocate", "fork", "accept"])
def test_a_batch_scheduled_before_a_change_is_stale(change):
    layer, cache, a = started_cache()
    if change == "accept":
        layer.step(torch.randn(3, C), cache.schedule([Spec(a, [1, 2, 3])]), cache)
    batch = cache.schedule([Decode(a, 9)])
    if change.startswith("free"):
        cache.free(a)
        if change == "free+allocate":
            assert cache.allocate() == a                                  # the slot's next owner
    elif change == "allocate":
        cache.allocate()
    elif change == "fork":
        cache.fork(a)
    else:
        cache.accept(a, 1)                                                # the window the batch read moved
    refused(layer, batch, cache, "^batch: stale")


def test_a_layer_of_another_config_is_refused():
    layer, cache, a = started_cache()
    for field, value in (("eos_token_id", TINY.eos_token_id + 1), ("vocab_size", TINY.vocab_size + 7)):
        cfg = TINY.replace(**{field: value})
        stranger = random_layer(cfg, 0, torch.float32, seed=2)
        assert stranger.config.hc_hidden_size == C and stranger.config.conv_state_len == TINY.conv_state_len
        refused(stranger, cache.schedule([Decode(a, 9)]), cache, f"^layer: .*{field}")


def test_cache_constructor_errors():
    assert PLECache(TINY, 3).num_layers == TINY.num_ple_layers == 2      # the default: every PLE layer
    with pytest.raises(ValueError, match="^num_layers: the config has 2 PLE layer"):
        PLECache(TINY, 3, num_layers=3)
    for bad in ("float32", torch.int32, 3):
        with pytest.raises(TypeError, match="^dtype: "):
            PLECache(TINY, 3, dtype=bad)


def damaged_files(tmp_path, cache):
    """(name, path) of files that ``PLECache.load`` must refuse."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    good = tmp_path / "good.safetensors"
    cache.save(good)
    data = good.read_bytes()
    with safe_open(str(good), framework="pt") as f:
        meta = json.loads(f.metadata()["ple"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}

    def edited(name, meta_edit=None, tensors_edit=None, raw=None):
        p = tmp_path / f"{name}.safetensors"
        m = copy.deepcopy(meta)
        t = dict(tensors)
        if meta_edit:
            meta_edit(m)
        if tensors_edit:
            tensors_edit(t)
        save_file(t, str(p), metadata={"ple": raw if raw is not None else json.dumps(m)})
        return name, p

    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) - 40])
    return [
        ("empty", empty),
        ("truncated", truncated),
        ("missing", tmp_path / "nope.safetensors"),
        edited("bad-json", raw="{not json"),
        edited("short-slot-table", lambda m: m["slots"].pop()),
        edited("active-null-slot", lambda m: m["slots"][0].update(active=True)),
        edited("bad-slot-field", lambda m: m["slots"][1].update(num_accepted=99)),
        edited("bad-config", lambda m: m["config"].update(hidden_size=-1)),
        edited("no-contexts", tensors_edit=lambda t: t.pop("contexts")),
        edited("states-shape", tensors_edit=lambda t: t.update(conv_states=t["conv_states"][:, :2])),
        edited("contexts-edited", tensors_edit=lambda t: t.update(contexts=t["contexts"] + 1)),
    ]


def test_load_refuses_damaged_files_naming_the_path(tmp_path):
    _, cache, a = started_cache()
    for name, path in damaged_files(tmp_path, cache):
        with pytest.raises(ValueError, match="^path: ") as e:
            PLECache.load(path)
        assert str(path) in str(e.value), name
    back = PLECache.load(tmp_path / "good.safetensors")                # the good file still loads
    assert back.context(a) == cache.context(a)
