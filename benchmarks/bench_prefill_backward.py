"""``ple_prefill``'s blocked backward on the CPU (``ple.vectorized``, training) beside autograd's composition.

The op alone, forward and ``torch.autograd.grad`` of ``sum(out * up)`` with respect to all seven tensors, from
one sequence of T rows (no conv state): ``blocked`` is the op as it runs (``prefill.BlockedPrefill``: the
blocked forward, a backward recomputed per block of rows), ``composition`` the same call with
``takes_blocked_backward_path`` refused (autograd over the gate, the mask, the conv and the adds, what ran
before). Both are timed interleaved in one run (A, B, A, ...; the median of ``--repeats`` calls each), and
their gradients compared (the largest difference relative to each gradient's largest value).

Widths: ``--widths`` ``engram`` (M 4 x H 1024, K 4, d 3, the Engram norms: the demo's) and ``qwen4exp``
(M 4 x H 512, the Qwen4Exp norms: ``bench_layer_cpu.py``'s); ``--seq`` T (2048), ``--threads`` (2),
``--dtype`` float32 (float64 also takes the blocked path; bfloat16 does not, so it is no case here).
``--smoke``: tiny widths, two repeats (what the tests run). Prints a Markdown table; ``--csv`` appends a row
per case and variant (benchmark ``prefill_backward_cpu``; ``vs_reference`` the composition's time over the row's).

    python benchmarks/bench_prefill_backward.py
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_layer_cpu import interleaved

import ple.vectorized as vec
import ple.vectorized.prefill as vec_prefill

WIDTHS = {"engram": dict(M=4, H=1024, K=4, dilation=3, unit_offset=False, conv_eps=1e-5),
          "qwen4exp": dict(M=4, H=512, K=4, dilation=3, unit_offset=True, conv_eps=None)}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="engram,qwen4exp")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--csv", default=None)
    return p.parse_args(argv)


def case_fns(w: dict, T: int, dtype: torch.dtype):
    """The two zero-argument callables of one case: each returns the seven gradients."""
    g = torch.Generator().manual_seed(0)
    C, H, K = w["M"] * w["H"], w["H"], w["K"]
    r = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(dtype)      # noqa: E731
    tensors = [r(T, C), r(T, H), r(T, C), 1 + r(C, s=0.1), 1 + r(C, s=0.1), 1 + r(C, s=0.1), r(C, K, s=0.3)]
    up = r(T, C)
    kw = dict(dilation=w["dilation"], query_start_loc=torch.tensor([0, T]), conv_eps=w["conv_eps"],
              unit_offset=w["unit_offset"])

    def blocked():
        leaves = [t.detach().requires_grad_() for t in tensors]
        out = vec.ple_prefill(*leaves[:6], 1e-6, leaves[6], **kw)
        return torch.autograd.grad(out, leaves, up)

    def composition():
        real = vec_prefill.takes_blocked_backward_path
        vec_prefill.takes_blocked_backward_path = lambda *a: False
        try:
            return blocked()
        finally:
            vec_prefill.takes_blocked_backward_path = real
    return blocked, composition


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    T, repeats = (96, 2) if args.smoke else (args.seq, args.repeats)
    print(f"# ple_prefill forward + backward on the CPU, T {T}, {args.dtype}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), median of {repeats} interleaved calls", flush=True)
    table, rows = [], []
    for name in args.widths.split(","):
        w = dict(WIDTHS[name], H=8) if args.smoke else WIDTHS[name]
        blocked, composition = case_fns(w, T, dtype)
        diff = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
                   for a, b in zip(blocked(), composition()))
        ms = interleaved({"blocked": blocked, "composition": composition}, repeats)
        case = f"{name} C {w['M'] * w['H']} T {T}"
        table.append((case, ms["blocked"], ms["composition"], diff))
        for variant, v in ms.items():
            rows.append(dict(benchmark="prefill_backward_cpu", case=f"{case} threads={torch.get_num_threads()}",
                             dtype=args.dtype, variant=variant, ms=f"{v:.4f}",
                             vs_reference=f"{ms['composition'] / v:.3f}"))
    print("| case | blocked ms | composition ms | speed-up | gradients' largest relative difference |")
    print("|---|---:|---:|---:|---:|")
    for case, b, c, d in table:
        print(f"| {case} | {b:.2f} | {c:.2f} | {c / b:.2f}x | {d:.1e} |")
    if args.csv:
        import common
        env = common._env()
        common.append_csv(args.csv, [dict(env, bytes=0, gbps="", copy_gbps="", frac_copy="", vs_compiled="", **r)
                                     for r in rows], common.FIELDS)
    bad = [case for case, *_, d in table if not d <= (1e-4 if dtype == torch.float32 else 1e-10)]
    if bad:
        print(f"gradients differ: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
