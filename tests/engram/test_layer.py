"""The Engram family's layer against an oracle of DeepSeek's demo module (tests/engram/_demo.py): hash parameters,
state dicts both ways, forward and gradients (float32 within 1e-5) on every backend, the initialisation, and
serving streams equal to the forward."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from engram._demo import DemoEngram, demo_head_sizes, demo_multipliers

import ple
from ple import PLEConfig, PLELayer
from ple.reference import hash_params
from ple.testing.serving import Action, check_replay, random_script, replay

BACKENDS = ["reference", "torch", pytest.param("triton", marks=pytest.mark.interpreter)]


def small(**kw) -> PLEConfig:
    args = dict(vocab_size=50, hidden_size=6, hc_count=3, engram_vocab_size=[23, 31], max_ngram_size=3,
                n_embed_per_ngram=6, n_head_per_ngram=2, layer_ids=[1, 4], pad_id=2, seed=5, kernel_size=3)
    args.update(kw)
    return PLEConfig.engram(**args)


def with_map(config: PLEConfig, seed: int = 0) -> PLEConfig:
    rng = np.random.default_rng(seed)
    return config.replace(token_map=rng.integers(0, config.vocab_size // 3, size=config.vocab_size).tolist())


def randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every float parameter random (norm weights around one), so every term shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            v = torch.randn(p.shape, generator=g, dtype=torch.float64) * (0.3 if p.dim() < 2 else 0.5)
            if "norm" in name:
                v += 1.0
            p.copy_(v.to(p.dtype))
    return module


# ---- configuration and hash parameters ---------------------------------------------------------------------

def test_spec_check_values():
    demo = PLEConfig.preset("engram-demo")
    assert demo.family == "engram" and demo.token_vocab_size == 129280 and demo.pad_id == 2
    p1, p15 = hash_params(demo, 0), hash_params(demo, 1)
    assert p1.multipliers.tolist() == [58737837727525, 3709723095905, 27562777300965]
    assert p1.head_sizes[:3].tolist() == [646403, 646411, 646421] and p1.num_rows == 10344164 == p1.head_sizes.sum()
    assert p15.head_sizes[:2].tolist() == [646631, 646637]
    c = PLEConfig.engram(vocab_size=1000, hidden_size=4, hc_count=1, engram_vocab_size=[100, 120],
                         n_embed_per_ngram=4, n_head_per_ngram=2, layer_ids=[0, 2], seed=7)
    assert hash_params(c, 0).multipliers.tolist() == [5765488047046173, 8275336682942967, 7154437704795911]
    assert hash_params(c, 0).head_sizes.tolist() == [101, 103, 127, 131]
    assert hash_params(c, 1).head_sizes.tolist() == [107, 109, 137, 139]
    assert hash_params(c, 1).head_offsets.tolist() == [0, 107, 216, 353] and hash_params(c, 1).num_rows == 492


@pytest.mark.parametrize("seed", range(6))
def test_hash_params_equal_the_demo_oracle(seed):
    rng = random.Random(seed)
    N = rng.choice([2, 3, 4])
    ids = sorted(rng.sample(range(0, 40), rng.randint(1, 4)))
    c = PLEConfig.engram(vocab_size=rng.randint(5, 3000), hidden_size=2, hc_count=1,
                         engram_vocab_size=[rng.randint(2, 500) for _ in range(N - 1)], max_ngram_size=N,
                         n_embed_per_ngram=rng.randint(1, 3) * 2, n_head_per_ngram=2, layer_ids=ids,
                         seed=rng.randint(0, 2**31), pad_id=0)
    c = with_map(c, seed) if seed % 2 else c
    sizes = demo_head_sizes(c.engram_vocab_size, 2, ids)
    for i, lid in enumerate(ids):
        p = hash_params(c, i)
        assert p.multipliers.tolist() == demo_multipliers(c.token_vocab_size, N, c.seed, lid).tolist()
        assert p.head_sizes.tolist() == sizes[lid]
        assert p.num_rows == sum(sizes[lid]) and p.eos_rule is False
    every = [s for lid in ids for s in sizes[lid]]
    assert len(set(every)) == len(every)                  # distinct across orders and layers


def test_config_round_trips_with_its_token_map(tmp_path):
    c = with_map(small())
    assert PLEConfig.from_dict(c.to_dict()) == c
    path = tmp_path / "config.json"
    path.write_text(json.dumps(c.to_dict()))
    back = PLEConfig.from_json(path)
    assert back == c and back.token_map == c.token_map and back.family == "engram"
    assert "token_map" not in repr(c)                      # a 100k-entry map stays out of the repr
    q = PLEConfig.preset("tiny")
    assert "family" not in q.to_dict() and PLEConfig.from_dict(q.to_dict()) == q   # the model's keys only


@pytest.mark.parametrize("change, error, name", [
    (dict(engram_vocab_size=[23]), ValueError, "engram_vocab_size"),
    (dict(engram_vocab_size=[23, 1]), ValueError, "engram_vocab_size"),
    (dict(engram_vocab_size="23"), TypeError, "engram_vocab_size"),
    (dict(n_embed_per_ngram=5), ValueError, "n_embed_per_ngram"),
    (dict(n_head_per_ngram=0), ValueError, "n_head_per_ngram"),
    (dict(max_ngram_size=1), ValueError, "max_ngram_size"),
    (dict(kernel_size=0), ValueError, "kernel_size"),
    (dict(pad_id=50), ValueError, "pad_id"),
    (dict(pad_id=2.0), TypeError, "pad_id"),
    (dict(layer_ids=[]), ValueError, "layer_ids"),
    (dict(layer_ids=[-1, 3]), ValueError, "layer_ids"),
    (dict(layer_ids=3), TypeError, "layer_ids"),
    (dict(layer_ids=[4, 1]), ValueError, "layer_ids"),
    (dict(layer_ids=[1, 1, 4]), ValueError, "layer_ids"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(hidden_size=0), ValueError, "hidden_size"),
    (dict(token_map=[0] * 49), ValueError, "token_map"),
    (dict(token_map=[-1] + [0] * 49), ValueError, "token_map"),
    (dict(token_map=torch.zeros(50)), TypeError, "token_map"),
    (dict(token_map="abc"), TypeError, "token_map"),
])
def test_bad_config_values_are_named(change, error, name):
    with pytest.raises(error, match=f"^{name}:"):
        small(**change)


def test_qwen4exp_configs_refuse_engram_fields():
    with pytest.raises(ValueError, match="^engram_vocab_size:"):
        PLEConfig.preset("tiny", engram_vocab_size=(5, 6))
    with pytest.raises(ValueError, match="^token_map:"):
        PLEConfig.preset("tiny", token_map=(0,) * 1000)
    with pytest.raises(ValueError, match="^family:"):
        PLEConfig.preset("tiny", family="olmo")


# ---- the layer against the demo module ------------------------------------------------------------------------

def test_state_dict_has_the_demo_keys_and_shapes_in_its_order():
    c = small()
    demo, layer = DemoEngram(c, 4), PLELayer(c, 1)
    ours, theirs = layer.state_dict(), demo.state_dict()
    assert list(ours) == list(theirs)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    assert torch.equal(ours["multi_head_embedding.offsets"], theirs["multi_head_embedding.offsets"])


def test_parameters_start_as_the_demo_module_starts_them():
    c = small(hidden_size=64, n_embed_per_ngram=64, kernel_size=4)
    layer = PLELayer(c, 0)
    E, K = c.ple_embed_dim, c.ple_conv_kernel_size
    for name in ("norm_key", "norm_query", "norm_conv"):
        assert torch.equal(getattr(layer, name).weight, torch.ones(c.hc_hidden_size))
    for lin in (layer.key_proj, layer.value_proj):                 # nn.Linear's default: U(-1/sqrt(E), 1/sqrt(E))
        for p in (lin.weight, lin.bias):
            assert p.abs().max() <= E ** -0.5 and p.abs().max() > 0.8 * E ** -0.5
    w = layer.conv1d.weight                                         # nn.Conv1d's default: fan_in K
    assert w.abs().max() <= K ** -0.5 and w.abs().max() > 0.8 * K ** -0.5
    t = layer.table.weight.detach()
    assert abs(float(t.mean())) < 0.05 and abs(float(t.std()) - 1) < 0.05


def _demo_and_layer(config, index, backend, seed):
    lid = config.ple_layer_ids[index]
    demo = randomised(DemoEngram(config, lid), seed)
    layer = PLELayer(config, index, backend=backend)
    layer.load_state_dict(demo.state_dict())
    return demo, layer


def _inputs(config, B, L, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, config.hc_hidden_size, generator=g)
    ids = torch.randint(0, config.vocab_size, (B, L), generator=g)
    ids[:, L // 2] = config.pad_id                                  # a pad inside the text: an ordinary token
    return hidden, ids


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mapped", [False, True])
def test_forward_and_gradients_equal_the_demo(backend, mapped):
    c = with_map(small()) if mapped else small()
    demo, layer = _demo_and_layer(c, 1, backend, seed=3)
    B, L, M, H = 2, 11, c.hc_count, c.hidden_size
    hidden, ids = _inputs(c, B, L, 4)
    up = torch.randn(B, L, M * H, generator=torch.Generator().manual_seed(9))
    h1 = hidden.clone().requires_grad_()
    want = h1 + demo(h1.view(B, L, M, H), ids.numpy()).reshape(B, L, M * H)   # the demo's block adds the residual
    (want * up).sum().backward()
    h2 = hidden.clone().requires_grad_()
    got = layer(h2, ids)
    (got * up).sum().backward()
    _close(got, want, "forward")
    _close(h2.grad, h1.grad, "gradient of hidden_states")
    # the demo's gradients, loaded as if they were weights, land where ple keeps each parameter
    grads = {k: p.grad for k, p in demo.named_parameters()}
    grads["multi_head_embedding.offsets"] = demo.multi_head_embedding.offsets
    as_ple = PLELayer(c, 1)
    as_ple.load_state_dict(grads)
    for name, p in layer.named_parameters():
        g = p.grad.to_dense() if p.grad.is_sparse else p.grad
        _close(g, dict(as_ple.named_parameters())[name].detach(), f"gradient of {name}")


def test_layer_weights_load_into_the_demo_and_agree():
    c = with_map(small(), 1)
    layer = randomised(PLELayer(c, 0), 11)
    demo = DemoEngram(c, c.ple_layer_ids[0])
    demo.load_state_dict(layer.state_dict())                        # strict: the same keys both ways
    hidden, ids = _inputs(c, 3, 9, 2)
    B, L, C = hidden.shape
    with torch.no_grad():
        _close(layer(hidden, ids), hidden + demo(hidden.view(B, L, c.hc_count, -1), ids.numpy()).reshape(B, L, C),
               "forward")


def test_the_norms_eps_follow_the_demo():
    """Small activations make the eps count: hidden states at 1e-3 (mean square 1e-6 against the key / query
    norms' finfo(float32).eps = 1.2e-7) and values at 1e-3 (the conv norm's 1e-5 against the gated values'
    mean square); a layer using the wrong eps for either is far from the demo."""
    c = small()
    assert c.gate_eps(torch.float32) == torch.finfo(torch.float32).eps
    assert c.gate_eps(torch.bfloat16) == torch.finfo(torch.bfloat16).eps
    assert c.gate_options() == {"conv_eps": 1e-5, "unit_offset": False}
    q = PLEConfig.preset("tiny")
    assert q.gate_eps(torch.bfloat16) == q.rms_norm_eps and q.gate_options() == {}
    demo, layer = _demo_and_layer(c, 0, "torch", seed=8)
    with torch.no_grad():
        for mod in (demo.value_proj, layer.value_proj):
            mod.weight.mul_(1e-3)
            mod.bias.mul_(1e-3)
    hidden, ids = _inputs(c, 2, 13, 6)
    hidden = hidden * 1e-3
    B, L, C = hidden.shape
    with torch.no_grad():
        want = hidden + demo(hidden.view(B, L, c.hc_count, -1), ids.numpy()).reshape(B, L, C)
        torch.testing.assert_close(layer(hidden, ids), want, rtol=1e-5, atol=1e-8)


def test_state_dict_saves_with_safetensors_and_loads_back(tmp_path):
    from safetensors.torch import load_file, save_file
    c = with_map(small())
    layer = randomised(PLELayer(c, 1), 4)
    save_file(layer.state_dict(), tmp_path / "engram.safetensors")       # no two entries share memory
    back = PLELayer(c, 1)
    back.load_state_dict(load_file(tmp_path / "engram.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), back.state_dict().values(), strict=True))
    assert torch.equal(back.key_proj.weight, layer.key_proj.weight)


def test_demo_offsets_of_another_config_are_refused():
    c = small()
    sd = DemoEngram(small(engram_vocab_size=[29, 31]), 1).state_dict()
    layer = PLELayer(c, 0)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises((ValueError, RuntimeError), match="offsets"):
        layer.load_state_dict(sd)
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())


# ---- serving ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_serving_streams_equal_the_forward(backend):
    c = with_map(small(), 2)
    layers = [randomised(PLELayer(c, i, backend=backend), 20 + i) for i in range(c.num_ple_layers)]
    cache = ple.state.PLECache(c, num_slots=5, num_spec_tokens=2)
    rng = random.Random(7)
    S = c.conv_state_len
    opening = [
        [Action(1000, "prefill", (c.pad_id, 4, 5)), Action(1001, "prefill", (7,))],
        [Action(1001, "prefill", tuple(rng.randrange(50) for _ in range(S + 2))), Action(1000, "decode", (9,))],
        [Action(1000, "spec", (1, 2, 3), 2), Action(1001, "decode", (c.pad_id,))],
        [Action(1000, "prefill", (4, 4)), Action(1001, "spec", (8, 8, 8), 1, finish=True)],
        [Action(1000, "decode", (3,), finish=True)],
    ]
    script = opening + random_script(rng, vocab_size=c.vocab_size, eos_token_id=c.pad_id, num_requests=4,
                                     max_live=3, max_prompt=10, max_chunk=4, max_generate=4, num_spec_tokens=2,
                                     eos_rate=0.1, append_rate=0.2)
    with torch.no_grad():
        res = replay(layers, cache, script, generator=torch.Generator().manual_seed(1))
    assert res.state_checks > 0
    check_replay(layers, res)


def test_serving_steps_turn_no_tensor_into_a_python_value():
    """The Engram family's token map and pad reach the step as tensors: a step of every mode makes no host sync."""
    c = with_map(small(), 3)
    layers = [PLELayer(c, i, backend="torch") for i in range(c.num_ple_layers)]
    cache = ple.state.PLECache(c, num_slots=5, num_spec_tokens=2)
    script = random_script(random.Random(1), vocab_size=c.vocab_size, eos_token_id=c.pad_id, num_requests=4,
                           num_spec_tokens=2)
    with torch.no_grad():
        res = replay(layers, cache, script, check_states=False, count_conversions=True)
    assert {kind for step in res.steps for kind in ("prefill", "decode", "spec") if step[kind]} == \
        {"prefill", "decode", "spec"}
    assert res.conversions == []
