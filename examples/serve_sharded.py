"""Serving with the PLE table sharded across ranks: each rank serves its own requests from its own cache.

    torchrun --nproc-per-node 2 examples/serve_sharded.py          # gloo on CPUs; NCCL on GPUs (LOCAL_RANK)
    torchrun --nproc-per-node 2 examples/serve_sharded.py --table int8   # or fp8: a quantized table

The table is a DTensor (``TableRowwise``, per-rank tokens: ``input_layouts=Shard(0)``), so
each rank holds 1/W of its rows (``ceil(rows / W)``, the checkpoint layout's split); the rest
of the layer is replicated. ``--table int8`` / ``fp8`` quantizes it first (``ple.quant``): the
shard then holds the raw int8 / FP8 rows with their scales (per row, sharded alike; or one,
replicated). Each rank schedules its
own requests on its own ``PLECache`` (no rank keeps another's conv states) and steps them
with ``layer.step``; every lookup is a collective, so a rank with nothing to do in a step
joins it with ``join_table_lookup``. A random stream of prefill, decode and speculative
steps runs, and each rank checks its outputs and conv states bit for bit against the same
requests served by the whole-table layer (built only for the check). Exit status 1 on a
mismatch.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import random
import sys

import torch
import torch.distributed as dist

import ple
from ple.demo import int_at_least
from ple.distributed import join_table_lookup, parallelize_tables
from ple.state import PLECache
from ple.testing.serving import step_each


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int_at_least(1), default=12)
    p.add_argument("--requests", type=int_at_least(1), default=2, help="requests per rank")
    p.add_argument("--table", choices=["float", "int8", "fp8"], default="float", help="the table's storage")
    args = p.parse_args(argv)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if cuda else "cpu"
    mesh = init_device_mesh(device, (world,))
    config = ple.PLEConfig.preset("tiny")
    torch.manual_seed(0)                                     # the same weights on every rank
    whole = ple.PLELayer(config, 0, device=device)
    with torch.no_grad():
        for w in (whole.norm_key.weight, whole.norm_query.weight, whole.norm_conv.weight, whole.conv1d.weight):
            w.normal_(0, 0.5)
    if args.table != "float":
        whole.ple_embedding.quantize_(args.table)
    layer = parallelize_tables(copy.deepcopy(whole), mesh, "row", input_layouts=Shard(0))

    rng = random.Random(rank)                                # each rank its own requests
    caches = [PLECache(config, num_slots=args.requests + 1, num_spec_tokens=2, num_layers=1, device=device)
              for _ in range(2)]                             # [sharded table, whole table]
    slots = [[c.allocate() for _ in range(args.requests)] for c in caches]
    started, mismatches, idle = [False] * args.requests, 0, 0
    with torch.no_grad():
        for _ in range(args.steps):
            plan = []
            for r in range(args.requests):
                if rng.random() < (0.3 if rank % 2 == 0 else 0.7):    # odd ranks are often idle
                    continue
                if not started[r]:
                    plan.append(("prefill", r, [rng.randrange(config.vocab_size) for _ in range(rng.randint(1, 12))]))
                    started[r] = True
                elif rng.random() < 0.5:
                    plan.append(("decode", r, rng.randrange(config.vocab_size)))
                else:
                    plan.append(("spec", r, [rng.randrange(config.vocab_size) for _ in range(2)]))
            if not plan:
                join_table_lookup(layer)
                idle += 1
                continue
            outs = step_each((layer, whole), caches, slots, plan, device=device)
            mismatches += not torch.equal(outs[0], outs[1])
            for kind, r, _ in plan:
                if kind == "spec":
                    accepted = rng.randint(1, 2)
                    for cache, s in zip(caches, slots, strict=True):
                        cache.accept(s[r], accepted)
    mismatches += not torch.equal(caches[0].conv_state(0), caches[1].conv_state(0))
    rows = layer.table.weight.to_local().shape[0]
    sys.stdout.write(f"rank {rank}: {args.requests} requests of its own, {args.steps} steps ({idle} idle), "
                     f"{layer.table.weight.dtype} table rows {rows} of {layer.table.num_rows}; outputs and conv states "
                     f"{'equal the whole-table layer bit for bit' if not mismatches else 'DIFFER'}\n")
    sys.stdout.flush()                                       # one write a line: ranks' lines do not interleave
    total = torch.tensor([mismatches], device=device)
    dist.all_reduce(total)
    # Free the DTensors (and the mesh) before the process group goes: freed after it, at interpreter exit,
    # gloo aborted the process ("terminate called without an active exception") in about 1 run in 6.
    del layer, whole, caches, mesh
    gc.collect()
    dist.destroy_process_group()
    return 0 if int(total) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
