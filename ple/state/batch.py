"""`StepBatch`: the metadata of one serving step, as `PLECache.schedule` lays it out."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["StepBatch"]


@dataclass
class StepBatch:
    """Everything one step needs, built by `PLECache.schedule`. Rows are in the caller's order.

    Index tensors live on the cache's device (int32, as serving engines keep them);
    ``*_host`` fields are the same values as Python lists, for the bookkeeping.
    """

    num_tokens: int
    input_ids: torch.Tensor              # [T] int64, the step's tokens in row order
    query_start_loc: torch.Tensor        # [R+1], every item in caller order (for hashing)
    ngram_context: torch.Tensor          # [R, N-1] int64, each item's context
    # spec rows
    num_spec_decodes: int
    num_spec_tokens: int
    spec_token_indices: torch.Tensor     # [T_spec] physical rows of the spec items, item by item
    spec_query_start_loc: torch.Tensor   # [R_spec+1]
    spec_state_indices: torch.Tensor     # [R_spec]
    num_accepted_tokens: torch.Tensor    # [R_spec]
    spec_query_len: int                  # the most rows a spec item may have: num_spec_tokens + 1
    # non-spec rows: decodes first, then prefills
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    non_spec_token_indices: torch.Tensor  # [T_d + T_p]
    state_indices: torch.Tensor          # [R_d + R_p]
    has_initial_states_d: torch.Tensor   # [R_d] bool
    has_initial_states_p: torch.Tensor   # [R_p] bool
    query_start_loc_p: torch.Tensor      # [R_p+1], over the prefill rows
    non_spec_query_start_loc: torch.Tensor  # [R_d + R_p + 1]
    # prefix-cache checkpoints of the prefills (offset 0 = none)
    checkpoint_offsets: torch.Tensor     # [R_p]
    checkpoint_slots: torch.Tensor       # [R_p]
    has_checkpoints: bool
    # non-spec requests whose window must move to columns [0, S) first: (slot, column offset)
    realign: list
    # host copies for the bookkeeping
    items: list
    tokens_host: list
    version: int                          # the cache's version when scheduled (SPEC section 7)
    owner: object = None                  # the identity of the cache that scheduled it
    slot_generations: dict = field(default_factory=dict)   # slot -> its generation when scheduled
    layers_done: set = field(default_factory=set)
