"""The Engram family on the default CPU layer (``backend="torch"``) beside DeepSeek's demo formulation and the GEMMs.

One run builds an Engram-family `PLELayer` at the demo's widths (``--hidden-size`` 1024, ``--hc-count`` 4,
``n_embed_per_ngram`` 512, 8 heads, N 3, K 4; ``--table-base`` sets ``engram_vocab_size``, so the table
is one this machine holds: 129,280 a head start gives 2.07M rows of 64, 0.5 GB in float32), loads the same
weights into the demo's formulation (``tests/engram/_demo.py``: numpy hashing on the host, one
``nn.Linear`` / ``nn.RMSNorm`` per stream, an ``nn.Conv1d``; the module the tests check ple against), checks
the first call of each case agrees (float32 within 1e-5), then times, interleaved (A, B, C, A, ...; the
median of ``--repeats`` calls each) so a busy machine slows all alike:

* ``forward BxL``: ``layer(hidden, ids)`` under ``torch.no_grad()``, against the demo block
  (``hidden + engram(hidden.view(B, L, M, H), ids)``) and against the step's projection GEMMs alone
  (``F.linear`` of the ``[T, E]`` embeddings by the key and value weights and biases, the same shapes the
  layer multiplies); bars: at most 0.9 of the demo's time, at most 1.25x the GEMMs' (their floor).
* ``compiled BxL``: ``torch.compile(layer, fullgraph=True)``'s forward (the torch backend traced; its
  elementwise work fused by inductor), against the same demo block and GEMMs; the same bars.
* ``fwd+bwd BxL``: the same forward and ``torch.autograd.grad`` of ``sum(out * up)`` with respect to the
  hidden states and every parameter, against the demo's and the GEMMs' forward and backward (gradients of
  the embeddings, weights and biases); the same bars. ple's table gradient is the rows looked up
  (``sparse_table_grad=True``, how ``ple.optim`` trains a table), the demo's ``nn.Embedding`` makes its dense
  one (as the demo does).
* ``decode R@P``: one decode step of R requests that each hold P tokens (``layer.step`` on a
  ``ple.state.PLECache`` prefilled beforehand; the host's ``schedule`` is timed too), against what the
  demo must do for the same new token: its forward over each request's whole sequence so far
  (``[R, P + 1]``, batched); at least 10x faster.

Defaults: ``--seqs 1x2048,4x512``, ``--decode 64@512``, ``--threads 2`` (torch's thread count while timing),
``--repeats 9``. ``--smoke``: tiny widths and one short case (what the tests run). Prints a Markdown table
(case, ple ms, demo ms, GEMMs ms, ratios and bars) and, with ``--csv``, appends a row per case and
implementation (benchmark ``engram_cpu``; variant ``torch``, ``demo`` or ``gemms``; ``vs_reference`` the
demo's time over the row's). Exit 1 when an output differs from the demo's; ``--check``: also when a bar is
missed.

    python benchmarks/bench_engram.py
    python benchmarks/bench_engram.py --smoke
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))     # the demo's formulation (the oracle)

from bench_layer_cpu import interleaved  # noqa: E402   (A, B, C, A, ...: the median of each)
from engram._demo import DemoEngram  # noqa: E402

import ple  # noqa: E402
from ple.state import Decode, PLECache, Prefill  # noqa: E402

BARS = {"forward": (0.9, 1.25), "compiled": (0.9, 1.25), "fwd+bwd": (0.9, 1.25)}     # (ple / demo, ple / GEMMs)
DECODE_SPEEDUP = 10.0


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--hc-count", type=int, default=4)
    p.add_argument("--table-base", type=int, default=129280, help="engram_vocab_size of each order")
    p.add_argument("--seqs", default="1x2048,4x512", help="BxL shapes of the forward cases")
    p.add_argument("--decode", default="64@512", help="R@P: R requests of P tokens each")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled cases")
    p.add_argument("--csv", default=None)
    p.add_argument("--check", action="store_true", help="exit 1 when a bar is missed")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden_size, args.hc_count, args.table_base = 16, 2, 101
        args.seqs, args.decode, args.repeats = "2x12", "4@6", 2
    return args


def config_of(args) -> ple.PLEConfig:
    n_embed = 16 if args.smoke else 512
    return ple.PLEConfig.engram(vocab_size=129280, hidden_size=args.hidden_size, hc_count=args.hc_count,
                                engram_vocab_size=(args.table_base, args.table_base), max_ngram_size=3,
                                n_embed_per_ngram=n_embed, n_head_per_ngram=8, layer_ids=(1, 15), pad_id=2,
                                seed=0, kernel_size=4)


def agree(got: torch.Tensor, want: torch.Tensor) -> str:
    """Whether ``got`` equals ``want`` within 1e-5 (relative and absolute), and the largest difference."""
    err = float((got - want).abs().max()) if got.numel() else 0.0
    ok = torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    return f"{'within' if ok else 'OVER'} 1e-5 (max abs diff {err:.1e})"


def forward_cases(layer, demo, B, L, cfg, gen, compiled=None):
    M, H, C, E = cfg.hc_count, cfg.hidden_size, cfg.hc_hidden_size, cfg.ple_embed_dim
    hidden = torch.randn(B, L, C, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (B, L), generator=gen)
    ids_np = ids.numpy()
    emb = torch.randn(B * L, E, generator=gen)
    up = torch.randn(B, L, C, generator=gen)
    kw, kb, vw, vb = (layer.key_proj.weight, layer.key_proj.bias, layer.value_proj.weight, layer.value_proj.bias)

    def ple_fwd(module=layer):
        with torch.no_grad():
            return module(hidden, ids)

    def demo_fwd():
        with torch.no_grad():
            return hidden + demo(hidden.view(B, L, M, H), ids_np).reshape(B, L, C)

    def gemms_fwd():
        with torch.no_grad():
            return F.linear(emb, kw, kb), F.linear(emb, vw, vb)

    def grads_of(module, call):
        params = [p for p in module.parameters() if p.requires_grad]

        def fn():
            h = hidden.detach().requires_grad_()      # a leaf sharing the storage: no copy timed
            out = call(h)
            return torch.autograd.grad(out, [h, *params], up)
        return fn

    ple_bwd = grads_of(layer, lambda h: layer(h, ids))          # the table's gradient: its rows (sparse)
    demo_bwd = grads_of(demo, lambda h: h + demo(h.view(B, L, M, H), ids_np).reshape(B, L, C))

    def gemms_bwd():
        e = emb.detach().requires_grad_()
        k, v = F.linear(e, kw, kb), F.linear(e, vw, vb)
        return torch.autograd.grad((k, v), [e, kw, kb, vw, vb], (up.reshape(B * L, C), up.reshape(B * L, C)[:, :H]))

    want = demo_fwd()
    cases = [(f"forward {B}x{L}", {"torch": ple_fwd, "demo": demo_fwd, "gemms": gemms_fwd}, agree(ple_fwd(), want))]
    if compiled is not None:
        run = lambda: ple_fwd(compiled)     # noqa: E731
        cases.append((f"compiled {B}x{L}", {"torch": run, "demo": demo_fwd, "gemms": gemms_fwd}, agree(run(), want)))
    cases.append((f"fwd+bwd {B}x{L}", {"torch": ple_bwd, "demo": demo_bwd, "gemms": gemms_bwd},
                  agree(ple_bwd()[0], demo_bwd()[0])))
    return cases


def decode_case(layer, demo, R, P, cfg, gen):
    M, H, C = cfg.hc_count, cfg.hidden_size, cfg.hc_hidden_size
    cache = PLECache(cfg, num_slots=R + 1, num_layers=1)
    slots = [cache.allocate() for _ in range(R)]
    prompts = torch.randint(0, cfg.vocab_size, (R, P), generator=gen)
    history = torch.randn(R, P, C, generator=gen)
    with torch.no_grad():
        batch = cache.schedule([Prefill(s, p.tolist()) for s, p in zip(slots, prompts)])
        layer.step(history.reshape(R * P, C), batch, cache)
    token = torch.randint(0, cfg.vocab_size, (R,), generator=gen)
    hidden = torch.randn(R, C, generator=gen)
    items = [Decode(s, int(t)) for s, t in zip(slots, token)]
    whole_ids = torch.cat([prompts, token[:, None]], 1).numpy()
    whole_hidden = torch.cat([history, hidden[:, None]], 1)

    def ple_step():                 # each call is one more decode step of the same requests: the same work
        with torch.no_grad():
            return layer.step(hidden, cache.schedule(items), cache)

    def demo_whole():
        with torch.no_grad():
            out = whole_hidden + demo(whole_hidden.view(R, P + 1, M, H), whole_ids).reshape(R, P + 1, C)
            return out[:, -1]

    check = agree(ple_step(), demo_whole())
    return (f"decode {R}@{P}", {"torch": ple_step, "demo": demo_whole}, check)


def main(argv=None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = config_of(args)
    layer = ple.PLELayer(cfg, 0, backend="torch", sparse_table_grad=True)
    demo = DemoEngram(cfg, cfg.ple_layer_ids[0])
    demo.load_state_dict(layer.state_dict())
    rows_of_table = layer.table.num_rows
    print(f"# Engram layer on the CPU: C {cfg.hc_hidden_size} (M {cfg.hc_count} x H {cfg.hidden_size}), "
          f"E {cfg.ple_embed_dim}, table {rows_of_table} x {cfg.ngram_head_dim}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), median of {args.repeats} interleaved calls", flush=True)
    gen = torch.Generator().manual_seed(1)
    cases = []
    for shape in args.seqs.split(","):
        B, L = (int(v) for v in shape.lower().split("x"))
        compiled = None
        if not args.no_compile:
            torch._dynamo.reset()
            compiled = torch.compile(layer, fullgraph=True)
        cases += forward_cases(layer, demo, B, L, cfg, gen, compiled)
    for spec in args.decode.split(","):
        R, P = (int(v) for v in spec.split("@"))
        cases.append(decode_case(layer, demo, R, P, cfg, gen))
    table, rows, missed = [], [], []
    for case, fns, check in cases:
        ms = interleaved(fns, args.repeats)
        kind = case.split()[0]
        t, d, g = ms["torch"], ms["demo"], ms.get("gemms")
        if kind == "decode":
            ok = d / t >= DECODE_SPEEDUP
            verdict = f"{d / t:.1f}x faster (bar {DECODE_SPEEDUP:.0f}x) " + ("ok" if ok else "over")
        else:
            bar_demo, bar_gemm = BARS[kind]
            ok = t / d <= bar_demo and t / g <= bar_gemm
            verdict = (f"{t / d:.3f} of the demo (bar {bar_demo}), {t / g:.3f}x the GEMMs (bar {bar_gemm}) "
                       + ("ok" if ok else "over"))
        if not ok:
            missed.append(case)
        table.append((case, t, d, g, verdict, check))
        print(f"  {case:16s} ple {t:9.2f} ms  demo {d:9.2f} ms" + (f"  gemms {g:8.2f} ms" if g else "")
              + f"  {verdict}  ({check})", flush=True)
        for variant, v in ms.items():
            rows.append(dict(benchmark="engram_cpu", case=f"{case} threads={torch.get_num_threads()}",
                             dtype="float32", variant=variant, ms=f"{v:.4f}", vs_reference=f"{d / v:.3f}"))
    print()
    print("| case | ple (torch) ms | demo ms | GEMMs ms | ratios and bars | outputs |")
    print("|---|---:|---:|---:|---|---|")
    for case, t, d, g, verdict, check in table:
        print(f"| {case} | {t:.2f} | {d:.2f} | {'-' if g is None else f'{g:.2f}'} | {verdict} | {check} |")
    if args.csv:
        import common
        env = common._env()
        common.append_csv(args.csv, [dict(env, bytes=0, gbps="", copy_gbps="", frac_copy="", vs_compiled="", **r)
                                     for r in rows], common.FIELDS)
    if missed:
        print(f"missed: {', '.join(missed)}")
    wrong = [case for case, *_, check in table if not check.startswith("within")]
    if wrong:
        print(f"outputs differ from the demo's: {', '.join(wrong)}")
    return 1 if wrong or (missed and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
