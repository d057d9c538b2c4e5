"""`PLECache`: per-request conv states and n-gram contexts, and the step scheduler.

A serving engine keeps, for every live request, the last S conv inputs of every
PLE layer (the *conv state*) and the last N-1 accepted tokens (the *n-gram
context*). `PLECache` holds both in slots, hands slots out (`allocate` / `free`),
and turns a list of `Prefill` / `Decode` / `Spec` items into a `StepBatch`: the
metadata a step needs, laid out as a serving engine lays it out (spec rows and
non-spec rows, decodes before prefills, ``token_indices`` into the caller's row
order). `PLELayer.step` consumes the batch; when the layer with the last PLE
index has run, the cache's bookkeeping advances.

Slot 0 is the null slot: never handed out, never read or written. A cache of
``num_slots`` slots therefore serves ``num_slots - 1`` requests at once.

Bookkeeping that a spec step leaves behind: the request's state holds the
windows ending at each token of the step (docs/spec.md section 6); ``accept(slot, n)``
keeps the first n tokens (default: all), and the next step reads the window of
the last kept token. A request that goes from spec steps back to prefill or
decode has that window moved to columns ``[0, S)`` at the start of its next step
("realigned"), since those modes read there.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import _checks
from .._deprecation import deprecated_parameter
from ..config import PLEConfig
from .batch import StepBatch, build_plan
from .items import Decode, Prefill, Spec, as_token_list, plain_decodes
from .persist import load_cache, save_cache
from .step import layer_step

if TYPE_CHECKING:
    from torch.types import Device

    from ..layer import PLELayer

__all__ = ["PLECache", "StepBatch", "LAYOUTS"]

LAYOUTS = ("channels_first", "channels_last")


@dataclass
class _Slot:
    """Host-side bookkeeping of one slot."""

    active: bool = False
    started: bool = False                # has any token been appended (by a prefill)?
    length: int = 0                      # accepted tokens so far
    context: list[int] = field(default_factory=list)   # the last N-1 accepted tokens, oldest first
    num_accepted: int = 1                # the window the next step reads: columns [n-1, n-1+S)
    spec_tokens: list[int] | None = None   # tokens of the last step if it was a spec step
    spec_context: list[int] | None = None  # the context before that spec step
    realigned: list[int] = field(default_factory=list)  # PLE layers whose window was already moved to [0, S)


class PLECache:
    """Conv states of every PLE layer and the n-gram context of every slot.

    ``conv_states`` is ``[num_layers, num_slots, W, C]`` (``W = S + num_spec_tokens``) with
    the default ``layout="channels_last"``, or ``[num_layers, num_slots, C, W]`` with
    ``layout="channels_first"``; ``conv_state(i)`` is always the ``[num_slots, C, W]`` view
    the ops take. Channels-last is the default because the fused decode / spec kernel
    moves it in 128-bit accesses along C (a channels-first window is read and written one
    element per channel; ``ple/fast/conv_decode.py``). ``dtype`` defaults to the torch default dtype; inputs are
    stored in it. ``num_layers`` defaults to the config's PLE layer count (a cache for
    fewer layers serves PLE indices ``0..num_layers-1``; more is a ``ValueError``).

    Capacity, for a scheduler: ``num_slots`` counts every slot, the null slot 0 included, so
    the cache holds at most ``num_slots - 1`` requests at once; `free_slots` is how many more it
    can take now (what `allocate` can still hand out) and `active_slots` lists the slots that
    hold a request, so ``free_slots + len(active_slots()) == num_slots - 1`` always.
    """

    def __init__(self, config: PLEConfig, num_slots: int, *, num_spec_tokens: int = 0,
                 num_layers: int | None = None, dtype: torch.dtype | None = None, device: Device = None,
                 layout: str = "channels_last") -> None:
        if not isinstance(config, PLEConfig):
            raise TypeError(f"config: expected a PLEConfig, got {type(config).__name__}")
        _checks.int_arg("num_slots", num_slots, minimum=2)
        _checks.int_arg("num_spec_tokens", num_spec_tokens, minimum=0)
        if config.num_ple_layers == 0:
            raise ValueError("config: has no PLE layer (ple_layer_ids is empty), so there is nothing to cache")
        num_layers = config.num_ple_layers if num_layers is None else num_layers
        _checks.int_arg("num_layers", num_layers, minimum=1)
        if num_layers > config.num_ple_layers:
            raise ValueError(f"num_layers: the config has {config.num_ple_layers} PLE layer(s) "
                             f"(ple_layer_ids={list(config.ple_layer_ids)}), got {num_layers}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        dtype = dtype or torch.get_default_dtype()
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype: expected a torch floating-point dtype (e.g. torch.bfloat16), got {dtype!r}")
        self.config = config
        self.num_slots = num_slots
        self.num_spec_tokens = num_spec_tokens
        self.num_layers = num_layers
        self.layout = layout
        self.null_slot = 0
        self.state_len = config.conv_state_len
        self.width = config.conv_state_len + num_spec_tokens
        C = config.hc_hidden_size
        shape = (num_layers, num_slots, C, self.width) if layout == "channels_first" else \
            (num_layers, num_slots, self.width, C)
        self.conv_states = torch.zeros(shape, dtype=dtype, device=device)
        self._slots = [_Slot() for _ in range(num_slots)]
        self._identity = object()            # a batch belongs to the cache that scheduled it
        self._version = 0                    # bumped by every change a batch depends on
        self._generations = [0] * num_slots  # per slot: bumped by allocate, free, accept, fork
        self._last_change = "nothing"
        self._pad_buffers: dict[tuple[int, bool, int], torch.Tensor] = {}   # pad_to shape -> its metadata buffer
        self._pad_generations: dict[tuple[int, bool, int], int] = {}        # ... and how many plans have used it
        self._in_flight: StepBatch | None = None

    def __repr__(self) -> str:
        live = self.active_slots()
        c = self.config
        return (f"PLECache({self.num_slots} slots ({len(live)} live: {live}; slot {self.null_slot} is the null slot), "
                f"{self.num_layers} PLE layer(s), C={c.hc_hidden_size}, W={self.width} "
                f"(S={self.state_len} + {self.num_spec_tokens} spec), {self.layout}, {self.dtype}, "
                f"{self.device}, version {self._version})")

    # ---- views ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.conv_states.device

    @property
    def dtype(self) -> torch.dtype:
        return self.conv_states.dtype

    def conv_state(self, layer: int) -> torch.Tensor:
        """The ``[num_slots, C, W]`` conv state of PLE layer ``layer`` (a view; strided in channels_last)."""
        _checks.int_arg("layer", layer, minimum=0)
        if layer >= self.num_layers:
            raise ValueError(f"layer: the cache holds {self.num_layers} PLE layer(s), got {layer}")
        s = self.conv_states[layer]
        return s if self.layout == "channels_first" else s.transpose(1, 2)

    def context(self, slot: int) -> list[int]:
        """The n-gram context the next step of ``slot`` will hash with (N-1 tokens, oldest first)."""
        return list(self._live(slot, "slot").context)

    def length(self, slot: int) -> int:
        """Accepted tokens of the request in ``slot``."""
        return self._live(slot, "slot").length

    @property
    def contexts(self) -> torch.Tensor:
        """``[num_slots, N-1]`` int64: every slot's context (EOS for free slots)."""
        eos = self.config.eos_token_id
        rows = [s.context if s.active else [eos] * self.config.context_len for s in self._slots]
        return torch.tensor(rows, dtype=torch.int64).reshape(self.num_slots, self.config.context_len)

    @property
    def free_slots(self) -> int:
        """How many slots `allocate` can hand out now (an ``int``; the null slot is never one): the requests
        the cache can still admit. ``num_slots - 1 - len(active_slots())``."""
        return sum(not s.active for s in self._slots[1:])

    def active_slots(self) -> list[int]:
        """The slots that hold a request now (allocated, not yet freed), in increasing order; never the null
        slot."""
        return [i for i, s in enumerate(self._slots) if s.active]

    # ---- slots ---------------------------------------------------------------------------------
    def allocate(self) -> int:
        """Hand out a free slot (never the null slot 0); its state and context start fresh."""
        self._not_in_flight("allocate")
        for i in range(1, self.num_slots):
            if not self._slots[i].active:
                self._reset(i)
                self._slots[i].active = True
                self._changed(i, f"slot {i} was allocated")
                return i
        raise RuntimeError(f"PLECache is full: all {self.num_slots - 1} slots are in use "
                           f"(slot 0 is the null slot)")

    def free(self, slot: int) -> None:
        """Release ``slot``; its state and context are cleared."""
        self._not_in_flight("free")
        self._live(slot, "slot")
        self._reset(slot)
        self._changed(slot, f"slot {slot} was freed")

    def fork(self, slot: int) -> int:
        """A new slot holding a copy of ``slot``'s request (state of every layer, context, bookkeeping).

        With a checkpoint slot this restores a cached prefix for a new request.
        """
        self._not_in_flight("fork")
        src = self._live(slot, "slot")
        new = self.allocate()
        self.conv_states[:, new].copy_(self.conv_states[:, slot])
        dst = self._slots[new]
        dst.started, dst.length, dst.context = src.started, src.length, list(src.context)
        dst.num_accepted = src.num_accepted
        dst.spec_tokens = None if src.spec_tokens is None else list(src.spec_tokens)
        dst.spec_context = None if src.spec_context is None else list(src.spec_context)
        dst.realigned = list(src.realigned)
        self._changed(new, f"slot {slot} was forked into slot {new}")
        return new

    def accept(self, slot: int, n: int) -> None:
        """After a spec step of ``slot``: keep its first ``n`` tokens (1..tokens of that step)."""
        self._not_in_flight("accept")
        s = self._live(slot, "slot")
        _checks.int_arg("n", n)
        if s.spec_tokens is None:
            raise ValueError(f"slot: slot {slot}'s last step was not a spec step; nothing to accept")
        q = len(s.spec_tokens)
        if not 1 <= n <= q:
            raise ValueError(f"n: expected 1..{q} (the tokens of slot {slot}'s last spec step), got {n}")
        s.length += n - s.num_accepted
        s.num_accepted = n
        s.context = self._roll(cast(list, s.spec_context), s.spec_tokens[:n])   # set with spec_tokens
        self._changed(slot, f"slot {slot} accepted {n} token(s)")

    def _changed(self, slot: int | None, what: str) -> None:
        """Record a change that makes every batch scheduled before it stale (docs/spec.md section 7)."""
        self._version += 1
        if slot is not None:
            self._generations[slot] += 1
        self._last_change = what

    def _reset(self, slot: int) -> None:
        self.conv_states[:, slot].zero_()
        self._slots[slot] = _Slot(context=[self.config.eos_token_id] * self.config.context_len)

    def _live(self, slot: object, name: str) -> _Slot:
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise TypeError(f"{name}: expected an int slot, got {type(slot).__name__}")
        if slot == self.null_slot:
            raise ValueError(f"{name}: slot 0 is the null slot and never holds a request")
        if not 0 < slot < self.num_slots:
            raise ValueError(f"{name}: unknown slot {slot}; the cache has slots 1..{self.num_slots - 1}")
        if not self._slots[slot].active:
            raise ValueError(f"{name}: slot {slot} is not allocated (freed, or never allocated)")
        return self._slots[slot]

    def _not_in_flight(self, what: str) -> None:
        if self._in_flight is not None:
            done, total = len(self._in_flight.layers_done), self.num_layers
            raise RuntimeError(f"{what}: a step is in flight ({done} of {total} PLE layers have run); "
                               f"run the remaining layers first")

    def _roll(self, context: list[int], tokens: list[int]) -> list[int]:
        n = self.config.context_len
        return (list(context) + list(tokens))[-n:]

    # ---- scheduling ----------------------------------------------------------------------------
    def schedule(self, items: list[Prefill | Decode | Spec] | tuple[Prefill | Decode | Spec, ...], *,
                 pad_to: int | None = None) -> StepBatch:
        """The plan (`StepBatch`) of one step from ``Prefill``/``Decode``/``Spec`` items, in row order.

        Everything is validated here, on the host, where the items already are: a freed or
        unknown slot, a slot twice in one step, a spec step longer than ``num_spec_tokens +
        1``, a decode or spec before any prefill, token ids outside ``[0, vocab_size)``, or a
        bad checkpoint request raise ``ValueError``/``TypeError`` and change nothing. The
        plan's metadata reaches the device in one copy, so ``layer.step`` reads nothing back.
        A list of plain ``Decode`` items (``int`` slots and tokens), the commonest step, is
        parsed and laid out by a shorter path with the same result (`_plain_decodes`).

        ``pad_to=N``: pad a decode-only batch, or a spec batch whose requests all have
        ``num_spec_tokens + 1`` tokens, to ``N`` requests with null-slot rows, in a metadata
        buffer the cache keeps for that shape, so every such plan uses the same device
        tensors (CUDA-graph capture; see ``ple.state.batch``). The caller passes hidden
        states for all ``batch.num_tokens`` rows; the padding rows get no conv term.
        Scheduling again with the same ``pad_to`` reuses the buffer and makes the earlier
        plan stale.
        """
        self._not_in_flight("schedule")
        if not isinstance(items, (list, tuple)):
            raise TypeError(f"items: expected a list of Prefill/Decode/Spec, got {type(items).__name__}")
        if pad_to is None:
            decodes = self._plain_decodes(items)
            if decodes is not None:
                return build_plan(self, decodes, None)
        V = self.config.vocab_size
        S = self.state_len
        seen: set[int] = set()
        parsed: list[tuple[Prefill | Decode | Spec, list[int]]] = []
        for i, item in enumerate(items):
            where = f"items[{i}]"
            if not isinstance(item, (Prefill, Decode, Spec)):
                raise TypeError(f"{where}: expected Prefill, Decode or Spec, got {type(item).__name__}")
            s = self._live(item.slot, f"{where}.slot")
            if item.slot in seen:
                raise ValueError(f"{where}.slot: slot {item.slot} appears twice in one step")
            seen.add(item.slot)
            if isinstance(item, Decode):
                tokens = as_token_list(f"{where}.token", item.token)
                if len(tokens) != 1:
                    raise ValueError(f"{where}.token: a decode takes exactly one token, got {len(tokens)}")
            else:
                tokens = as_token_list(f"{where}.tokens", item.tokens)
            bad = [t for t in tokens if not 0 <= t < V]
            if bad:
                raise ValueError(f"{where}.tokens: token ids must lie in [0, {V}), got {bad[:4]}")
            if isinstance(item, (Decode, Spec)) and not s.started:
                kind = type(item).__name__.lower()
                raise ValueError(f"{where}: slot {item.slot} has no prefill yet; a {kind} needs one first")
            if isinstance(item, Spec) and not 1 <= len(tokens) <= self.num_spec_tokens + 1:
                raise ValueError(f"{where}.tokens: a spec step takes 1..num_spec_tokens + 1 = "
                                 f"{self.num_spec_tokens + 1} tokens, got {len(tokens)}")
            if isinstance(item, Prefill) and (item.checkpoint_at is not None or item.checkpoint_slot is not None):
                if item.checkpoint_at is None or item.checkpoint_slot is None:
                    raise ValueError(f"{where}: checkpoint_at and checkpoint_slot go together")
                _checks.int_arg(f"{where}.checkpoint_at", item.checkpoint_at)
                if not S <= item.checkpoint_at <= len(tokens) or item.checkpoint_at == 0:
                    raise ValueError(f"{where}.checkpoint_at: expected an offset in [S={max(S, 1)}, "
                                     f"{len(tokens)}] (the chunk's tokens), got {item.checkpoint_at}")
                c = self._live(item.checkpoint_slot, f"{where}.checkpoint_slot")
                if item.checkpoint_slot in seen or c.started:
                    raise ValueError(f"{where}.checkpoint_slot: slot {item.checkpoint_slot} must be a fresh "
                                     f"allocated slot not otherwise in this step")
                seen.add(item.checkpoint_slot)
            parsed.append((item, tokens))
        if not parsed:
            raise ValueError("items: a step needs at least one item")
        if pad_to is not None:
            self._check_padding(parsed, pad_to)
        return build_plan(self, parsed, pad_to)

    def _plain_decodes(self, items: list[Prefill | Decode | Spec] | tuple[Prefill | Decode | Spec, ...]
                       ) -> list[tuple[Prefill | Decode | Spec, list[int]]] | None:
        """`ple.state.items.plain_decodes` on this cache's slot records."""
        return plain_decodes(items, self._slots, self.config.vocab_size, self.null_slot)

    def _check_padding(self, parsed: list[tuple[Prefill | Decode | Spec, list[int]]], pad_to: int) -> None:
        _checks.int_arg("pad_to", pad_to, minimum=1)
        kinds = {type(item).__name__ for item, _ in parsed}
        q = self.num_spec_tokens + 1
        if kinds == {"Spec"} and any(len(t) != q for _, t in parsed):
            raise ValueError(f"pad_to: a padded spec batch needs num_spec_tokens + 1 = {q} tokens per request")
        if kinds not in ({"Decode"}, {"Spec"}):
            raise ValueError(f"pad_to: only decode-only or spec-only batches are padded, got {sorted(kinds)}")
        if len(parsed) > pad_to:
            raise ValueError(f"pad_to: the batch has {len(parsed)} requests, more than pad_to={pad_to}")

    # ---- called by PLELayer.step ---------------------------------------------------------------
    def run_layer_step(self, layer: PLELayer, hidden_states: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """``layer.step(hidden_states, batch, self)``: the layer hands its step to the cache it runs on (the
        layer module sits below ``ple.state`` and does not import it); see ``ple.state.step``."""
        return layer_step(layer, hidden_states, batch, self)

    def begin_layer(self, batch: StepBatch, layer: int) -> None:
        """Check that ``batch`` is current and PLE layer ``layer`` has not run it yet."""
        if not isinstance(batch, StepBatch):
            raise TypeError(f"batch: expected a StepBatch from cache.schedule, got {type(batch).__name__}")
        if batch.owner is not self._identity:
            raise ValueError("batch: it was scheduled by another PLECache; a batch runs only on the cache "
                             "that scheduled it")
        if batch.pad_key is not None and self._pad_generations.get(batch.pad_key) != batch.buffer_generation:
            raise ValueError(f"batch: stale; a later schedule(pad_to={batch.pad_to}) reused its metadata buffer")
        if batch.version != self._version:
            moved = [s for s, g in batch.slot_generations.items() if self._generations[s] != g]
            why = (f"slot(s) {moved} of the batch changed (allocated, freed, accepted or forked)" if moved
                   else f"the cache changed: {self._last_change}")
            raise ValueError(f"batch: stale; since it was scheduled {why}; schedule the step again")
        if layer >= self.num_layers:
            raise ValueError(f"cache: holds {self.num_layers} PLE layer(s) but the layer has PLE index {layer}")
        if layer in batch.layers_done:
            raise ValueError(f"batch: PLE layer {layer} has already run this step")
        if self._in_flight is not None and self._in_flight is not batch:
            raise ValueError("batch: another step is in flight")

    @deprecated_parameter("state", "conv_state", since="0.1.0")
    def realign_windows(self, batch: StepBatch, layer: int, conv_state: torch.Tensor) -> None:
        """Spec -> non-spec: move the window each such request reads to columns ``[0, S)`` of ``conv_state``
        (PLE layer ``layer``'s ``[num_slots, C, W]`` view; the keyword ``state=`` still works and warns:
        deprecated).

        Done once per slot and layer (recorded in the slot), so a step that fails after
        this and is run again does not move the window twice.
        """
        S = self.state_len
        for slot, offset in batch.realign:
            record = self._slots[slot].realigned
            if layer in record:
                continue
            conv_state[slot, :, :S] = conv_state[slot, :, offset:offset + S].clone()
            record.append(layer)

    def end_layer(self, batch: StepBatch, layer: int) -> None:
        """Record that ``layer`` ran; once the layer with the last PLE index has run, advance the
        contexts and bookkeeping (docs/spec.md section 7)."""
        batch.layers_done.add(layer)
        self._in_flight = batch
        if layer != self.num_layers - 1:
            return
        self._in_flight = None
        self._changed(None, "another batch's step completed")
        for item, tokens in zip(batch.items, batch.tokens_host):
            s = self._slots[item.slot]
            if isinstance(item, Spec):
                s.spec_context = list(s.context)
                s.spec_tokens = list(tokens)
                s.realigned = []
                s.num_accepted = len(tokens)            # all kept until accept() says otherwise
                s.context = self._roll(s.context, tokens)
                s.length += len(tokens)
                continue
            if isinstance(item, Prefill) and item.checkpoint_at:
                c = self._slots[cast(int, item.checkpoint_slot)]     # given with checkpoint_at
                c.started, c.length = True, s.length + item.checkpoint_at
                c.context = self._roll(s.context, tokens[: item.checkpoint_at])
                c.num_accepted, c.spec_tokens, c.spec_context = 1, None, None
            if tokens:
                s.started = True
            s.context = self._roll(s.context, tokens)
            s.length += len(tokens)
            s.num_accepted, s.spec_tokens, s.spec_context, s.realigned = 1, None, None, []

    # ---- save / load ---------------------------------------------------------------------------
    SLOT_FIELDS = tuple(f.name for f in fields(_Slot))
    """The fields of one slot's host bookkeeping, in order (the entries of `slot_table`)."""

    def slot_table(self) -> list[dict[str, Any]]:
        """Every slot's host bookkeeping as plain dicts of `SLOT_FIELDS` (copies), for ``ple.state.persist``."""
        return [asdict(s) for s in self._slots]

    def restore_slot_table(self, table: list[dict[str, Any]]) -> None:
        """Replace every slot's bookkeeping by ``table`` (entries as `slot_table` gives them, one per slot; the
        caller checks their values, as ``ple.state.persist.load_cache`` does)."""
        if len(table) != self.num_slots or any(set(s) != set(self.SLOT_FIELDS) for s in table):
            raise ValueError(f"table: expected {self.num_slots} entries of the fields {list(self.SLOT_FIELDS)}")
        self._slots = [_Slot(**s) for s in table]

    def save(self, path: str | os.PathLike) -> None:
        """Write the whole cache (states, contexts, slot table) to a safetensors file, bit-exact."""
        self._not_in_flight("save")
        save_cache(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike, *, device: Device = None) -> PLECache:
        """Read a cache written by `save`; the same states (bit for bit), contexts and slot table.

        Every part of the file is checked first: a damaged, truncated, empty or edited file
        is a ``ValueError`` naming ``path`` and what is wrong (``ple.state.persist``).
        """
        return load_cache(cls, path, device=device)
