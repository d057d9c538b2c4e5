"""Sequence-parallel serving: one `PLELayer.step` whose rows are split across ranks.

Every rank holds the same `PLECache` and schedules the same `StepBatch` (the
scheduler is replicated, as in a serving engine); rank ``k`` holds rows
``[bounds[k], bounds[k + 1])`` of the step's hidden states (default: the balanced
split of ``batch.num_tokens``) and gets those rows of the output. Afterwards every
rank's cache equals the cache of one process that ran the whole step.

Two exchanges of conv inputs:

* ``"halo"``: a request continued from an earlier rank gets its (at most S)
  inputs before this rank's first row, point to point. The outputs then need
  nothing else: each local piece of a request runs as a prefill from its own
  history (the request's window in the cache, followed by the halo). To keep the
  replicated caches equal, the inputs every rank needs to update its states (the
  last ``min(S, q)`` inputs of each request, all of a spec request's, the S
  before each prefix-cache checkpoint) are then all-gathered: that costs about
  ``R * S * C`` per step for R requests, whatever their lengths.
* ``"allgather"``: every conv input is all-gathered and every rank runs the conv
  of the whole step, as one process does (the baseline the serving layer this
  grew from uses).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import _checks
from ..state.cache import PLECache, StepBatch
from ..state.items import Decode, Spec
from ..state.step import check_same_config, step_conv
from .comm import GroupLike
from .exchange import halo_exchange
from .partition import check_bounds, even_bounds, fragments, halo_plan
from .sequence import EXCHANGES, _cumsum, _embed, local_ngram_ids, resolve_comm

if TYPE_CHECKING:
    from ..layer import PLELayer

__all__ = ["sp_step"]


@torch.no_grad()
def sp_step(layer: PLELayer, hidden_states: torch.Tensor, batch: StepBatch, cache: PLECache, group: GroupLike = None, *,
            bounds: list[int] | None = None, exchange: str = "halo") -> torch.Tensor:
    """This rank's rows of ``layer.step(hidden, batch, cache)``: ``[T_k, C] -> [T_k, C]``; caches updated.

    Every rank of the group calls it with the same ``batch`` and its own rows.
    ``bounds`` (``[W + 1]``, default `even_bounds(batch.num_tokens, W)`) is the split;
    a rank may hold no rows and a request may span any number of ranks. Inference
    only. With a sharded table (a DTensor) the lookup is ``local_token_rows``.
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange: expected one of {EXCHANGES}, got {exchange!r}")
    if not isinstance(cache, PLECache):
        raise TypeError(f"cache: expected a PLECache, got {type(cache).__name__}")
    comm = resolve_comm(layer, group)
    index = layer.ple_layer_index
    cache.begin_layer(batch, index)
    layer._check_hidden(hidden_states, 2)
    T = batch.num_tokens
    W, k = comm.world_size, comm.rank
    bounds = even_bounds(T, W) if bounds is None else check_bounds("bounds", bounds, T, W)
    lo, hi = bounds[k], bounds[k + 1]
    if hidden_states.shape[0] != hi - lo:
        raise ValueError(f"hidden_states: rank {k} holds rows [{lo}, {hi}) of the step, expected {hi - lo} "
                         f"rows, got {hidden_states.shape[0]}")
    check_same_config(layer.config, cache.config)
    if batch.pad_to is not None:
        raise ValueError("batch: a padded plan (schedule(pad_to=...)) is for layer.step; sp_step splits the "
                         "real rows of an unpadded one")
    _checks.tensor("hidden_states", hidden_states, device=cache.device)

    cfg = layer.config
    ops = layer.ops
    N1 = cfg.context_len
    query_start_loc_list = batch.host.query_start_loc
    frags = fragments(query_start_loc_list, lo, hi)
    local_query_start_loc_list = _cumsum(b - a for _, a, b in frags)     # the pieces' offsets in our rows

    # n-gram ids of the local rows: a piece that continues a request hashes with the tokens before it.
    contexts = batch.host.ngram_context
    ctx = [(contexts[r] + batch.tokens_host[r][: a - query_start_loc_list[r]])[-N1:] for r, a, _ in frags]
    ids = local_ngram_ids(layer, batch.input_ids[lo:hi], local_query_start_loc_list, ctx)
    counts = [bounds[r + 1] - bounds[r] for r in range(W)]
    emb = _embed(layer, ids, hidden_states.dtype, counts, comm)          # [T_k, E]
    out, conv_input = layer.gate(emb, hidden_states)                     # gated becomes the output in place
    conv_state = cache.conv_state(index)                                 # [num_slots, C, W] view
    weights = layer.conv_weights.to(conv_input.dtype)

    cache.realign_windows(batch, index, conv_state)

    if exchange == "allgather":
        _conv_allgather(ops, conv_input, out, hidden_states, conv_state, weights, batch, cache, comm, counts,
                        lo, hi)
    else:
        _conv_halo(ops, conv_input, out, hidden_states, conv_state, weights, batch, cache, comm, bounds,
                   query_start_loc_list, frags, local_query_start_loc_list)
    cache.end_layer(batch, index)
    return out


def _conv_allgather(ops, conv_input, out, hidden, conv_state, weights, batch, cache, comm, counts, lo, hi):
    """Every rank runs the whole step's conv on all-gathered inputs, exactly as `layer_step` does."""
    full = comm.all_gather_rows(conv_input, counts, "conv_allgather")   # [T, C]
    y = torch.zeros_like(full)
    step_conv(ops, full, y, conv_state, weights, batch, cache)
    # The same rounding as one process: (gated + y) + hidden.
    out.add_(y[lo:hi])
    out.add_(hidden)


class _Requests:
    """Host view of a batch's requests in caller order: mode, slot, history window, checkpoint."""

    def __init__(self, batch: StepBatch):
        host = batch.host                                # the plan's host twins: nothing read back
        acc, init_d, init_p = host.num_accepted_tokens, host.has_initial_states_d, host.has_initial_states_p
        ck_off, ck_slot = host.checkpoint_offsets, host.checkpoint_slots
        self.mode: list[str] = []
        self.slot: list[int] = []
        self.offset: list[int] = []
        self.has_initial: list[bool] = []
        self.checkpoint: list[tuple[int, int] | None] = []     # (tokens in, slot) of a prefill's checkpoint
        js = jd = jp = 0
        for item in batch.items:
            self.slot.append(item.slot)
            self.checkpoint.append(None)
            if isinstance(item, Spec):
                self.mode.append("spec")
                self.offset.append(acc[js] - 1)
                self.has_initial.append(True)
                js += 1
            elif isinstance(item, Decode):
                self.mode.append("decode")
                self.offset.append(0)
                self.has_initial.append(bool(init_d[jd]))
                jd += 1
            else:
                self.mode.append("prefill")
                self.offset.append(0)
                self.has_initial.append(bool(init_p[jp]))
                if ck_off[jp] > 0:
                    self.checkpoint[-1] = (ck_off[jp], ck_slot[jp])
                jp += 1

    def window(self, r: int, conv_state: torch.Tensor, state_len: int, dtype) -> torch.Tensor:
        """The ``[S, C]`` history (S = ``state_len``) request r starts this step from (its conv state before the
        step)."""
        S, slot, o = state_len, self.slot[r], self.offset[r]
        if self.has_initial[r]:
            return conv_state[slot, :, o:o + S].T.to(dtype)
        return torch.zeros(S, conv_state.shape[1], dtype=dtype, device=conv_state.device)


def _conv_halo(ops, conv_input, out, hidden, conv_state, weights, batch, cache, comm, bounds, query_start_loc_list,
               frags, local_query_start_loc_list):
    S = cache.state_len
    C = conv_input.shape[1]
    dt, dev = conv_input.dtype, conv_input.device
    k = comm.rank
    lo, hi = bounds[k], bounds[k + 1]
    null = cache.null_slot
    req = _Requests(batch)

    # 1. Outputs. Each local piece of a request runs as a prefill from its own history: the request's
    #    window, then (for a piece continued from an earlier rank) the halo received from there.
    plan = halo_plan(bounds, query_start_loc_list, S, k)
    halo = halo_exchange(conv_input, plan, comm, "conv_halo")           # [<= S, C]
    if frags:
        scratch = conv_input.new_zeros((len(frags) + 1, C, S))          # slot 0: null
        state_indices_list = []                                         # the pieces' slots in scratch
        for f, (r, a, _) in enumerate(frags):
            if req.slot[r] == null:
                state_indices_list.append(0)
                continue
            hist = req.window(r, conv_state, S, dt)
            if a > query_start_loc_list[r]:                             # only the first piece: halo rows
                hist = torch.cat([hist, halo], dim=0)[halo.shape[0]:]
            scratch[f + 1] = hist.T
            state_indices_list.append(f + 1)
        n = len(frags)
        ops.ple_conv(conv_input, out, scratch, weights,
                     torch.tensor(state_indices_list, dtype=torch.int32, device=dev),
                     mode="prefill", dilation=cache.config.conv_dilation,
                     query_start_loc=torch.tensor(local_query_start_loc_list, dtype=torch.int32, device=dev),
                     has_initial_states=torch.ones(n, dtype=torch.bool, device=dev),
                     outer_residual=hidden, null_slot=0)

    # 2. States. Every rank updates every request's state, so it needs the inputs that end up there.
    needed: set[int] = set()
    for r in range(len(req.slot)):
        a, b = query_start_loc_list[r], query_start_loc_list[r + 1]
        if b == a or req.slot[r] == null:
            continue
        needed.update(range(a if req.mode[r] == "spec" else max(a, b - S), b))
        ck = req.checkpoint[r]
        if ck is not None and ck[1] != null:
            off = ck[0]
            needed.update(range(a + off - S, a + off))
    rows = sorted(needed)
    W = comm.world_size
    counts = [sum(1 for g in rows if bounds[q] <= g < bounds[q + 1]) for q in range(W)]
    mine = torch.tensor([g - lo for g in rows if lo <= g < hi], dtype=torch.int64, device=dev)
    gathered = comm.all_gather_rows(conv_input.index_select(0, mine), counts, "conv_state_sync")
    where = {g: i for i, g in enumerate(rows)}

    def inputs(a: int, b: int) -> torch.Tensor:
        return gathered[where[a]: where[a] + (b - a)] if b > a else gathered[:0]

    updates = []                                                        # read every state before writing any
    for r in range(len(req.slot)):
        a, b = query_start_loc_list[r], query_start_loc_list[r + 1]
        slot = req.slot[r]
        if b == a or slot == null:
            continue
        if req.mode[r] == "spec":
            keep = torch.cat([req.window(r, conv_state, S, dt), inputs(a, b)], dim=0)[1:]
        else:
            hist = torch.cat([req.window(r, conv_state, S, dt), inputs(max(a, b - S), b)], dim=0)
            keep = hist[hist.shape[0] - S:]
        updates.append((slot, keep))
        ck = req.checkpoint[r]
        if ck is not None and ck[1] != null:
            off, ck_slot = ck
            updates.append((ck_slot, inputs(a + off - S, a + off)))
    for slot, keep in updates:
        conv_state[slot, :, : keep.shape[0]] = keep.T.to(conv_state.dtype)
