"""An oracle of DeepSeek's Engram demo module, written for these tests from the formulas of its demo
(engram_demo_v1.py; docs/engram.md maps its names to ple's): the same submodule names, so its
``state_dict`` has the demo's keys, and its arithmetic done the demo's way (numpy hashing on the host,
one ``nn.Linear`` and ``nn.RMSNorm`` per stream, an ``nn.Conv1d`` padded and cut to be causal).

It reads nothing of ``ple`` but the `PLEConfig` fields it is given, so ple's hash parameters, windows,
projections, norms and conv are all checked against an independent computation.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn


def _prime(n: int) -> bool:
    if n < 2:
        return False
    f = 2
    while f * f <= n:
        if n % f == 0:
            return False
        f += 1
    return True


def demo_multipliers(token_vocab: int, order: int, seed: int, layer_id: int) -> np.ndarray:
    bound = max(1, (np.iinfo(np.int64).max // token_vocab) // 2)
    draw = np.random.default_rng(int(seed + 10007 * layer_id)).integers(0, bound, size=(order,), dtype=np.int64)
    return draw * 2 + 1


def demo_head_sizes(starts, heads: int, layer_ids) -> dict[int, list[int]]:
    taken: set[int] = set()
    out = {}
    for lid in layer_ids:
        sizes = []
        for start in starts:
            at = start - 1
            for _ in range(heads):
                cand = at + 1
                while cand in taken or not _prime(cand):
                    cand += 1
                taken.add(cand)
                sizes.append(cand)
                at = cand
        out[lid] = sizes
    return out


class _Table(nn.Module):
    def __init__(self, sizes: list[int], dim: int) -> None:
        super().__init__()
        self.register_buffer("offsets", torch.tensor(np.cumsum([0] + sizes[:-1]).tolist(), dtype=torch.long))
        self.embedding = nn.Embedding(sum(sizes), dim)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.embedding(rows + self.offsets)


class _ShortConv(nn.Module):
    def __init__(self, width: int, taps: int, dilation: int, streams: int) -> None:
        super().__init__()
        channels = width * streams
        self.conv = nn.Conv1d(channels, channels, taps, groups=channels, bias=False,
                              padding=(taps - 1) * dilation, dilation=dilation)
        self.norms = nn.ModuleList(nn.RMSNorm(width, eps=1e-5) for _ in range(streams))

    def forward(self, x: torch.Tensor) -> torch.Tensor:            # [B, L, M, H]
        B, L, M, H = x.shape
        normed = torch.cat([self.norms[m](x[:, :, m]) for m in range(M)], dim=-1)
        y = self.conv(normed.transpose(1, 2))[..., :L]
        return nn.functional.silu(y).transpose(1, 2).reshape(B, L, M, H)


class DemoEngram(nn.Module):
    """The demo's ``Engram(layer_id)`` for a `PLEConfig` of the Engram family: ``forward(hidden [B, L, M, H],
    input_ids [B, L]) -> [B, L, M, H]`` (the module's own term; the block adds the residual)."""

    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        cfg = config
        self.M, self.H, self.N, self.P = cfg.hc_count, cfg.hidden_size, cfg.ngram_size, cfg.heads_per_ngram
        self.lookup = None if cfg.token_map is None else np.asarray(cfg.token_map, dtype=np.int64)
        token_vocab = cfg.vocab_size if self.lookup is None else int(self.lookup.max()) + 1
        self.pad = int(cfg.eos_token_id if self.lookup is None else self.lookup[cfg.eos_token_id])
        self.mult = demo_multipliers(token_vocab, self.N, cfg.seed, layer_id)
        self.sizes = demo_head_sizes(cfg.engram_vocab_size, self.P, cfg.ple_layer_ids)[layer_id]
        E = cfg.ple_embed_dim
        self.multi_head_embedding = _Table(self.sizes, E // len(self.sizes))
        self.short_conv = _ShortConv(self.H, cfg.ple_conv_kernel_size, self.N, self.M)
        self.value_proj = nn.Linear(E, self.H)
        self.key_projs = nn.ModuleList(nn.Linear(E, self.H) for _ in range(self.M))
        self.norm1 = nn.ModuleList(nn.RMSNorm(self.H) for _ in range(self.M))
        self.norm2 = nn.ModuleList(nn.RMSNorm(self.H) for _ in range(self.M))

    def hash(self, input_ids) -> np.ndarray:
        """``[B, L, NH]`` head-local rows (before the offsets), numpy int64."""
        x = np.asarray(input_ids, dtype=np.int64)
        if self.lookup is not None:
            x = self.lookup[x]
        B, L = x.shape
        back = [x] + [np.pad(x, ((0, 0), (k, 0)), constant_values=self.pad)[:, :L] for k in range(1, self.N)]
        heads = []
        for n in range(2, self.N + 1):
            mix = back[0] * self.mult[0]
            for k in range(1, n):
                mix = np.bitwise_xor(mix, back[k] * self.mult[k])
            for j in range(self.P):
                heads.append(mix % self.sizes[(n - 2) * self.P + j])
        return np.stack(heads, axis=2)

    def forward(self, hidden_states: torch.Tensor, input_ids) -> torch.Tensor:
        rows = torch.from_numpy(self.hash(np.asarray(input_ids)))
        e = self.multi_head_embedding(rows).flatten(start_dim=-2)
        gates = []
        for m in range(self.M):
            kn = self.norm1[m](self.key_projs[m](e))
            qn = self.norm2[m](hidden_states[:, :, m, :])
            s = (kn * qn).sum(dim=-1) / math.sqrt(self.H)
            s = s.abs().clamp_min(1e-6).sqrt() * s.sign()
            gates.append(s.sigmoid().unsqueeze(-1))
        value = torch.stack(gates, dim=2) * self.value_proj(e).unsqueeze(2)
        return value + self.short_conv(value)
