"""Benchmark ``ple_conv`` (prefill / decode / spec) and ``dilated_causal_conv`` (training).

    python benchmarks/bench_conv.py                       # real widths, all cases (GPU)
    python benchmarks/bench_conv.py --smoke --dtype float32  # tiny shapes, checks the script runs
    python benchmarks/bench_conv.py --backward            # training path forward + backward
"""

from __future__ import annotations

import common
import torch

import ple.fast as fast
import ple.reference as ref


def conv_case(args, cfg, mode, n, device, dtype, repeats, spec_len=4, requests=1):
    C, K, d = cfg.hc_hidden_size, cfg.ple_conv_kernel_size, cfg.conv_dilation
    S = cfg.conv_state_len
    g = torch.Generator(device="cpu").manual_seed(0)
    W = S + spec_len
    if mode == "prefill":
        T, R = n, requests
        cuts = [round(i * T / R) for i in range(R + 1)]
        kw = dict(query_start_loc=torch.tensor(cuts, dtype=torch.int32, device=device),
                  has_initial_states=torch.ones(R, dtype=torch.bool, device=device))
        case = f"prefill T={T} R={R}"
    elif mode == "decode":
        T = R = n
        kw = {}
        case = f"decode B={R}"
    else:
        R, T = n, n * spec_len
        kw = dict(query_start_loc=torch.arange(R + 1, dtype=torch.int32, device=device) * spec_len,
                  num_accepted_tokens=torch.full((R,), 2, dtype=torch.int32, device=device),
                  spec_query_len=spec_len)
        case = f"spec B={R} q={spec_len}"
    x = torch.randn(T, C, generator=g).to(device, dtype)
    residual = torch.randn(T, C, generator=g).to(device, dtype)
    outer = torch.randn(T, C, generator=g).to(device, dtype)
    state = torch.randn(R + 1, C, W, generator=g).to(device, dtype)
    w = torch.randn(C, K, generator=g).to(device, dtype)
    slots = torch.arange(1, R + 1, dtype=torch.int32, device=device)

    def run(op):
        return lambda: op(x, residual, state, w, slots, mode=mode, dilation=d, outer_residual=outer, **kw)

    isz = x.element_size()
    nbytes = 4 * T * C * isz + R * C * isz * (S + (S if mode != "spec" else S + spec_len - 1))
    variants = common.op_variants(args, run, fast.ple_conv, ref.ple_conv)
    return common.run_case(args, "ple_conv", case, dtype, device, repeats, variants, nbytes)


def training_case(args, cfg, T, device, dtype, repeats):
    C, K, d = cfg.hc_hidden_size, cfg.ple_conv_kernel_size, cfg.conv_dilation
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, T, C, generator=g).to(device, dtype).requires_grad_(args.backward)
    w = torch.randn(C, K, generator=g).to(device, dtype).requires_grad_(args.backward)
    dy = torch.randn(1, T, C, generator=g).to(device, dtype)

    def run(op):
        return common.with_backward(args, lambda: op(x, w, dilation=d), (x, w), dy)

    isz = x.element_size()
    nbytes = 2 * T * C * isz * (3 if args.backward else 1)
    case = f"{'fwd+bwd' if args.backward else 'fwd'} T={T}"
    variants = common.op_variants(args, run, fast.dilated_causal_conv, ref.dilated_causal_conv)
    return common.run_case(args, "dilated_causal_conv", case, dtype, device, repeats, variants, nbytes)


SIZES = {"--prefill": ("512,4096,16384", "7,33", "prefill token counts"),
         "--decode": ("1,64,256", "1,3", "decode batch sizes"),
         "--spec-batch": ("1,64,256", "2", "spec batch sizes (4 tokens each)")}     # (default, --smoke, help)


def main(argv=None):
    args, device, dtype, repeats, cfg = common.script(__doc__, argv, SIZES)
    print(f"ple_conv: C={cfg.hc_hidden_size} K={cfg.ple_conv_kernel_size} d={cfg.conv_dilation} {dtype} "
          f"on {device}; copy bandwidth {common.copy_bandwidth(device, repeats):.1f} GB/s")
    rows = []
    if not args.backward:
        for T in common.ints(args.prefill):
            for R in (1, 4):
                rows += conv_case(args, cfg, "prefill", T, device, dtype, repeats, requests=R)
        for B in common.ints(args.decode):
            rows += conv_case(args, cfg, "decode", B, device, dtype, repeats)
        for B in common.ints(args.spec_batch):
            rows += conv_case(args, cfg, "spec", B, device, dtype, repeats)
    for T in common.ints(args.prefill):
        rows += training_case(args, cfg, T, device, dtype, repeats)
    return rows


if __name__ == "__main__":
    main()
