"""Data-parallel training with the PLE table sharded across ranks, on PyTorch's own engines.

    torchrun --nproc-per-node 2 examples/train_sharded.py                 # gloo on CPUs
    torchrun --nproc-per-node 8 examples/train_sharded.py --placement col # NCCL on GPUs (LOCAL_RANK)

The model is token embedding -> PLE layer -> RMS norm -> linear head, on the synthetic
n-gram language of ``examples/train_tiny.py``. The PLE table is a DTensor on a 1-D
DeviceMesh (``TableRowwise``: rows split across ranks, the memory win; ``--placement col``:
columns, transformers' TP layout), each rank trains on its own batches
(``input_layouts=Shard(0)``), and FSDP2 (``fully_shard``) shards every dense parameter over
the same ranks, the table left to DTensor (``ignored_params``). The table trains with
``ple.optim.RowwiseAdagrad``: each rank updates the rows (or columns) it holds, from the
lookups of every rank, and keeps their state (no dense gradient, nothing sized by the table
crosses the wire); the dense parameters with ``torch.optim.Adam`` beside it. Rank 0 prints
the loss of the first and the last step; the loss must fall (exit status 1 if it does not).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import ple
from ple.demo import int_at_least
from ple.distributed import dense_params, parallelize_tables


class TinyLM(nn.Module):
    def __init__(self, config: ple.PLEConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hc_hidden_size)
        self.ple = ple.PLELayer(config, 0)
        self.norm = nn.RMSNorm(config.hc_hidden_size)
        self.head = nn.Linear(config.hc_hidden_size, config.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The next-token loss of token rows ``x`` ``[B, L + 1]``."""
        ids = x[:, :-1]
        logits = self.head(self.norm(self.ple(self.embed(ids), ids)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int_at_least(1), default=40)
    p.add_argument("--batch", type=int_at_least(1), default=8, help="sequences per rank and step")
    p.add_argument("--placement", choices=["row", "col"], default="row")
    p.add_argument("--table-lr", type=float, default=0.3, help="RowwiseAdagrad's learning rate for the table")
    args = p.parse_args(argv)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_tiny import make_batch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
    config = ple.PLEConfig(vocab_size=48, hidden_size=32, hc_count=2, ple_embed_dim=32, heads_per_ngram=2,
                           ngram_size=3, ple_conv_kernel_size=2, ngram_vocab_size_base=3001,
                           make_ngram_vocab_size_divisible_by=16, eos_token_id=0, ple_layer_ids=[1])
    torch.manual_seed(0)                                     # the same initial weights on every rank
    model = TinyLM(config).to("cuda" if cuda else "cpu")
    parallelize_tables(model, mesh, args.placement, input_layouts=Shard(0))
    fully_shard(model, mesh=mesh, ignored_params={model.ple.table.weight})
    table_opt = ple.optim.RowwiseAdagrad(model.ple, lr=args.table_lr)   # each rank its rows and their state
    opt = torch.optim.Adam(dense_params(model), lr=3e-2)                # the rest, sharded by FSDP2
    gen = torch.Generator().manual_seed(1 + rank)           # each rank its own data
    losses = []
    for _ in range(args.steps):
        x = make_batch(gen, args.batch, 32, config.vocab_size, config.eos_token_id, 0.05).to(mesh.device_type)
        loss = model(x)
        loss.backward()                      # the table's gradient rows go to their owners here
        opt.step()
        table_opt.step()
        opt.zero_grad()
        table_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    t = model.ple.table.weight
    piece, shape = tuple(model.ple.table.weight.to_local().shape), tuple(model.ple.table.weight.shape)
    del model, opt, table_opt, t, mesh                       # the DTensors go before the process group does
    gc.collect()
    if rank == 0:
        print(f"{world} ranks, table {args.placement}-sharded ({piece} of {shape} "
              f"on rank 0) trained by RowwiseAdagrad, dense parameters under FSDP2")
        print(f"loss: step 1 {losses[0]:.3f} -> step {args.steps} {losses[-1]:.3f}")
    dist.destroy_process_group()
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())
