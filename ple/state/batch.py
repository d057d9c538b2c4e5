"""`StepBatch`, the plan of one serving step, and `build_plan`, which lays it out.

`PLECache.schedule` validates the items on the host (they are Python values already) and
calls `build_plan`, which lays every op's metadata out as a serving engine does (spec rows,
then non-spec rows with decodes before prefills, ``token_indices`` into the caller's row
order) in one flat int64 host buffer, uploads it to the device in one copy (pinned and
non-blocking on CUDA), and hands out the device tensors as views of that buffer. Each
device tensor has a host twin of Python ints in ``batch.host``, so nothing a step needs is
ever read back from the device.

``pad_to=N`` (decode-only batches, or spec batches whose requests all have
``num_spec_tokens + 1`` tokens) pads the batch to ``N`` requests with null-slot rows and
writes the metadata into a persistent buffer the cache owns for that size, so the device
tensors of every such plan are the same tensors: a CUDA graph captured on one replays for
any batch of up to ``N`` requests.
"""

from __future__ import annotations

import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .items import Decode, Prefill, Spec

if TYPE_CHECKING:
    from .cache import PLECache

__all__ = ["StepBatch", "StepHost", "build_plan"]


@dataclass(frozen=True)
class StepHost:
    """The host twins of a plan's index tensors, as lists of Python ints (same names)."""

    input_ids: list[int]
    query_start_loc: list[int]
    ngram_context: list[list[int]]       # [R][N-1]
    spec_token_indices: list[int]
    spec_query_start_loc: list[int]
    spec_state_indices: list[int]
    num_accepted_tokens: list[int]
    non_spec_token_indices: list[int]
    state_indices: list[int]
    has_initial_states_d: list[int]
    has_initial_states_p: list[int]
    query_start_loc_p: list[int]
    checkpoint_offsets: list[int]
    checkpoint_slots: list[int]


_FIELDS = tuple(StepHost.__dataclass_fields__)


@dataclass
class StepBatch:
    """Everything one step needs, built by `PLECache.schedule`. Rows are in the caller's order.

    Index tensors are int64 views of one device buffer (flags are 0/1); ``host`` holds the
    same values as Python ints. ``num_tokens`` counts padding rows (``pad_to``) too.
    """

    num_tokens: int
    input_ids: torch.Tensor              # [T] the step's tokens in row order
    query_start_loc: torch.Tensor        # [R+1], every item in caller order (for hashing)
    ngram_context: torch.Tensor          # [R, N-1], each item's context
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
    has_initial_states_d: torch.Tensor   # [R_d] 0/1
    has_initial_states_p: torch.Tensor   # [R_p] 0/1
    query_start_loc_p: torch.Tensor      # [R_p+1], over the prefill rows
    # prefix-cache checkpoints of the prefills (offset 0 = none)
    checkpoint_offsets: torch.Tensor     # [R_p]
    checkpoint_slots: torch.Tensor       # [R_p]
    has_checkpoints: bool
    # non-spec requests whose window must move to columns [0, S) first: (slot, column offset)
    realign: list[tuple[int, int]]
    host: StepHost                       # the index tensors' values as Python ints
    items: list[Prefill | Decode | Spec]  # the scheduled items and their tokens, for the bookkeeping
    tokens_host: list[list[int]]
    version: int                         # the cache's version when scheduled (docs/spec.md section 7)
    owner: object = None                 # the identity of the cache that scheduled it
    slot_generations: dict[int, int] = field(default_factory=dict)   # slot -> its generation when scheduled
    pad_to: int | None = None            # padded to this many requests (a persistent buffer)
    pad_key: tuple[int, bool, int] | None = None   # that buffer's key in the cache
    buffer_generation: int = 0           # which use of that buffer this plan is
    layers_done: set[int] = field(default_factory=set)
    _upload: object = None               # keeps the pinned host buffer alive during its copy

    def __repr__(self) -> str:
        kinds = {t: sum(type(i).__name__ == t for i in self.items) for t in ("Prefill", "Decode", "Spec")}
        what = ", ".join(f"{n} {k.lower()}" for k, n in kinds.items() if n)
        pad = f", padded to {self.pad_to}" if self.pad_to else ""
        return f"StepBatch({what or 'no items'}; {self.num_tokens} rows{pad}; cache version {self.version})"


def _cumsum(lengths: Iterable[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def host_layout(cache: PLECache, parsed: list[tuple[Prefill | Decode | Spec, list[int]]],
                pad_to: int | None) -> tuple[StepHost, dict[str, Any]]:
    """The host twins of a step's metadata and the plan's scalar fields."""
    if pad_to is None and all(type(item) is Decode for item, _ in parsed):
        return decode_layout(cache, parsed)
    return general_layout(cache, parsed, pad_to)


def general_layout(cache: PLECache, parsed: list[tuple[Prefill | Decode | Spec, list[int]]],
                   pad_to: int | None) -> tuple[StepHost, dict[str, Any]]:
    """`host_layout` of any batch."""
    null, eos = cache.null_slot, cache.config.eos_token_id
    N1 = cache.config.context_len
    records = cache._slots                                          # each slot's host bookkeeping
    rows: list[tuple[Any, list[int], list[int]]] = [(item, list(t), list(records[item.slot].context))
                                                    for item, t in parsed]     # (item or None, tokens, context)
    # Padding rows (item None) are null-slot requests of the batch's own shape: decodes, or full spec steps.
    pad_kind = "Spec" if any(isinstance(item, Spec) for item, _ in parsed) else "Decode"
    if pad_to is not None:
        q = 1 if pad_kind == "Decode" else cache.num_spec_tokens + 1
        rows += [(None, [eos] * q, [eos] * N1)] * (pad_to - len(rows))
    query_start_loc_list = _cumsum(len(t) for _, t, _ in rows)

    def group(name: str) -> list[tuple[int, Any, list[int]]]:       # (row, item of that kind or None, tokens)
        return [(r, item, t) for r, (item, t, _) in enumerate(rows)
                if (pad_kind if item is None else type(item).__name__) == name]

    spec, dec, pre = group("Spec"), group("Decode"), group("Prefill")

    def rows_of(g: list[tuple[int, Any, list[int]]]) -> list[int]:
        return [i for r, _, t in g for i in range(query_start_loc_list[r], query_start_loc_list[r] + len(t))]

    def slot_of(item: Any) -> int:
        return null if item is None else item.slot

    host = StepHost(
        input_ids=[tok for _, t, _ in rows for tok in t],
        query_start_loc=query_start_loc_list,
        ngram_context=[c for _, _, c in rows],
        spec_token_indices=rows_of(spec),
        spec_query_start_loc=_cumsum(len(t) for _, _, t in spec),
        spec_state_indices=[slot_of(item) for _, item, _ in spec],
        num_accepted_tokens=[1 if item is None else records[item.slot].num_accepted for _, item, _ in spec],
        non_spec_token_indices=rows_of(dec) + rows_of(pre),
        state_indices=[slot_of(item) for _, item, _ in dec + pre],
        has_initial_states_d=[1] * len(dec),
        has_initial_states_p=[int(records[item.slot].started) for _, item, _ in pre],
        query_start_loc_p=_cumsum(len(t) for _, _, t in pre),
        checkpoint_offsets=[item.checkpoint_at or 0 for _, item, _ in pre],
        checkpoint_slots=[item.checkpoint_slot or null for _, item, _ in pre],
    )
    realign = [(item.slot, records[item.slot].num_accepted - 1) for _, item, _ in dec + pre
               if item is not None and records[item.slot].num_accepted > 1]
    scalars = dict(
        num_tokens=query_start_loc_list[-1], num_spec_decodes=len(spec),
        num_spec_tokens=sum(len(t) for _, _, t in spec),
        spec_query_len=cache.num_spec_tokens + 1, num_decodes=len(dec), num_decode_tokens=len(dec),
        num_prefills=len(pre), num_prefill_tokens=sum(len(t) for _, _, t in pre),
        has_checkpoints=any(item.checkpoint_at for _, item, _ in pre) and cache.state_len > 0,
        realign=realign, pad_to=pad_to)
    return host, scalars


def decode_layout(cache: PLECache, parsed: list[tuple[Prefill | Decode | Spec, list[int]]]
                   ) -> tuple[StepHost, dict[str, Any]]:
    """`host_layout` of a batch of decodes only, unpadded (the commonest step), written out directly: the values
    of `general_layout` (``tests/state/test_schedule_fast.py`` compares the two), in a quarter of its time."""
    records = cache._slots
    R = len(parsed)
    state_indices = [item.slot for item, _ in parsed]
    rows = list(range(R))
    host = StepHost(
        input_ids=[t[0] for _, t in parsed], query_start_loc=list(range(R + 1)),
        ngram_context=[list(records[s].context) for s in state_indices],
        spec_token_indices=[], spec_query_start_loc=[0], spec_state_indices=[], num_accepted_tokens=[],
        non_spec_token_indices=rows, state_indices=state_indices, has_initial_states_d=[1] * R,
        has_initial_states_p=[], query_start_loc_p=[0], checkpoint_offsets=[], checkpoint_slots=[])
    realign = [(s, records[s].num_accepted - 1) for s in state_indices if records[s].num_accepted > 1]
    scalars = dict(
        num_tokens=R, num_spec_decodes=0, num_spec_tokens=0, spec_query_len=cache.num_spec_tokens + 1,
        num_decodes=R, num_decode_tokens=R, num_prefills=0, num_prefill_tokens=0, has_checkpoints=False,
        realign=realign, pad_to=None)
    return host, scalars


def build_plan(cache: PLECache, parsed: list[tuple[Prefill | Decode | Spec, list[int]]],
               pad_to: int | None = None) -> StepBatch:
    """Lay out and upload the plan of one step (``parsed``: validated ``(item, tokens)`` pairs)."""
    host, scalars = host_layout(cache, parsed, pad_to)
    values = {name: getattr(host, name) for name in _FIELDS}
    values["ngram_context"] = [tok for c in host.ngram_context for tok in c]
    sizes = [len(values[name]) for name in _FIELDS]
    flat = [v for name in _FIELDS for v in values[name]]
    dev = cache.device
    staged = torch.frombuffer(array.array("q", flat), dtype=torch.int64)    # holds the array, shares its memory
    if dev.type == "cuda":
        staged = staged.pin_memory()
    generation, key = 0, None
    buffer: torch.Tensor | None
    if pad_to is None:
        buffer = staged.to(dev, non_blocking=True)
    else:                                        # the same device tensor for every plan of this size
        key = (pad_to, scalars["num_spec_decodes"] > 0, len(flat))
        buffer = cache._pad_buffers.get(key)
        if buffer is None:
            buffer = cache._pad_buffers[key] = torch.empty(len(flat), dtype=torch.int64, device=dev)
        buffer.copy_(staged, non_blocking=True)
        generation = cache._pad_generations[key] = cache._pad_generations.get(key, 0) + 1
    views: dict[str, Any] = dict(zip(_FIELDS, buffer.split(sizes)))   # the index tensors, by StepBatch field
    views["ngram_context"] = views["ngram_context"].view(len(host.ngram_context), cache.config.context_len)
    return StepBatch(**views, **scalars, host=host, items=[item for item, _ in parsed],
                     tokens_host=[list(t) for _, t in parsed], version=cache._version, owner=cache._identity,
                     slot_generations={item.slot: cache._generations[item.slot] for item, _ in parsed},
                     pad_key=key, buffer_generation=generation, _upload=staged)
