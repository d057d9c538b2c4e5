"""`check_layer`: a whole `PLELayer` on the user's ops against the reference layer.

The layer calls the same ops in the same order on every backend, so this exercises the
user's entry points whole, fused ones included. Three parts, each over Hypothesis-drawn
configs (channels beyond one tile: C up to a few hundred, odd sizes; K 1..5; two PLE layers):

Both families are drawn (docs/spec.md section 15: an Engram config's window rule, token map, biases and
norm form reach the ops as arguments).

* **forward**: ``layer(hidden, ids, mask)`` with left / right padding, which runs the ops'
  ``ngram_embedding`` (hash and gather), the projections, then ``ple_prefill`` (gate, the
  padding mask as ``keep``, conv from zero history, both adds); judged against a float64 run of
  the reference layer (the fast error at most twice the reference's own, plus a floor: docs/spec.md
  section 8's rule for ill-conditioned gates, used throughout here);
* **gradients** of the hidden states and of every parameter (through ``ple_prefill``'s and
  ``ngram_embedding``'s autograd), judged the same way;
* **serving**: a script through ``layer.step`` on a ``PLECache`` (float32, every PLE layer of
  the config chained): a fixed opening that has every kind of step (prefill-only steps, which
  run the ops' ``ple_prefill`` on the cache's conv states, from fresh slots and from carried
  states, one with a chunk shorter than S and one right after a spec step; mixed steps, which
  run ``ple_gate`` then a ``ple_conv`` per mode: decode + prefill and prefill + spec with
  partial acceptance), then random traffic (chunked prefills, decodes, spec steps with random
  acceptance, appends after spec, slot reuse). After every step every conv state must equal
  bit for bit the layer's own last S conv inputs, and every accepted token's output must equal
  the reference layer's forward over its whole sequence.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from hypothesis import given, note
from hypothesis import strategies as st

from ... import _checks
from ...config import PLEConfig
from ...state import PLECache
from ..layers import random_layer
from ..serving import Action, check_replay, random_script, replay
from ..strategies import configs
from ._options import check_options
from ._report import compare_close, fmt_case
from .conv import _seeded, _settings

__all__ = ["check_layer", "serving_script"]


def _layers(config, ops, dtype, seed, num_layers):
    """(layers on ``ops``, reference layers, float64 reference layers) with the same random weights."""
    from ...layer import PLELayer
    mine, refs, r64 = [], [], []
    for i in range(num_layers):
        base = random_layer(config, i, dtype=dtype, seed=seed + i)
        a = PLELayer(config, i, ops=ops, dtype=dtype)
        a.load_state_dict(base.state_dict())
        b = PLELayer(config, i, dtype=torch.float64)
        b.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in base.state_dict().items()})
        mine.append(a)
        refs.append(base)
        r64.append(b)
    return mine, refs, r64


def serving_script(config: PLEConfig, seed: int) -> list[list[Action]]:
    """The serving part's script: a fixed opening with every kind of step, then random traffic.

    The opening (requests 1000 and 1001, both finished before the random part starts, so its
    requests reuse their slots): prefill-only on fresh slots; prefill-only with initial states
    (one chunk of a single token, shorter than any S > 1); decode + prefill; prefill + spec
    (3 tokens, 2 accepted); prefill-only right after that spec (a realigned window); a decode.
    """
    rng = random.Random(seed)

    def toks(n):
        return tuple(config.eos_token_id if rng.random() < 0.1 else rng.randrange(config.vocab_size)
                     for _ in range(n))
    a, b, S = 1000, 1001, config.conv_state_len
    opening = [
        [Action(a, "prefill", toks(5)), Action(b, "prefill", toks(2))],
        [Action(b, "prefill", toks(1)), Action(a, "prefill", toks(S + 2))],
        [Action(b, "decode", toks(1)), Action(a, "prefill", toks(3))],
        [Action(a, "prefill", toks(2)), Action(b, "spec", toks(3), 2)],
        [Action(b, "prefill", toks(2)), Action(a, "prefill", toks(1), finish=True)],
        [Action(b, "decode", toks(1), finish=True)],
    ]
    return opening + random_script(rng, vocab_size=config.vocab_size, eos_token_id=config.eos_token_id,
                                   num_requests=4, max_live=3, max_prompt=12, max_chunk=5, max_generate=4,
                                   num_spec_tokens=2, eos_rate=0.1, append_rate=0.2)


@st.composite
def _layer_cases(draw, dtypes, max_hidden, families=("qwen4exp", "engram")):
    config = draw(configs(max_hidden=max_hidden, max_hc=3, families=families))
    B, L = draw(st.integers(1, 3)), draw(st.integers(1, 24))
    return dict(config=config, dtype=draw(st.sampled_from(list(dtypes))), B=B, L=L,
                pads=draw(st.lists(st.tuples(st.sampled_from(["none", "left", "right"]), st.integers(0, L - 1)),
                                   min_size=B, max_size=B)),
                script_seed=draw(st.integers(0, 2**31 - 1)), seed=draw(st.integers(0, 2**31 - 1)))


def check_one_layer(ops: object, case: dict[str, Any], *, grad: bool = True, serving: bool = True) -> None:
    config: PLEConfig = case["config"]
    dt = case["dtype"]
    B, L, C = case["B"], case["L"], config.hc_hidden_size
    mine, refs, r64 = _layers(config, ops, dt, case["seed"], 1)
    g = torch.Generator().manual_seed(case["seed"])
    hidden = torch.randn(B, L, C, generator=g, dtype=torch.float64).to(dt)
    ids = torch.randint(0, config.vocab_size, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.int64)
    for b, (kind, n) in enumerate(case["pads"]):
        if kind == "left":
            mask[b, :n] = 0
        elif kind == "right":
            mask[b, L - n:] = 0
    up = torch.randn(B, L, C, generator=g, dtype=torch.float64).to(dt)
    where = lambda idx: f"sequence {idx[0]}, position {idx[1]}, channel {idx[2]}"  # noqa: E731
    outs, grads = [], []
    for layer, h, u in ((mine[0], hidden, up), (refs[0], hidden, up), (r64[0], hidden.double(), up.double())):
        h = h.clone().requires_grad_(grad)
        y = layer(h, ids, mask)
        outs.append(y.detach())
        if grad:
            y.backward(u)
            grads.append({"hidden_states": h.grad, **{n: p.grad for n, p in layer.named_parameters()}})
    compare_close(outs[0], outs[1], outs[2], name="layer forward", where=where, case=case, judge64=True)
    if grad:
        for name in grads[1]:
            if grads[1][name] is None:
                continue
            if grads[0][name] is None:
                raise AssertionError(f"layer gradient of {name}: none was computed\n  case: {fmt_case(case)}")
            w = where if name == "hidden_states" else (lambda idx: f"element {idx}")
            compare_close(grads[0][name].to_dense(), grads[1][name].to_dense(), grads[2][name].to_dense(),
                          name=f"layer gradient of {name}", where=w, case=case, judge64=True)
    if serving:
        n = config.num_ple_layers
        mine, refs, _ = _layers(config, ops, torch.float32, case["seed"], n)
        cache = PLECache(config, num_slots=4, num_spec_tokens=2, num_layers=n, dtype=torch.float32)
        script = serving_script(config, case["script_seed"])
        try:
            with torch.no_grad():
                res = replay(mine, cache, script, generator=torch.Generator().manual_seed(case["seed"]))
            check_replay(refs, res)
        except AssertionError as e:
            raise AssertionError(f"serving (float32, {n} PLE layers): {e}\n  case: {fmt_case(case)}") from None


def check_layer(ops: object, *, dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16), max_hidden: int = 40,
                grad: bool = True,
                serving: bool = True, families: Sequence[str] = ("qwen4exp", "engram"), max_examples: int = 10,
                seed: int | None = 0) -> None:
    """Check ``PLELayer(config, ops=ops)`` whole against the reference layer (see the module docstring).

    ``ops`` is any object with the op names of ``ple.backends.OP_NAMES``. The forward (through
    ``ngram_embedding`` and ``ple_prefill``) in each of ``dtypes``, its gradients (``grad``) and
    a serving replay (``serving``, float32: prefill-only steps through ``ple_prefill`` with the
    cache's states, mixed steps through ``ple_gate`` + ``ple_conv``). ``max_hidden`` bounds the
    stream width; ``max_examples`` cases, ``seed`` fixes the draw (None: Hypothesis's own
    randomness). Returns quietly or raises ``AssertionError`` naming the part and the smallest
    case. Both families are drawn; ``families=("qwen4exp",)`` checks ops written for the Qwen4Exp family alone
    (an Engram layer passes its norms' form to ``ple_gate`` / ``ple_prefill`` as keywords, docs/spec.md
    section 15). In the Engram family the float64 judge runs its own dtype's key / query eps
    (``torch.finfo(float64).eps``, as the demo's ``nn.RMSNorm`` would), which differs from a bfloat16 layer's."""
    check_options(dtypes=dtypes, max_hidden=max_hidden, grad=grad, serving=serving, max_examples=max_examples,
                  seed=seed)
    from .ops import FAMILIES
    families = _checks.choices_arg("families", families, FAMILIES)
    @given(case=_layer_cases(dtypes, max_hidden, families))
    @_settings(max_examples, seed)
    def prop(case):
        note(repr(case))
        check_one_layer(ops, case, grad=grad, serving=serving)

    _seeded(prop, seed)()
