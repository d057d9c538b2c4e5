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
        def f():
            gated, conv_in = op(*inputs, cfg.rms_norm_eps)
            if args.backward:
                torch.autograd.grad((gated, conv_in), inputs, (dg, dc))
        return f

    isz = key.element_size()
    nbytes = (2 * T * C + T * H + 2 * T * C) * isz          # read key, hidden, value; write gated, conv_input
    if args.backward:
        nbytes += (2 * T * C + 2 * T * C + T * H + 2 * T * C) * isz   # read again + grads in, grads out
    compiled = common.maybe_compile(ref.ple_gate, args)
    case = f"{'fwd+bwd' if args.backward else 'fwd'} T={T}"
    variants = dict(triton=run(fast.ple_gate), reference=run(ref.ple_gate),
                    compiled=run(compiled) if compiled else None)
    return common.run_case(args, "ple_gate", case, dtype, device, repeats, variants, nbytes)


def main(argv=None):
    p = common.parser(__doc__.splitlines()[0])
    common.add_model_args(p)
    p.add_argument("--tokens", default="1,64,256,512,4096,16384", help="token counts")
    args = p.parse_args(argv)
    device, dtype, repeats = common.setup(args)
    cfg = common.model_config(args)
    if args.smoke:
        args.tokens = "1,9"
    print(f"ple_gate: C={cfg.hc_hidden_size} H={cfg.hidden_size} {dtype} on {device}; "
          f"copy bandwidth {common.copy_bandwidth(device, repeats):.1f} GB/s")
    rows = []
    for T in common.ints(args.tokens):
        rows += gate_case(args, cfg, T, device, dtype, repeats)
    return rows


if __name__ == "__main__":
    main()
