"""Sequence parallelism: bytes sent per layer call by the halo exchange against the all-gather baseline.

Each rank holds ``n`` tokens (``--tokens-per-rank``) of a packed batch split over W
ranks (``--world-sizes``); by default the batch is one sequence, so every rank
boundary cuts it and every rank but the first needs a halo (the worst case for the
halo). One *layer call* is the sequence-parallel conv of the layer
(`ple.distributed.sp_dilated_causal_conv`: exchange, then the dilated causal conv),
forward and backward. Bytes are what the ranks put on the wire, summed over the
group (counted by `ple.distributed.Comm`; collectives as their ring algorithms
send). The halo sends at most ``(W - 1) * S * C`` elements per call whatever ``n``;
the all-gather sends ``W * (W - 1) * n * C``.

``--layer`` runs the whole layer (`sp_forward`, tiny widths unless given) and
reports every category (conv halo, token halo, table traffic with ``--sharded-table``: the
table row-sharded as a DTensor, its ``table_ids`` all-gather and ``table_rows`` reduce-scatter).

Locally (CPU, gloo; W processes spawned per world size)::

    python benchmarks/bench_sequence_parallel.py                       # C = 10240, n = 16,128,1024
    python benchmarks/bench_sequence_parallel.py --smoke               # tiny, seconds

On GPUs, one process per GPU (NCCL)::

    torchrun --nproc-per-node 8 benchmarks/bench_sequence_parallel.py --tokens-per-rank 512,4096,32768

Rows are appended to ``benchmarks/results/sequence_parallel.csv``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results" / "sequence_parallel.csv"
FIELDS = ["date", "commit", "machine", "device", "torch", "backend", "benchmark", "world_size",
          "tokens_per_rank", "seq_len", "C", "S", "dtype", "variant", "category", "fwd_bytes", "bwd_bytes",
          "fwd_elems", "bound_elems", "within_bound", "ms_fwd", "ms_fwd_bwd"]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny widths and sizes: checks the script runs")
    p.add_argument("--world-sizes", default=None,
                   help="W to spawn locally (default 2,3,4, smoke 2; ignored under torchrun)")
    p.add_argument("--tokens-per-rank", default=None, help="comma-separated n (default 16,128,1024)")
    p.add_argument("--seq-len", type=int, default=0, help="cut the batch into sequences of this length "
                   "(0: one sequence over every rank)")
    p.add_argument("--hidden-size", type=int, default=2560, help="H (C = hc_count * H)")
    p.add_argument("--hc-count", type=int, default=4, help="M")
    p.add_argument("--kernel-size", type=int, default=4, help="K")
    p.add_argument("--ngram-size", type=int, default=3, help="N, also the dilation d; S = (K - 1) * d")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on GPUs, float32 on CPUs")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5, smoke 1)")
    p.add_argument("--layer", action="store_true", help="also run the whole layer (sp_forward), tiny widths")
    p.add_argument("--sharded-table", action="store_true", help="with --layer: shard the table as well")
    p.add_argument("--csv", default=str(RESULTS), help="CSV to append rows to ('' for none)")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden_size, args.hc_count = 24, 2
        args.world_sizes = args.world_sizes or "2"
        args.tokens_per_rank = args.tokens_per_rank or "4,32"
    args.tokens_per_rank = [int(v) for v in (args.tokens_per_rank or "16,128,1024").split(",") if v]
    args.world_sizes = [int(v) for v in (args.world_sizes or "2,3,4").split(",") if v]
    args.repeats = args.repeats or (1 if args.smoke else 5)
    return args


def _forward(conv, x):
    with torch.no_grad():
        conv(x)


def _forward_backward(conv, x, grad):
    conv(x.detach().requires_grad_(True)).backward(grad)


def _group_max(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def conv_cases(rank, W, args, device) -> list[dict]:
    """The sequence-parallel conv, both exchanges, for every n: bytes and times (rows on rank 0 only)."""
    import common

    from ple.backends import resolve_backend
    from ple.distributed import Comm, even_bounds, sp_dilated_causal_conv

    _, ops = resolve_backend("auto")
    dtype = getattr(torch, args.dtype)
    C = args.hidden_size * args.hc_count
    K, d = args.kernel_size, args.ngram_size
    S = (K - 1) * d
    rows = []
    g = torch.Generator().manual_seed(rank)
    weight = (torch.randn(C, K, generator=g) * 0.1).to(device, dtype)
    for n in args.tokens_per_rank:
        T = n * W
        L = args.seq_len or T
        starts = list(range(0, T, L)) + [T]
        bounds = even_bounds(T, W)
        x = torch.randn(n, C, generator=g).to(device, dtype)
        grad = torch.randn(n, C, generator=g).to(device, dtype)
        for variant in ("halo", "allgather"):
            comm = Comm()
            conv = functools.partial(sp_dilated_causal_conv, weight=weight, dilation=d, cu_seqlens=starts,
                                     group=comm, bounds=bounds, exchange=variant, ops=ops)
            fwd = functools.partial(_forward, conv, x)
            fwd_bwd = functools.partial(_forward_backward, conv, x, grad)

            fwd()                                            # one counted call
            cat = "conv_halo" if variant == "halo" else "conv_allgather"
            fwd_bytes = comm.all_reduce_sum_ints([comm.bytes_sent[cat]])[0]
            comm.reset()
            fwd_bwd()
            bwd_bytes = comm.all_reduce_sum_ints([comm.bytes_sent[cat + "_grad"]])[0]
            # one warm-up call each; host time, the device synchronised around each call (ranks wait on each other)
            ms_fwd = _group_max(common.bench(fwd, device, args.repeats, warmup=1, wall=True), device)
            ms_all = _group_max(common.bench(fwd_bwd, device, args.repeats, warmup=1, wall=True), device)
            elems = fwd_bytes // torch.tensor([], dtype=dtype).element_size()
            bound = (W - 1) * S * C
            rows.append(dict(benchmark="sp_conv", world_size=W, tokens_per_rank=n, seq_len=L, C=C, S=S,
                             dtype=args.dtype, variant=variant, category=cat, fwd_bytes=fwd_bytes,
                             bwd_bytes=bwd_bytes, fwd_elems=elems, bound_elems=bound,
                             within_bound=str(elems <= bound) if variant == "halo" else "",
                             ms_fwd=f"{ms_fwd:.3f}", ms_fwd_bwd=f"{ms_all:.3f}"))
    return rows


def layer_cases(rank, W, args, device) -> list[dict]:
    """The whole layer (`sp_forward`, tiny widths): bytes per category per call, forward and backward."""
    import ple
    from ple.distributed import Comm, even_bounds, parallelize_tables, sp_forward, sync_grads

    cfg = ple.PLEConfig.preset("tiny")
    dtype = torch.float32
    torch.manual_seed(0)
    layer = ple.PLELayer(cfg, backend="auto", device=device, dtype=dtype)
    comm = Comm()
    if args.sharded_table:                                   # the table a row-sharded DTensor on the group
        layer = parallelize_tables(layer, comm, "row")
    C, S = cfg.hc_hidden_size, cfg.conv_state_len
    rows = []
    for n in args.tokens_per_rank:
        T = n * W
        L = args.seq_len or T
        starts = torch.tensor(list(range(0, T, L)) + [T], device=device)
        lo, hi = even_bounds(T, W)[rank:rank + 2]
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, cfg.vocab_size, (T,), generator=g).to(device)
        hidden = torch.randn(T, C, generator=g).to(device, dtype)
        for variant in ("halo", "allgather"):
            comm.reset()
            h = hidden[lo:hi].clone().requires_grad_(True)
            out = sp_forward(layer, h, ids[lo:hi], starts, comm, exchange=variant)
            fwd = dict(comm.bytes_sent)
            out.sum().backward()
            sync_grads(layer, comm)
            both = dict(comm.bytes_sent)
            for cat in sorted(both):
                if cat.endswith("_grad") or cat == "control":
                    continue
                bwd_cat = cat if cat == "grad_sync" else cat + "_grad"          # grad_sync: after backward
                f = comm.all_reduce_sum_ints([fwd.get(cat, 0) if cat != "grad_sync" else 0])[0]
                b = comm.all_reduce_sum_ints([both.get(bwd_cat, 0)])[0]
                rows.append(dict(benchmark="sp_forward", world_size=W, tokens_per_rank=n, seq_len=L, C=C, S=S,
                                 dtype="float32", variant=variant, category=cat, fwd_bytes=f, bwd_bytes=b,
                                 fwd_elems="", bound_elems="", within_bound="", ms_fwd="", ms_fwd_bwd=""))
    return rows


def run(rank, W, args) -> list[dict]:
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    rows = conv_cases(rank, W, args, device)
    if args.layer:
        rows += layer_cases(rank, W, args, device)
    return rows


def _spawned(rank, W, args):
    return run(rank, W, args)


def report(rows, args, backend: str) -> None:
    import common

    env = {k: v for k, v in common._env().items() if k in FIELDS}
    print(f"{'W':>2} {'n/rank':>7} {'variant':>9} {'category':>15} {'fwd bytes':>12} {'bwd bytes':>12} "
          f"{'fwd elems':>10} {'bound':>9} {'ms fwd':>8} {'ms f+b':>8}")
    for r in rows:
        print(f"{r['world_size']:>2} {r['tokens_per_rank']:>7} {r['variant']:>9} {r['category']:>15} "
              f"{r['fwd_bytes']:>12} {r['bwd_bytes']:>12} {r['fwd_elems']!s:>10} {r['bound_elems']!s:>9} "
              f"{r['ms_fwd']:>8} {r['ms_fwd_bwd']:>8}"
              + ("" if r["within_bound"] in ("", "True") else "   EXCEEDS (W-1)*S*C"))
    if args.csv:
        common.append_csv(args.csv, [dict(env, backend=backend, **r) for r in rows], FIELDS)


def main(argv=None) -> list[dict]:
    args = parse(argv)
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:          # under torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        args.dtype = args.dtype or ("bfloat16" if backend == "nccl" else "float32")
        dist.init_process_group(backend)
        try:
            rows = run(dist.get_rank(), dist.get_world_size(), args)
            if dist.get_rank() == 0:
                report(rows, args, backend)
        finally:
            dist.destroy_process_group()
        return rows
    from ple.distributed import spawn

    args.dtype = args.dtype or "float32"
    rows = []
    for W in args.world_sizes:
        rows += spawn(_spawned, W, args, timeout=1800.0, pg_timeout=600.0)[0]
    report(rows, args, "gloo")
    return rows


if __name__ == "__main__":
    main()
