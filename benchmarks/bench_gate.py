"""Benchmark ``ple_gate``: the three grouped norms and the signed-sqrt gate (forward, or --backward).

    python benchmarks/bench_gate.py                 # real widths (GPU)
    python benchmarks/bench_gate.py --smoke --dtype float32
"""

from __future__ import annotations

import common
import torch

import ple.fast as fast
import ple.reference as ref


def gate_case(args, cfg, T, device, dtype, repeats):
    C, H = cfg.hc_hidden_size, cfg.hidden_size
    g = torch.Generator(device="cpu").manual_seed(0)

    def make(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_(args.backward)

    key, value, hidden = make(T, C), make(T, H), make(T, C)
    wk, wq, wc = make(C), make(C), make(C)
    dg, dc = torch.randn(T, C, generator=g).to(device, dtype), torch.randn(T, C, generator=g).to(device, dtype)
    inputs = (key, value, hidden, wk, wq, wc)

    def run(op):
        return common.with_backward(args, lambda: op(*inputs, cfg.rms_norm_eps), inputs, (dg, dc))

    isz = key.element_size()
    nbytes = (2 * T * C + T * H + 2 * T * C) * isz          # read key, hidden, value; write gated, conv_input
    if args.backward:
        nbytes += (2 * T * C + 2 * T * C + T * H + 2 * T * C) * isz   # read again + grads in, grads out
    case = f"{'fwd+bwd' if args.backward else 'fwd'} T={T}"
    variants = common.op_variants(args, run, fast.ple_gate, ref.ple_gate)
    return common.run_case(args, "ple_gate", case, dtype, device, repeats, variants, nbytes)


def main(argv=None):
    args, device, dtype, repeats, cfg = common.script(__doc__, argv, {"--tokens": common.TOKENS})
    print(f"ple_gate: C={cfg.hc_hidden_size} H={cfg.hidden_size} {dtype} on {device}; "
          f"copy bandwidth {common.copy_bandwidth(device, repeats):.1f} GB/s")
    rows = []
    for T in common.ints(args.tokens):
        rows += gate_case(args, cfg, T, device, dtype, repeats)
    return rows


if __name__ == "__main__":
    main()
