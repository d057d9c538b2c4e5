"""A row optimizer's state in checkpoints (docs/spec.md section 11): ``ple.io.save(..., optimizer=opt)`` writes it
beside the table in the table's layout, ``ple.io.load_optimizer`` reads it, and a run saved and resumed gives the
bits of a run never stopped; transformers' view of the checkpoint (its files and index) is unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import ple.io
import ple.optim as O
from ple import PLEConfig
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

TINY = PLEConfig.preset("tiny")
RULES = {"sgd": O.SparseSGD, "adagrad": O.RowwiseAdagrad, "adam": O.RowwiseAdam}


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 5, TINY.hc_hidden_size, generator=g),
            torch.randint(0, TINY.vocab_size, (2, 5), generator=g))


def train(layer, opt, dense, seeds):
    for seed in seeds:
        h, ids = batch(seed)
        (layer(h, ids) * torch.linspace(-1, 1, h.shape[-1])).sum().backward()
        opt.step()
        dense.step()
        opt.zero_grad()
        dense.zero_grad()


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("parts", [0, 3])
def test_saved_and_resumed_gives_the_bits_of_a_run_never_stopped(tmp_path, rule, parts):
    def fresh(seed=30):
        layer = random_layer(TINY, 0, torch.float32, seed=seed, backend="torch")
        opt = RULES[rule](layer, lr=0.05)
        dense = torch.optim.Adam(O.other_parameters(layer), lr=1e-3)
        return layer, opt, dense

    whole, opt_w, dense_w = fresh()
    train(whole, opt_w, dense_w, (1, 2, 3, 4))
    first, opt_f, dense_f = fresh()
    sched = torch.optim.lr_scheduler.StepLR(opt_f, 1, gamma=1.0)      # adds initial_lr to the groups
    train(first, opt_f, dense_f, (1, 2))
    sched.step()
    files = ple.io.save(first, tmp_path / "ck", parts=parts, optimizer=opt_f, max_file_bytes=40_000)
    assert any(f.parent.name == "optimizer" for f in files)
    torch.save(dense_f.state_dict(), tmp_path / "dense.pt")
    # The model's files and index are those of a save without the optimizer.
    names = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.is_file())
    plain = tmp_path / "plain"
    ple.io.save(first, plain, parts=parts, max_file_bytes=40_000)
    assert names == sorted(p.name for p in plain.iterdir() if p.is_file())
    resumed = ple.io.load_layer(tmp_path / "ck", backend="torch")
    opt_r = RULES[rule](resumed, lr=123.0)                             # its hyperparameters come from the file
    dense_r = torch.optim.Adam(O.other_parameters(resumed), lr=1e-3)
    dense_r.load_state_dict(torch.load(tmp_path / "dense.pt"))
    ple.io.load_optimizer(opt_r, tmp_path / "ck")
    assert opt_r.param_groups[0]["lr"] == 0.05 and opt_r.param_groups[0]["initial_lr"] == 0.05
    train(resumed, opt_r, dense_r, (3, 4))
    for name, t in whole.state_dict().items():
        assert_bitwise_equal(resumed.state_dict()[name], t, name=name)
    for name, t in opt_w.state[whole.table.weight].items():
        got = opt_r.state[resumed.table.weight][name]
        assert (torch.equal(got, t) if isinstance(t, torch.Tensor) else got == t), name


def test_the_state_is_in_the_tables_layout_with_its_own_names(tmp_path):
    layer = random_layer(TINY, 0, torch.float32, seed=31, backend="torch")
    opt = O.RowwiseAdam(layer, lr=0.1)
    train(layer, opt, torch.optim.SGD(O.other_parameters(layer), lr=0.0), (5,))
    ple.io.save(layer, tmp_path / "ck", parts=2, optimizer=opt)
    (f,) = (tmp_path / "ck" / "optimizer").glob("*.safetensors")
    pfx = ple.io.model_prefix(TINY, 0)
    with safe_open(f, "pt") as fh:
        keys = sorted(fh.keys())
        meta = json.loads(fh.metadata()["ple.optimizer"])
        rows = [fh.get_tensor(pfx + f"ple_embedding.ngram_embedding.shard_{k}.optim.exp_avg_sq") for k in (0, 1)]
    assert keys == sorted(pfx + f"ple_embedding.ngram_embedding.shard_{k}.optim.{n}"
                          for k in (0, 1) for n in ("exp_avg", "exp_avg_sq"))
    assert meta["rule"] == "adam" and meta["tables"][0]["step"] == 1 and meta["tables"][0]["prefix"] == pfx
    assert_bitwise_equal(torch.cat(rows), opt.state[layer.table.weight]["exp_avg_sq"], name="exp_avg_sq")
    # A later save without the optimizer leaves no stale state behind.
    ple.io.save(layer, tmp_path / "ck", parts=2, overwrite=True)
    assert not (tmp_path / "ck" / "optimizer").exists()
    with pytest.raises(ValueError, match="^path: .* holds no optimizer state"):
        ple.io.load_optimizer(opt, tmp_path / "ck")


def test_what_does_not_fit_is_refused(tmp_path):
    a = random_layer(TINY, 0, torch.float32, seed=32)
    b = random_layer(TINY, 1, torch.float32, seed=33)
    opt = O.RowwiseAdagrad([a, b], lr=0.1)
    with pytest.raises(ValueError, match="^optimizer: it trains 2 tables"):
        ple.io.save(a, tmp_path / "x", optimizer=opt)
    other = random_layer(TINY, 0, torch.float32, seed=34)
    with pytest.raises(ValueError, match="^optimizer: it does not train layer 0's table"):
        ple.io.save(other, tmp_path / "x", optimizer=opt)
    with pytest.raises(TypeError, match="^optimizer: "):
        ple.io.save(a, tmp_path / "x", optimizer=torch.optim.SGD(a.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="^optimizer: .* pass a directory"):
        ple.io.save([a, b], tmp_path / "x.safetensors", optimizer=opt)
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.safetensors").exists()
    ple.io.save([a, b], tmp_path / "ok", optimizer=opt)
    adam = O.RowwiseAdam([random_layer(TINY, 0, torch.float32), random_layer(TINY, 1, torch.float32)], lr=0.1)
    with pytest.raises(ValueError, match="^state_dict: saved by a 'adagrad' optimizer"):
        ple.io.load_optimizer(adam, tmp_path / "ok")
    one = O.RowwiseAdagrad(random_layer(TINY, 0, torch.float32), lr=0.1)
    with pytest.raises(ValueError, match="^state_dict: "):
        ple.io.load_optimizer(one, tmp_path / "ok")
