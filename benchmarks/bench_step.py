"""Benchmark ``PLELayer.step`` (a whole serving step of one layer) and ``PLELayer.forward``.

Cases: a prefill of T tokens, a decode batch of B requests, a spec batch of B
requests with 4 tokens each, and a mixed step (one prefill chunk + decodes + specs).
Variants: the layer on the Triton backend and on the reference backend.

    python benchmarks/bench_step.py                 # real widths (GPU)
    python benchmarks/bench_step.py --smoke --dtype float32
    python benchmarks/bench_step.py --backward      # forward + backward of PLELayer.forward (training)
    python benchmarks/bench_step.py --host          # µs of host time per step: schedule and step

``--host`` times what the host spends per serving step, for both backends: ``schedule``
(validation on the host, the plan, its one upload) and ``layer.step`` up to its return
(launches only on a GPU: the device is synchronised before and after, never inside). On
a CPU the step's host time is its whole time.
"""

from __future__ import annotations

import time

import common
import torch

import ple
from ple.state import Decode, PLECache, Prefill, Spec


def make_layer(cfg, backend, device, dtype):
    torch.manual_seed(0)
    layer = ple.PLELayer(cfg, backend=backend, device=device, dtype=dtype)
    with torch.no_grad():
        for p in (layer.norm_key.weight, layer.norm_query.weight, layer.norm_conv.weight, layer.conv1d.weight):
            p.normal_(0, 0.1)
    return layer


def step_variant(layer, cfg, kind, n, device, dtype, spec_len=4):
    """A zero-arg callable running one step of ``kind`` on fresh state (scheduling included)."""
    slots = n if kind != "prefill" else 1
    cache = PLECache(cfg, slots + 2, num_spec_tokens=spec_len - 1, num_layers=1, dtype=dtype, device=device)
    ids = list(range(2, 2 + slots))
    live = [cache.allocate() for _ in range(slots)]
    warm = cache.schedule([Prefill(s, [3, 4, 5]) for s in live])
    layer.step(torch.zeros(warm.num_tokens, cfg.hc_hidden_size, device=device, dtype=dtype), warm, cache)
    if kind == "prefill":
        items = [Prefill(live[0], [7] * n)]
    elif kind == "decode":
        items = [Decode(s, t) for s, t in zip(live, ids)]
    elif kind == "spec":
        items = [Spec(s, [t] * spec_len) for s, t in zip(live, ids)]
    else:                                   # mixed: a 512-token chunk, a third decodes, the rest spec
        items = [Prefill(live[0], [7] * 512)] + [
            Decode(s, 5) if i % 3 == 0 else Spec(s, [5] * spec_len) for i, s in enumerate(live[1:])]
    hidden = torch.randn(sum(len(getattr(i, "tokens", [0])) for i in items), cfg.hc_hidden_size,
                         device=device).to(dtype)

    saved = [slot.__dict__.copy() for slot in cache._slots]

    def schedule():
        # The step advances the cache's bookkeeping; put it back so the same items can run again.
        for slot, d in zip(cache._slots, saved):
            slot.__dict__.update(d)
        return cache.schedule(items)

    batch = schedule()                                  # scheduled once: the timing is the layer's step

    def run():
        schedule()
        batch.version, batch.layers_done = cache._version, set()
        layer.step(hidden, batch, cache)

    def host_step():
        """(µs in schedule, µs in layer.step until it returns) of one fresh step."""
        common.sync(device)
        t0 = time.perf_counter()
        b = schedule()
        t1 = time.perf_counter()
        layer.step(hidden, b, cache)
        t2 = time.perf_counter()
        common.sync(device)
        return (t1 - t0) * 1e6, (t2 - t1) * 1e6

    tokens = hidden.shape[0]
    return run, tokens, host_step


def host_times(args, layers, cfg, device, dtype, repeats) -> list[dict]:
    """µs of host time per step (median): decode R = 1, 64, 256 and a mixed step, both backends."""
    cases = [("decode", n) for n in common.ints(args.decode)] + [("mixed", n) for n in common.ints(args.mixed)]
    rows = []
    print(f"  {'case':28s} {'backend':10s} {'schedule µs':>12s} {'step µs':>12s}")
    for kind, n in cases:
        for name, layer in layers.items():
            if name not in args.variants.split(","):
                continue
            _, tokens, host_step = step_variant(layer, cfg, kind, n, device, dtype)
            sched, step = common.column_medians(host_step, repeats, warmup=2)
            case = f"{kind} n={n} T={tokens}"
            print(f"  {case:28s} {name:10s} {sched:12.1f} {step:12.1f}")
            for part, us in (("schedule", sched), ("step", step)):     # host milliseconds, one row a part
                rows.append(dict(common._env(), benchmark="layer_step_host", case=case,
                                 dtype=str(dtype).replace("torch.", ""), variant=f"{name}:{part}",
                                 ms=f"{us / 1e3:.4f}", bytes=0, gbps="", copy_gbps="", frac_copy="",
                                 vs_reference="", vs_compiled=""))
    if args.csv:
        common.append_csv(args.csv, rows, common.FIELDS)
    return rows


SIZES = {"--prefill": ("512,4096,16384", "9", "prefill token counts"),
         "--decode": ("1,64,256", "3", "decode batch sizes"),
         "--spec-batch": ("1,64,256", "2", "spec batch sizes (4 tokens each)"),
         "--mixed": ("64", "", "requests in the mixed step")}                      # (default, --smoke, help)


def main(argv=None):
    args, device, dtype, repeats, cfg = common.script(__doc__, argv, SIZES, lambda p: p.add_argument(
        "--host", action="store_true", help="µs of host time per step instead of device time"))
    layers = {"triton": make_layer(cfg, "triton", device, dtype)}
    layers["reference"] = make_layer(cfg, "reference", device, dtype)
    layers["reference"].load_state_dict(layers["triton"].state_dict())
    C, E = cfg.hc_hidden_size, cfg.ple_embed_dim
    isz = torch.empty(0, dtype=dtype).element_size()
    print(f"PLELayer: C={C} E={E} NH={cfg.num_ngram_heads} {dtype} on {device}; "
          f"copy bandwidth {common.copy_bandwidth(device, repeats):.1f} GB/s")
    rows = []
    if args.host:
        return host_times(args, layers, cfg, device, dtype, repeats)
    if args.backward:
        for T in common.ints(args.prefill):
            hidden = torch.randn(1, T, C, device=device).to(dtype).requires_grad_(True)
            ids = torch.randint(0, cfg.vocab_size, (1, T), device=device)
            grad = torch.randn_like(hidden)

            def fb(layer, hidden=hidden, ids=ids, grad=grad):
                def f():
                    out = layer(hidden, ids)
                    torch.autograd.grad(out, [hidden] + [q for q in layer.parameters()], grad)
                return f
            nbytes = T * isz * (6 * C + 2 * E) * 3 + sum(q.numel() for n, q in layers["triton"].named_parameters()
                                                         if "ngram" not in n) * isz * 2
            rows += common.run_case(args, "layer_forward_backward", f"T={T}", dtype, device, repeats,
                                    {k: fb(v) for k, v in layers.items()}, nbytes)
        return rows
    weights = (C * E + cfg.hidden_size * E) * isz
    cases = [("prefill", n) for n in common.ints(args.prefill)] + [("decode", n) for n in common.ints(args.decode)] \
        + [("spec", n) for n in common.ints(args.spec_batch)] + [("mixed", n) for n in common.ints(args.mixed)]
    for kind, n in cases:
        variants = {}
        for name, layer in layers.items():
            variants[name], tokens, _ = step_variant(layer, cfg, kind, n, device, dtype)
        # at least: the projection weights, each token's table rows, 6 [T, C] tensors, the conv states
        nbytes = weights + tokens * isz * (6 * C + 2 * E) + n * C * cfg.conv_state_len * isz * 2
        rows += common.run_case(args, "layer_step", f"{kind} n={n} T={tokens}", dtype, device, repeats,
                                variants, nbytes)
    return rows


if __name__ == "__main__":
    main()
