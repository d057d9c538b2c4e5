"""Benchmark ``ngram_ids`` and the embedding lookup (hash + gather of NH table rows per token).

    python benchmarks/bench_ngram.py                # real widths, a 5 GB table by default (GPU)
    python benchmarks/bench_ngram.py --smoke --dtype float32
"""

from __future__ import annotations

import common
import torch

import ple.fast as fast
import ple.reference as ref


def ngram_case(args, cfg, params, table, T, R, device, dtype, repeats):
    g = torch.Generator(device="cpu").manual_seed(T)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g).to(device)
    qsl = torch.tensor([round(i * T / R) for i in range(R + 1)], dtype=torch.int32, device=device)
    ctx = torch.randint(0, cfg.vocab_size, (R, cfg.context_len), generator=g).to(device)
    kw = dict(heads_per_ngram=cfg.heads_per_ngram, eos_token_id=cfg.eos_token_id, query_start_loc=qsl,
              ngram_context=ctx)

    def lookup(ops):
        return lambda: ops.embedding_lookup(table, ops.ngram_ids(ids, params, **kw))

    NH, D = cfg.num_ngram_heads, cfg.ngram_head_dim
    print("  ngram_ids")
    rows = common.run_case(args, "ngram_ids", f"T={T} R={R}", torch.int64, device, repeats,
                           dict(triton=lambda: fast.ngram_ids(ids, params, **kw),
                                reference=lambda: ref.ngram_ids(ids, params, **kw)),
                           T * 8 + T * NH * 8)
    variants = dict(triton=lookup(fast), reference=lookup(ref))
    if hasattr(fast, "ngram_embedding"):        # the fused hash + gather of ple.fast
        variants["fused"] = lambda: fast.ngram_embedding(table, ids, params, **kw)
    print("  ngram_ids + embedding_lookup")
    rows += common.run_case(args, "ngram_embedding", f"T={T} R={R}", dtype, device, repeats, variants,
                            T * 8 + 2 * T * NH * D * table.element_size())
    return rows


def main(argv=None):
    args, device, dtype, repeats, cfg = common.script(__doc__, argv, {"--tokens": common.TOKENS})
    if "fused" not in args.variants:
        args.variants += ",fused"
    params = ref.hash_params(cfg, 0).to(device)
    table = torch.randn(params.num_rows, cfg.ngram_head_dim, device=device, dtype=dtype)
    print(f"ngram: NH={cfg.num_ngram_heads} D={cfg.ngram_head_dim} table {params.num_rows:,} rows "
          f"({table.numel() * table.element_size() / 1e9:.2f} GB) {dtype} on {device}; "
          f"copy bandwidth {common.copy_bandwidth(device, repeats):.1f} GB/s")
    rows = []
    for T in common.ints(args.tokens):
        rows += ngram_case(args, cfg, params, table, T, max(1, min(T, 8)), device, dtype, repeats)
    return rows


if __name__ == "__main__":
    main()
