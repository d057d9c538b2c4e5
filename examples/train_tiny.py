"""Train a tiny next-token model with and without a PLE layer on an n-gram language.

The synthetic language: each next token is a fixed function of the previous two
tokens (``(a * x[t] + b * x[t-1] + c) mod V``), replaced by a random token with
probability ``--noise``; an EOS token now and then starts a new sentence. A model
that sees only the current token cannot do better than guessing among V
candidates; the PLE layer hashes each token's bigram (and trigram) window into
its table, so the model can look the answer up.

Both models: token embedding -> [PLE layer] -> RMS norm -> linear head. The no-PLE
twin is the same model without the PLE layer. The PLE layer's table trains with a row optimizer
(``ple.optim.RowwiseAdagrad``: only the rows a step looked up, state one float a row); everything
else with ``torch.optim.Adam``. Usage::

    python examples/train_tiny.py                      # ~300 steps, both models, prints both losses
    python examples/train_tiny.py --table-optimizer adam   # the table in torch.optim.Adam too (dense)
    python examples/train_tiny.py --backend triton     # the fast layer (TRITON_INTERPRET=1 on a CPU)
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch import nn

import ple
from ple._progress import progress
from ple.demo import int_at_least


def make_batch(gen: torch.Generator, batch: int, length: int, vocab: int, eos: int, noise: float) -> torch.Tensor:
    """``[batch, length + 1]`` token ids of the synthetic language."""
    a, b, c = 5, 11, 3
    x = torch.empty(batch, length + 1, dtype=torch.int64)
    x[:, 0] = eos
    x[:, 1] = torch.randint(0, vocab, (batch,), generator=gen)
    for t in range(2, length + 1):
        nxt = (a * x[:, t - 1] + b * x[:, t - 2] + c) % vocab
        rand = torch.randint(0, vocab, (batch,), generator=gen)
        flip = torch.rand(batch, generator=gen) < noise
        x[:, t] = torch.where(flip, rand, nxt)
        restart = torch.rand(batch, generator=gen) < 0.02
        x[:, t] = torch.where(restart, torch.full_like(x[:, t], eos), x[:, t])
    return x


class TinyLM(nn.Module):
    def __init__(self, config: ple.PLEConfig, use_ple: bool, backend: str):
        super().__init__()
        C = config.hc_hidden_size
        self.embed = nn.Embedding(config.vocab_size, C)
        self.ple = ple.PLELayer(config, backend=backend) if use_ple else None
        self.norm = nn.RMSNorm(C)
        self.head = nn.Linear(C, config.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)                               # [B, L, C]
        if self.ple is not None:
            h = self.ple(h, ids)
        return self.head(self.norm(h))                    # [B, L, V]


def optimizers(model: TinyLM, args) -> list[torch.optim.Optimizer]:
    """The table in a row optimizer (``ple.optim``), the rest in Adam; or everything in Adam."""
    if model.ple is None or args.table_optimizer == "adam":
        return [torch.optim.Adam(model.parameters(), lr=args.lr)]
    table = model.ple.table.weight
    rest = [p for p in model.parameters() if p is not table]
    return [ple.optim.RowwiseAdagrad(model.ple, lr=args.table_lr), torch.optim.Adam(rest, lr=args.lr)]


def next_token_loss(model: TinyLM, x: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``x[:, 1:]`` from ``x[:, :-1]`` (``x``: ``[batch, length + 1]`` ids)."""
    logits = model(x[:, :-1])                             # [B, L, V]
    return nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def train_step(model: TinyLM, opts: list[torch.optim.Optimizer], x: torch.Tensor) -> float:
    """One step of every optimizer on the next-token loss of ``x`` (``[batch, length + 1]``); returns the loss."""
    loss = next_token_loss(model, x)
    for opt in opts:
        opt.zero_grad()
    loss.backward()
    for opt in opts:
        opt.step()
    return loss.item()


def train(use_ple: bool, args, config: ple.PLEConfig) -> list[float]:
    torch.manual_seed(args.seed)
    model = TinyLM(config, use_ple, args.backend)
    opts = optimizers(model, args)
    gen = torch.Generator().manual_seed(args.seed + 1)
    losses = []
    for _ in progress(range(args.steps), desc="with PLE" if use_ple else "without PLE"):
        x = make_batch(gen, args.batch, args.length, config.vocab_size, config.eos_token_id, args.noise)
        losses.append(train_step(model, opts, x))
    return losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int_at_least(1), default=300, help="optimizer steps per model (default: 300)")
    p.add_argument("--batch", type=int_at_least(1), default=32, help="sequences per batch (default: 32)")
    p.add_argument("--length", type=int_at_least(2), default=32, help="tokens per sequence (default: 32)")
    p.add_argument("--noise", type=float, default=0.1, help="chance a token breaks the rule (default: 0.1)")
    p.add_argument("--lr", type=float, default=3e-2, help="Adam learning rate (default: 0.03)")
    p.add_argument("--table-optimizer", choices=["rowwise-adagrad", "adam"], default="rowwise-adagrad",
                   help="the PLE table's optimizer: ple.optim.RowwiseAdagrad (default) or Adam with the rest")
    p.add_argument("--table-lr", type=float, default=0.3, help="RowwiseAdagrad's learning rate (default: 0.3)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data (default: 0)")
    p.add_argument("--backend", choices=["reference", "torch", "triton", "auto"], default="auto",
                   help="ops of the PLE layer (default: auto = Triton on CUDA, else torch; triton on a CPU "
                        "needs TRITON_INTERPRET=1)")
    p.add_argument("--threads", type=int_at_least(0), default=1, help="torch CPU threads (default: 1)")
    args = p.parse_args(argv)
    if not 0 <= args.noise <= 1:
        p.error(f"argument --noise: expected a probability in [0, 1], got {args.noise}")
    try:
        ple.backends.resolve_backend(args.backend)
    except ValueError as e:
        p.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    config = ple.PLEConfig(vocab_size=48, hidden_size=32, hc_count=2, ple_embed_dim=32, heads_per_ngram=2,
                           ngram_size=3, ple_conv_kernel_size=2, ngram_vocab_size_base=3001,
                           make_ngram_vocab_size_divisible_by=16, eos_token_id=0, ple_layer_ids=[1])
    window = max(1, args.steps // 10)
    results = {}
    for use_ple in (False, True):
        t0 = time.perf_counter()
        losses = train(use_ple, args, config)
        name = "with PLE" if use_ple else "without PLE"
        final = sum(losses[-window:]) / window
        results[use_ple] = final
        print(f"{name:12s}: loss {losses[0]:.3f} -> {final:.3f} (mean of the last {window} steps), "
              f"{time.perf_counter() - t0:.1f} s")
    V, eps = config.vocab_size, args.noise
    p_hit, p_other = 1 - eps + eps / V, eps / V          # the rule's token, and each of the others
    entropy = -p_hit * math.log(p_hit) - (V - 1) * p_other * math.log(p_other) if eps > 0 else 0.0
    print(f"uniform guess: {math.log(V):.3f}; the language's entropy (ignoring restarts): {entropy:.3f}")
    better = results[True] < results[False]
    print("PLE model beats its no-PLE twin" if better else "PLE model did NOT beat its no-PLE twin")
    return 0 if better else 1


if __name__ == "__main__":
    sys.exit(main())
