"""``python -m ple demo``: the layer at a glance, then a serving simulation checked token by token.

1. Builds a preset with random weights and prints the config, parameter counts,
   per-stream gate statistics and output norms of a forward pass.
2. Simulates serving: requests arrive and finish, prompts are prefilled in chunks,
   then decode and speculative steps with random acceptance run, and slots are
   reused. Every accepted token's output is checked against a whole-sequence
   forward, and every live conv state bit for bit after every step.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from .backends import resolve_backend
from .config import PLEConfig
from .layer import PLELayer
from .reference.gate import stream_gates
from .state import PLECache
from .testing.serving import check_replay, random_script, replay

__all__ = ["main"]

SIZES = {
    # name: (preset, overrides, requests, max live, max prompt, max chunk, max generate)
    "tiny": ("tiny", {}, 12, 4, 40, 16, 12),
    "small": ("tiny", dict(hidden_size=256, hc_count=4, ple_embed_dim=256, heads_per_ngram=8,
                           ngram_vocab_size_base=50_000), 24, 8, 256, 64, 32),
}


MAX_LAYERS = 8


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an int in ``[minimum, maximum]``; anything else is one ``error:`` line, exit 2."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            span = f"at least {minimum}" if maximum is None else f"in {minimum}..{maximum}"
            raise argparse.ArgumentTypeError(f"expected an integer {span}, got {value}")
        return value
    return parse


def _parser(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser("demo", help="build a layer and simulate serving, checked against forward",
                       description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model size (default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and traffic (default: 0)")
    p.add_argument("--requests", type=int_at_least(1), default=None, help="requests to serve (default: by size)")
    p.add_argument("--steps", type=int_at_least(1), default=None, help="stop after this many steps (default: all)")
    p.add_argument("--spec", type=int_at_least(0), default=3,
                   help="speculative tokens per step, 0 for none (default: 3)")
    p.add_argument("--layers", type=int_at_least(1, MAX_LAYERS), default=2,
                   help=f"PLE layers stacked, 1..{MAX_LAYERS} (default: 2)")
    p.add_argument("--backend", choices=["auto", "reference", "torch", "triton"], default="auto",
                   help="ops to run on (default: auto = Triton on CUDA, else torch; triton on a CPU "
                        "needs TRITON_INTERPRET=1)")
    p.add_argument("--threads", type=int_at_least(0), default=1,
                   help="CPU threads for torch (default: 1, fastest at these sizes; 0 = torch's default)")
    p.set_defaults(func=main)


def _gate_stats(layer: PLELayer, hidden: torch.Tensor, ids: torch.Tensor) -> list[str]:
    """Per-stream statistics of the gate g (0.5 = indifferent) over a forward pass's tokens."""
    cfg = layer.config
    B, L, C = hidden.shape
    query_start_loc = torch.arange(B + 1, device=hidden.device) * L
    with torch.no_grad():
        hid = layer.ops.ngram_ids(ids.reshape(-1), layer.ple_embedding.hash_params(),
                                  heads_per_ngram=cfg.heads_per_ngram, eos_token_id=cfg.eos_token_id,
                                  query_start_loc=query_start_loc)
        key, _ = layer.project(layer.embed(hid, hidden.dtype))
        g = stream_gates(key, hidden.reshape(B * L, C), layer.norm_key.weight, layer.norm_query.weight,
                         cfg.hidden_size, cfg.gate_eps(key.dtype), unit_offset=cfg.family != "engram")
    lines = []
    for m in range(cfg.hc_count):
        gm = g[:, m].float()
        lines.append(f"  stream {m}: gate mean {gm.mean():.3f}  std {gm.std():.3f}  "
                     f"min {gm.min():.3f}  max {gm.max():.3f}")
    return lines


def main(args: argparse.Namespace) -> int:
    preset, overrides, n_req, max_live, max_prompt, max_chunk, max_gen = SIZES[args.size]
    try:
        config = PLEConfig.preset(preset, **overrides, ple_layer_ids=tuple(range(1, args.layers + 1)))
        backend, _ = resolve_backend(args.backend)
    except (ValueError, TypeError) as e:
        print(f"python -m ple demo: error: {e}", file=sys.stderr)
        return 2
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    if device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)   # small matmuls: extra threads only add contention
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    layers = [PLELayer(config, i, backend=backend, device=device) for i in range(args.layers)]
    with torch.no_grad():                 # the model starts norms and conv at zero; wake them up
        for layer in layers:
            for norm in (layer.norm_key, layer.norm_query, layer.norm_conv):
                norm.weight.normal_(0, 0.3)
            layer.conv1d.weight.normal_(0, 0.5)
    build = time.perf_counter() - t0

    print(f"ple demo: size={args.size} backend={backend} device={device} seed={args.seed}")
    print(f"config: {config}")
    c = config
    print(f"sizes: C={c.hc_hidden_size} (M={c.hc_count} x H={c.hidden_size})  E={c.ple_embed_dim}  "
          f"NH={c.num_ngram_heads} x D={c.ngram_head_dim}  K={c.ple_conv_kernel_size}  d={c.conv_dilation}  "
          f"S={c.conv_state_len}")
    layer = layers[0]
    counts = {name: p.numel() for name, p in layer.named_parameters()}
    print(f"parameters per layer: {sum(counts.values()):,}")
    for name, n in counts.items():
        print(f"  {name:40s} {n:>12,}")

    B, L = 2, 48
    hidden = torch.randn(B, L, c.hc_hidden_size, device=device)
    ids = torch.randint(0, c.vocab_size, (B, L), device=device)
    ids[:, L // 2] = c.eos_token_id
    t1 = time.perf_counter()
    with torch.no_grad():
        out = layer(hidden, ids)
    fwd = time.perf_counter() - t1
    print(f"forward of [{B}, {L}, {c.hc_hidden_size}] in {fwd * 1e3:.1f} ms; gate per stream:")
    print("\n".join(_gate_stats(layer, hidden, ids)))
    print(f"  |hidden| {hidden.norm(dim=-1).mean():.2f}   |out - hidden| {(out - hidden).norm(dim=-1).mean():.2f}"
          f"   |out| {out.norm(dim=-1).mean():.2f}  (mean row norms)")

    rng = random.Random(args.seed)
    script = random_script(rng, vocab_size=c.vocab_size, eos_token_id=c.eos_token_id,
                           num_requests=args.requests or n_req, max_live=max_live, max_prompt=max_prompt,
                           max_chunk=max_chunk, max_generate=max_gen, num_spec_tokens=args.spec)
    if args.steps is not None:
        script = script[: args.steps]
    cache = PLECache(config, max_live + 1, num_spec_tokens=args.spec, num_layers=args.layers, device=device)
    print(f"\nserving {args.requests or n_req} requests through {args.layers} PLE layer(s), "
          f"{max_live} slots, up to {args.spec} speculative tokens per step")
    print(f"{'step':>5} {'prefill':>8} {'decode':>7} {'spec':>5} {'tokens':>7} {'live':>5} {'ms':>8}")

    def on_step(i, batch, seconds):
        if i < 8 or i % 10 == 0:
            print(f"{i:>5} {batch.num_prefills:>8} {batch.num_decodes:>7} {batch.num_spec_decodes:>5} "
                  f"{batch.num_tokens:>7} {len(cache.active_slots()):>5} {seconds * 1e3:>8.2f}")

    result = replay(layers, cache, script, generator=torch.Generator().manual_seed(args.seed),
                    on_step=on_step)
    err = check_replay(layers, result)
    tokens = sum(s["tokens"] for s in result.steps)
    accepted = sum(len(t) for t in result.tokens.values())
    step_time = sum(s["seconds"] for s in result.steps)
    print(f"\nrequests {len(result.tokens)} (finished {len(result.finished)}), steps {len(result.steps)}, "
          f"tokens {tokens} ({accepted} accepted)")
    print(f"largest |step - forward| over accepted tokens: {err:.3g}; conv states checked bit for bit "
          f"{result.state_checks} times")
    print(f"throughput: {tokens / step_time:,.0f} tokens/s in layer steps "
          f"({step_time:.2f} s of steps, build {build:.2f} s, total {time.perf_counter() - t0:.2f} s)")
    print("OK")
    return 0
