"""The default CPU layer (``backend="torch"``, ``ple.vectorized``) beside transformers' ``Qwen4ExpTextPLELayer``.

One run builds one random layer (``ple.testing.layers.random_layer``) per dtype
at C 2048 (``--hidden-size`` 512, ``--hc-count`` 4), E 512 and a small table
(``ngram_vocab_size_base`` 20_000), loads the same weights into transformers' module, checks that
each case's first call gives the same outputs (bfloat16: bit for bit; float32: within 1e-5
relative, printed either way), then times every case with the two implementations interleaved
(call A, call B, call A, ...; the median of ``--repeats`` calls each), so that a noisy, shared
machine slows both alike. Cases, and the bar each must meet (ple time / transformers time):

* ``forward BxL``: ``layer(hidden, ids)`` under ``torch.no_grad()`` against ``hidden + module(hidden,
  ids, None)`` (as its decoder layer adds the module's term); at most 0.8.
* ``fwd+bwd BxL``: that forward and ``torch.autograd.grad`` of its output with respect to the hidden
  states and every parameter (the table included, dense); at most 0.8.
* ``compiled BxL``: ``torch.compile(layer, fullgraph=True)`` forward against transformers' *eager*
  forward; at most 0.35.
* ``decode R``: one decode step of R one-token requests after a prefill of prompts of different
  lengths: ``layer.step(hidden, cache.schedule([Decode(slot, token), ...]), cache)`` with a
  ``ple.state.PLECache`` (the host's ``schedule`` is timed: a user pays it every step), eager and as
  ``ple.state.CompiledStep(layer)`` (``decode-compiled``: ``compute_step`` under ``torch.compile``),
  against transformers' call in
  a decode step with its ``DynamicCache`` (prompts left-padded, as its model pads a batch); at most
  0.5 (either).

Defaults: ``--seqs 1x2048,8x256``, ``--decode 64``, ``--dtype float32,bfloat16``, ``--threads 1``
(the torch thread count while timing; ``--threads 0`` keeps torch's default), ``--repeats 15``
(decode cases: ``--decode-repeats``, default 4x that).
``--smoke``: the tiny preset, one short sequence shape, R 4, two repeats (what the tests run).
``--no-compile`` skips the compiled cases. Prints one Markdown table (case, dtype, transformers ms,
ple ms, ratio, bar, outputs) and appends a row per case and implementation to the results CSV
(benchmark ``layer_cpu``; variant ``transformers`` or ``torch``; ``vs_reference`` holds
transformers' time over this row's).

    python benchmarks/bench_layer_cpu.py
    python benchmarks/bench_layer_cpu.py --smoke --no-compile
    python benchmarks/bench_layer_cpu.py --dtype bfloat16 --modes forward,decode --repeats 30

Without transformers (``pip install transformers==5.23.0``) ``--smoke`` times ``ple`` alone and says
so; a full run exits with an error.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import bench_decode_cpu
import common
import torch

from ple.state import CompiledStep, Decode
from ple.testing.layers import random_layer

MODES = ("forward", "backward", "compiled", "decode")
BARS = {"forward": 0.8, "fwd+bwd": 0.8, "compiled": 0.35, "decode": 0.5, "decode-compiled": 0.5}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, two repeats: checks the script runs")
    p.add_argument("--dtype", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    p.add_argument("--repeats", type=int, default=None, help="timed calls of each implementation (default 15)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--seqs", default="1x2048,8x256", help="B x L shapes of forward, backward and compiled")
    p.add_argument("--decode", default="64", help="requests per decode step")
    p.add_argument("--decode-repeats", type=int, default=None,
                   help="timed calls of each implementation in decode cases (default 4x --repeats: they are short)")
    p.add_argument("--prompt", type=int, default=32, help="longest prompt of the prefill before decode")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads while timing (0: torch's default)")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled cases")
    p.add_argument("--csv", default=str(common.RESULTS), help="CSV to append rows to ('' for none)")
    common.add_model_args(p)
    p.set_defaults(hidden_size=512, hc_count=4, embed_dim=512, table_base=20_000)
    return p.parse_args(argv)


def interleaved(fns: dict, repeats: int, warmup: int = 2) -> dict:
    """Median ms of each zero-arg callable, calling them in turn (A, B, A, B, ...) after ``warmup`` rounds."""
    times = {name: [] for name in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def compare(got, want, dtype, bitwise=True) -> str:
    """``same bits`` / ``max rel diff x`` of the output (and the gradients), and whether it meets its bar.

    The bar (docs/spec.md section 8): an eager bfloat16 output equals the model's bit for bit (``bitwise``);
    gradients, compiled outputs (inductor rounds differently) and float32 are within a relative
    difference (of the largest magnitude) of 1e-5 in float32, 2e-2 in bfloat16.
    """
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    notes, ok = [], True
    for part, gs, ws in (("output", got[:1], want[:1]), ("grads", got[1:], want[1:])):
        if not gs:
            continue
        if all(torch.equal(g, w) for g, w in zip(gs, ws)):
            notes.append(f"{part} same bits")
            continue
        rel = max(((g.double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30)).item()
                  for g, w in zip(gs, ws))
        ok &= rel <= tol and not (bitwise and part == "output" and dtype == torch.bfloat16)
        notes.append(f"{part} max rel diff {rel:.2g}")
    return ", ".join(notes) + ("" if ok else " (MISMATCH)")


class Inputs:
    """Hidden states, ids and an output gradient of B sequences of L tokens."""

    def __init__(self, cfg, B, L, dtype, seed=1):
        g = torch.Generator().manual_seed(seed)
        C = cfg.hc_hidden_size
        self.hidden = torch.randn(B, L, C, generator=g).to(dtype)
        self.ids = torch.randint(0, cfg.vocab_size, (B, L), generator=g)
        self.grad = torch.randn(B, L, C, generator=g).to(dtype)


def forward_fns(layer, tfm, x, compiled=None):
    def ple():
        with torch.no_grad():
            return (layer if compiled is None else compiled)(x.hidden, x.ids)

    def tf():
        with torch.no_grad():
            return x.hidden + tfm(x.hidden, x.ids, None)
    return ple, tf


def backward_fns(layer, tfm, x):
    h = x.hidden.detach().requires_grad_(True)

    def run(module, call):
        params = [h, *module.parameters()]

        def fn():
            out = call()
            return (out.detach(), *torch.autograd.grad(out, params, x.grad))
        return fn
    return run(layer, lambda: layer(h, x.ids)), (run(tfm, lambda: h + tfm(h, x.ids, None)) if tfm else None)


def decode_fns(cfg, layer, tf, tfm, tcfg, R, max_prompt, dtype, step=None):
    """Decode-step callables of ple (``step`` or ``layer.step``) and transformers, each on its own prefilled cache."""
    case = bench_decode_cpu.Case(cfg, layer, tf, tfm, tcfg, R, max_prompt, dtype)
    step = layer.step if step is None else step
    items = [Decode(s, t) for s, t in zip(case.slots, case.tokens.tolist())]

    def ple():
        with torch.no_grad():
            return step(case.hidden, case.cache.schedule(items), case.cache)
    return ple, ((lambda: case.decode_tf()[:, 0]) if tfm is not None else None)


def main(argv=None):
    args = parse(argv)
    repeats = args.repeats or (2 if args.smoke else 15)
    if args.smoke:
        args.seqs, args.decode, args.prompt = "2x9", "4", 6
    dtypes = [getattr(torch, d) for d in args.dtype.split(",") if d]
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"bench_layer_cpu: unknown mode {sorted(unknown)}")
    if args.no_compile:
        modes = [m for m in modes if m != "compiled"]
    cfg = common.model_config(args)
    tf = bench_decode_cpu.load_transformers()
    if tf is None:
        msg = f"transformers is not installed (pip install transformers=={bench_decode_cpu.TRANSFORMERS_VERSION})"
        if not args.smoke:
            raise SystemExit(f"{msg}: it is what this benchmark compares against")
        print(f"{msg}; --smoke times ple alone")
    default_threads = torch.get_num_threads()
    threads = args.threads or default_threads
    env = common._env()
    print(f"PLELayer (backend torch) vs transformers on {env['device']}: C={cfg.hc_hidden_size} "
          f"E={cfg.ple_embed_dim} NH={cfg.num_ngram_heads} table base {cfg.ngram_vocab_size_base}; "
          f"torch {torch.__version__}, {threads} thread(s), median of {repeats} interleaved calls")
    if not args.no_compile:
        common.allow_recompiles()
    table, rows = [], []

    decode_repeats = args.decode_repeats or 4 * repeats

    def record(case, dtype, fns, check):
        torch.set_num_threads(threads)
        try:
            n = decode_repeats if case.startswith("decode") else repeats
            ms = interleaved({k: f for k, f in fns.items() if f is not None}, n)
        finally:
            torch.set_num_threads(default_threads)
        tf_ms, ple_ms = ms.get("transformers"), ms["torch"]
        kind = case.split()[0]
        table.append((case, str(dtype)[6:], tf_ms, ple_ms, BARS[kind], check))
        for variant, t in ms.items():
            rows.append(dict(env, benchmark="layer_cpu", case=f"{case} threads={threads}", dtype=str(dtype)[6:],
                             variant=variant, ms=f"{t:.4f}", bytes=0, gbps="", copy_gbps="", frac_copy="",
                             vs_reference=f"{tf_ms / t:.2f}" if tf_ms else "", vs_compiled=""))
        line = f"  {case:22s} {str(dtype)[6:]:8s} ple {ple_ms:9.3f} ms"
        if tf_ms:
            line += f"  transformers {tf_ms:9.3f} ms  ratio {ple_ms / tf_ms:.3f}"
        print(line + f"  ({check})", flush=True)

    for dtype in dtypes:
        layer = random_layer(cfg, dtype=dtype, backend="torch")
        tfm, tcfg = bench_decode_cpu.tf_layer(tf, cfg, layer, dtype) if tf else (None, None)
        for shape in args.seqs.split(","):
            B, L = (int(v) for v in shape.lower().split("x"))
            x = Inputs(cfg, B, L, dtype)
            for mode in modes:
                if mode == "decode":
                    continue
                if mode == "backward":
                    ple, tfn = backward_fns(layer, tfm, x)
                    case = f"fwd+bwd {B}x{L}"
                elif mode == "compiled":
                    torch._dynamo.reset()
                    compiled = torch.compile(layer, fullgraph=True)
                    ple, tfn = forward_fns(layer, tfm, x, compiled)
                    case = f"compiled {B}x{L}"
                else:
                    ple, tfn = forward_fns(layer, tfm, x)
                    case = f"forward {B}x{L}"
                got = ple()
                check = (compare(got, tfn(), dtype, bitwise=mode != "compiled") if tfm is not None
                         else "transformers not installed")
                record(case, dtype, {"transformers": tfn if tfm is not None else None, "torch": ple}, check)
        if "decode" in modes:
            for R in common.ints(args.decode):
                variants = [("decode", None)]
                if not args.no_compile:
                    torch._dynamo.reset()
                    variants.append(("decode-compiled", CompiledStep(layer)))
                for name, step in variants:
                    ple, tfn = decode_fns(cfg, layer, tf, tfm, tcfg, R, args.prompt, dtype, step)
                    check = (compare(ple(), tfn(), dtype, bitwise=step is None) if tfn is not None
                             else "transformers not installed")
                    record(f"{name} {R}", dtype, {"transformers": tfn, "torch": ple}, check)
    print(markdown(table))
    if args.csv:
        common.append_csv(args.csv, rows, common.FIELDS)
    return rows


def markdown(table) -> str:
    lines = ["| case | dtype | transformers ms | ple (torch) ms | ratio ple / transformers | bar | outputs |",
             "|---|---|---:|---:|---:|---:|---|"]
    for case, dtype, tf_ms, ple_ms, bar, check in table:
        tf_cell = f"{tf_ms:.3f}" if tf_ms else "-"
        ratio = f"{ple_ms / tf_ms:.3f}" + (" ok" if ple_ms / tf_ms <= bar else " over") if tf_ms else "-"
        lines.append(f"| {case} | {dtype} | {tf_cell} | {ple_ms:.3f} | {ratio} | {bar} | {check} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
    sys.exit(0)
