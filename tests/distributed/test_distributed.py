"""ple.distributed on gloo: 2 and 3 CPU processes against one process.

Process startup dominates (torch import, a few seconds a process), so each world
size is spawned once (a module fixture) and runs every check in that group; each
test below then reports one check. Every process builds the same layers from the
same seed and runs the single-process reference itself, so nothing large crosses
process boundaries.

Covered: serving steps with a row-sharded table (the DTensor table, replicated tokens);
a rank's rows read from the checkpoint shards that overlap them (float and int8);
sequence-parallel training (outputs, gradients of every parameter and input; whole,
row-sharded and FP8 row-sharded tables) and serving steps (outputs and cache states,
bit for bit; whole, row-sharded and int8 row-sharded tables) with both exchanges;
splits with a rank that holds no tokens, ranks holding fewer than S tokens, a request
spanning three ranks; and the halo's byte bound, ``(W - 1) * S * C`` elements per layer
call. The sharded table itself: ``test_sharded_table.py`` and ``test_dtensor.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _helpers import nonzero_layers, packed_reference

import ple
from ple.distributed import (
    Comm,
    even_bounds,
    fragments,
    halo_plan,
    parallelize_tables,
    shard_range,
    sp_forward,
    sp_step,
    spawn,
    sync_grads,
)
from ple.state import Decode, PLECache, Prefill, Spec
from ple.testing import spawned
from ple.testing.spawned import close, expect, same_bits

pytestmark = pytest.mark.deep      # deep tier: sequence parallelism and checkpoint reads at W = 2, 3

CONFIG = ple.PLEConfig.preset("tiny")          # C 48, S 9, N 3, NH 6, D 4, 6128 table rows
CKPT_PREFIX = "model.layers.1.ple."


def make_layers(num_layers=1, *, seed=0, dtype=torch.float32):
    """Layers with every parameter non-zero (norms and conv included), the same in every process."""
    return nonzero_layers(CONFIG, num_layers, seed=seed, dtype=dtype)


def total_bytes(comm: Comm, category: str) -> int:
    """Bytes sent under ``category``, summed over the group."""
    return comm.all_reduce_sum_ints([comm.bytes_sent[category]])[0]


# ---- checks run inside the spawned group -------------------------------------------------------
def check_checkpoint_reads(rank, W, ckpt_dir):
    """A rank's rows of the sharded table come from the checkpoint shards that overlap them, and only those rows
    (``ple.io``'s one reader), for a float table and an int8 one (its scales beside); a checkpoint of another
    config, or a wrong prefix, is refused, naming the key."""
    from ple.distributed import load_table_piece_
    from ple.io.files import Checkpoint
    from ple.io.layout import plan_layer, shard_rows
    from ple.table import DenseTable

    full = make_layers()[0].ple_embedding.ngram_embedding.weight.detach()
    rows = full.shape[0]
    a, b = shard_range(rows, W, rank)
    read = []
    original = Checkpoint.read

    def spy(self, key, start=None, stop=None):
        if "ngram_embedding" in key:
            read.append((key.rsplit(".", 1)[0].rsplit(".", 1)[-1], start, stop))
        return original(self, key, start, stop)

    for kind, parts in (("float", 5), ("int8", 3)):
        path = f"{ckpt_dir}/{kind}"
        pieces = plan_layer(Checkpoint.open(path), CONFIG, 0, CKPT_PREFIX).pieces
        expect([(p.start, p.stop) for p in pieces] == shard_rows(rows, parts), f"{kind}: the layout's shards")
        want = {(f"shard_{k}", max(a, s0) - s0, min(b, s1) - s0) for k, (s0, s1) in enumerate(shard_rows(rows, parts))
                if min(b, s1) > max(a, s0)}
        layer = ple.PLELayer(CONFIG, 0, table=DenseTable(rows, CONFIG.ngram_head_dim, device="meta"))
        parallelize_tables(layer, Comm(), "row")
        read.clear()
        Checkpoint.read = spy
        try:
            load_table_piece_(layer, path, prefix=CKPT_PREFIX)
        finally:
            Checkpoint.read = original
        expect(set(read) == want, f"{kind}: rows [{a}, {b}) read {sorted(read)}, expected {sorted(want)}")
        if kind == "float":
            same_bits(layer.table.weight.to_local(), full[a:b], "float rows from the checkpoint")
            expect(layer.table.scale is None, "a float table has no scale")
        else:
            q, scale = int8_table(make_layers()[0])
            expect(layer.table.weight.dtype == torch.int8 and layer.table.scale.dim() == 2, "an int8 table now")
            same_bits(layer.table.weight.to_local(), q[a:b], "int8 rows from the checkpoint")
            same_bits(layer.table.scale.to_local(), scale[a:b], "row scales from the checkpoint")
    for make, match in ((lambda: load_table_piece_(layer, ckpt_dir + "/float", prefix="nope."),
                         "prefix: no key starts with 'nope.'"),
                        (lambda: load_table_piece_(parallelize_tables(
                            ple.PLELayer(CONFIG.replace(seed=CONFIG.seed + 1), 0), Comm()), ckpt_dir + "/float",
                            prefix=CKPT_PREFIX), "layer_multipliers")):
        try:
            make()
            expect(False, f"no ValueError matching {match!r}")
        except ValueError as e:
            expect(match in str(e), f"{match!r} not in {e}")


def _script(slots, eos, g):
    """Serving steps: (items, accept, bounds) with long prefills, decodes, spec, a checkpoint, tiny steps."""
    a, b, c, ck, d = slots

    def toks(n):
        return [int(x) for x in torch.randint(0, CONFIG.vocab_size, (n,), generator=g)]

    pa = toks(25)
    pa[6] = eos
    return [
        ([Prefill(a, pa), Prefill(b, toks(3)), Prefill(c, toks(14), checkpoint_at=10, checkpoint_slot=ck)],
         {}, None),
        ([Decode(a, toks(1)), Spec(b, toks(3)), Prefill(c, toks(7)), Decode(ck, eos)], {b: 2}, None),
        ([Prefill(b, toks(5)), Spec(a, toks(2)), Decode(c, toks(1))], {a: 1}, None),
        ([Decode(b, toks(1))], {}, None),                                 # fewer tokens than ranks
        ([Spec(a, toks(3)), Prefill(d, toks(30))], {a: 3}, "custom"),
        ([Decode(a, toks(1)), Decode(b, toks(1)), Prefill(d, toks(4))], {}, None),
    ]


def _custom_bounds(T, W):
    # A rank with fewer than S rows between others, and (for W = 3) a request over three ranks.
    return [0, 5, T] if W == 2 else [0, 12, 15, T]


def _serve(rank, W, mode, exchange, quantized=None):
    """Run the script on one process (reference) and split over the group; compare every step."""
    layers = make_layers(2, seed=3)
    if quantized:
        for layer in layers:
            layer.ple_embedding.quantize_(quantized)
    ref_cache = PLECache(CONFIG, 7, num_spec_tokens=2, num_layers=2)
    cache = PLECache(CONFIG, 7, num_spec_tokens=2, num_layers=2)
    comm = Comm()
    if mode == "sp":
        mine = layers
    else:                                                   # the table sharded by rows, through the group
        mine = [parallelize_tables(copy.deepcopy(layer), comm, "row") for layer in layers]
    slots = [ref_cache.allocate() for _ in range(5)]
    expect([cache.allocate() for _ in range(5)] == slots, "the same slots")
    g = torch.Generator().manual_seed(4)
    C, S = CONFIG.hc_hidden_size, CONFIG.conv_state_len
    for step, (items, accept, split) in enumerate(_script(slots, CONFIG.eos_token_id, g)):
        ref_batch, batch = ref_cache.schedule(items), cache.schedule(items)
        T = batch.num_tokens
        hidden = torch.randn(T, C, generator=g)
        bounds = _custom_bounds(T, W) if split == "custom" else (even_bounds(T, W) if step % 2 else None)
        lo, hi = (bounds or even_bounds(T, W))[rank:rank + 2]
        h_ref, h = hidden, hidden if mode == "table" else hidden[lo:hi]
        for li in range(2):
            before = comm.bytes_sent["conv_halo"]
            h_ref = layers[li].step(h_ref, ref_batch, ref_cache)
            if mode == "table":
                h = mine[li].step(h, batch, cache)
                got, want = h, h_ref
            else:
                h = sp_step(mine[li], h, batch, cache, comm, bounds=bounds, exchange=exchange)
                got, want = h, h_ref[lo:hi]
            close(got, want, f"step {step} layer {li} output", tol=1e-6)
            sent = total_bytes(comm, "conv_halo") - comm.all_reduce_sum_ints([before])[0]
            expect(sent <= (W - 1) * S * C * 4, f"step {step}: halo sent {sent} bytes")
        for s, n in accept.items():
            ref_cache.accept(s, n)
            cache.accept(s, n)
        # Matmuls over a rank's rows may round differently from those over all rows, so states match one
        # process to rounding; across ranks the replicated caches must agree bit for bit.
        close(cache.conv_states, ref_cache.conv_states, f"conv states after step {step}", tol=1e-5)
        every = comm.all_gather(cache.conv_states, "test")
        for r in range(W):
            same_bits(every[r], cache.conv_states, f"rank {r}'s conv states after step {step}")
        expect(cache._slots == ref_cache._slots, f"bookkeeping after step {step}")
    if mode == "sp" and exchange == "halo":
        expect(comm.bytes_sent["conv_allgather"] == 0, "the halo path all-gathers no conv input")
        expect(total_bytes(comm, "conv_halo") > 0, "some halo was sent")


def check_step_sharded_table(rank, W, ckpt_dir):
    _serve(rank, W, "table", None)


def check_sp_step_halo(rank, W, ckpt_dir):
    _serve(rank, W, "sp", "halo")


def check_sp_step_allgather(rank, W, ckpt_dir):
    _serve(rank, W, "sp", "allgather")


def check_sp_step_sharded_table(rank, W, ckpt_dir):
    _serve(rank, W, "sp+table", "halo")


def check_sp_step_quantized_sharded_table(rank, W, ckpt_dir):
    _serve(rank, W, "sp+table", "halo", quantized="int8")


def _train(rank, W, sharded, exchange, bounds_list, quantized=None):
    """sp_forward over a packed batch: outputs, input and parameter gradients against one process."""
    def layer_():
        layer, = make_layers(dtype=torch.float64, seed=5)
        if quantized:
            layer.ple_embedding.quantize_(quantized)
        return layer

    full = layer_()
    lengths = [5, 23, 1, 0, 14]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    T, C, S = starts[-1], CONFIG.hc_hidden_size, CONFIG.conv_state_len

    # One process: every sequence through forward, the loss summed.
    one = packed_reference(full, starts, eos_at=20)
    ids, hidden, probe, ref, h = one["ids"], one["hidden"], one["probe"], one["ref"], one["h"]
    ref_grads = {n: p.grad.clone() for n, p in full.named_parameters()}

    comm = Comm()
    cu = torch.tensor(starts)
    for bounds in bounds_list:
        layer = layer_()
        if sharded:
            layer = parallelize_tables(layer, comm, "row")
        lo, hi = (bounds or even_bounds(T, W))[rank:rank + 2]
        hk = hidden[lo:hi].clone().requires_grad_(True)
        comm.reset()
        out = sp_forward(layer, hk, ids[lo:hi], cu, comm, bounds=bounds, exchange=exchange)
        (out * probe[lo:hi]).sum().backward()
        sync_grads(layer, comm)
        close(out, ref[lo:hi], f"bounds {bounds}: output")
        close(hk.grad, h.grad[lo:hi], f"bounds {bounds}: hidden_states grad")
        for name, p in layer.named_parameters():
            want, got = ref_grads[name], p.grad
            if sharded and name == "ple_embedding.ngram_embedding.weight":
                a, b = shard_range(want.shape[0], W, rank)
                want, got = want[a:b], got.to_local()
            close(got, want, f"bounds {bounds}: grad of {name}")
        if sharded:
            expect(comm.bytes_sent["table_rows"] > 0, f"table traffic counted: {dict(comm.bytes_sent)}")
        if exchange == "halo":
            for cat in ("conv_halo", "conv_halo_grad"):
                sent = total_bytes(comm, cat)
                expect(sent <= (W - 1) * S * C * 8, f"bounds {bounds}: {cat} sent {sent} bytes")
            expect(comm.bytes_sent["conv_allgather"] == 0, "the halo path all-gathers no conv input")


def _train_bounds(W):
    T = 43
    if W == 2:
        return [None, [0, 0, T], [0, 33, T]]           # even; rank 0 empty; a cut inside a sequence
    return [None, [0, 10, 10, T], [0, 12, 15, T]]      # even; rank 1 empty; a sequence over three ranks


def check_sp_forward_halo(rank, W, ckpt_dir):
    _train(rank, W, False, "halo", _train_bounds(W))


def check_sp_forward_allgather(rank, W, ckpt_dir):
    _train(rank, W, False, "allgather", _train_bounds(W)[:2])


def check_sp_forward_sharded_table(rank, W, ckpt_dir):
    _train(rank, W, True, "halo", _train_bounds(W)[1:])


def check_sp_forward_quantized_sharded_table(rank, W, ckpt_dir):
    _train(rank, W, True, "halo", _train_bounds(W)[1:2], quantized="fp8")


CHECKS = {
    "checkpoint_reads": check_checkpoint_reads,
    "step_sharded_table": check_step_sharded_table,
    "sp_step_halo": check_sp_step_halo,
    "sp_step_allgather": check_sp_step_allgather,
    "sp_step_sharded_table": check_sp_step_sharded_table,
    "sp_step_quantized_sharded_table": check_sp_step_quantized_sharded_table,
    "sp_forward_halo": check_sp_forward_halo,
    "sp_forward_allgather": check_sp_forward_allgather,
    "sp_forward_sharded_table": check_sp_forward_sharded_table,
    "sp_forward_quantized_sharded_table": check_sp_forward_quantized_sharded_table,
}


def run_checks(rank, world_size, names, ckpt_dir):
    """Every check in turn; a failing check is reported and the others still run."""
    return spawned.run_checks(CHECKS, names, rank, world_size, ckpt_dir)


# ---- the parent side ------------------------------------------------------------------------------
def int8_table(layer):
    """The layer's table quantized per row by ``ple.quant``: ``(q [rows, D], scale [rows, 1])``."""
    from ple.quant import quantize

    return quantize(layer.ple_embedding.ngram_embedding.weight.detach(), "int8")


def write_checkpoint(path, layer, parts, *, quantized=False):
    """The model's layout by ``ple.io.save``: shard k holds rows from k * ceil(rows / parts); several files."""
    from ple import io as pio

    pio.save(layer, path, prefix=CKPT_PREFIX, parts=parts, table_dtype="int8" if quantized else None,
             max_file_bytes=40_000, ple_only=quantized)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    layer = make_layers()[0]
    write_checkpoint(path / "float", layer, parts=5)
    write_checkpoint(path / "int8", layer, parts=3, quantized=True)
    return str(path)


def _group_results(world_size, checkpoint_dir):
    per_rank = spawn(run_checks, world_size, list(CHECKS), checkpoint_dir, timeout=150.0, pg_timeout=30.0)
    return {name: [(r, res[name]) for r, res in enumerate(per_rank) if res[name] is not None]
            for name in CHECKS}


@pytest.fixture(scope="module")
def world2(checkpoint_dir):
    return _group_results(2, checkpoint_dir)


@pytest.fixture(scope="module")
def world3(checkpoint_dir):
    return _group_results(3, checkpoint_dir)


def _report(results, name):
    failures = results[name]
    if failures:
        pytest.fail("\n".join(f"rank {r}:\n{tb}" for r, tb in failures), pytrace=False)


@pytest.mark.parametrize("name", list(CHECKS))
def test_two_processes(world2, name):
    _report(world2, name)


@pytest.mark.parametrize("name", list(CHECKS))
def test_three_processes(world3, name):
    _report(world3, name)


# ---- single-process pieces -------------------------------------------------------------------------
def test_halo_plan_bound_and_coverage():
    """Every rank receives exactly the rows of its first request before its first row, at most S."""
    starts = [0, 5, 28, 29, 29, 43]
    S = 9
    splits = ([0, 43], [0, 21, 43], [0, 10, 10, 43], [0, 12, 15, 43], [0, 1, 2, 3, 43], even_bounds(43, 5))
    for bounds in splits:
        W = len(bounds) - 1
        plans = [halo_plan(bounds, starts, S, k) for k in range(W)]
        assert sum(p.num_recv for p in plans) <= (W - 1) * S
        for k, p in enumerate(plans):
            lo, hi = bounds[k], bounds[k + 1]
            frags = fragments(starts, lo, hi)
            want = 0 if not frags else min(S, frags[0][1] - starts[frags[0][0]])
            assert p.num_recv == want and p.start == lo - want
            got = [row for src, _, n in p.recvs
                   for row in range(max(p.start, bounds[src]), max(p.start, bounds[src]) + n)]
            assert got == list(range(p.start, lo))
            for src, _, n in p.recvs:                # matched by the sender's plan
                assert any(dst == k and h - l_ == n for dst, l_, h in plans[src].sends)


def test_benchmark_smoke(tmp_path, monkeypatch):
    """The benchmark runs (2 gloo processes, tiny widths) and shows the halo bound whatever the tokens."""
    import pathlib
    import sys

    bench = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    sys.modules.pop("bench_sequence_parallel", None)
    import bench_sequence_parallel

    rows = bench_sequence_parallel.main(["--smoke", "--tokens-per-rank", "4,32,256", "--repeats", "1",
                                         "--csv", str(tmp_path / "sp.csv")])
    halo = {r["tokens_per_rank"]: r for r in rows if r["variant"] == "halo"}
    gather = {r["tokens_per_rank"]: r for r in rows if r["variant"] == "allgather"}
    S, C = halo[4]["S"], halo[4]["C"]
    for r in halo.values():
        assert r["fwd_elems"] <= (r["world_size"] - 1) * S * C and r["within_bound"] == "True"
        assert r["bwd_bytes"] == r["fwd_bytes"]
    assert halo[32]["fwd_bytes"] == halo[256]["fwd_bytes"]           # n >= S: constant
    assert gather[256]["fwd_bytes"] == 8 * gather[32]["fwd_bytes"]   # all-gather: linear in n
    assert (tmp_path / "sp.csv").read_text().count("\n") == len(rows) + 1
