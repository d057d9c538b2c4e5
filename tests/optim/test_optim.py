"""``ple.optim`` (docs/spec.md section 11): the row optimizers train a layer's table through its lookups.

What a step gets (the ids the layer hashed, the gradient of their rows) is checked against a float64 twin trained
by dense autograd; micro-batches accumulate; ``fused=True`` updates in the backward; nothing reaches ``.grad``; a
step allocates nothing of the table's row count; LR schedulers, ``state_dict`` and resuming; the errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ple.optim as O
from ple import PLEConfig, _checks, reference
from ple.optim.rowwise import STATE_NAMES
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

TINY = PLEConfig.preset("tiny")
BACKENDS = ["reference", "torch", pytest.param("triton", marks=pytest.mark.interpreter)]
RULES = {"sgd": lambda t, **k: O.SparseSGD(t, **k), "adagrad": lambda t, **k: O.RowwiseAdagrad(t, **k),
         "adam": lambda t, **k: O.RowwiseAdam(t, **k)}


def batch(seed: int, B: int = 2, L: int = 6, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, L, TINY.hc_hidden_size, generator=g).to(dtype),
            torch.randint(0, TINY.vocab_size, (B, L), generator=g))


def loss_of(layer, h, ids):
    return (layer(h, ids).float() * torch.linspace(-1, 1, h.shape[-1])).sum()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sgd_step_equals_dense_autograd_on_the_rows_looked_up(backend):
    """SparseSGD's step is ``w - lr * (dense gradient)`` on every looked-up row, against a float64 twin trained by
    dense autograd; the other rows bit for bit; the table's ``.grad`` stays None, the other parameters get theirs."""
    layer = random_layer(TINY, 0, torch.float32, seed=1, backend=backend)
    twin = random_layer(TINY, 0, torch.float64, seed=1, backend="reference")
    w0 = layer.table.weight.detach().clone()
    opt = O.SparseSGD(layer, lr=0.5)
    h, ids = batch(2)
    loss_of(layer, h, ids).backward()
    loss_of(twin, h.double(), ids).backward()
    assert layer.table.weight.grad is None and layer.key_proj.weight.grad is not None
    opt.step()
    dense = twin.table.weight.grad
    touched = dense.abs().sum(1) > 0
    assert int(touched.sum()) > 10
    want = w0.double() - 0.5 * dense
    torch.testing.assert_close(layer.table.weight.detach()[touched].double(), want[touched], rtol=1e-5, atol=1e-5)
    assert_bitwise_equal(layer.table.weight.detach()[~touched], w0[~touched], name="rows not looked up")


def _recorded(monkeypatch):
    """Record every table_update call's (ids, grad) (copies) and pass it on."""
    import ple.optim.rowwise as rowwise

    calls = []
    real = rowwise.update_ops

    def spy_ops(ops, weight):
        fn = real(ops, weight)

        def record(w, ids, grad, state, **kw):
            calls.append((ids.clone(), grad.clone(), kw))
            return fn(w, ids, grad, state, **kw)
        return record

    monkeypatch.setattr(rowwise, "update_ops", spy_ops)
    return calls


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_micro_batches_accumulate_into_one_update(rule, dtype, monkeypatch):
    """Two backward calls then ``step()`` = one ``table_update`` of both calls' lookups in order (bit for bit)."""
    calls = _recorded(monkeypatch)
    layer = random_layer(TINY, 0, dtype, seed=3, backend="torch")
    w0 = layer.table.weight.detach().clone()
    opt = RULES[rule](layer, lr=0.1, weight_decay=0.01)
    for seed in (4, 5):
        loss_of(layer, *batch(seed, dtype=dtype)).backward()
    opt.step()
    assert len(calls) == 1
    ids, grad, kw = calls[0]
    assert ids.numel() == 2 * 2 * 6 * TINY.num_ngram_heads and grad.dtype == dtype
    # The ids are the layer's own hash of both micro-batches, in order.
    want_ids = []
    for seed in (4, 5):
        _, tokens = batch(seed)
        for row in tokens:
            want_ids.append(reference.ngram_ids(row, layer.ple_embedding.hash_params(),
                                                heads_per_ngram=TINY.heads_per_ngram,
                                                eos_token_id=TINY.eos_token_id).reshape(-1))
    assert torch.equal(ids, torch.cat(want_ids))
    w = w0.clone()
    state = tuple(torch.zeros(s) for s in _checks.state_shapes(rule, *w.shape))
    reference.table_update(w, ids, grad, state, **kw)
    assert_bitwise_equal(layer.table.weight.detach(), w, name="weight after two micro-batches")
    # Nothing is left to apply: another step changes nothing but Adam's step count.
    before = layer.table.weight.detach().clone()
    opt.zero_grad()
    opt.step()
    assert_bitwise_equal(layer.table.weight.detach(), before, name="weight after an empty step")


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
def test_fused_updates_in_each_backward(rule, monkeypatch):
    """``fused=True``: each backward call is one step, applied in the backward; ``step()`` does nothing for the
    table. The same as an unfused optimizer stepping after each backward."""
    fused_layer = random_layer(TINY, 0, torch.float32, seed=6, backend="torch")
    plain_layer = random_layer(TINY, 0, torch.float32, seed=6, backend="torch")
    fused = RULES[rule](fused_layer, lr=0.05, fused=True)
    plain = RULES[rule](plain_layer, lr=0.05)
    for seed in (7, 8, 9):
        before = fused_layer.table.weight.detach().clone()
        loss_of(fused_layer, *batch(seed)).backward()
        assert not torch.equal(fused_layer.table.weight.detach(), before)        # updated in the backward
        after = fused_layer.table.weight.detach().clone()
        fused.step()
        assert_bitwise_equal(fused_layer.table.weight.detach(), after, name="fused step()")
        loss_of(plain_layer, *batch(seed)).backward()
        plain.step()
        plain.zero_grad()
        assert_bitwise_equal(fused_layer.table.weight.detach(), plain_layer.table.weight.detach(), name="fused")
    assert fused.state[fused_layer.table.weight]["step"] == 3


def _oracle_step(rule: str, t: int, w, state: dict, ids, grad, *, lr: float, weight_decay: float, eps: float,
                 betas: tuple[float, float]) -> None:
    """The rule of docs/spec.md section 11 written out in float64, in place, on the rows ``ids`` looked up (with
    their gradient rows ``grad`` summed), ``t`` the optimizer's step count (Adam's bias corrections)."""
    g = torch.zeros_like(w).index_add_(0, ids, grad.double())
    r = torch.unique(ids)
    g = g[r] + weight_decay * w[r]
    if rule == "sgd":
        w[r] -= lr * g
    elif rule == "adagrad":
        state["sum"][r] += (g * g).mean(1)
        w[r] -= lr * g / (state["sum"][r].sqrt() + eps).unsqueeze(1)
    else:
        b1, b2 = betas
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m[r] = b1 * m[r] + (1 - b1) * g
        v[r] = b2 * v[r] + (1 - b2) * (g * g).mean(1)
        w[r] -= lr * (m[r] / (1 - b1**t)) / ((v[r] / (1 - b2**t)).sqrt() + eps).unsqueeze(1)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
def test_steps_follow_a_float64_oracle_counting_the_steps(rule, fused, monkeypatch):
    """Two steps against the rule written out in float64 here, its ``t`` counted here: the number of ``step()``
    calls (of backward calls when fused), 1 then 2, whatever the optimizer passes its op (a step count off by
    one moves Adam's bias corrections at t = 2). SGD and Adagrad follow the same oracle, which has no count.
    The weight and the state after each step within float32's tolerance of the oracle; the step count kept."""
    calls = _recorded(monkeypatch)          # the ids and gradients each step got (their bits: the tests above)
    layer = random_layer(TINY, 0, torch.float32, seed=30, backend="torch")
    hyper = dict(lr=0.1, weight_decay=0.01, eps=1e-8, betas=(0.9, 0.999))
    kw = {"sgd": ("lr", "weight_decay"), "adagrad": ("lr", "weight_decay", "eps")}.get(rule, tuple(hyper))
    opt = RULES[rule](layer, fused=fused, **{k: hyper[k] for k in kw})
    w = layer.table.weight.detach().double().clone()
    state = {name: torch.zeros(shape, dtype=torch.float64)
             for name, shape in zip(STATE_NAMES[rule], _checks.state_shapes(rule, *w.shape), strict=True)}
    for t in (1, 2):
        loss_of(layer, *batch(30 + t)).backward()
        opt.step()
        opt.zero_grad()
        assert len(calls) == t
        ids, grad, _ = calls[-1]
        _oracle_step(rule, t, w, state, ids, grad, **hyper)
        got = opt.state[layer.table.weight]
        assert got["step"] == t
        torch.testing.assert_close(layer.table.weight.detach().double(), w, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, t=t: f"{rule} weight at t = {t}: {m}")
        for name, want in state.items():
            torch.testing.assert_close(got[name].double(), want, rtol=1e-5, atol=1e-9,
                                       msg=lambda m, t=t, name=name: f"{rule} {name} at t = {t}: {m}")


def test_an_lr_scheduler_drives_the_step():
    layer = random_layer(TINY, 0, torch.float32, seed=10, backend="torch")
    opt = O.SparseSGD(layer, lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.0)      # lr 0 after the first step
    loss_of(layer, *batch(11)).backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    before = layer.table.weight.detach().clone()
    opt.zero_grad()
    loss_of(layer, *batch(12)).backward()
    opt.step()
    assert_bitwise_equal(layer.table.weight.detach(), before, name="weight at lr 0")


class _Sizes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Record the shape of every new tensor (views and in-place results share an input's storage)."""
        kwargs = kwargs or {}
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.shapes.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_a_step_allocates_nothing_of_the_tables_row_count(rule, backend):
    layer = random_layer(TINY, 0, torch.float32, seed=13, backend=backend)
    rows = layer.table.num_rows
    opt = RULES[rule](layer, lr=0.1)
    loss_of(layer, *batch(14)).backward()
    with _Sizes() as mode:
        opt.step()
    big = [(f, s) for f, s in mode.shapes if s and s[0] == rows]
    assert mode.shapes and not big, big


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
def test_a_run_saved_and_resumed_gives_the_bits_of_one_never_stopped(rule):
    def train(layer, opt, seeds):
        for seed in seeds:
            loss_of(layer, *batch(seed)).backward()
            opt.step()
            opt.zero_grad()

    whole = random_layer(TINY, 0, torch.float32, seed=15, backend="torch")
    opt_whole = RULES[rule](whole, lr=0.05)
    train(whole, opt_whole, (16, 17, 18, 19))
    first = random_layer(TINY, 0, torch.float32, seed=15, backend="torch")
    opt_first = RULES[rule](first, lr=0.05)
    train(first, opt_first, (16, 17))
    saved_sd = {k: v.clone() for k, v in first.state_dict().items()}
    saved_opt = opt_first.state_dict()
    saved_opt = {"state": {k: {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in v.items()}
                           for k, v in saved_opt["state"].items()}, "param_groups": saved_opt["param_groups"]}
    resumed = random_layer(TINY, 0, torch.float32, seed=99, backend="torch")
    resumed.load_state_dict(saved_sd)
    opt_resumed = RULES[rule](resumed, lr=0.05)
    opt_resumed.load_state_dict(saved_opt)
    train(resumed, opt_resumed, (18, 19))
    assert_bitwise_equal(resumed.table.weight.detach(), whole.table.weight.detach(), name="resumed table")
    for name, t in opt_whole.state[whole.table.weight].items():
        got = opt_resumed.state[resumed.table.weight][name]
        if isinstance(t, torch.Tensor):
            assert_bitwise_equal(got, t, name=name)
        else:
            assert got == t


def test_bad_arguments_are_refused_naming_them():
    layer = random_layer(TINY, 0, torch.float32, seed=20)
    for make, err, match in [
        (lambda: O.SparseSGD(layer, lr=-0.1), ValueError, "^lr: "),
        (lambda: O.RowwiseAdagrad(layer, lr=0.1, eps=0.0), ValueError, "^eps: "),
        (lambda: O.RowwiseAdam(layer, lr=0.1, betas=(0.9, 1.0)), ValueError, r"^betas\[1\]: "),
        (lambda: O.RowwiseAdam(layer, lr=0.1, betas=(-0.1, 0.5)), ValueError, r"^betas\[0\]: "),
        (lambda: O.SparseSGD(layer, lr=0.1, weight_decay=-1.0), ValueError, "^weight_decay: "),
        (lambda: O.SparseSGD([layer, layer.table], lr=0.1), ValueError, "^params: a table is given twice"),
        (lambda: O.SparseSGD([], lr=0.1), ValueError, "^params: no table"),
        (lambda: O.SparseSGD(layer.key_proj, lr=0.1), TypeError, "^params: "),
        (lambda: O.SparseSGD(layer, lr="0.1"), TypeError, "^lr: "),
        (lambda: O.SparseSGD(layer, lr=0.1, fused=1), TypeError, "^fused: "),
    ]:
        with pytest.raises(err, match=match):
            make()
        assert layer.table.row_optimizer is None
    first = O.RowwiseAdagrad(layer, lr=0.1)
    with pytest.raises(ValueError, match="^params: the table is already trained by another optimizer"):
        O.RowwiseAdam(layer, lr=0.1)
    assert layer.table.row_optimizer is first
    frozen = random_layer(TINY, 0, torch.float32, seed=21)
    frozen.table.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="^params: the table is frozen"):
        O.SparseSGD(frozen, lr=0.1)
    for scheme in ("fp8", "int8", "nf4"):
        q = random_layer(TINY, 0, torch.float32, seed=22)
        q.ple_embedding.quantize_(scheme)
        with pytest.raises(ValueError, match=f"^params: the table is quantized \\({scheme}\\)"):
            O.RowwiseAdagrad(q, lr=0.1)
    sparse = random_layer(TINY, 0, torch.float32, seed=23, sparse_table_grad=True)
    with pytest.raises(ValueError, match="^params: the table was made with sparse_table_grad"):
        O.SparseSGD(sparse, lr=0.1)


def test_a_state_dict_of_another_rule_or_size_is_refused_and_nothing_loads():
    layer = random_layer(TINY, 0, torch.float32, seed=24)
    opt = O.RowwiseAdagrad(layer, lr=0.1)
    other = random_layer(TINY, 0, torch.float32, seed=25)
    adam = O.RowwiseAdam(other, lr=0.1)
    with pytest.raises(ValueError, match="^state_dict: saved by a 'adam' optimizer"):
        opt.load_state_dict(adam.state_dict())
    sd = opt.state_dict()
    bad = {"state": {0: {"step": 3, "sum": torch.ones(7)}}, "param_groups": sd["param_groups"]}
    with pytest.raises(ValueError, match="^state_dict: table 0's 'sum' should be"):
        opt.load_state_dict(bad)
    bad = {"state": {0: {"step": 3, "sum": torch.ones(layer.table.num_rows, dtype=torch.float64)}},
           "param_groups": sd["param_groups"]}
    with pytest.raises(TypeError, match="^state_dict: table 0's 'sum' should be float32"):
        opt.load_state_dict(bad)
    assert not opt.state[layer.table.weight]["sum"].any() and opt.state[layer.table.weight]["step"] == 0


def test_the_optimizer_holds_the_table_weakly_and_other_parameters_leave_it_out():
    layer = random_layer(TINY, 0, torch.float32, seed=26)
    others = O.other_parameters(layer)
    assert all(p is not layer.table.weight for p in others)
    assert len(others) == len(list(layer.parameters())) - 1
    opt = O.SparseSGD(layer, lr=0.1)
    assert layer.table.row_optimizer is opt
    del opt
    assert layer.table.row_optimizer is None                 # dropped: the table trains by autograd again
    loss_of(layer, *batch(27)).backward()
    assert layer.table.weight.grad is not None



@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_host_offloaded_table_trains_where_its_rows_live(rule, backend, monkeypatch):
    """The table in host memory, the rest of the layer on the GPU: the rows cross to the device, their gradients
    back, and the update runs on the host (on the Triton backend with the torch backend's op): the bits of the
    reference op applied on the host to the same ids and gradients."""
    from ple.offload import offload_table

    calls = _recorded(monkeypatch)
    dev = torch.device("cuda")
    layer = random_layer(TINY, 0, torch.float32, seed=40, backend=backend).to(dev)
    offload_table(layer, pin=True)
    assert layer.table.weight.device.type == "cpu"
    opt = RULES[rule](layer, lr=0.1)
    w0 = layer.table.weight.detach().clone()
    h, ids = batch(41)
    loss_of(layer, h.to(dev), ids.to(dev)).backward()
    assert layer.table.weight.grad is None
    opt.step()
    (got_ids, grad, kw), = calls
    assert got_ids.device.type == "cpu" and grad.device.type == "cpu"
    state = tuple(torch.zeros(s) for s in _checks.state_shapes(rule, *w0.shape))
    reference.table_update(w0, got_ids, grad, state, **kw)
    assert_bitwise_equal(layer.table.weight.detach(), w0, name="host table after a step")
