"""Per-rank bytes of the PLE table's sharding plans at the real model's widths, and a check of the collectives.

    python benchmarks/table_sharding_report.py                 # the Markdown table (qwen4exp, bf16)
    python benchmarks/table_sharding_report.py --world 2,4,8 --tokens 4096
    python benchmarks/table_sharding_report.py --measure       # W = 2 gloo run: collectives as claimed?
    python benchmarks/table_sharding_report.py --int8 [--measure]   # also the row-sharded int8 table

For each plan of the sharded table (``ple.distributed``: the table a DTensor, rows or columns, tokens
replicated or per rank) and the unsharded table, per rank and per lookup of one PLE layer
with ``T`` tokens per rank: the table's bytes, the bytes this rank sends in forward and in
backward, the collectives, and the host syncs. Bytes sent follow ``ple.distributed.Comm``'s
ring convention (all-reduce of n bytes: 2 (W-1)/W n; all-gather of an n-byte chunk: (W-1) n;
reduce-scatter or all-to-all of n bytes: (W-1)/W n). Per-rank tokens are padded to the
largest count, so unequal counts send that much more, and their counts are all-gathered
first ((W-1) 8 bytes, the host sync). On gloo, which has no all-to-all, DTensor all-gathers
instead (W times the bytes).

``--int8`` adds the row-sharded int8 table (per-row scales, ``ple.quant``): its rows travel as
their D bytes with the scale's 4 bytes beside them, no gradient.

``--measure`` runs every plan on two gloo processes at a tiny width under
``torch.distributed.tensor.debug.CommDebugMode`` and compares the collectives issued in
forward and backward with the ones the table names (exit status 1 on a difference).
"""

from __future__ import annotations

import argparse
import sys

import ple
from ple.reference.hashing import hash_params

# plan -> (forward collectives, backward collectives), as DTensor issues them on NCCL. Per-rank tokens:
# "allgather_" finds the ranks' token counts (the host sync), one all_gather_into_tensor the hash ids.
COLLECTIVES = {
    "row, replicated tokens": ({"all_reduce": 1}, {}),
    "row, per-rank tokens": ({"allgather_": 1, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1},
                             {"all_gather_into_tensor": 1}),
    "col, replicated tokens": ({"all_gather_into_tensor": 1}, {}),
    "col, per-rank tokens": ({"allgather_": 1, "all_gather_into_tensor": 1, "all_to_all_single": 1},
                             {"all_to_all_single": 1}),
}
INT8_COLLECTIVES = {                                      # no table gradient: nothing in backward
    "row, int8, replicated tokens": ({"all_reduce": 1}, {}),
    "row, int8, per-rank tokens": ({"allgather_": 1, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}, {}),
}


def on_gloo(counts: dict) -> dict:
    """Gloo has no all-to-all: DTensor all-gathers instead (W times the bytes of the all-to-all)."""
    out = dict(counts)
    n = out.pop("all_to_all_single", 0)
    if n:
        out["all_gather_into_tensor"] = out.get("all_gather_into_tensor", 0) + n
    return out


def plan_rows(config: ple.PLEConfig, W: int, T: int, elem: int = 2, *, int8: bool = False) -> list[dict]:
    """One dict per plan: table bytes, forward / backward bytes sent by one rank, host syncs per lookup."""
    rows, D, E, NH = hash_params(config, 0).num_rows, config.ngram_head_dim, config.ple_embed_dim, \
        config.num_ngram_heads
    emb = T * E * elem                                    # this rank's looked-up rows
    ids = (W - 1) * T * NH * 8                            # all-gather of the int64 hash ids
    row_piece = -(-rows // W) * D * elem
    col_piece = rows * -(-D // W) * elem
    q_emb, q_piece = T * NH * (D + 4), -(-rows // W) * (D + 4)    # int8 rows and their float32 scales
    quantized = [
        dict(plan="row, int8, replicated tokens", table=q_piece, fwd=2 * (W - 1) / W * q_emb, bwd=0, syncs=0),
        dict(plan="row, int8, per-rank tokens", table=q_piece, fwd=ids + (W - 1) * q_emb, bwd=0, syncs=1),
    ] if int8 else []
    return [
        dict(plan="unsharded (whole table on every rank)", table=rows * D * elem, fwd=0, bwd=0, syncs=0),
        dict(plan="row, replicated tokens", table=row_piece, fwd=2 * (W - 1) / W * emb, bwd=0, syncs=0),
        dict(plan="row, per-rank tokens", table=row_piece, fwd=ids + (W - 1) * emb, bwd=(W - 1) * emb, syncs=1),
        dict(plan="col, replicated tokens", table=col_piece, fwd=(W - 1) / W * emb, bwd=0, syncs=0),
        dict(plan="col, per-rank tokens", table=col_piece, fwd=ids + (W - 1) / W * emb, bwd=(W - 1) / W * emb,
             syncs=1),
    ] + quantized


def _h(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def markdown(config: ple.PLEConfig, worlds: list[int], T: int, *, int8: bool = False) -> str:
    lines = [f"Per rank, one PLE layer's lookup of T = {T} tokens per rank (E = {config.ple_embed_dim}, "
             f"D = {config.ngram_head_dim}, {hash_params(config, 0).num_rows:,} rows, bfloat16):", "",
             "| G | plan | table / rank | sent, forward | sent, backward | collectives (fwd; bwd) | host syncs |",
             "|---|---|---|---|---|---|---|"]
    for W in worlds:
        for r in plan_rows(config, W, T, int8=int8):
            fwd, bwd = {**COLLECTIVES, **INT8_COLLECTIVES}.get(r["plan"], ({}, {}))
            names = "; ".join(", ".join(f"{n} x{k}" for n, k in side.items()) or "-" for side in (fwd, bwd))
            lines.append(f"| {W} | {r['plan']} | {_h(r['table'])} | {_h(r['fwd'])} | {_h(r['bwd'])} | {names} | "
                         f"{r['syncs']} |")
    return "\n".join(lines)


# ---- --measure: the collectives DTensor issues, on two gloo processes ------------------------------------
def _measure(rank: int, W: int, int8: bool = False) -> dict:
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.debug import CommDebugMode

    from ple.distributed import parallelize_tables

    config = ple.PLEConfig.preset("tiny")
    mesh = init_device_mesh("cpu", (W,))
    torch.manual_seed(0)
    base = ple.PLELayer(config, 0)
    quantized = copy.deepcopy(base)
    quantized.ple_embedding.quantize_("int8")
    out = {}
    for plan in {**COLLECTIVES, **(INT8_COLLECTIVES if int8 else {})}:
        placement = plan[:3]
        layouts = Shard(0) if "per-rank" in plan else None
        layer = parallelize_tables(copy.deepcopy(quantized if "int8" in plan else base), mesh, placement,
                                   input_layouts=layouts)
        ids = torch.randint(0, config.vocab_size, (2, 5))
        hidden = torch.randn(2, 5, config.hc_hidden_size, requires_grad=True)
        counts = []
        for side in ("fwd", "bwd"):
            mode = CommDebugMode()
            with mode:
                if side == "fwd":
                    y = layer(hidden, ids)
                else:
                    y.sum().backward()
            counts.append({str(op).split(".")[-2] if str(op).endswith(".default") else str(op).split(".")[-1]: n
                           for op, n in mode.get_comm_counts().items()})
        out[plan] = counts
    return out


def measure(int8: bool = False) -> int:
    from ple.distributed import spawn

    got = spawn(_measure, 2, int8, timeout=120.0)[0]
    bad = 0
    for plan, (fwd, bwd) in {**COLLECTIVES, **(INT8_COLLECTIVES if int8 else {})}.items():
        ok = got[plan] == [on_gloo(fwd), on_gloo(bwd)]
        bad += not ok
        print(f"{plan:<24} forward {got[plan][0]}  backward {got[plan][1]}  {'as claimed' if ok else 'DIFFERS'}")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", default="2,4,8", help="world sizes, comma-separated")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank and lookup")
    p.add_argument("--measure", action="store_true", help="check the collectives on two gloo processes")
    p.add_argument("--int8", action="store_true", help="add the row-sharded int8 table's plans")
    args = p.parse_args(argv)
    if args.measure:
        return measure(args.int8)
    print(markdown(ple.PLEConfig.preset("qwen4exp"), [int(w) for w in args.world.split(",")], args.tokens,
                   int8=args.int8))
    return 0


if __name__ == "__main__":
    sys.exit(main())
