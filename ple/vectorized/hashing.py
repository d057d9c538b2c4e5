"""``ngram_ids`` vectorised over the whole flattened batch (SPEC section 3).

Each token finds its request with ``torch.searchsorted`` on the device ``query_start_loc``;
the k-back token of every token is one shifted copy of the ids (or a read of the request's
context row), and the EOS rule is a running flag over k. No tensor becomes a Python value after
the checks, so a step traces under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import torch

from .. import _checks
from .. import reference as _reference
from ..backends import twin
from ..reference.hashing import HashParams

__all__ = ["ngram_ids"]


def _windows(ids: torch.Tensor, ctx: torch.Tensor, N: int, eos_token_id: int,
             query_start_loc: torch.Tensor | None) -> list[torch.Tensor]:
    """``window[k][t]``: the token k positions before token t (context included), EOS rule applied."""
    dev = ids.device
    T = ids.numel()
    R = ctx.shape[0]
    tokens = torch.arange(T, device=dev)
    if query_start_loc is None:
        req, pos = torch.zeros(T, dtype=torch.int64, device=dev), tokens
    else:
        qsl = query_start_loc.to(torch.int64)
        req = torch.searchsorted(qsl[1:], tokens, right=True).clamp(max=max(R - 1, 0))   # [T] request of a token
        pos = tokens - qsl[req]                                                           # position in it

    # back[k][t] is the token k positions before token t: inside the chunk, or in its context.
    back = [ids]
    for k in range(1, N):
        in_chunk = pos >= k
        from_chunk = torch.cat([ids.new_zeros(min(k, T)), ids[: max(T - k, 0)]])  # ids shifted k to the right
        from_ctx = ctx[req, (N - 1 + pos - k).clamp(0, N - 2)] if R else from_chunk
        back.append(torch.where(in_chunk, from_chunk, from_ctx))

    # EOS rule: once a step back reaches an EOS, every older entry is EOS (the EOS itself is kept).
    window = [back[0]]
    seen_eos = torch.zeros(T, dtype=torch.bool, device=dev)
    for k in range(1, N):
        window.append(torch.where(seen_eos, torch.full_like(back[k], eos_token_id), back[k]))
        seen_eos = seen_eos | (back[k] == eos_token_id)

    return window


@twin(_reference.ngram_ids)
def ngram_ids(input_ids: torch.Tensor, params: HashParams, *, heads_per_ngram: int, eos_token_id: int,
              query_start_loc: torch.Tensor | None = None,
              ngram_context: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    check = _checks.ngram_call if validate else _checks.ngram_meta
    check(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context)
    dev = input_ids.device
    N = params.multipliers.numel()
    R = 1 if query_start_loc is None else query_start_loc.numel() - 1
    ids = input_ids.to(torch.int64)
    if ngram_context is None:
        ctx = torch.full((R, N - 1), eos_token_id, dtype=torch.int64, device=dev)
    else:
        ctx = ngram_context.to(torch.int64)

    window = _windows(ids, ctx, N, eos_token_id, query_start_loc)

    m = params.multipliers.to(dev)
    sizes, offsets = params.head_sizes.to(dev), params.head_offsets.to(dev)
    P = heads_per_ngram
    mix = window[0] * m[0]
    blocks = []
    for n in range(2, N + 1):
        mix = mix ^ (window[n - 1] * m[n - 1])
        heads = slice((n - 2) * P, (n - 1) * P)
        blocks.append(mix[:, None] % sizes[heads] + offsets[heads])
    return torch.cat(blocks, dim=1)
