"""Benchmark the whole layer against the anchor users would pick: transformers' ``Qwen4ExpTextPLELayer``.

One run builds one random ``PLELayer`` (``ple.testing.layers.random_layer``), loads the same
weights into transformers' module, compares every variant's first call with the reference's
(printed: the output, and with ``backward`` the gradient of the hidden states, bit for bit or the
largest difference), then times, side by side on the same inputs:

* ``reference``: ``PLELayer`` on the reference backend (eager ``ple.reference``),
* ``compiled``: ``torch.compile`` of that layer (its ``forward``; ``layer.step`` for decode,
  compiled with ``dynamic=None`` so that the step counter stops causing recompiles),
* ``triton``: ``PLELayer`` on the Triton backend (``ple.fast``),
* ``transformers``: transformers' ``Qwen4ExpTextPLELayer`` (5.23), eager,
* ``transformers_compiled``: ``torch.compile`` of that module,

in three modes:

* ``forward``: ``layer(hidden, ids)`` over ``B`` whole sequences of ``L`` tokens under
  ``torch.no_grad()`` (transformers: ``hidden + module(hidden, ids, None)``, as its decoder
  layer adds it);
* ``backward``: that forward and ``torch.autograd.grad`` of its output with respect to the
  hidden states and every parameter (the table included, dense);
* ``decode``: one decode step of ``R`` one-token requests after a prefill of prompts of
  different lengths: ``layer.step(hidden, cache.schedule([Decode(slot, token), ...]), cache)``
  with a ``ple.state.PLECache`` (the host's ``schedule`` is timed too: a user pays it every
  step), against transformers' call in a decode step with its ``DynamicCache`` (prompts
  left-padded, as its model pads a batch).

Defaults: ``--seqs 1x4096,4x4096`` (B x L), ``--decode 1,64,256`` (R) after prompts of up to
``--prompt 32`` tokens, a table of ``ngram_vocab_size_base`` 100_000 (1.6M rows, 0.5 GB in bf16).
Each variant is timed by ``common.bench`` (median of ``--repeats``, after the checking call and
three warm-up calls; with ``--smoke`` none, or one when a compiled variant runs); the printed
ratios are ``x vs reference`` / ``x vs compiled`` per row and, in the closing table, every
variant against transformers eager and compiled. Rows (benchmark ``layer``, cases ``forward``,
``fwd+bwd`` and ``decode``) are appended to the results CSV.

    python benchmarks/bench_layer.py                  # real widths (GPU): C 10240, E 2560, bf16
    python benchmarks/bench_layer.py --smoke --dtype float32
    python benchmarks/bench_layer.py --modes decode --decode 1,64,256

Without transformers (``pip install transformers==5.23.0``; not in the dev extra) its two
variants are skipped with a note. ``--no-compile`` skips both compiled variants. On a CPU the
Triton kernels run interpreted, so only ``--smoke`` sizes are practical and the times only
show that the script runs.
"""

from __future__ import annotations

import copy
import os

import common
import torch

from ple.state import Decode, PLECache, Prefill
from ple.testing.layers import random_layer

VARIANTS = ("reference", "compiled", "triton", "transformers", "transformers_compiled")
MODES = ("forward", "backward", "decode")
COMPILED = ("compiled", "transformers_compiled")


def load_transformers():
    """``(Qwen4ExpTextConfig, Qwen4ExpTextPLELayer, DynamicCache)`` or None (a note printed) when missing."""
    import bench_decode_cpu

    tf = bench_decode_cpu.load_transformers()
    if tf is None:
        print(f"note: transformers is not installed (pip install transformers=={bench_decode_cpu.TRANSFORMERS_VERSION}"
              "); its variants are skipped")
    return tf


def build(cfg, tf, device, dtype, wanted):
    """The layers of every wanted variant, on the same weights: ``{name: module}`` (compiled ones wrap others)."""
    import bench_decode_cpu

    ref_layer = random_layer(cfg, dtype=dtype, backend="reference", device=device)
    layers = {"reference": ref_layer}
    if "triton" in wanted:                              # a copy: the same weights, built without a second draw
        layers["triton"] = copy.deepcopy(ref_layer)
        layers["triton"].set_backend("triton")
    if tf is not None and ({"transformers", "transformers_compiled"} & set(wanted)):
        with torch.device(device):                       # built where it runs: no CPU copy of the table
            module, tcfg = bench_decode_cpu.tf_layer(tf, cfg, ref_layer, dtype)
        layers["transformers"] = module
        layers["_tcfg"] = tcfg
    return layers


def maybe_compile(fn, args, name, dynamic=False):
    """``torch.compile(fn)`` for a compiled variant, or None when not wanted / unavailable."""
    if args.no_compile or name not in args.variants.split(","):
        return None
    try:
        common.allow_recompiles()
        return torch.compile(fn, dynamic=dynamic)
    except Exception as e:  # noqa: BLE001 - report, do not abort the benchmark
        print(f"  torch.compile unavailable for {name}: {type(e).__name__}: {e}")
        return None


def attempt(case, name, make):
    """``make()`` (a variant's setup: a prefill, a cache), or None with a printed note when it raises."""
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
        if os.environ.get("PLE_BENCH_DEBUG"):
            raise
        print(f"  {case:28s} {name:22s} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        return None


def diff_note(name, got, want) -> str:
    """``name: same bits`` or ``name: max |diff| x`` against the reference's output (a tuple: each part)."""
    if isinstance(got, tuple):
        return f"{name}: " + ", ".join(f"{part} {diff_note('', g, w)[2:]}"
                                       for part, g, w in zip(("output", "d hidden"), got, want))
    if torch.equal(got, want):
        return f"{name}: same bits"
    return f"{name}: max |diff| {(got.float() - want.float()).abs().max().item():.3g}"


def checked(case, fns):
    """Run each variant once, print how its output (and d hidden) compares with the reference's; drop those that
    fail."""
    results, notes, ok = {}, [], {}
    for name, fn in fns.items():
        if fn is None:
            continue
        try:
            got = fn()
            results[name] = tuple(t.detach() for t in got) if isinstance(got, tuple) else got.detach()
            ok[name] = fn
        except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
            if os.environ.get("PLE_BENCH_DEBUG"):
                raise
            print(f"  {case:28s} {name:22s} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    want = results.get("reference")
    for name, got in results.items():
        if name != "reference" and want is not None:
            notes.append(diff_note(name, got, want))
    if notes:
        print(f"  {case:28s} outputs vs reference: " + "; ".join(notes))
    return ok


def forward_case(args, cfg, layers, B, L, device, dtype, repeats, backward):
    C, E = cfg.hc_hidden_size, cfg.ple_embed_dim
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, L, C, generator=g).to(device, dtype).requires_grad_(backward)
    ids = torch.randint(0, cfg.vocab_size, (B, L), generator=g).to(device)
    grad = torch.randn(B, L, C, generator=g).to(device, dtype)

    def ple_fn(layer):
        return lambda: layer(hidden, ids)

    def tf_fn(module):
        return lambda: hidden + module(hidden, ids, None)

    def no_grad(fn):                                     # forward alone: inference, nothing recorded
        def run():
            with torch.no_grad():
                return fn()
        return run

    fns = {}
    for name in ("reference", "triton"):
        fns[name] = ple_fn(layers[name]) if name in layers else None
    compiled = maybe_compile(layers["reference"], args, "compiled")
    fns["compiled"] = ple_fn(compiled) if compiled is not None else None
    if "transformers" in layers:
        fns["transformers"] = tf_fn(layers["transformers"])
        tcomp = maybe_compile(layers["transformers"], args, "transformers_compiled")
        fns["transformers_compiled"] = tf_fn(tcomp) if tcomp is not None else None

    def with_grad(fn, module):
        params = [hidden] + [p for p in module.parameters()]

        def run():
            out = fn()
            grads = torch.autograd.grad(out, params, grad)
            return out, grads[0]                          # checked compares the output and d hidden
        return run

    if backward:
        owner = dict(reference=layers["reference"], compiled=layers["reference"], triton=layers.get("triton"),
                     transformers=layers.get("transformers"), transformers_compiled=layers.get("transformers"))
        fns = {k: with_grad(f, owner[k]) if f is not None else None for k, f in fns.items()}
    else:
        fns = {k: no_grad(f) if f is not None else None for k, f in fns.items()}
    case = f"{'fwd+bwd' if backward else 'forward'} B={B} L={L}"
    fns = checked(case, fns)
    T, isz = B * L, hidden.element_size()
    weights = (C * E + cfg.hidden_size * E + 3 * C + C * cfg.ple_conv_kernel_size) * isz
    # at least: the projection weights, each token's table rows, 6 [T, C] tensors (forward) ...
    nbytes = weights + T * isz * (6 * C + 2 * E)
    if backward:                                          # ... read again, gradients in and out
        nbytes = T * isz * (6 * C + 2 * E) * 3 + weights * 2
    return common.run_case(args, "layer", case, dtype, device, repeats, fns, nbytes, warmup=warmup(args))


class DecodeCase:
    """R requests prefilled in one implementation; ``step()`` runs one more decode step of all R."""

    def __init__(self, cfg, R, max_prompt, device, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        C = cfg.hc_hidden_size
        self.cfg, self.R, self.device, self.dtype = cfg, R, device, dtype
        self.lengths = torch.randint(max(1, max_prompt // 3), max_prompt + 1, (R,), generator=gen).tolist()
        self.prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in self.lengths]
        self.hidden_p = [torch.randn(n, C, generator=gen).to(device, dtype) for n in self.lengths]
        self.tokens = torch.randint(0, cfg.vocab_size, (R,), generator=gen)
        self.hidden = torch.randn(R, C, generator=gen).to(device, dtype)

    def ple(self, layer, step):
        """A decode-step callable of ``step`` (``layer.step`` or a compiled one) on its own prefilled cache."""
        cache = PLECache(self.cfg, self.R + 1, num_layers=1, dtype=self.dtype, device=self.device)
        slots = [cache.allocate() for _ in range(self.R)]
        batch = cache.schedule([Prefill(s, p) for s, p in zip(slots, self.prompts)])
        with torch.no_grad():
            layer.step(torch.cat(self.hidden_p), batch, cache)
        items = [Decode(s, t) for s, t in zip(slots, self.tokens.tolist())]

        def run():
            with torch.no_grad():
                return step(self.hidden, cache.schedule(items), cache)
        return run

    def transformers(self, tf, tcfg, module, call):
        """A decode-step callable of ``call`` (the module or a compiled one) on its own prefilled ``DynamicCache``."""
        R, C, L = self.R, self.cfg.hc_hidden_size, max(self.lengths)
        mask = torch.zeros(R, L, dtype=torch.long, device=self.device)
        ids = torch.full((R, L), self.cfg.eos_token_id, dtype=torch.long, device=self.device)
        hid = torch.zeros(R, L, C, dtype=self.dtype, device=self.device)
        for r, (n, p, h) in enumerate(zip(self.lengths, self.prompts, self.hidden_p)):
            mask[r, L - n:], ids[r, L - n:], hid[r, L - n:] = 1, torch.tensor(p, device=self.device), h
        cache = tf[2](config=tcfg)
        with torch.no_grad():
            module(hid, ids, cache, conv_mask=mask)
        hidden, tokens = self.hidden[:, None], self.tokens[:, None].to(self.device)

        def run():
            with torch.no_grad():                          # what Qwen4ExpTextDecoderLayer does in a decode step
                return (hidden + call(hidden, tokens, cache, conv_mask=None))[:, 0]
        return run


def decode_case(args, cfg, layers, tf, R, device, dtype, repeats):
    case = f"decode R={R}"
    inputs = DecodeCase(cfg, R, args.prompt, device, dtype)
    ref_layer = layers["reference"]
    fns = {"reference": inputs.ple(ref_layer, ref_layer.step)}
    if "triton" in layers:
        fns["triton"] = attempt(case, "triton", lambda: inputs.ple(layers["triton"], layers["triton"].step))
    # dynamic=None: the batch's version (a Python int that every schedule increments) becomes symbolic after
    # one recompile (a warm-up call); with dynamic=False every step would compile anew.
    step = maybe_compile(ref_layer.step, args, "compiled", dynamic=None)
    if step is not None:
        fns["compiled"] = attempt(case, "compiled", lambda: inputs.ple(ref_layer, step))
    if "transformers" in layers:
        module, tcfg = layers["transformers"], layers["_tcfg"]
        fns["transformers"] = attempt(case, "transformers", lambda: inputs.transformers(tf, tcfg, module, module))
        tcomp = maybe_compile(module, args, "transformers_compiled")
        if tcomp is not None:
            fns["transformers_compiled"] = attempt(case, "transformers_compiled",
                                                   lambda: inputs.transformers(tf, tcfg, module, tcomp))
    fns = checked(case, fns)                              # every variant's first decode step, from equal states
    C, E, isz = cfg.hc_hidden_size, cfg.ple_embed_dim, inputs.hidden.element_size()
    weights = (C + cfg.hidden_size) * E * isz
    # at least: the projection weights, the rows' table rows, 6 [R, C] tensors, the conv states read and written
    nbytes = weights + R * isz * (6 * C + 2 * E) + R * C * cfg.conv_state_len * isz * 2
    return common.run_case(args, "layer", case, dtype, device, repeats, fns, nbytes, warmup=warmup(args))


def warmup(args) -> int:
    """Warm-up calls before the timed ones, beyond the one ``checked`` makes: none with ``--smoke`` (the
    interpreted kernels are slow) unless a compiled variant runs (the compiled decode step recompiles once, on
    its second call); three on real sizes."""
    compiling = not args.no_compile and any(v in COMPILED for v in args.variants.split(","))
    return (1 if compiling else 0) if args.smoke else 3


def ratio_table(rows) -> str:
    """Markdown: per case, each variant's ms and how many times faster it is than transformers eager / compiled."""
    lines = ["| case | variant | ms | x vs transformers | x vs transformers_compiled | x vs reference |",
             "|---|---|---:|---:|---:|---:|"]
    by_case: dict = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["variant"]] = float(r["ms"])
    for case, ms in by_case.items():
        for name, t in ms.items():
            cells = [f"{ms[a] / t:.2f}" if a in ms else "-" for a in ("transformers", "transformers_compiled",
                                                                        "reference")]
            lines.append(f"| {case} | {name} | {t:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SIZES = {"--seqs": ("1x4096,4x4096", "2x9", "B x L shapes of forward / backward"),
         "--decode": ("1,64,256", "3", "requests per decode step"),
         "--prompt": (32, 6, "longest prompt of the prefill before decode")}      # (default, --smoke, help)


def _options(p):
    p.set_defaults(table_base=100_000, variants=",".join(VARIANTS))
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))


def main(argv=None):
    args, device, dtype, repeats, cfg = common.script(__doc__, argv, SIZES, _options)
    modes = ["backward"] if args.backward else [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES) | set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"bench_layer: unknown mode or variant {sorted(unknown)}")
    wanted = [v for v in args.variants.split(",") if not (args.no_compile and v in COMPILED)]
    tf = load_transformers() if {"transformers", "transformers_compiled"} & set(wanted) else None
    layers = build(cfg, tf, device, dtype, wanted)
    print(f"PLELayer vs transformers: C={cfg.hc_hidden_size} E={cfg.ple_embed_dim} NH={cfg.num_ngram_heads} "
          f"table base {cfg.ngram_vocab_size_base} {dtype} on {device}; "
          f"copy bandwidth {common.copy_bandwidth(device, repeats):.1f} GB/s")
    rows = []
    for mode in modes:
        if mode == "decode":
            for R in common.ints(args.decode):
                rows += decode_case(args, cfg, layers, tf, R, device, dtype, repeats)
            continue
        for shape in args.seqs.split(","):
            B, L = (int(v) for v in shape.lower().split("x"))
            rows += forward_case(args, cfg, layers, B, L, device, dtype, repeats, backward=mode == "backward")
    if rows:
        print(ratio_table(rows))
    return rows


if __name__ == "__main__":
    main()
