"""`check_ngram_ids`, `check_ngram_embedding`, `check_embedding_lookup`, `check_ple_gate`, `check_dilated_causal_conv`.

Each drives the user's function through a Hypothesis property against ``ple.reference``:
outputs by the tolerance table (bfloat16 against a float64 reference run), integer results
and gathered rows (``embedding_lookup``, ``ngram_embedding``: copies) bit for bit, gradients
of every differentiable input by the same table (None, autograd not reaching an input, passes
only where the reference's gradient is all zero). The two lookups also gather quantized tables
(FP8 bytes, int8, NF4's packed rows; ``quantized``): the stored rows bit for bit, and the values
they stand for, unpacked, bit for bit.
Sizes go beyond one tile and are often odd; index tensors are int32 or int64; fresh buffers
are NaN-poisoned while the function runs. A failure raises ``AssertionError`` naming the
smallest case, the element (request, row, channel, head) and both values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import given, note
from hypothesis import strategies as st

from ... import _checks
from ... import reference as ref
from ...config import PLEConfig
from ..strategies import configs, varlen_batches
from ._options import check_options
from ._report import compare_bits, compare_close, fmt_case, poisoned_empty, row_of
from .cases import HALF_DTYPES, randn, to64
from .conv import DTYPES, _seeded, _settings
from .quantized import SCHEMES, as_schemes, check_quantized, even_dim, quantized_table

__all__ = ["check_ngram_ids", "check_ngram_embedding", "check_embedding_lookup", "check_ple_gate",
           "check_dilated_causal_conv"]


def _prop(strategy, body, max_examples, seed):
    @given(case=strategy)
    @_settings(max_examples, seed)
    def prop(case):
        note(repr(case))
        body(case)
    _seeded(prop, seed)()


def _grads(fn, inputs: dict, wrt: list[str], g_out, **kw):
    """``fn(**inputs, **kw)`` and the gradients of ``wrt`` for the upstream gradient ``g_out``."""
    leaves = {k: (v.detach().clone().requires_grad_(True) if k in wrt else v) for k, v in inputs.items()}
    out = fn(*leaves.values(), **kw)
    outs = out if isinstance(out, tuple) else (out,)
    gs = g_out(outs)
    live = [(o, g) for o, g in zip(outs, gs, strict=False) if isinstance(o, torch.Tensor) and o.requires_grad]
    grads: tuple[torch.Tensor | None, ...] = (None,) * len(wrt)   # autograd reaches no output: no gradient
    if wrt and live:
        grads = torch.autograd.grad([o for o, _ in live], [leaves[k] for k in wrt], [g for _, g in live],
                                    allow_unused=True)
    return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs), dict(zip(wrt, grads, strict=True))


# ---- ngram_ids ------------------------------------------------------------------------------------

def _family(config: PLEConfig) -> str:
    """The hash family of a case, as its report names it (the config's repr leaves the token map out)."""
    if config.family != "engram":
        return "qwen4exp (EOS rule)"
    if config.token_map is None:
        return f"engram (no EOS rule, pad {config.eos_token_id}, no token_map)"
    return (f"engram (no EOS rule, pad {config.eos_token_id}, token_map onto {config.token_vocab_size} ids: "
            f"{list(config.token_map)})")


@st.composite
def _ngram_cases(draw, max_requests, families=("qwen4exp", "engram")):
    # Both families (docs/spec.md sections 3 and 15): the Engram one has no EOS rule and, half the time, a
    # token_map onto fewer ids, so an op that ignores params.token_map or params.eos_rule fails.
    config = draw(configs(max_hidden=3, families=families))
    batch = draw(varlen_batches(config, max_requests=max_requests, max_len=40))
    return dict(family=_family(config), config=config, ple_layer_index=draw(st.integers(0, 1)),
                input_ids=batch.input_ids.tolist(),
                query_start_loc=batch.query_start_loc.tolist(), index_dtype=batch.query_start_loc.dtype,
                ids_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                context=batch.ngram_context.tolist() if draw(st.booleans()) else None)


def check_ngram_ids(fn: Callable[..., Any], *, max_examples: int = 25, max_requests: int = 4,
                    families: Sequence[str] = ("qwen4exp", "engram"), seed: int | None = 0) -> None:
    """Check ``fn`` (the signature of ``ple.reference.ngram_ids``): the ``[T, NH]`` ids, exactly.

    Cases: both families' hash parameters (``ref.hash_params`` of a drawn config): Qwen4Exp's, with the EOS
    rule, and Engram's (``params.eos_rule`` False, and half the time a ``params.token_map`` onto fewer ids),
    varlen batches heavy in the EOS / pad token, with and without ``ngram_context``, int32 / int64 ids and
    offsets. A failure names the case's family (its token map included). ``families=("qwen4exp",)`` checks
    an op written for the Qwen4Exp family alone."""
    check_options(max_examples=max_examples, max_requests=max_requests, seed=seed)
    families = _checks.choices_arg("families", families, FAMILIES)
    def body(case):
        c: PLEConfig = case["config"]
        params = ref.hash_params(c, case["ple_layer_index"])
        kw: dict[str, Any] = dict(heads_per_ngram=c.heads_per_ngram, eos_token_id=c.eos_token_id,
                  query_start_loc=torch.tensor(case["query_start_loc"], dtype=case["index_dtype"]),
                  ngram_context=None if case["context"] is None else torch.tensor(case["context"]).reshape(
                      -1, c.context_len))
        ids = torch.tensor(case["input_ids"], dtype=case["ids_dtype"])
        want = ref.ngram_ids(ids, params, **kw)
        with poisoned_empty():
            got = fn(ids, params, **kw)
        query_start_loc_list = case["query_start_loc"]
        compare_bits(got, want, name="ngram_ids", case=case,
                     where=lambda idx: f"{row_of(query_start_loc_list, idx[0])}, head {idx[1]} "
                                       f"(n-gram {idx[1] // c.heads_per_ngram + 2})")
    _prop(_ngram_cases(max_requests, families), body, max_examples, seed)


# ---- ngram_embedding ------------------------------------------------------------------------------

@st.composite
def _scheme(draw, schemes):
    """None (a float table) half the time, else one of ``schemes`` (float tables only when there are none)."""
    return draw(st.sampled_from(schemes)) if schemes and draw(st.booleans()) else None


@st.composite
def _ngram_embedding_cases(draw, dtypes, max_requests, max_dim, schemes, families=("qwen4exp", "engram")):
    case = draw(_ngram_cases(max_requests, families))
    case.update(dtype=draw(st.sampled_from(list(dtypes))),
                D=draw(st.one_of(st.just(None), st.integers(1, max_dim), st.sampled_from([128, 160]))),
                extra_rows=draw(st.sampled_from([0, 0, 1, 7])), strided=draw(st.booleans()),
                column_ids=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)), scheme=draw(_scheme(schemes)))
    if case["scheme"] is not None:
        del case["dtype"]                 # the values are judged in every dtype of the check
        D = case["D"] or case["config"].ngram_head_dim
        case["D"] = even_dim(D) if case["scheme"] == "nf4" else D
    return case


def check_ngram_embedding(fn: Callable[..., Any], *,
                          dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16, torch.float64),
                          max_dim: int = 200, max_requests: int = 4, grad: bool = True,
                          schemes: Sequence[str] = SCHEMES, families: Sequence[str] = ("qwen4exp", "engram"),
                          max_examples: int = 25, seed: int | None = 0) -> None:
    """Check ``fn`` (the signature of ``ple.reference.ngram_embedding``): the ``[T, NH * D]`` rows bit for bit
    (hashing then a gather: a copy), and with ``grad`` the table's gradient by the tolerance table.

    Cases: varlen batches (empty requests included, EOS-heavy), with and without ``ngram_context``,
    int32 / int64 ids (sometimes a strided column), offsets and contexts, two PLE layers' hash
    parameters of either family (``check_ngram_ids``: Engram's without the EOS rule, sometimes with a
    token map), table widths D from the config's to beyond a tile, tables with spare rows or a
    strided column slice, in each of ``dtypes``, and quantized tables of each of ``schemes``
    (``()``: none) as ``check_embedding_lookup`` gives them: ``fn`` given an NF4 table's packed uint8
    ``[rows, D/2 + 4]`` rows (or an FP8 table's raw bytes, or an int8 table) returns the gathered
    stored rows, ``embedding_lookup(weight, ngram_ids(...))``, bit for bit, and their values unpacked
    in each of ``dtypes`` are the table's; no gradient. ``families=("qwen4exp",)`` leaves the Engram family out.
    """
    check_options(dtypes=dtypes, max_dim=max_dim, max_requests=max_requests, grad=grad, max_examples=max_examples,
                  seed=seed)
    schemes = as_schemes(schemes)
    families = _checks.choices_arg("families", families, FAMILIES)

    def body(case):
        c: PLEConfig = case["config"]
        params = ref.hash_params(c, case["ple_layer_index"])
        ix, idt = case["index_dtype"], case["ids_dtype"]
        kw: dict[str, Any] = dict(heads_per_ngram=c.heads_per_ngram, eos_token_id=c.eos_token_id,
                  query_start_loc=torch.tensor(case["query_start_loc"], dtype=ix),
                  ngram_context=None if case["context"] is None else torch.tensor(case["context"], dtype=idt).reshape(
                      -1, c.context_len))
        g = torch.Generator().manual_seed(case["seed"])
        D = case["D"] or c.ngram_head_dim
        rows = params.num_rows + case["extra_rows"]
        ids = torch.tensor(case["input_ids"], dtype=idt)
        if case["column_ids"]:
            ids = torch.stack([ids, torch.zeros_like(ids)], 1)[:, 0]
        heads = ref.ngram_ids(ids, params, **kw)
        query_start_loc_list, P = case["query_start_loc"], c.heads_per_ngram

        def where_head(t, h):
            return (f"{row_of(query_start_loc_list, t)}, head {h} (n-gram {h // P + 2}, "
                    f"table row {heads[t, h].item()})")
        if case["scheme"] is not None:
            table = quantized_table(case["scheme"], rows, D, g, strided=case["strided"])
            want = ref.ngram_embedding(table.stored, ids, params, **kw)
            with poisoned_empty():
                got = fn(table.stored, ids, params, **kw)
            check_quantized(got, want, table, heads, dtypes=dtypes, name="ngram_embedding", case=case,
                            where_head=where_head)
            return
        weight = randn((rows, D + 2) if case["strided"] else (rows, D), case["dtype"], g)[:, :D]
        up = randn((ids.numel(), heads.shape[1] * D), case["dtype"], g)
        wrt = ["weight"] if grad else []
        (want,), gw = _grads(ref.ngram_embedding, dict(weight=weight, input_ids=ids, params=params), wrt,
                             lambda outs: (up,), **kw)
        with poisoned_empty():
            (got,), gg = _grads(fn, dict(weight=weight, input_ids=ids, params=params), wrt, lambda outs: (up,), **kw)
        compare_bits(got, want, name="ngram_embedding: output", case=case,
                     where=lambda idx: f"{where_head(idx[0], idx[1] // D)}, column {idx[1] % D}")
        if grad:
            exact = None
            if case["dtype"] in HALF_DTYPES:
                _, g64 = _grads(ref.ngram_embedding, dict(weight=to64(weight), input_ids=ids, params=params), wrt,
                                lambda outs: (to64(up),), **kw)
                exact = g64["weight"]
            compare_close(gg["weight"], gw["weight"], exact, name="ngram_embedding: weight gradient", case=case,
                          grad=True, where=lambda idx: f"table row {idx[0]}, column {idx[1]}")
    _prop(_ngram_embedding_cases(dtypes, max_requests, max_dim, schemes, families), body, max_examples, seed)


# ---- embedding_lookup -----------------------------------------------------------------------------

@st.composite
def _lookup_cases(draw, dtypes, max_dim, schemes):
    case = dict(rows=draw(st.integers(1, 300)),
                D=draw(st.one_of(st.integers(1, max_dim), st.sampled_from([24, 128, 160]))),
                T=draw(st.integers(0, 70)), NH=draw(st.integers(1, 6)), dtype=draw(st.sampled_from(list(dtypes))),
                index_dtype=draw(st.sampled_from([torch.int32, torch.int64])), repeats=draw(st.booleans()),
                seed=draw(st.integers(0, 2**31 - 1)), scheme=draw(_scheme(schemes)))
    if case["scheme"] is not None:
        del case["dtype"]                 # the values are judged in every dtype of the check
        case["D"] = even_dim(case["D"]) if case["scheme"] == "nf4" else case["D"]
    return case


def check_embedding_lookup(fn: Callable[..., Any], *, dtypes: Sequence[torch.dtype] = DTYPES, max_dim: int = 200,
                           grad: bool = True, schemes: Sequence[str] = SCHEMES, max_examples: int = 25,
                           seed: int | None = 0) -> None:
    """Check ``fn`` (the signature of ``ple.reference.embedding_lookup``): rows bit for bit (a gather), and
    with ``grad`` the table's gradient (repeated ids summed) by the tolerance table.

    Tables: float ones of each of ``dtypes``, and quantized ones of each of ``schemes`` (``"fp8"``,
    ``"int8"``, ``"nf4"``; ``()``: float tables only), given to ``fn`` as a quantized table gathers
    them (``ple.testing.kit.quantized``): an FP8 table's raw bytes, an int8 table and its float32
    ``[rows, 1]`` row scales, an NF4 table's packed uint8 ``[rows, D/2 + 4]`` rows (codes, float16
    scale, two zero bytes). Their rows must come back as copies, ``[T, NH * width]`` in the stored
    dtype, bit for bit, and so must the values they stand for, unpacked in each of ``dtypes``
    (NF4 by ``ple.reference.nf4_dequantize_rows``); no gradient.
    """
    check_options(dtypes=dtypes, max_dim=max_dim, grad=grad, max_examples=max_examples, seed=seed)
    schemes = as_schemes(schemes)

    def body(case):
        g = torch.Generator().manual_seed(case["seed"])
        if case["scheme"] is not None:
            _quantized_lookup(fn, case, g, dtypes)
            return
        weight = randn((case["rows"], case["D"]), case["dtype"], g)
        hi = min(case["rows"], 3) if case["repeats"] else case["rows"]
        ids = torch.randint(0, hi, (case["T"], case["NH"]), generator=g).to(case["index_dtype"])
        up = randn((case["T"], case["NH"] * case["D"]), case["dtype"], g)
        where_out = lambda idx: (f"token {idx[0]}, head {idx[1] // case['D']} (table row "  # noqa: E731
                                 f"{ids[idx[0], idx[1] // case['D']].item()}), column {idx[1] % case['D']}")
        (want,), gw = _grads(ref.embedding_lookup, dict(weight=weight, ids=ids), ["weight"] if grad else [],
                             lambda outs: (up,))
        with poisoned_empty():
            (got,), gg = _grads(fn, dict(weight=weight, ids=ids), ["weight"] if grad else [], lambda outs: (up,))
        compare_bits(got, want, name="embedding_lookup: output", where=where_out, case=case)
        if grad:
            exact = None
            if case["dtype"] in HALF_DTYPES:
                _, g64 = _grads(ref.embedding_lookup, dict(weight=to64(weight), ids=ids), ["weight"],
                                lambda outs: (to64(up),))
                exact = g64["weight"]
            compare_close(gg["weight"], gw["weight"], exact, name="embedding_lookup: weight gradient", case=case,
                          grad=True, where=lambda idx: f"table row {idx[0]}, column {idx[1]}")
    _prop(_lookup_cases(dtypes, max_dim, schemes), body, max_examples, seed)


def _quantized_lookup(fn, case, g, dtypes):
    """An ``embedding_lookup`` case on a quantized table: ``fn`` gathers its stored rows (and int8 scales)."""
    table = quantized_table(case["scheme"], case["rows"], case["D"], g)
    hi = min(case["rows"], 3) if case["repeats"] else case["rows"]
    ids = torch.randint(0, hi, (case["T"], case["NH"]), generator=g).to(case["index_dtype"])
    want, want_scale = table.gather(ref.embedding_lookup, ids)
    with poisoned_empty():
        got, got_scale = table.gather(fn, ids)
    check_quantized(got, want, table, ids, dtypes=dtypes, name="embedding_lookup", case=case,
                    where_head=lambda t, h: f"token {t}, head {h} (table row {ids[t, h].item()})",
                    scales=None if want_scale is None else (got_scale, want_scale))


# ---- ple_gate -------------------------------------------------------------------------------------

FAMILIES = ("qwen4exp", "engram")
"""The gate families a check draws (docs/spec.md section 15): ``"qwen4exp"`` calls ``fn`` without the family's
keywords (as the layer does: ``unit_offset=True``, ``conv_eps=eps``), ``"engram"`` with ``unit_offset=False``
(the norms scale by ``w``) and a ``conv_eps`` other than ``eps``."""


def draw_gate_family(draw: st.DrawFn, families: Sequence[str], dtype: torch.dtype, eps_choices: Sequence[float]
                     ) -> dict[str, Any]:
    """A case's gate family: ``family``, ``eps``, ``unit_offset`` and ``conv_eps`` (None: ``eps``). The Engram
    family's key / query eps is ``torch.finfo(dtype).eps`` (``nn.RMSNorm``'s default) or one of ``eps_choices``,
    its conv eps one of 1e-5 (the demo's), 1e-3 or 0.1, never ``eps``; its weights start at one (`gate_weight`)."""
    family = draw(st.sampled_from(list(families)))
    if family == "qwen4exp":
        return dict(family=family, eps=draw(st.sampled_from(list(eps_choices))), unit_offset=True, conv_eps=None)
    eps = draw(st.sampled_from([torch.finfo(dtype).eps, *eps_choices]))
    conv_eps = draw(st.sampled_from([c for c in (1e-5, 1e-3, 0.1) if c != eps]))
    return dict(family=family, eps=eps, unit_offset=False, conv_eps=conv_eps)


def gate_family_kwargs(case: dict[str, Any]) -> dict[str, Any]:
    """The keywords ``fn`` gets for the case's family: none for Qwen4Exp (so an op with the old signature runs
    its cases), ``unit_offset`` and ``conv_eps`` for Engram. A case without them (one written by hand) is
    Qwen4Exp's."""
    unit_offset, conv_eps = case.get("unit_offset", True), case.get("conv_eps")
    if unit_offset and conv_eps is None:
        return {}
    return dict(unit_offset=unit_offset, conv_eps=conv_eps)


def gate_weight(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, case: dict[str, Any]) -> torch.Tensor:
    """A norm weight: ``0.3 N(0, 1)`` about the family's start (0 for ``1 + w``, 1 for ``w``)."""
    w = randn(shape, dtype, g) * 0.3
    return w if case.get("unit_offset", True) else w + 1.0


def call_with_family(op: str, call: Callable[[], Any], case: dict[str, Any]) -> Any:
    """``call()``; a ``TypeError`` because ``fn`` refuses the family's keywords becomes an ``AssertionError`` naming
    them and the case (an op with the old signature can be checked with ``families=("qwen4exp",)``)."""
    try:
        return call()
    except TypeError as e:
        words = [k for k in gate_family_kwargs(case) if k in str(e)]
        if not words or "keyword" not in str(e):
            raise
        raise AssertionError(f"{op}: the function does not take {' / '.join(words)} (the Engram family's norms, "
                             f"docs/spec.md section 15): {e}; check the Qwen4Exp family alone with "
                             f"families=('qwen4exp',)\n  case: {fmt_case(case)}") from e


@st.composite
def _gate_cases(draw, dtypes, max_hidden, families):
    T, M = draw(st.integers(0, 40)), draw(st.integers(1, 4))
    H = draw(st.one_of(st.integers(1, max_hidden), st.sampled_from([1, 2, 127, 160])))
    dtype = draw(st.sampled_from(list(dtypes)))
    family = draw_gate_family(draw, families, dtype, [1e-6, 1e-5, 0.1])
    return dict(T=T, M=M, H=H, dtype=dtype, **family, scale=draw(st.sampled_from([1.0, 1e-4, 30.0])),
                strided=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


def check_ple_gate(fn: Callable[..., Any], *, dtypes: Sequence[torch.dtype] = DTYPES, max_hidden: int = 300,
                   grad: bool = True, families: Sequence[str] = FAMILIES, max_examples: int = 25,
                   seed: int | None = 0) -> None:
    """Check ``fn`` (the signature of ``ple.reference.ple_gate``): ``(gated, conv_input)`` and, with ``grad``,
    the gradients of key, value, hidden states and the three norm weights.

    ``families`` (`FAMILIES`): the Qwen4Exp family's cases call ``fn`` as the layer does for it (no
    ``unit_offset`` / ``conv_eps``); the Engram family's pass ``unit_offset=False`` and a ``conv_eps`` other than
    ``eps`` (docs/spec.md section 15), so a function that ignores either fails, naming the case's family."""
    check_options(dtypes=dtypes, max_hidden=max_hidden, grad=grad, max_examples=max_examples, seed=seed)
    families = _checks.choices_arg("families", families, FAMILIES)
    names = ["key", "value", "hidden_states", "norm_key_weight", "norm_query_weight", "norm_conv_weight"]

    def body(case):
        g = torch.Generator().manual_seed(case["seed"])
        T, M, H, dt = case["T"], case["M"], case["H"], case["dtype"]
        C = M * H

        def rows(n):
            t = randn((T, n + 3) if case["strided"] else (T, n), dt, g) * case["scale"]
            return t[:, :n]
        inputs = dict(key=rows(C), value=rows(H), hidden_states=rows(C),
                      norm_key_weight=gate_weight((C,), dt, g, case), norm_query_weight=gate_weight((C,), dt, g, case),
                      norm_conv_weight=gate_weight((C,), dt, g, case))
        ups = (randn((T, C), dt, g), randn((T, C), dt, g))
        wrt = names if grad else []
        kw = dict(eps=case["eps"], **gate_family_kwargs(case))
        want, gw = _grads(ref.ple_gate, inputs, wrt, lambda outs: ups, **kw)
        with poisoned_empty():
            got, gg = call_with_family("ple_gate", lambda: _grads(fn, inputs, wrt, lambda outs: ups, **kw), case)
        exact, g64 = (None, None), {}
        # docs/spec.md section 8: where a score lies within 0.05 of zero, float32 is judged like bfloat16.
        ill = dt == torch.float32 and bool(
            (_scores(inputs, H, case["eps"], unit_offset=case["unit_offset"]).abs() < 0.05).any())
        if dt in HALF_DTYPES or ill:
            exact, g64 = _grads(ref.ple_gate, {k: to64(v) for k, v in inputs.items()}, wrt,
                                lambda outs: tuple(map(to64, ups)), **kw)
        where = lambda idx: f"token {idx[0]}, stream {idx[1] // H}, channel {idx[1]} ({idx[1] % H} of the stream)"  # noqa: E731
        for i, name in enumerate(("gated", "conv_input")):
            compare_close(got[i], want[i], exact[i], name=f"ple_gate: {name}", where=where, case=case, judge64=ill)
        for k in wrt:
            w = where if gw[k].dim() == 2 and k != "value" else (
                (lambda idx: f"token {idx[0]}, channel {idx[1]}") if k == "value" else
                (lambda idx: f"channel {idx[0]} (stream {idx[0] // H})"))
            compare_close(gg[k], gw[k], g64.get(k), name=f"ple_gate: gradient of {k}", where=w, case=case, grad=True,
                          judge64=ill)
    _prop(_gate_cases(dtypes, max_hidden, families), body, max_examples, seed)


def _scores(inputs: dict, hidden_size: int, eps: float, *, unit_offset: bool = True) -> torch.Tensor:
    """The gate scores ``s[t, m]`` in float64 (docs/spec.md section 4; ``unit_offset``: section 15)."""
    H = hidden_size
    x = {k: v.detach().double() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    kn = ref.grouped_rms_norm(x["key"], x["norm_key_weight"], H, eps, unit_offset=unit_offset).unflatten(1, (-1, H))
    qn = ref.grouped_rms_norm(x["hidden_states"], x["norm_query_weight"], H, eps,
                              unit_offset=unit_offset).unflatten(1, (-1, H))
    return (kn * qn).sum(-1) / H**0.5


# ---- dilated_causal_conv --------------------------------------------------------------------------

@st.composite
def _dcc_cases(draw, dtypes, max_channels):
    packed = draw(st.booleans())
    lens = draw(st.lists(st.sampled_from([0, 1, 2, 5, 17, 40]) | st.integers(0, 70), min_size=1, max_size=4))
    return dict(C=draw(st.one_of(st.integers(1, max_channels), st.sampled_from([1, 5, 130]))),
                K=draw(st.integers(1, 5)),
                dilation=draw(st.integers(1, 4)), packed=packed, lens=lens if packed else None,
                B=draw(st.integers(1, 3)), L=draw(st.integers(0, 70)), dtype=draw(st.sampled_from(list(dtypes))),
                index_dtype=draw(st.sampled_from([torch.int32, torch.int64])), seed=draw(st.integers(0, 2**31 - 1)))


def check_dilated_causal_conv(fn: Callable[..., Any], *, dtypes: Sequence[torch.dtype] = DTYPES,
                              max_channels: int = 300, grad: bool = True,
                              max_examples: int = 25, seed: int | None = 0) -> None:
    """Check ``fn`` (the signature of ``ple.reference.dilated_causal_conv``), ``[B, L, C]`` and packed
    ``[T, C]`` with ``cu_seqlens``: the output and, with ``grad``, the gradients of ``x`` and ``weight``."""
    check_options(dtypes=dtypes, max_channels=max_channels, grad=grad, max_examples=max_examples, seed=seed)
    def body(case):
        g = torch.Generator().manual_seed(case["seed"])
        C, K, dt = case["C"], case["K"], case["dtype"]
        kw = dict(dilation=case["dilation"])
        if case["packed"]:
            cu_seqlens_list = [0]
            for n in case["lens"]:
                cu_seqlens_list.append(cu_seqlens_list[-1] + n)
            x = randn((cu_seqlens_list[-1], C), dt, g)
            kw["cu_seqlens"] = torch.tensor(cu_seqlens_list, dtype=case["index_dtype"])
            where = lambda idx: f"{row_of(cu_seqlens_list, idx[0])}, channel {idx[1]}"  # noqa: E731
        else:
            x = randn((case["B"], case["L"], C), dt, g)
            where = lambda idx: f"sequence {idx[0]}, position {idx[1]}, channel {idx[2]}"  # noqa: E731
        inputs = dict(x=x, weight=randn((C, K), dt, g) * 0.5)
        up = (randn(tuple(x.shape), dt, g),)
        wrt = ["x", "weight"] if grad else []
        (want,), gw = _grads(ref.dilated_causal_conv, inputs, wrt, lambda outs: up, **kw)
        with poisoned_empty():
            (got,), gg = _grads(fn, inputs, wrt, lambda outs: up, **kw)
        exact, g64 = (None,), {}
        if dt in HALF_DTYPES:
            exact, g64 = _grads(ref.dilated_causal_conv, {k: to64(v) for k, v in inputs.items()}, wrt,
                                lambda outs: (to64(up[0]),), **kw)
        compare_close(got, want, exact[0], name="dilated_causal_conv: output", where=where, case=case)
        if grad:
            compare_close(gg["x"], gw["x"], g64.get("x"), name="dilated_causal_conv: gradient of x", where=where,
                          grad=True, case=case)
            compare_close(gg["weight"], gw["weight"], g64.get("weight"), case=case, grad=True,
                          name="dilated_causal_conv: gradient of weight",
                          where=lambda idx: f"channel {idx[0]}, tap {idx[1]}")
    _prop(_dcc_cases(dtypes, max_channels), body, max_examples, seed)
