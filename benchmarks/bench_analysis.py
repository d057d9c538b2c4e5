"""``ple.analysis.ngram_stats`` over a Zipfian corpus: tokens/s, peak memory, and a plain Python ``Counter`` beside it.

The corpus: ``--tokens`` tokens (default 10M) drawn from a Zipf law of exponent ``--zipf`` (1.0) over the real
model's vocabulary (V 248,320; token ids a fixed random permutation of the ranks), cut into documents of
``--doc`` tokens (2,048), each ending in EOS, int32; the hash is the real model's
(``PLEConfig.preset("qwen4exp")``, PLE index 0: 16 heads of about 2e7 rows). Each variant runs in a fresh
process, so that its peak memory is its own:

* ``ple``: ``ngram_stats(config, documents)`` with ``documents`` an iterable of 1-D tensors (a generator over
  the rows of the corpus, which the process builds before its baseline), ``torch.set_num_threads(T)`` for each
  T of ``--threads`` (default ``2,1``). Peak memory: the increase of the resident set over the baseline taken
  after the imports and the corpus (``VmHWM`` after resetting it through ``/proc/self/clear_refs``, less the
  ``VmRSS`` then; ``ru_maxrss`` where the reset is refused).
* ``counter``: the same statistics in plain Python on the first ``--slice`` tokens (default 200,000): windows by
  the EOS rule in a loop, a ``collections.Counter`` of window tuples per order, the hash in Python ints, a
  ``Counter`` of rows per head; checked equal to ``ngram_stats`` of the same slice, field by field.

On a machine busy with other work, torch's OpenMP threads spinning between two parallel ops (the default wait
policy) can cost more than the work itself at 2 threads: ``--omp-passive`` runs the children with
``OMP_WAIT_POLICY=PASSIVE`` (threads sleep between ops), the rows' case says so.

Printed: a Markdown table (variant, threads, tokens, seconds, tokens/s, peak memory, x the Counter's tokens/s) and
the targets (``ple`` at 2 threads: >= 1M tokens/s, <= 2 GiB; ``--check`` exits 1 on a miss). A row per variant is
appended to the results CSV (``common.FIELDS``; benchmark ``ngram_stats``; ``bytes``: the peak memory increase;
``vs_reference``: the ratio of tokens/s to the Counter's).

    python benchmarks/bench_analysis.py                       # 10M tokens, threads 2 and 1
    python benchmarks/bench_analysis.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

TARGET_TOKENS_PER_S = 1e6
TARGET_PEAK_BYTES = 2 * 2**30


# ---- the child process -----------------------------------------------------------------------------------------
def zipf_corpus(config, tokens: int, doc: int, exponent: float, seed: int = 0):
    """``[tokens // doc, doc]`` int32 token ids: Zipfian ranks mapped through a random permutation, EOS last."""
    import torch

    V = config.vocab_size
    g = torch.Generator().manual_seed(seed)
    cdf = torch.arange(1, V + 1, dtype=torch.float64).pow(-exponent).cumsum(0)
    cdf /= cdf[-1].item()
    ids = torch.randperm(V, generator=g).to(torch.int32)
    docs = max(1, tokens // doc)
    corpus = torch.empty(docs, doc, dtype=torch.int32)
    for i in range(0, docs, 256):                                  # in pieces: no float64 copy of the corpus
        u = torch.rand(min(256, docs - i), doc, generator=g, dtype=torch.float64)
        corpus[i:i + 256] = ids[torch.searchsorted(cdf, u).clamp_(max=V - 1)]
    corpus[:, -1] = config.eos_token_id
    return corpus


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> tuple[int, bool]:
    """The resident set now, and whether the peak (VmHWM) could be reset to it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status("VmRSS"), True
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, False


def counter_stats(config, documents) -> list[dict]:
    """Every head's statistics in plain Python: a Counter of window tuples per order, rows per head."""
    from ple.reference import hash_params

    params = hash_params(config, 0)
    mult, sizes = params.multipliers.tolist(), params.head_sizes.tolist()
    N, P, eos = config.ngram_size, config.heads_per_ngram, config.eos_token_id
    grams = {n: Counter() for n in range(2, N + 1)}
    tokens = 0
    for doc in documents:
        history = [eos] * (N - 1)                                  # oldest first
        for tok in doc.tolist():
            window, seen = [tok], False                            # newest first; past an EOS, EOS
            for k in range(1, N):
                back = history[-k]
                window.append(eos if seen else back)
                seen = seen or back == eos
            for n in range(2, N + 1):
                grams[n][tuple(window[:n])] += 1
            history = history[1:] + [tok]
            tokens += 1
    heads = []
    for h in range(len(sizes)):
        n = h // P + 2
        per_row, occurrences = Counter(), Counter()
        for gram, count in grams[n].items():
            mix = 0
            for k, tok in enumerate(gram):
                mix ^= tok * mult[k]
            row = mix % sizes[h]
            per_row[row] += 1
            occurrences[row] += count
        shared = [r for r, c in per_row.items() if c >= 2]
        heads.append(dict(head=h, distinct=len(grams[n]), rows_hit=len(per_row), shared_rows=len(shared),
                          collided=sum(occurrences[r] for r in shared) / tokens if tokens else 0.0))
    return heads


def child(args) -> dict:
    import torch

    from ple import PLEConfig
    from ple.analysis.stats import ngram_stats

    torch.set_num_threads(args.threads_one)
    config = PLEConfig.preset("qwen4exp")
    corpus = zipf_corpus(config, args.tokens if args.variant == "ple" else args.slice, args.doc, args.zipf)
    baseline, reset = reset_peak()
    t0 = time.perf_counter()
    if args.variant == "ple":
        stats = ngram_stats(config, (row for row in corpus))
    else:
        heads = counter_stats(config, corpus)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = dict(variant=args.variant, threads=args.threads_one, tokens=corpus.numel(), seconds=seconds,
               peak_increase=peak - baseline, baseline_rss=baseline, peak_reset=reset,
               corpus_bytes=corpus.numel() * corpus.element_size())
    if args.variant == "ple":
        out["distinct"] = {str(h.order): h.distinct for h in stats.heads}
        out["table"] = stats.table()
    else:                                                          # the same numbers as ngram_stats
        want = ngram_stats(config, (row for row in corpus)).heads
        out["equal"] = all(all(getattr(w, k) == v for k, v in got.items()) for got, w in zip(heads, want,
                                                                                            strict=True))
    return out


# ---- the parent --------------------------------------------------------------------------------------------
def run(args, variant: str, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--threads-one", str(threads), "--tokens", str(args.tokens),
           "--doc", str(args.doc), "--zipf", str(args.zipf), "--slice", str(args.slice)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if args.omp_passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        raise RuntimeError(f"{variant} (threads {threads}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(results: list[dict]) -> tuple[str, list[str]]:
    counter = next(r for r in results if r["variant"] == "counter")
    base = counter["tokens"] / counter["seconds"]
    lines = ["| variant | threads | tokens | seconds | tokens/s | peak memory increase | x Counter |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rate = r["tokens"] / r["seconds"]
        lines.append(f"| {r['variant']} | {r['threads']} | {r['tokens']:,} | {r['seconds']:.2f} | {rate:,.0f} | "
                     f"{r['peak_increase'] / 2**20:,.0f} MiB | {rate / base:.1f} |")
    missed = []
    two = [r for r in results if r["variant"] == "ple" and r["threads"] == 2]
    for r in two:
        rate = r["tokens"] / r["seconds"]
        lines.append(f"\nple, 2 threads: {rate:,.0f} tokens/s (target >= {TARGET_TOKENS_PER_S:,.0f}), peak memory "
                     f"+{r['peak_increase'] / 2**30:.2f} GiB (target <= 2 GiB)")
        if rate < TARGET_TOKENS_PER_S:
            missed.append(f"{rate:,.0f} tokens/s")
        if r["peak_increase"] > TARGET_PEAK_BYTES:
            missed.append(f"peak memory +{r['peak_increase'] / 2**30:.2f} GiB")
    lines.append(f"Counter on the first {counter['tokens']:,} tokens: statistics equal to ngram_stats': "
                 f"{counter['equal']}")
    if not counter["equal"]:
        missed.append("the Counter's statistics differ")
    return "\n".join(lines), missed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=10_000_000, help="corpus tokens (default 10M)")
    ap.add_argument("--doc", type=int, default=2048, help="tokens per document (default 2048)")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent (default 1.0)")
    ap.add_argument("--threads", default="2,1", help="torch thread counts to time ple with (default 2,1)")
    ap.add_argument("--slice", type=int, default=200_000, help="tokens of the Counter variant (default 200,000)")
    ap.add_argument("--csv", default=None, help="CSV to append rows to (default: benchmarks/results/results.csv; "
                                                "'' for none)")
    ap.add_argument("--omp-passive", action="store_true",
                    help="run the children with OMP_WAIT_POLICY=PASSIVE (on a machine busy with other work)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--smoke", action="store_true", help="tiny: checks the script runs")
    ap.add_argument("--child", default=None, choices=["ple", "counter"], help=argparse.SUPPRESS)
    ap.add_argument("--threads-one", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.variant = args.child
        print(json.dumps(child(args)))
        return 0
    if args.smoke:
        args.tokens, args.doc, args.slice = 20_000, 512, 4_000
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common

    results = [run(args, "ple", int(t)) for t in args.threads.split(",") if t]
    results.append(run(args, "counter", 1))
    for r in results:
        print(f"{r['variant']:8s} threads {r['threads']}: {r['tokens']:,} tokens in {r['seconds']:.2f} s, peak "
              f"+{r['peak_increase'] / 2**20:,.0f} MiB", flush=True)
    table, missed = report(results)
    print(next(r["table"] for r in results if r["variant"] == "ple"))
    print("\n" + table)
    csv_path = common.RESULTS if args.csv is None else args.csv
    if csv_path:
        env = common._env()
        base = results[-1]["tokens"] / results[-1]["seconds"]
        rows = [dict(env, benchmark="ngram_stats",
                     case=f"T={r['tokens']} doc={args.doc} V=248320 zipf={args.zipf} threads={r['threads']}"
                          + (" omp=passive" if args.omp_passive else ""),
                     dtype="int32", variant=r["variant"], ms=f"{r['seconds'] * 1e3:.1f}", bytes=r["peak_increase"],
                     gbps="", copy_gbps="", frac_copy="", vs_reference=f"{r['tokens'] / r['seconds'] / base:.2f}",
                     vs_compiled="") for r in results]
        common.append_csv(csv_path, rows, common.FIELDS)
    return 1 if args.check and missed and not args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
