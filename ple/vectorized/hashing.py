"""``ngram_ids`` vectorised over the whole flattened batch (docs/spec.md section 3).

Each token finds its request with ``torch.searchsorted`` on the device ``query_start_loc``;
every token's whole window (the token and the N-1 before it, from the chunk or the request's
context) is one gather, the EOS rule a running maximum over it, and all NH heads one remainder:
about 20 ops whatever T and N are. No tensor becomes a Python value after
the checks, so a step traces under ``torch.compile(fullgraph=True)``.

The family (docs/spec.md section 15) is data in ``HashParams``: with ``token_map`` the tokens, the contexts and
the boundary token are gathered through the map first (the boundary as the 0-d tensor ``token_map[eos]``, never
read on the host), and ``eos_rule`` False (Engram) leaves the windows as gathered.
"""

from __future__ import annotations

import torch

from .. import _checks
from .. import reference as _reference
from ..backends import twin
from ..reference.hashing import HashParams

__all__ = ["ngram_ids"]


def _batch_windows(ids: torch.Tensor, ctx: torch.Tensor, ngram_size: int, eos_token_id: int | torch.Tensor,
                   query_start_loc: torch.Tensor | None, eos_rule: bool = True) -> torch.Tensor:
    """``window[t, k]``: the token k positions before token t (context included), EOS rule applied; ``[T, N]``.

    One gather from ``cat(ctx.flatten(), ids)``: entry k of token t is ``ids[t - k]`` when the token is
    at least k into its request, else the request's context entry ``N - 1 + pos - k``. The EOS rule
    (past a step that reached an EOS, every older entry is EOS) is a running maximum over k; with
    ``eos_rule`` False (the Engram family) there is none. ``eos_token_id`` may be a 0-d tensor on the
    ids' device (a mapped boundary token, `_mapped`).
    """
    N = ngram_size
    dev = ids.device
    T = ids.numel()
    R = ctx.shape[0]
    t = torch.arange(T, device=dev)
    if query_start_loc is None:
        req, pos = torch.zeros(T, dtype=torch.int64, device=dev), t
    else:
        query_start_loc = query_start_loc.to(torch.int64)
        req = torch.searchsorted(query_start_loc[1:], t, right=True).clamp(max=max(R - 1, 0))   # [T] its request
        pos = t - query_start_loc[req]                                                # position in it
    k = torch.arange(N, device=dev)
    n_ctx = R * (N - 1)
    in_chunk = pos[:, None] >= k
    idx = torch.where(in_chunk, n_ctx + t[:, None] - k, req[:, None] * (N - 1) + (N - 1) + pos[:, None] - k)
    back = torch.cat([ctx.reshape(-1), ids]).index_select(0, idx.clamp(min=0).flatten()).view(T, N)
    if N <= 2 or not eos_rule:
        return back
    eos = (back[:, 1:N - 1] == eos_token_id).to(torch.int8).cummax(1).values       # [T, N-2]: an EOS at 1..k-1
    seen = torch.cat([eos.new_zeros(T, 2), eos], 1) != 0
    return torch.where(seen, eos_token_id, back)


@twin(_reference.ngram_ids)
def ngram_ids(input_ids: torch.Tensor, params: HashParams, *, heads_per_ngram: int, eos_token_id: int,
              query_start_loc: torch.Tensor | None = None,
              ngram_context: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """One path, all tokens at once on the device: each token finds its request with ``torch.searchsorted``
    on ``query_start_loc``, its whole window is one gather from the contexts and the tokens
    (``_batch_windows``), the EOS rule a running maximum over the window, every head one floor remainder
    (about 20 ops whatever T and N are). A ``params.token_map`` is one gather of the tokens and one of the
    contexts (the boundary token ``token_map[eos_token_id]`` a 0-d tensor on the device, never read back);
    ``params.eos_rule`` False skips the rule. Token ids and contexts of either int dtype are widened to int64.
    The checks read the token ids and offsets on the host once (``validate=True``); after them no tensor
    becomes a Python value, so with ``validate=False`` a call makes no device-to-host synchronisation and
    traces under ``torch.compile(fullgraph=True)``. Any device."""
    check = _checks.ngram_call if _checks.validating(validate) else _checks.ngram_meta
    check(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context)
    return _ngram_ids(input_ids, params, heads_per_ngram, eos_token_id, query_start_loc, ngram_context)


def _ngram_ids(input_ids: torch.Tensor, params: HashParams, heads_per_ngram: int, eos_token_id: int,
               query_start_loc: torch.Tensor | None, ngram_context: torch.Tensor | None) -> torch.Tensor:
    """The body of `ngram_ids`, for a call already checked."""
    dev = input_ids.device
    N = params.multipliers.numel()
    R = 1 if query_start_loc is None else query_start_loc.numel() - 1
    ids = input_ids.to(torch.int64)
    if ngram_context is None:
        ctx = torch.full((R, N - 1), eos_token_id, dtype=torch.int64, device=dev)
    else:
        ctx = ngram_context.to(torch.int64)
    boundary: int | torch.Tensor = eos_token_id
    tmap = params.token_map
    if tmap is not None:                                # docs/spec.md 15: every id through the map first
        ids, ctx = _mapped(ids, tmap), _mapped(ctx, tmap)
        boundary = tmap.to(dev)[eos_token_id].to(torch.int64)     # a 0-d tensor: no host read
    window = _batch_windows(ids, ctx, N, boundary, query_start_loc, params.eos_rule)     # [T, N]
    return _window_rows(window, params, heads_per_ngram)


def _mapped(ids: torch.Tensor, token_map: torch.Tensor) -> torch.Tensor:
    """``token_map[ids]`` as int64, same shape (a gather on the ids' device: nothing is read on the host). A map
    on another device is copied to the ids' first (as the multipliers are; a layer keeps it on its own)."""
    return token_map.to(ids.device).index_select(0, ids.reshape(-1)).to(torch.int64).view(ids.shape)


def _window_rows(window: torch.Tensor, params: HashParams, heads_per_ngram: int, first_order: int = 2) -> torch.Tensor:
    """The table rows of windows ``[T, n]`` (the ids the hash reads: through ``params.token_map`` already, after
    the family's rule; ``n`` = the multipliers of ``params``, whose map and rule are not read here): each
    order's mix and every head's floor remainder (docs/spec.md section 3), ``[T, (n - first_order + 1) * P]``
    for the orders ``first_order..n``, whose head sizes and offsets ``params`` holds (all NH heads with the
    default 2; ``ple.analysis`` hashes the windows of one order n with the first n multipliers and order n's
    heads)."""
    dev = window.device
    N = params.multipliers.numel()
    m = params.multipliers.to(dev)
    sizes, offsets = params.head_sizes.to(dev), params.head_offsets.to(dev)
    P = heads_per_ngram
    prod = window * m                                                           # [T, N]
    mixes = [prod[:, 0] ^ prod[:, 1]]
    for n in range(3, N + 1):
        mixes.append(mixes[-1] ^ prod[:, n - 1])
    mix = torch.stack(mixes[first_order - 2:], 1).repeat_interleave(P, dim=1)   # head h: order h // P + first_order
    return mix % sizes + offsets
