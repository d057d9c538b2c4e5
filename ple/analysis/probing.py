"""`probe`: the layer's parts on one batch, each head's share of the value, and the output the layer gives."""

from __future__ import annotations

from typing import NamedTuple

import torch
from einops import einsum, rearrange

from ..layer import Intermediates, PLELayer

__all__ = ["Probe", "probe"]


class Probe(NamedTuple):
    """What `probe` returns, ``[B, L, ...]`` (M streams, H = ``hidden_size``, C = M * H, NH hash heads)."""

    rows: torch.Tensor          # [B, L, NH] int64: the table rows looked up (ngram_ids), head by head
    score: torch.Tensor         # [B, L, M]: s of docs/spec.md section 4
    gate: torch.Tensor          # [B, L, M]: g = sigmoid(sign(s) * sqrt(max(|s|, 1e-6)))
    value: torch.Tensor         # [B, L, H]: the value projection, in the layer's dtype
    head_value: torch.Tensor    # [B, L, NH, H]: each head's row times its columns of the value projection
    gated: torch.Tensor         # [B, L, C]: g[m] * value, stream by stream
    conv: torch.Tensor          # [B, L, C]: the conv term y
    out: torch.Tensor           # [B, L, C]: layer(hidden_states, input_ids), bit for bit


@torch.no_grad()
def probe(layer: PLELayer, hidden_states: torch.Tensor, input_ids: torch.Tensor) -> Probe:
    """Run ``layer`` on ``hidden_states`` ``[B, L, C]`` and ``input_ids`` ``[B, L]`` and return its parts (`Probe`).

    Without autograd (the results hold no graph). Any backend (``layer.backend``, ``ops=``) and any table:
    dense, FP8 / int8 / NF4, host-offloaded, on disk (an overlay included); a sharded table's lookups are
    collective, so every rank calls `probe` alike, as it calls ``forward``. The arguments are checked as
    ``forward`` checks them (the same errors). Every row of the batch is a whole sequence from its start.

    Where each part comes from:

    * ``rows``, ``value``, ``gated``, ``conv``: the layer's op-by-op path
      (``layer(..., return_intermediates=True)``, ``ple.layer.Intermediates``): ``ngram_ids``, the table's
      lookup, the projections, ``ple_gate`` and ``dilated_causal_conv`` of ``layer.ops``, bits as that backend
      gives them. ``score`` and ``gate`` are recomputed from the key by ``ple.reference.gate.stream_scores``
      (the values ``ple_gate`` uses inside; a fused kernel may round its internal score differently).
    * ``out``: ``layer(hidden_states, input_ids)`` itself (the fused ``ple_prefill`` path), so it is the
      layer's output on that backend bit for bit. On every built-in backend it also equals
      ``(gated + conv) + hidden_states`` computed in the layer's dtype (the sum rounded, then the residual
      added: docs/spec.md section 5), bit for bit; a custom ``ops=`` whose fused op rounds otherwise may
      differ there by rounding, and ``out`` stays the forward's.
    * ``head_value[..., h, :]``: head h's row (columns ``[h * D, (h + 1) * D)`` of the embedding) times the
      same columns of ``value_proj.weight``: a dot product of D terms in the accumulation dtype (float32;
      float64 for a float64 layer), from the layer's values (exact there). Summed over the heads
      it equals ``value`` up to rounding, not bit for bit: ``value`` is the layer's GEMM rounded to the
      layer's dtype (one rounding of a float32 sum for bfloat16), the heads' sum is a float32 (float64) sum
      in another order. The Qwen4Exp value projection has no bias (docs/spec.md section 4), so nothing is left
      out; an Engram-family layer's has one (section 15): there ``value`` is the heads' sum plus
      ``value_proj.bias``, which belongs to no head.

    The table is looked up once for the parts and once for ``out`` (a pending ``start_prefetch`` serves the
    first; a disk table's counters count both). Under `ablate` the parts and ``out`` are the ablated layer's.
    """
    if not isinstance(layer, PLELayer):
        raise TypeError(f"layer: expected a ple.PLELayer, got {type(layer).__name__}")
    parts = layer(hidden_states, input_ids, return_intermediates=True)
    assert isinstance(parts, Intermediates)
    out = layer(hidden_states, input_ids)
    assert isinstance(out, torch.Tensor)
    cfg = layer.config
    NH = cfg.num_ngram_heads
    acc = torch.promote_types(hidden_states.dtype, torch.float32)
    emb = rearrange(parts.embeddings.to(acc), "b l (nh d) -> b l nh d", nh=NH)
    weight = rearrange(layer.value_proj.weight.detach().to(acc), "h (nh d) -> nh h d", nh=NH)
    head_value = einsum(emb, weight, "b l nh d, nh h d -> b l nh h")
    return Probe(parts.ngram_ids, parts.scores, parts.gates, parts.value, head_value, parts.gated, parts.conv, out)
