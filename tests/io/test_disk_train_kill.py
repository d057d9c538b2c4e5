"""A trainable disk table killed mid-training (docs/spec.md section 12): the overlay is as of a flush, never a mixture.

A child process (this file run as a script) trains a disk table through an overlay on a deterministic data
stream (step k's batch drawn from seed k), flushing every `FLUSH_EVERY` steps and printing ``flushing <n>``
before each flush and ``flushed <n>`` once it returned (``n``: the steps trained). The parent kills it
(SIGKILL) at a random moment, or while a flush is under way (the child's fsyncs slowed down so that a flush
takes a while), then loads the overlay again: it loads, its optimizer step count ``s`` is a flush's (the last
one printed as flushed, or the one in progress), the directory holds nothing but the manifest's files, and
every row and every row's state equal the in-memory table trained ``s`` steps, bit for bit. The next child
resumes from there (``load_optimizer``); at last the parent resumes and trains to the end, which equals
training never stopped.
The checkpoint's files are never written.

Crashes injected in this process too: every file operation of three training steps (rows spill) and a flush
(that merges away the last flush's durable segments) made to fail in turn; the overlay loads as the flush
before or that one, exactly. What no kill can show (it leaves the page cache) is checked on the order of the
file operations (``tests/_overlay_helpers.py``): every segment the new manifest names fsynced, and the
directory, before its rename; no segment a durable manifest names deleted before the new one is durable.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from _overlay_helpers import Crash, FaultInjector, check_flush_order, watched_child

import ple
import ple.io as pio
from ple import PLEConfig
from ple.io.disk_table.overlay._files import LOCK, MANIFEST
from ple.io.disk_table.overlay.store import SLOT_OVERHEAD
from ple.optim.rowwise import STATE_NAMES
from ple.testing.layers import random_layer
from ple.testing.numerics import assert_bitwise_equal

TINY = PLEConfig.preset("tiny")
OPTS = {"sgd": ple.optim.SparseSGD, "adagrad": ple.optim.RowwiseAdagrad, "adam": ple.optim.RowwiseAdam}
B, L = 4, 16
FLUSH_EVERY = 3
LR = 0.05
ROW_BYTES = 2 * 4 + 4 * 4 + 4 + SLOT_OVERHEAD        # an Adam row of D = 4 in the overlay's memory
OVERLAY_BYTES = 150 * ROW_BYTES                      # about 150 rows in memory: spills between flushes
SLOW_FSYNC = 0.02                                    # seconds each fsync of a "slow" child sleeps first


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    h = torch.randn(B, L, TINY.hc_hidden_size, generator=g).to(torch.bfloat16)
    return h, torch.randint(0, TINY.vocab_size, (B, L), generator=g)


def table_only(layer: ple.PLELayer, rule: str) -> ple.optim.RowOptimizer:
    """A row optimizer over ``layer``'s table; its other parameters frozen (they are not in the overlay)."""
    for p in ple.optim.other_parameters(layer):
        p.requires_grad_(False)
    return OPTS[rule](layer, lr=LR)


def train_step(layer: ple.PLELayer, opt: ple.optim.RowOptimizer, step: int) -> None:
    h, ids = batch(step)
    layer(h, ids).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def open_disk(ckpt: str | Path, ov: str | Path, overlay_bytes: int = OVERLAY_BYTES) -> ple.PLELayer:
    return pio.load_layer(ckpt, backend="torch", offload="disk", overlay=ov, overlay_bytes=overlay_bytes)


# ---- the child --------------------------------------------------------------------------------------------
def child(ckpt: str, ov: str, rule: str, end: int, slow: bool) -> None:
    """Resume the overlay and train to step ``end``, flushing every `FLUSH_EVERY` steps (and at ``end``)."""
    if slow:
        real_fsync = os.fsync

        def slow_fsync(fd: int) -> None:
            time.sleep(SLOW_FSYNC)
            real_fsync(fd)

        os.fsync = slow_fsync
    layer = open_disk(ckpt, ov)
    opt = table_only(layer, rule)
    if layer.table.overlay.meta.get("optimizer") is not None:
        pio.load_optimizer(opt, ov)
    start = opt.state[layer.table.trained]["step"]
    print("ready", start, flush=True)
    for k in range(start, end):
        train_step(layer, opt, k)
        if (k + 1) % FLUSH_EVERY == 0 or k + 1 == end:
            print("flushing", k + 1, flush=True)
            t = time.perf_counter()
            layer.table.flush()
            print("flushed", k + 1, time.perf_counter() - t, flush=True)
    print("done", flush=True)
    layer.table.close()


# ---- the parent -------------------------------------------------------------------------------------------
class Reference:
    """The in-memory table trained step by step, with a snapshot of its rows and state at the steps asked."""

    def __init__(self, ckpt: Path, rule: str) -> None:
        self.layer = pio.load_layer(ckpt, backend="torch")
        self.opt = table_only(self.layer, rule)
        self.rule, self.steps = rule, 0
        self.snapshots: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}

    def at(self, steps: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The rows and state after ``steps`` steps (trained on to there; earlier ones must be snapshots)."""
        if steps not in self.snapshots:
            assert steps >= self.steps
            for k in range(self.steps, steps):
                train_step(self.layer, self.opt, k)
            self.steps = steps
            st = self.opt.state[self.layer.table.trained]
            self.snapshots[steps] = (self.layer.table.weight.detach().clone(),
                                     {name: st[name].clone() for name in STATE_NAMES[self.rule]})
        return self.snapshots[steps]

    def check(self, ov: Path, steps: int, ckpt: Path) -> None:
        """The overlay in ``ov`` equals this table trained ``steps`` steps: rows, state and step count; the
        directory holds nothing but its manifest's files once loaded (a killed writer's leftovers cleaned)."""
        rows, states = self.at(steps)
        layer = open_disk(ckpt, ov)
        try:
            store = layer.table.overlay
            s = store.meta["optimizer"]["step"] if store.meta.get("optimizer") else 0
            assert s == steps
            ids = torch.arange(layer.table.num_rows)
            with torch.no_grad():
                got = layer.table.lookup(ids.view(-1, 1), torch.bfloat16, ops=layer.ops).view_as(rows)
            assert_bitwise_equal(got, rows, name=f"rows after {steps} steps")
            _, state = store.read(ids)
            for name, want in states.items():
                if steps == 0:                  # nothing flushed: an overlay no optimizer has taken yet
                    assert f"state.{name}" not in state and not want.any()
                    continue
                assert_bitwise_equal(state[f"state.{name}"], want, name=f"{name} after {steps} steps")
            listed = {s["file"] for s in json.loads((ov / MANIFEST).read_text())["manifest"]["segments"]} \
                if (ov / MANIFEST).exists() else set()
            assert {p.name for p in ov.iterdir()} <= listed | {MANIFEST, LOCK}, "leftovers not cleaned"
        finally:
            layer.table.close()


def durable_step(ov: Path) -> int:
    """The step count of the overlay's last flush (0: none), read from its manifest."""
    if not (ov / MANIFEST).exists():
        return 0
    meta = json.loads((ov / MANIFEST).read_text())["manifest"]["meta"]
    return int(meta["optimizer"]["step"]) if meta and meta.get("optimizer") else 0


def kill_round(ckpt: Path, ov: Path, rule: str, rng: random.Random, durable: int, *, during_flush: bool
               ) -> tuple[int, int, bool]:
    """One child killed: returns (last step printed flushed, last printed flushing, killed inside a flush)."""
    with watched_child(__file__, ckpt, ov, rule, 10**6, int(during_flush)) as (proc, start):
        assert start == durable, "the child did not resume from the last flush"
        flushes = rng.randrange(1 if during_flush else 0, 3)
        longest = 0.0                                        # the longest flush so far, in seconds
        seen = []
        while True:
            line = proc.stdout.readline().split()
            assert line, f"the child stopped: {proc.communicate()[1]}"
            seen.append(line)
            if line[0] == "flushed":
                longest = max(longest, float(line[2]))
            if line[0] == ("flushing" if during_flush else "flushed"):
                if flushes == 0:
                    break
                flushes -= 1
        time.sleep(rng.uniform(0.0, longest) if during_flush else rng.uniform(0.0, 0.4))
        proc.kill()
        out, _ = proc.communicate()
    lines = seen + [x.split() for x in out.splitlines()]
    flushed = max([durable] + [int(x[1]) for x in lines if x[:1] == ["flushed"]])
    flushing = max([flushed] + [int(x[1]) for x in lines if x[:1] == ["flushing"]])
    return flushed, flushing, flushing > flushed


def digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def kill_run(tmp_path: Path, seed: int, kills: int, during_flush: bool, *, finish: bool = True) -> list[bool]:
    """``kills`` children killed, each resumed by the next, then (``finish``) the overlay resumed here and
    trained to the end. Returns, per kill, whether it landed inside a flush (``flushing <n>`` printed,
    ``flushed <n>`` not)."""
    rule = "adam" if seed % 2 == 0 else "adagrad"
    ckpt, ov = tmp_path / "ckpt", tmp_path / "ov"
    pio.save([random_layer(TINY, i, torch.bfloat16, 5 + i) for i in range(TINY.num_ple_layers)], ckpt)
    before = digests(ckpt)
    ref = Reference(ckpt, rule)
    rng = random.Random(seed)
    durable, inside = 0, []
    for _ in range(kills):
        flushed, flushing, in_flush = kill_round(ckpt, ov, rule, rng, durable, during_flush=during_flush)
        s = durable_step(ov)
        assert s % FLUSH_EVERY == 0 and s in (flushed, flushing), (s, flushed, flushing)
        inside.append(in_flush)
        ref.check(ov, s, ckpt)
        durable = s
    if not finish:
        return inside
    end = durable + 2 * FLUSH_EVERY + 1                      # resumed here, to a step not a multiple
    layer = open_disk(ckpt, ov)
    opt = table_only(layer, rule)
    if durable:
        pio.load_optimizer(opt, ov)
    for k in range(durable, end):
        train_step(layer, opt, k)
    layer.table.flush()
    layer.table.close()
    ref.check(ov, end, ckpt)
    assert digests(ckpt) == before, "the checkpoint's files changed"
    return inside


def test_killed_training_quick(tmp_path):
    kill_run(tmp_path, seed=0, kills=1, during_flush=False)


def test_killed_during_flush_quick(tmp_path):
    """Killed while a flush is under way (after ``flushing <n>``, at a random moment within the longest flush
    seen, the child's fsyncs slowed): the overlay is the previous flush or that one. At least one of the kills
    lands inside a flush."""
    inside = kill_run(tmp_path, seed=1, kills=2, during_flush=True, finish=False)
    assert any(inside), "no kill landed inside a flush"


@pytest.mark.deep
@pytest.mark.parametrize("seed", range(2, 12))
def test_killed_training(tmp_path, seed):
    kill_run(tmp_path, seed=seed, kills=4, during_flush=seed % 3 == 0)


# ---- crashes injected at every file operation --------------------------------------------------------------
@pytest.fixture(scope="module")
def crash_setup(tmp_path_factory):
    """A checkpoint, an overlay trained 3 steps and flushed (the template every crash starts from), and the
    in-memory table's rows and state after 3 and 6 steps."""
    root = tmp_path_factory.mktemp("crash")
    ckpt, template = root / "ckpt", root / "template"
    pio.save([random_layer(TINY, i, torch.bfloat16, 7 + i) for i in range(TINY.num_ple_layers)], ckpt)
    layer = open_disk(ckpt, template)
    opt = table_only(layer, "adam")
    for k in range(3):
        train_step(layer, opt, k)
    layer.table.flush()
    layer.table.close()
    ref = Reference(ckpt, "adam")
    ref.at(3)
    ref.at(6)
    return ckpt, template, ref


CRASH_BYTES = 300 * ROW_BYTES
"""The crash trials' overlay memory: rows spill during steps 3-5, and the flush's segment holds as many live rows
as the segments before it, so the flush merges them all, the template's durable ones too."""


def crash_trial(setup, d: Path, at: int, monkeypatch) -> FaultInjector:
    """Resume the template in ``d``, train steps 3-5 (rows spill) and flush (a merge that retires the template's
    durable segments), the ``at``-th file operation failing; then load the overlay as a new process would and
    check it is the flush of step 3 or of step 6, exactly. Returns the injector (``count``: the file operations
    the training and flush did, to the crash; ``log``: what they were)."""
    ckpt, template, ref = setup
    shutil.copytree(template, d)
    layer = open_disk(ckpt, d, CRASH_BYTES)
    opt = table_only(layer, "adam")
    pio.load_optimizer(opt, d)
    store = layer.table.overlay
    with monkeypatch.context() as m:
        inj = FaultInjector(m, at)
        try:
            for k in range(3, 6):
                train_step(layer, opt, k)
            layer.table.flush()
        except Crash:
            pass
    store._lock.release()                       # a dead process's lock goes with it; its files stay as they are
    store._lock = None
    s = durable_step(d)
    assert s in (3, 6), (at, s)
    assert s == 6 or inj.count >= at, "the flush did not happen but nothing failed"
    ref.check(d, s, ckpt)
    shutil.rmtree(d)
    return inj


def _crash_points(setup, tmp_path, monkeypatch) -> int:
    """The file operations of a trial without a crash, checked in order (`check_flush_order`: what a kill cannot
    show): every segment the new manifest names fsynced, and the directory, before its rename; no durable
    segment deleted before the rename is durable. The flush merges away (retires) the template's durable
    segments, so some crash points lie inside that merge."""
    template = setup[1]
    durable = {s["file"] for s in json.loads((template / MANIFEST).read_text())["manifest"]["segments"]}
    inj = crash_trial(setup, tmp_path / "dry", 10**9, monkeypatch)       # no crash: counts the operations
    order = check_flush_order(inj.log, tmp_path / "dry", durable)
    assert order["manifests"] == 1 and order["retired"] == len(durable) > 1, (order, durable)
    assert inj.count > 10
    return inj.count


def test_injected_crashes_quick(crash_setup, tmp_path, monkeypatch):
    n = _crash_points(crash_setup, tmp_path, monkeypatch)
    for at in sorted({1, n // 3, n // 2, n - 4, n - 3, n - 2, n - 1, n}):
        crash_trial(crash_setup, tmp_path / f"at{at}", at, monkeypatch)


@pytest.mark.deep
def test_injected_crashes_every_operation(crash_setup, tmp_path, monkeypatch):
    n = _crash_points(crash_setup, tmp_path, monkeypatch)
    for at in range(1, n + 1):
        crash_trial(crash_setup, tmp_path / f"at{at}", at, monkeypatch)


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1")
