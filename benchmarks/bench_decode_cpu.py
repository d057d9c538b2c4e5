"""A CPU decode step of ``PLELayer`` (reference backend) beside transformers' own ``Qwen4ExpTextPLELayer``.

The goal: a 64-request decode on a CPU at least 2x faster than transformers' batched
decode of the same layer. One run builds one random layer at the real model's widths (a small
table: ``ngram_vocab_size_base`` 20_000), loads the same weights into both, prefills R requests
of different lengths (left-padded for transformers, as its model pads a batch), checks that one
decode step gives the same outputs (bfloat16: bit for bit; float32: within 1e-5), then times
further decode steps of R one-token requests.

* ``transformers``: ``hidden + module(hidden[:, None], ids[:, None], cache, conv_mask=None)``, as
  ``Qwen4ExpTextDecoderLayer`` calls it in a decode step, with the model's ``DynamicCache`` (its
  linear-attention layer keeps the PLE conv state and the n-gram context as conv states 1 and 2).
* ``reference``: ``layer.step(hidden, batch, cache)`` with a ``ple.state.PLECache``;
  ``reference+schedule`` adds the ``cache.schedule([Decode(slot, token), ...])`` that builds the batch.

    pip install transformers==5.23.0            # not in the dev extra
    python benchmarks/bench_decode_cpu.py        # R = 1, 64, 256; float32 and bfloat16; default and 1 thread
    python benchmarks/bench_decode_cpu.py --smoke
    python benchmarks/bench_decode_cpu.py --decode 64 --dtype bfloat16 --profile

Without transformers, ``--smoke`` times ``ple`` alone and says so; a full run exits with an error.
``--variants``, ``--no-compile`` and ``--backward`` of the shared parser do not apply here.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import common
import torch

from ple.state import Decode, PLECache, Prefill
from ple.testing.layers import random_layer

TRANSFORMERS_VERSION = "5.23.0"
DEFAULT_THREADS = torch.get_num_threads()


def load_transformers():
    """``(Qwen4ExpTextConfig, Qwen4ExpTextPLELayer, DynamicCache)`` or None when transformers is missing."""
    try:
        import transformers
        from transformers import DynamicCache
        from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
        from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer
    except ImportError:
        return None
    if transformers.__version__ != TRANSFORMERS_VERSION:
        print(f"note: transformers {transformers.__version__} installed; the anchor is {TRANSFORMERS_VERSION}")
    return Qwen4ExpTextConfig, Qwen4ExpTextPLELayer, DynamicCache


def tf_layer(tf, cfg, ple_layer, dtype):
    """transformers' PLE module of PLE index 0 for ``cfg``, holding ``ple_layer``'s weights, and its config."""
    config_cls, module_cls, _ = tf
    num_layers = max(cfg.ple_layer_ids)
    tcfg = config_cls(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, hc_count=cfg.hc_count,
                      ple_embed_dim=cfg.ple_embed_dim, ple_conv_kernel_size=cfg.ple_conv_kernel_size,
                      ngram_size=cfg.ngram_size, heads_per_ngram=cfg.heads_per_ngram,
                      ngram_vocab_size_base=cfg.ngram_vocab_size_base,
                      make_ngram_vocab_size_divisible_by=cfg.make_ngram_vocab_size_divisible_by,
                      seed=cfg.seed, eos_token_id=cfg.eos_token_id, rms_norm_eps=cfg.rms_norm_eps,
                      ple_layer_ids=list(cfg.ple_layer_ids), num_hidden_layers=num_layers,
                      layer_types=["linear_attention"] * num_layers)
    module = module_cls(tcfg, cfg.ple_layer_ids[0] - 1, 0).to(dtype)
    module.load_state_dict(ple_layer.state_dict(), strict=True)
    return module.eval(), tcfg


class Case:
    """R requests prefilled in both implementations; ``decode_*`` run one more decode step of all R."""

    def __init__(self, cfg, layer, tf, tfm, tcfg, R, max_prompt, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        C, eos = cfg.hc_hidden_size, cfg.eos_token_id
        lengths = torch.randint(max(1, max_prompt // 3), max_prompt + 1, (R,), generator=gen).tolist()
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
        hidden_p = [torch.randn(n, C, generator=gen).to(dtype) for n in lengths]
        self.tokens = torch.randint(0, cfg.vocab_size, (R,), generator=gen)
        self.hidden = torch.randn(R, C, generator=gen).to(dtype)
        self.layer, self.tfm = layer, tfm
        self.cache = PLECache(cfg, R + 1, num_layers=1, dtype=dtype)
        self.slots = [self.cache.allocate() for _ in range(R)]
        batch = self.cache.schedule([Prefill(s, p) for s, p in zip(self.slots, prompts)])
        self.prefill_out = layer.step(torch.cat(hidden_p), batch, self.cache)
        if tfm is None:
            return
        L = max(lengths)                                   # left-padded, as transformers pads a batch
        mask = torch.zeros(R, L, dtype=torch.long)
        ids = torch.full((R, L), eos, dtype=torch.long)
        hid = torch.zeros(R, L, C, dtype=dtype)
        for r, (n, p, h) in enumerate(zip(lengths, prompts, hidden_p)):
            mask[r, L - n:], ids[r, L - n:], hid[r, L - n:] = 1, torch.tensor(p), h
        self.tf_cache = tf[2](config=tcfg)
        with torch.no_grad():
            out = hid + tfm(hid, ids, self.tf_cache, conv_mask=mask)
        self.tf_prefill_out = torch.cat([out[r, L - n:] for r, n in enumerate(lengths)])
        self.tf_hidden, self.tf_ids = self.hidden[:, None], self.tokens[:, None]

    def decode_tf(self):
        with torch.no_grad():                              # what Qwen4ExpTextDecoderLayer does in a decode step
            return self.tf_hidden + self.tfm(self.tf_hidden, self.tf_ids, self.tf_cache, conv_mask=None)

    def schedule(self):
        return self.cache.schedule([Decode(s, t) for s, t in zip(self.slots, self.tokens.tolist())])

    def decode_ple(self, batch=None):
        return self.layer.step(self.hidden, self.schedule() if batch is None else batch, self.cache)


def compare(name, a, b, dtype) -> str:
    """``same bits`` / ``max |diff| x`` and whether it meets the bar (bf16: bit for bit; fp32: 1e-5)."""
    diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    same = torch.equal(a, b)
    ok = same if dtype != torch.float32 else diff <= 1e-5
    return f"{name}: {'same bits' if same else f'max abs diff {diff:.3g}'} ({'OK' if ok else 'MISMATCH'})"


def medians(fn, repeats, budget_s):
    """Column medians of ``fn()`` (a tuple of ms, the last the total): one warm-up call, then ``repeats`` calls,
    stopping early once ``budget_s`` has passed. A warm-up call slower than the budget is the only sample."""
    out, start = [], time.perf_counter()
    for i in range(repeats + 1):
        out.append(fn())
        if time.perf_counter() - start > budget_s and (i > 0 or out[0][-1] > budget_s * 1e3):
            break
    return [statistics.median(col) for col in zip(*(out[1:] or out))]


def ms_of(fn):
    """``fn`` timed: a zero-arg callable returning ``(ms,)``."""
    def run():
        t0 = time.perf_counter()
        fn()
        return ((time.perf_counter() - t0) * 1e3,)
    return run


def ple_parts(case):
    """One more ple decode step: ``(schedule ms, step ms, total ms)``."""
    t0 = time.perf_counter()
    batch = case.schedule()
    t1 = time.perf_counter()
    case.decode_ple(batch)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t2 - t0) * 1e3


def profile(case, out=sys.stdout):
    """A ``torch.profiler`` table of one ple decode step (schedule included)."""
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    case.decode_ple()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("schedule"):
            batch = case.schedule()
        with record_function("step"):
            case.decode_ple(batch)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=out)


def main(argv=None):
    p = common.parser(__doc__.splitlines()[0])
    common.add_model_args(p)
    p.set_defaults(table_base=20_000, dtype=None)
    p.add_argument("--decode", default="1,64,256", help="requests per decode step")
    p.add_argument("--prompt", type=int, default=12, help="longest prompt of the prefill (shortest: a third)")
    p.add_argument("--threads", default=f"{DEFAULT_THREADS},1", help="torch.set_num_threads values to time")
    p.add_argument("--budget", type=float, default=20.0, help="seconds to stop repeating a variant after")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of one ple step")
    args = p.parse_args(argv)
    repeats = args.repeats or (2 if args.smoke else 20)
    dtypes = [getattr(torch, args.dtype)] if args.dtype else [torch.float32, torch.bfloat16]
    threads = [DEFAULT_THREADS] if args.smoke else common.ints(args.threads)
    if args.smoke:
        args.decode, args.prompt = "8", 6
    cfg = common.model_config(args)
    tf = load_transformers()
    if tf is None:
        msg = f"transformers is not installed (pip install transformers=={TRANSFORMERS_VERSION})"
        if not args.smoke:
            raise SystemExit(f"{msg}: it is what this benchmark compares against")
        print(f"{msg}; --smoke times ple alone")
    device = torch.device("cpu")
    copy = common.copy_bandwidth(device, repeats)
    print(f"PLELayer decode on {common._env()['device']}: C={cfg.hc_hidden_size} E={cfg.ple_embed_dim} "
          f"NH={cfg.num_ngram_heads} table base {cfg.ngram_vocab_size_base}; torch {torch.__version__}, "
          f"default threads {DEFAULT_THREADS}; copy bandwidth {copy:.1f} GB/s")
    rows, table, env = [], [], common._env()
    for dtype in dtypes:
        layer = random_layer(cfg, dtype=dtype, backend="reference")
        tfm, tcfg = tf_layer(tf, cfg, layer, dtype) if tf else (None, None)
        isz = torch.empty(0, dtype=dtype).element_size()
        weights = (cfg.hc_hidden_size + cfg.hidden_size) * cfg.ple_embed_dim * isz
        for R in common.ints(args.decode):
            case = Case(cfg, layer, tf, tfm, tcfg, R, args.prompt, dtype)
            check = "transformers not installed"
            if tfm is not None:                              # the first decode step: the one checked
                check = compare("prefill", case.prefill_out, case.tf_prefill_out, dtype) + "; " + compare(
                    "decode", case.decode_ple(), case.decode_tf()[:, 0], dtype)
            print(f"  {str(dtype)[6:]:8s} R={R:<4d} {check}")
            for n in threads:
                torch.set_num_threads(n)
                ms = {}
                if tfm is not None:
                    (ms["transformers"],) = medians(ms_of(case.decode_tf), repeats, args.budget)
                sched, ms["reference"], ms["reference+schedule"] = medians(functools.partial(ple_parts, case), repeats,
                                                                           args.budget)
                table.append((str(dtype)[6:], R, n, ms.get("transformers"), ms["reference"], sched,
                              ms["reference+schedule"], check))
                # at least: the projection weights, the rows' table rows, 6 [R, C] tensors, the conv states
                nbytes = weights + R * isz * (6 * cfg.hc_hidden_size + 2 * cfg.ple_embed_dim) \
                    + R * cfg.hc_hidden_size * cfg.conv_state_len * isz * 2
                for variant, t in ms.items():
                    gbps = nbytes / (t * 1e-3) / 1e9
                    rows.append(dict(env, benchmark="decode_cpu", case=f"decode R={R} threads={n}",
                                     dtype=str(dtype)[6:], variant=variant, ms=f"{t:.4f}", bytes=nbytes,
                                     gbps=f"{gbps:.2f}", copy_gbps=f"{copy:.1f}", frac_copy=f"{gbps / copy:.3f}",
                                     vs_reference=f"{ms['reference'] / t:.2f}", vs_compiled=""))
            torch.set_num_threads(DEFAULT_THREADS)
        if args.profile:
            profile(case)
    print(markdown(table))
    if args.csv:
        common.append_csv(args.csv, rows, common.FIELDS)
    return rows


def markdown(table) -> str:
    lines = ["| dtype | R | threads | transformers ms | ple step ms | ple schedule ms | ple step+schedule ms "
             "| x (transformers / ple step) | x (transformers / ple step+schedule) | same outputs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for dtype, R, n, tf_ms, step, sched, total, check in table:
        tf_cell = f"{tf_ms:.3f}" if tf_ms is not None else "-"
        x1 = f"{tf_ms / step:.2f}" if tf_ms is not None else "-"
        x2 = f"{tf_ms / total:.2f}" if tf_ms is not None else "-"
        lines.append(f"| {dtype} | {R} | {n} | {tf_cell} | {step:.3f} | {sched:.3f} | {total:.3f} | {x1} | {x2} "
                     f"| {check} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
    sys.exit(0)
