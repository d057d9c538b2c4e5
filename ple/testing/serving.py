"""Serving scripts: random request traffic, replayed through `PLECache` and checked against `forward`.

A *script* is a list of steps; each step is a list of `Action`s, in row order:
``Action(rid, kind, tokens, accept)`` appends ``tokens`` to request ``rid`` as a
``"prefill"``, ``"decode"`` or ``"spec"`` item, and for spec keeps the first
``accept`` tokens. A request is allocated a slot at its first action and freed
after its action with ``finish=True``, so slots are reused.

`random_script` draws such traffic from a ``random.Random`` (the demo uses one
seeded from ``--seed``; `ple.testing.strategies.serving_scripts` feeds it
Hypothesis' randomness). `replay` runs a script through one or more PLE layers
stacked as in the model, and `check_replay` compares every accepted token's
output with the layers' whole-sequence ``forward`` and every live slot's conv
state with the conv inputs it must hold, bit for bit.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..state import Decode, PLECache, Prefill, Spec
from .conversions import count_host_conversions
from .numerics import assert_bitwise_equal

if TYPE_CHECKING:
    from ..layer import PLELayer
    from ..state import StepBatch

__all__ = ["Action", "random_script", "replay", "check_replay", "ReplayResult", "conv_inputs_of_step"]


@dataclass(frozen=True)
class Action:
    rid: int
    kind: str                   # "prefill" | "decode" | "spec"
    tokens: tuple[int, ...]
    accept: int | None = None   # spec only: tokens kept
    finish: bool = False        # free the request's slot after this step


def random_script(rng: random.Random, *, vocab_size: int, eos_token_id: int, num_requests: int = 6,
                  max_live: int = 3, max_prompt: int = 20, max_chunk: int = 8, max_generate: int = 8,
                  num_spec_tokens: int = 0, eos_rate: float = 0.1, append_rate: float = 0.1) -> list[list[Action]]:
    """Random traffic: requests arrive, prefill in chunks, then decode or speculate, then finish.

    At most ``max_live`` requests are live at once; each step shuffles its items.
    With ``append_rate`` a generating request receives another prefill chunk (e.g. a
    tool result), which exercises the spec -> prefill realignment.
    """
    def token() -> int:
        return eos_token_id if rng.random() < eos_rate else rng.randrange(vocab_size)

    pending = list(range(num_requests))
    live: dict[int, dict[str, int]] = {}
    script: list[list[Action]] = []
    while pending or live:
        while pending and len(live) < max_live and (not live or rng.random() < 0.6):
            rid = pending.pop(0)
            live[rid] = dict(prompt=rng.randint(1, max_prompt), generate=rng.randint(1, max_generate))
        step: list[list[Any]] = []           # [rid, kind, tokens, accept]
        for rid, r in list(live.items()):
            if r["prompt"] > 0:
                n = min(r["prompt"], rng.randint(1, max_chunk))
                r["prompt"] -= n
                step.append([rid, "prefill", tuple(token() for _ in range(n)), None])
                continue
            if rng.random() < append_rate:
                n = rng.randint(1, max_chunk)
                step.append([rid, "prefill", tuple(token() for _ in range(n)), None])
                continue
            if num_spec_tokens and rng.random() < 0.6:
                q = rng.randint(1, num_spec_tokens + 1)
                a = rng.randint(1, q)
                step.append([rid, "spec", tuple(token() for _ in range(q)), a])
                r["generate"] -= a
            else:
                step.append([rid, "decode", (token(),), None])
                r["generate"] -= 1
        rng.shuffle(step)
        actions = []
        for rid, kind, tokens, accept in step:
            done = live[rid]["prompt"] == 0 and live[rid]["generate"] <= 0
            if done:
                del live[rid]
            actions.append(Action(rid, kind, tokens, accept, finish=done))
        script.append(actions)
    return script


@dataclass
class ReplayResult:
    """What `replay` saw: per request its accepted tokens, hidden rows and outputs; per step a summary."""

    tokens: dict[int, list[int]] = field(default_factory=dict)       # rid -> list of accepted token ids
    hidden: dict[int, list[torch.Tensor]] = field(default_factory=dict)   # rid -> [n, C] input rows (accepted)
    outputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # rid -> [n, C] output rows (accepted)
    # rid -> per layer, list of [n, C] conv inputs
    conv_inputs: dict[int, list[list[torch.Tensor]]] = field(default_factory=dict)
    # rid -> per accepted token, (step, "prefill"/"decode"/"spec")
    origin: dict[int, list[tuple[int, str]]] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)   # prefill/decode/spec counts, tokens, seconds
    finished: list[int] = field(default_factory=list)           # rids in the order they finished
    state_checks: int = 0
    seconds: float = 0.0
    conversions: list[tuple[int, str, str]] = field(default_factory=list)   # with count_conversions: records

    def __repr__(self) -> str:
        kinds = {k: sum(s[k] for s in self.steps) for k in ("prefill", "decode", "spec")}
        accepted = sum(len(t) for t in self.tokens.values())
        return (f"ReplayResult({len(self.tokens)} requests ({len(self.finished)} finished), {len(self.steps)} steps "
                f"({kinds['prefill']} prefill / {kinds['decode']} decode / {kinds['spec']} spec items), "
                f"{accepted} accepted tokens, {self.state_checks} state checks, {self.seconds:.2f} s)")


def conv_inputs_of_step(layer: PLELayer, hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    """The conv inputs the layer computed inside `step` for these rows (same ops, same shapes: same bits).

    A step run as one ``ple_prefill`` (``ple.state.step.uses_fused_prefill``) never materialises
    them: where the op module offers ``prefill_conv_inputs`` (``ple.fast``: the arithmetic of the
    kernel that writes its states, whose float32 sums over H may end one ulp from ``ple_gate``'s)
    they come from it, else from the backend's ``ple_gate``.
    """
    from ..state.step import uses_fused_prefill
    cfg = layer.config
    ids = layer.ops.ngram_ids(batch.input_ids, layer.ple_embedding.hash_params(),
                              heads_per_ngram=cfg.heads_per_ngram, eos_token_id=cfg.eos_token_id,
                              query_start_loc=batch.query_start_loc, ngram_context=batch.ngram_context)
    emb = layer.embed(ids, hidden.dtype)
    fused_inputs = getattr(layer.ops, "prefill_conv_inputs", None)
    if uses_fused_prefill(batch) and fused_inputs is not None:
        key, value = layer.project(emb)
        return fused_inputs(key, value, hidden, *layer.norm_weights, cfg.gate_eps(hidden.dtype), cfg.conv_state_len,
                            **cfg.gate_options())
    return layer.gate(emb, hidden)[1]


def step_each(layers: Sequence[PLELayer], caches: Sequence[PLECache], slots: Sequence[Sequence[int]],
              plan: Sequence[tuple[str, int, Any]], *, generator: torch.Generator | None = None,
              dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> list[torch.Tensor]:
    """One step of ``plan`` through each layer on its own cache (a sharded layer and the whole one, say).

    ``plan``'s ``(kind, request, tokens)`` entries (kind ``"prefill"``, ``"decode"`` or ``"spec"``) are
    scheduled on each cache, request r on that cache's ``slots[r]``. The hidden states, ``[tokens, C]`` normal
    draws (``torch.randn`` with ``generator``, ``dtype`` and ``device``), are drawn once, at the first layer,
    and every layer steps on them. Returns the layers' outputs, in order.
    """
    h = None
    outs = []
    for layer, cache, s in zip(layers, caches, slots, strict=True):
        items: list[Prefill | Decode | Spec] = [
            Prefill(s[r], t) if kind == "prefill" else Decode(s[r], t) if kind == "decode" else Spec(s[r], t)
            for kind, r, t in plan]
        batch = cache.schedule(items)
        if h is None:
            h = torch.randn(batch.num_tokens, layer.config.hc_hidden_size, generator=generator, dtype=dtype,
                            device=device)
        outs.append(layer.step(h, batch, cache))
    return outs


def replay(layers: Iterable[PLELayer], cache: PLECache, script: Iterable[Sequence[Action]], *,
           generator: torch.Generator | None = None, check_states: bool = True,
           on_step: Callable[[int, StepBatch, float], object] | None = None,
           count_conversions: bool = False) -> ReplayResult:
    """Run ``script`` through ``layers`` (PLE layers in PLE-index order, chained as in the model).

    Hidden states of each step are drawn from ``generator``. With ``check_states``
    every live slot's conv state of every layer is compared bit for bit, after every
    step, with the last S accepted conv inputs (zeros before the sequence start),
    taken at the window the next step will read. ``on_step(index, batch, seconds)``
    is called after each step. With ``count_conversions`` every tensor-to-Python conversion
    made inside the ``layer.step`` calls is recorded in ``result.conversions``
    (``ple.testing.conversions``): a serving step must make none.
    """
    layers = list(layers)
    cfg = cache.config
    S = cfg.conv_state_len
    C = cfg.hc_hidden_size
    dtype = layers[0].key_proj.weight.dtype
    dev = cache.device
    res = ReplayResult()
    slot_of: dict[int, int] = {}                  # request id -> its slot
    t_start = time.perf_counter()
    for index, actions in enumerate(script):
        items: list[Prefill | Decode | Spec] = []
        for a in actions:
            if a.rid not in slot_of:
                slot_of[a.rid] = cache.allocate()
                res.tokens[a.rid], res.hidden[a.rid], res.outputs[a.rid], res.origin[a.rid] = [], [], [], []
                res.conv_inputs[a.rid] = [[] for _ in layers]
            s = slot_of[a.rid]
            item = {"prefill": Prefill, "spec": Spec}.get(a.kind)
            items.append(item(s, list(a.tokens)) if item else Decode(s, a.tokens[0]))
        batch = cache.schedule(items)
        hidden = torch.randn(batch.num_tokens, C, generator=generator, dtype=torch.float32).to(dtype).to(dev)
        t0 = time.perf_counter()
        h = hidden
        conv_in = []
        for layer in layers:
            if check_states:
                conv_in.append(conv_inputs_of_step(layer, h, batch))
            if count_conversions:
                with count_host_conversions() as seen:
                    h = layer.step(h, batch, cache)
                res.conversions += [(index, what, where) for what, where in seen.records]
            else:
                h = layer.step(h, batch, cache)
        seconds = time.perf_counter() - t0
        row = 0
        for a in actions:
            n = len(a.tokens)
            keep = n
            if a.kind == "spec" and a.accept is not None:
                keep = a.accept
                cache.accept(slot_of[a.rid], keep)
            res.tokens[a.rid] += list(a.tokens[:keep])
            res.origin[a.rid] += [(index, a.kind)] * keep
            res.hidden[a.rid].append(hidden[row:row + keep])
            res.outputs[a.rid].append(h[row:row + keep])
            for li, ci in enumerate(conv_in):
                res.conv_inputs[a.rid][li].append(ci[row:row + keep])
            row += n
        if check_states:
            for a in actions:
                _check_state(cache, slot_of[a.rid], res.conv_inputs[a.rid], S, C, len(layers))
                res.state_checks += 1
        for a in actions:
            if a.finish:
                cache.free(slot_of.pop(a.rid))
                res.finished.append(a.rid)
        res.steps.append(dict(step=index, prefill=sum(a.kind == "prefill" for a in actions),
                              decode=sum(a.kind == "decode" for a in actions),
                              spec=sum(a.kind == "spec" for a in actions), tokens=batch.num_tokens,
                              live=len(cache.active_slots()), seconds=seconds))
        if on_step is not None:
            on_step(index, batch, seconds)
    res.seconds = time.perf_counter() - t_start
    return res


def _check_state(cache: PLECache, slot: int, conv_inputs: list[list[torch.Tensor]], state_len: int, channels: int,
                 num_layers: int) -> None:
    """The window the next step reads must be the last ``state_len`` accepted conv inputs, bit for bit."""
    S, C = state_len, channels
    if S == 0:
        return
    o = cache._slots[slot].num_accepted - 1
    for li in range(num_layers):
        rows = torch.cat(conv_inputs[li]) if conv_inputs[li] else torch.zeros(0, C)
        rows = rows.to(cache.dtype)
        hist = torch.cat([torch.zeros(S, C, dtype=cache.dtype, device=rows.device), rows])[-S:]
        got = cache.conv_state(li)[slot, :, o:o + S].T
        assert_bitwise_equal(got, hist, name=f"conv state of slot {slot}, PLE layer {li}")


def check_replay(layers: Sequence[PLELayer], result: ReplayResult, *, rtol: float = 1e-5,
                 atol: float = 1e-5) -> float:
    """Compare every accepted token's output with ``forward`` over its whole accepted sequence.

    Returns the largest absolute error; raises ``AssertionError`` past the tolerance.
    """
    worst = 0.0
    for rid, toks in result.tokens.items():
        if not toks:
            continue
        hidden = torch.cat(result.hidden[rid])[None]
        ids = torch.tensor(toks, device=hidden.device)[None]
        expected = hidden
        with torch.no_grad():
            for layer in layers:
                expected = layer(expected, ids)
        got = torch.cat(result.outputs[rid])[None]
        err = (got.double() - expected.double()).abs()
        worst = max(worst, float(err.max()))
        bound = atol + rtol * expected.double().abs()
        if not bool((err <= bound).all()):
            i, c = divmod(int((err - bound).flatten().argmax()), hidden.shape[-1])
            step, kind = result.origin[rid][i] if result.origin.get(rid) else (None, "?")
            cfg = layers[0].config
            raise AssertionError(
                f"request {rid}: the output of token {i} of {len(toks)} (made by a {kind} in step {step}) differs "
                f"from forward over the request's sequence at channel {c} (stream {c // cfg.hidden_size}): "
                f"step {float(got[0, i, c]):.7g}, forward {float(expected[0, i, c]):.7g}, error "
                f"{float(err[0, i, c]):.3g} > {float(bound[0, i, c]):.3g}; config: C={cfg.hc_hidden_size} "
                f"(hc_count={cfg.hc_count} x hidden_size={cfg.hidden_size}), K={cfg.ple_conv_kernel_size}, "
                f"dilation={cfg.conv_dilation}, N={cfg.ngram_size}, {len(layers)} PLE layer(s), "
                f"{expected.dtype}")
    return worst
