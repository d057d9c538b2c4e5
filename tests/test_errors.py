"""Every documented error (docs/spec.md section 9): the right exception, naming the argument, nothing modified.

Bad calls are tables of one change each to a valid call; the valid call itself is
run first so that each failure comes from the change alone. Every case runs on every
backend (``ops`` is ``ple.reference``, ``ple.vectorized`` or ``ple.fast``, the latter with Triton,
under the interpreter without a GPU).
"""

from __future__ import annotations

import pytest
import torch
from _helpers import args_snapshot, assert_args_unchanged

import ple.reference
from ple import PLEConfig, PLELayer
from ple.backends import backend_module
from ple.reference import hash_params
from ple.testing.numerics import assert_bitwise_equal

BACKENDS = [pytest.param("reference", id="reference"), pytest.param("torch", id="torch"),
            pytest.param("triton", id="fast", marks=pytest.mark.interpreter)]


@pytest.fixture(params=BACKENDS)
def ops(request):
    """The op module of a backend: ``ple.reference``, ``ple.vectorized`` or ``ple.fast``."""
    return backend_module(request.param)


def backend_name(ops) -> str:
    return {"ple.reference": "reference", "ple.vectorized": "torch", "ple.fast": "triton"}[ops.__name__]

C, K, D = 5, 3, 2  # channels, taps, dilation
S = (K - 1) * D  # 4
Q = 3  # spec_query_len
W = S + Q - 1  # 6
NUM_SLOTS = 4
META = torch.device("meta")  # a device other than the inputs'


def conv_args(mode: str) -> dict:
    """A valid ``ple_conv`` call of ``mode`` with two requests, rows interleaved, a strided state."""
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(NUM_SLOTS, W, C, generator=gen)  # viewed as [slots, C, W]
    args = dict(
        inputs=torch.randn(7, C, generator=gen),
        residual=torch.randn(7, C, generator=gen),
        conv_state=buf.transpose(1, 2),
        conv_weights=torch.randn(C, K, generator=gen),
        state_indices=torch.tensor([1, 3]),
        mode=mode,
        dilation=D,
        outer_residual=torch.randn(7, C, generator=gen),
        null_slot=0,
    )
    if mode == "decode":
        args.update(token_indices=torch.tensor([4, 1]), has_initial_states=torch.tensor([True, False]))
    else:
        args.update(
            token_indices=torch.tensor([5, 0, 2, 6, 1]),
            query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32),
        )
    if mode == "prefill":
        args.update(has_initial_states=torch.tensor([True, False]))
    if mode == "spec":
        args.update(spec_query_len=Q, num_accepted_tokens=torch.tensor([2, 3]))
    return args


def narrow_state(width: int):
    return lambda a: a.update(conv_state=torch.randn(NUM_SLOTS, C, width))


def put(**changes):
    return lambda a: a.update(changes)


def drop(name):
    return lambda a: a.pop(name)


I64 = torch.int64
# (id, mode, change, exception, argument the message must start with)
CONV_CASES = [
    ("inputs-not-tensor", "prefill", lambda a: a.update(inputs=a["inputs"].tolist()), TypeError, "inputs"),
    ("inputs-int", "prefill", lambda a: a.update(inputs=a["inputs"].long()), TypeError, "inputs"),
    ("inputs-3d", "decode", lambda a: a.update(inputs=a["inputs"][None]), ValueError, "inputs"),
    ("residual-shape", "prefill", lambda a: a.update(residual=torch.zeros(7, C + 1)), ValueError, "residual"),
    ("residual-rows", "spec", lambda a: a.update(residual=torch.zeros(6, C)), ValueError, "residual"),
    ("residual-dtype", "spec", lambda a: a.update(residual=a["residual"].double()), TypeError, "residual"),
    (
        "residual-device",
        "prefill",
        lambda a: a.update(residual=torch.zeros(7, C, device=META)),
        ValueError,
        "residual",
    ),
    (
        "outer-shape",
        "decode",
        lambda a: a.update(outer_residual=torch.zeros(7, C - 1)),
        ValueError,
        "outer_residual",
    ),
    (
        "outer-dtype",
        "prefill",
        lambda a: a.update(outer_residual=a["outer_residual"].half()),
        TypeError,
        "outer_residual",
    ),
    (
        "state-2d",
        "prefill",
        lambda a: a.update(conv_state=torch.zeros(NUM_SLOTS, C * W)),
        ValueError,
        "conv_state",
    ),
    (
        "state-channels",
        "decode",
        lambda a: a.update(conv_state=torch.zeros(NUM_SLOTS, C + 1, W)),
        ValueError,
        "conv_state",
    ),
    (
        "state-int",
        "prefill",
        lambda a: a.update(conv_state=torch.zeros(NUM_SLOTS, C, W, dtype=torch.int32)),
        TypeError,
        "conv_state",
    ),
    (
        "state-device",
        "spec",
        lambda a: a.update(conv_state=torch.zeros(NUM_SLOTS, C, W, device=META)),
        ValueError,
        "conv_state",
    ),
    ("state-narrower-than-S", "prefill", narrow_state(S - 1), ValueError, "conv_state"),
    ("state-narrower-than-S-decode", "decode", narrow_state(S - 1), ValueError, "conv_state"),
    ("spec-too-long-for-window", "spec", narrow_state(W - 1), ValueError, "conv_state"),
    ("spec-query-len-past-window", "spec", put(spec_query_len=Q + 1), ValueError, "conv_state"),
    (
        "weights-channels",
        "prefill",
        lambda a: a.update(conv_weights=torch.zeros(C + 2, K)),
        ValueError,
        "conv_weights",
    ),
    (
        "weights-no-taps",
        "decode",
        lambda a: a.update(conv_weights=torch.zeros(C, 0)),
        ValueError,
        "conv_weights",
    ),
    (
        "weights-3d",
        "prefill",
        lambda a: a.update(conv_weights=torch.zeros(C, 1, K)),
        ValueError,
        "conv_weights",
    ),
    (
        "weights-int",
        "spec",
        lambda a: a.update(conv_weights=torch.zeros(C, K, dtype=I64)),
        TypeError,
        "conv_weights",
    ),
    ("mode-unknown", "prefill", put(mode="chunked"), ValueError, "mode"),
    ("mode-none", "decode", put(mode=None), TypeError, "mode"),
    ("dilation-zero", "prefill", put(dilation=0), ValueError, "dilation"),
    ("dilation-float", "spec", put(dilation=2.0), TypeError, "dilation"),
    ("null-slot-str", "prefill", put(null_slot="0"), TypeError, "null_slot"),
    ("slots-float", "prefill", put(state_indices=torch.tensor([1.0, 3.0])), TypeError, "state_indices"),
    ("slots-list", "decode", put(state_indices=[1, 3]), TypeError, "state_indices"),
    ("slots-2d", "spec", put(state_indices=torch.tensor([[1, 3]])), ValueError, "state_indices"),
    (
        "slot-past-end",
        "prefill",
        put(state_indices=torch.tensor([1, NUM_SLOTS])),
        ValueError,
        "state_indices",
    ),
    ("slot-negative", "decode", put(state_indices=torch.tensor([-1, 3])), ValueError, "state_indices"),
    ("slot-past-end-spec", "spec", put(state_indices=torch.tensor([7, 1])), ValueError, "state_indices"),
    ("slot-twice", "prefill", put(state_indices=torch.tensor([3, 3])), ValueError, "state_indices"),
    ("slot-twice-spec", "spec", put(state_indices=torch.tensor([2, 2])), ValueError, "state_indices"),
    (
        "slot-twice-decode",
        "decode",
        put(state_indices=torch.tensor([1, 1], dtype=torch.int32)),
        ValueError,
        "state_indices",
    ),
    (
        "null-slot-past-end",
        "prefill",
        put(state_indices=torch.tensor([1, NUM_SLOTS]), null_slot=2),
        ValueError,
        "state_indices",
    ),
    (
        "decode-rows-vs-slots",
        "decode",
        put(state_indices=torch.tensor([1, 2, 3])),
        ValueError,
        "state_indices",
    ),
    ("qsl-missing", "prefill", drop("query_start_loc"), ValueError, "query_start_loc"),
    ("qsl-missing-spec", "spec", drop("query_start_loc"), ValueError, "query_start_loc"),
    (
        "qsl-not-from-0",
        "prefill",
        put(query_start_loc=torch.tensor([1, 2, 5])),
        ValueError,
        "query_start_loc",
    ),
    (
        "qsl-decreasing",
        "prefill",
        put(query_start_loc=torch.tensor([0, 6, 5])),
        ValueError,
        "query_start_loc",
    ),
    ("qsl-wrong-end", "prefill", put(query_start_loc=torch.tensor([0, 2, 4])), ValueError, "query_start_loc"),
    ("qsl-past-end", "spec", put(query_start_loc=torch.tensor([0, 2, 6])), ValueError, "query_start_loc"),
    ("qsl-wrong-count", "prefill", put(query_start_loc=torch.tensor([0, 5])), ValueError, "query_start_loc"),
    ("qsl-float", "spec", put(query_start_loc=torch.tensor([0.0, 2.0, 5.0])), TypeError, "query_start_loc"),
    ("qsl-2d", "prefill", put(query_start_loc=torch.tensor([[0, 2, 5]])), ValueError, "query_start_loc"),
    (
        "qsl-decode-not-one-per-request",
        "decode",
        put(query_start_loc=torch.tensor([0, 2, 2])),
        ValueError,
        "query_start_loc",
    ),
    ("rows-vs-qsl", "prefill", put(token_indices=torch.tensor([5, 0, 2, 6])), ValueError, "query_start_loc"),
    (
        "spec-request-too-long",
        "spec",
        put(query_start_loc=torch.tensor([0, 1, 5])),
        ValueError,
        "query_start_loc",
    ),
    (
        "spec-request-empty",
        "spec",
        put(query_start_loc=torch.tensor([0, 0, 2]), token_indices=torch.tensor([3, 4])),
        ValueError,
        "query_start_loc",
    ),
    (
        "has-initial-float",
        "prefill",
        put(has_initial_states=torch.tensor([1.0, 0.0])),
        TypeError,
        "has_initial_states",
    ),
    (
        "has-initial-length",
        "decode",
        put(has_initial_states=torch.tensor([True])),
        ValueError,
        "has_initial_states",
    ),
    (
        "has-initial-2d",
        "prefill",
        put(has_initial_states=torch.tensor([[True, False]])),
        ValueError,
        "has_initial_states",
    ),
    ("accepted-missing", "spec", drop("num_accepted_tokens"), ValueError, "num_accepted_tokens"),
    (
        "accepted-zero",
        "spec",
        put(num_accepted_tokens=torch.tensor([0, 1])),
        ValueError,
        "num_accepted_tokens",
    ),
    (
        "accepted-past-q",
        "spec",
        put(num_accepted_tokens=torch.tensor([1, Q + 1])),
        ValueError,
        "num_accepted_tokens",
    ),
    (
        "accepted-length",
        "spec",
        put(num_accepted_tokens=torch.tensor([1, 1, 1])),
        ValueError,
        "num_accepted_tokens",
    ),
    (
        "accepted-float",
        "spec",
        put(num_accepted_tokens=torch.tensor([1.0, 2.0])),
        TypeError,
        "num_accepted_tokens",
    ),
    ("spec-query-len-zero", "spec", put(spec_query_len=0), ValueError, "spec_query_len"),
    ("spec-query-len-float", "spec", put(spec_query_len=3.0), TypeError, "spec_query_len"),
    (
        "rows-past-end",
        "prefill",
        put(token_indices=torch.tensor([5, 0, 2, 7, 1])),
        ValueError,
        "token_indices",
    ),
    ("rows-negative", "spec", put(token_indices=torch.tensor([5, 0, -1, 6, 1])), ValueError, "token_indices"),
    (
        "rows-repeated",
        "prefill",
        put(token_indices=torch.tensor([5, 0, 2, 5, 1])),
        ValueError,
        "token_indices",
    ),
    ("rows-repeated-decode", "decode", put(token_indices=torch.tensor([4, 4])), ValueError, "token_indices"),
    ("rows-float", "spec", put(token_indices=torch.tensor([5.0, 0, 2, 6, 1])), TypeError, "token_indices"),
    ("rows-2d", "prefill", put(token_indices=torch.tensor([[5, 0, 2, 6, 1]])), ValueError, "token_indices"),
    (
        "rows-device",
        "decode",
        put(token_indices=torch.tensor([4, 1], device=META)),
        ValueError,
        "token_indices",
    ),
]

# docs/spec.md section 9: index tensors are int32 / int64 only; flags bool or integer 0 / 1; one device; values
# of index tensors are needed, so never on the meta device.
NOT_INDEX_DTYPES = [torch.uint8, torch.bool, torch.int8, torch.int16, torch.float32, torch.complex64]
if hasattr(torch, "uint16"):
    NOT_INDEX_DTYPES.append(torch.uint16)


def as_dtype(name, dtype):
    return lambda a: a.update({name: a[name].to(dtype)})


def all_meta(a):
    for k, v in list(a.items()):
        if isinstance(v, torch.Tensor):
            a[k] = v.to(META)


CONV_CASES += [
    (f"{name}-{str(dt).split('.')[-1]}", mode, as_dtype(name, dt), TypeError, name)
    for dt in NOT_INDEX_DTYPES
    for name, mode in (("state_indices", "prefill"), ("query_start_loc", "spec"), ("token_indices", "decode"),
                       ("num_accepted_tokens", "spec"))
] + [
    ("has-initial-two", "prefill", put(has_initial_states=torch.tensor([2, 0])), ValueError, "has_initial_states"),
    ("has-initial-negative", "decode", put(has_initial_states=torch.tensor([1, -1], dtype=torch.int8)), ValueError,
     "has_initial_states"),
    ("has-initial-complex", "prefill", put(has_initial_states=torch.tensor([1, 0], dtype=torch.complex64)),
     TypeError, "has_initial_states"),
    ("has-initial-half", "decode", put(has_initial_states=torch.tensor([1, 0], dtype=torch.float16)), TypeError,
     "has_initial_states"),
    ("inputs-meta-among-real", "prefill", lambda a: a.update(inputs=a["inputs"].to(META)), ValueError, "residual"),
    ("weights-meta-among-real", "decode", lambda a: a.update(conv_weights=a["conv_weights"].to(META)), ValueError,
     "conv_weights"),
    ("outer-meta-among-real", "spec", lambda a: a.update(outer_residual=a["outer_residual"].to(META)), ValueError,
     "outer_residual"),
    ("slots-meta-among-real", "prefill", lambda a: a.update(state_indices=a["state_indices"].to(META)), ValueError,
     "state_indices"),
    ("qsl-meta-among-real", "spec", lambda a: a.update(query_start_loc=a["query_start_loc"].to(META)), ValueError,
     "query_start_loc"),
    ("accepted-meta-among-real", "spec", lambda a: a.update(num_accepted_tokens=a["num_accepted_tokens"].to(META)),
     ValueError, "num_accepted_tokens"),
    ("has-initial-meta-among-real", "decode", lambda a: a.update(has_initial_states=a["has_initial_states"].to(META)),
     ValueError, "has_initial_states"),
    ("all-meta-prefill", "prefill", all_meta, ValueError, "state_indices"),
    ("all-meta-decode", "decode", all_meta, ValueError, "state_indices"),
]



def call_conv(args: dict, ops=ple.reference) -> None:
    a = dict(args)
    ops.ple_conv(
        a.pop("inputs"),
        a.pop("residual"),
        a.pop("conv_state"),
        a.pop("conv_weights"),
        a.pop("state_indices"),
        **a,
    )


@pytest.mark.parametrize("mode", ["prefill", "decode", "spec"])
def test_base_conv_calls_are_valid_and_write(mode, ops):
    args = conv_args(mode)
    before = args_snapshot(args)
    call_conv(args, ops)
    assert not torch.equal(args["residual"], before["residual"])
    assert not torch.equal(args["conv_state"]._base, before["conv_state._base"])


@pytest.mark.parametrize("case, mode, change, exc, arg", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_bad_ple_conv_call_raises_and_changes_nothing(case, mode, change, exc, arg, ops):
    args = conv_args(mode)
    change(args)
    before = args_snapshot(args)
    with pytest.raises(exc, match=rf"^{arg}\b"):
        call_conv(args, ops)
    assert_args_unchanged(args, before)


def checkpoint_args() -> dict:
    """A valid export: request 0 has 5 rows (checkpoint at 4 = S), request 1 has 4 rows (at 4)."""
    gen = torch.Generator().manual_seed(1)
    buf = torch.randn(NUM_SLOTS, W + 2, C, generator=gen)
    return dict(
        inputs=torch.randn(10, C, generator=gen),
        conv_state=buf.transpose(1, 2)[:, :, 1 : 1 + W],
        query_start_loc=torch.tensor([0, 5, 9]),
        offsets=torch.tensor([S, 4]),
        slots=torch.tensor([2, 3]),
        state_len=S,
        token_indices=torch.tensor([9, 0, 3, 1, 8, 2, 7, 4, 6]),
        null_slot=0,
    )


CHECKPOINT_CASES = [
    ("inputs-int", lambda a: a.update(inputs=a["inputs"].int()), TypeError, "inputs"),
    ("state-channels", put(conv_state=torch.zeros(NUM_SLOTS, C - 1, W)), ValueError, "conv_state"),
    ("state-device", put(conv_state=torch.zeros(NUM_SLOTS, C, W, device=META)), ValueError, "conv_state"),
    (
        "state-narrower-than-state-len",
        put(conv_state=torch.zeros(NUM_SLOTS, C, S - 1)),
        ValueError,
        "conv_state",
    ),
    ("state-len-zero", put(state_len=0), ValueError, "state_len"),
    ("state-len-float", put(state_len=4.0), TypeError, "state_len"),
    ("null-slot-float", put(null_slot=0.0), TypeError, "null_slot"),
    ("offset-inside-first-S", put(offsets=torch.tensor([S - 1, 4])), ValueError, "offsets"),
    ("offset-one", put(offsets=torch.tensor([0, 1])), ValueError, "offsets"),
    ("offset-past-rows", put(offsets=torch.tensor([6, 4])), ValueError, "offsets"),
    ("offset-past-rows-second", put(offsets=torch.tensor([S, 5])), ValueError, "offsets"),
    ("offset-negative", put(offsets=torch.tensor([-1, 4])), ValueError, "offsets"),
    ("offsets-float", put(offsets=torch.tensor([4.0, 4.0])), TypeError, "offsets"),
    ("offsets-2d", put(offsets=torch.tensor([[4, 4]])), ValueError, "offsets"),
    ("slots-length", put(slots=torch.tensor([2])), ValueError, "slots"),
    ("slots-float", put(slots=torch.tensor([2.0, 3.0])), TypeError, "slots"),
    ("slot-past-end", put(slots=torch.tensor([2, NUM_SLOTS])), ValueError, "slots"),
    ("slot-negative", put(slots=torch.tensor([-2, 3])), ValueError, "slots"),
    ("slot-twice", put(slots=torch.tensor([3, 3])), ValueError, "slots"),
    ("qsl-wrong-end", put(query_start_loc=torch.tensor([0, 5, 8])), ValueError, "query_start_loc"),
    ("qsl-wrong-count", put(query_start_loc=torch.tensor([0, 9])), ValueError, "query_start_loc"),
    ("qsl-not-from-0", put(query_start_loc=torch.tensor([1, 5, 9])), ValueError, "query_start_loc"),
    (
        "rows-past-end",
        put(token_indices=torch.tensor([9, 0, 3, 1, 8, 2, 7, 4, 10])),
        ValueError,
        "token_indices",
    ),
    (
        "rows-negative",
        put(token_indices=torch.tensor([9, 0, 3, 1, -8, 2, 7, 4, 6])),
        ValueError,
        "token_indices",
    ),
    (
        "rows-float",
        put(token_indices=torch.tensor([9.0, 0, 3, 1, 8, 2, 7, 4, 6])),
        TypeError,
        "token_indices",
    ),
]

CHECKPOINT_CASES += [
    (f"{name}-{str(dt).split('.')[-1]}", as_dtype(name, dt), TypeError, name)
    for dt in NOT_INDEX_DTYPES
    for name in ("query_start_loc", "offsets", "slots", "token_indices")
] + [
    ("inputs-meta-among-real", lambda a: a.update(inputs=a["inputs"].to(META)), ValueError, "conv_state"),
    ("qsl-meta-among-real", lambda a: a.update(query_start_loc=a["query_start_loc"].to(META)), ValueError,
     "query_start_loc"),
    ("slots-meta-among-real", lambda a: a.update(slots=a["slots"].to(META)), ValueError, "slots"),
    ("all-meta", all_meta, ValueError, "token_indices"),
]



def call_export(args: dict, ops=ple.reference) -> None:
    a = dict(args)
    ops.export_conv_checkpoints(a.pop("inputs"), a.pop("conv_state"), **a)


def test_base_checkpoint_call_is_valid_and_writes(ops):
    args = checkpoint_args()
    before = args_snapshot(args)
    call_export(args, ops)
    assert not torch.equal(args["conv_state"]._base, before["conv_state._base"])


@pytest.mark.parametrize("case, change, exc, arg", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_bad_checkpoint_export_raises_and_changes_nothing(case, change, exc, arg, ops):
    args = checkpoint_args()
    change(args)
    before = args_snapshot(args)
    with pytest.raises(exc, match=rf"^{arg}\b"):
        call_export(args, ops)
    assert_args_unchanged(args, before)


def test_checkpoint_duplicates_and_null_slot_without_offsets_are_fine(ops):
    # A repeated slot only matters where a checkpoint is written; the null slot is never written.
    args = checkpoint_args()
    args.update(offsets=torch.tensor([0, 4]), slots=torch.tensor([3, 3]))
    call_export(args, ops)
    args = checkpoint_args()
    args.update(slots=torch.tensor([0, 0]))
    before = args_snapshot(args)
    call_export(args, ops)
    assert_args_unchanged(args, before)


# ---- the other ops: exception type and the argument named -----------------------------------------
TINY = PLEConfig.preset("tiny")
PARAMS = hash_params(TINY, 0)
IDS = torch.tensor([3, 2, 999, 0])


def ngram(**changes):
    kw = dict(
        input_ids=IDS, params=PARAMS, heads_per_ngram=TINY.heads_per_ngram, eos_token_id=TINY.eos_token_id
    )
    kw.update(changes)
    return lambda ops: ops.ngram_ids(**kw)


def gate(**changes):
    gen = torch.Generator().manual_seed(2)
    kw = dict(
        key=torch.randn(3, 6, generator=gen),
        value=torch.randn(3, 2, generator=gen),
        hidden_states=torch.randn(3, 6, generator=gen),
        norm_key_weight=torch.zeros(6),
        norm_query_weight=torch.zeros(6),
        norm_conv_weight=torch.zeros(6),
        eps=1e-6,
    )
    kw.update(changes)
    return lambda ops: ops.ple_gate(**kw)


def dense_conv(**changes):
    kw = dict(x=torch.randn(2, 5, 3), weight=torch.randn(3, 2), dilation=2)
    kw.update(changes)
    return lambda ops: ops.dilated_causal_conv(kw["x"], kw["weight"], **{k: v for k, v in kw.items()
                                                                          if k not in ("x", "weight")})


def layer_call(**changes):
    kw = dict(
        hidden_states=torch.randn(2, 4, TINY.hc_hidden_size),
        input_ids=torch.randint(0, 1000, (2, 4)),
        attention_mask=torch.ones(2, 4, dtype=torch.bool),
    )
    kw.update(changes)
    return lambda ops: PLELayer(TINY, backend=backend_name(ops))(**kw)


OTHER_CASES = [
    ("ngram-input-float", ngram(input_ids=IDS.float()), TypeError, "input_ids"),
    ("ngram-input-list", ngram(input_ids=[3, 2]), TypeError, "input_ids"),
    ("ngram-input-2d", ngram(input_ids=IDS[None]), ValueError, "input_ids"),
    ("ngram-token-past-vocab", ngram(input_ids=torch.tensor([3, 1000])), ValueError, "input_ids"),
    (
        "ngram-token-negative",
        ngram(input_ids=torch.tensor([-1, 3], dtype=torch.int32)),
        ValueError,
        "input_ids",
    ),
    ("ngram-params-type", ngram(params=TINY), TypeError, "params"),
    ("ngram-heads-mismatch", ngram(heads_per_ngram=TINY.heads_per_ngram + 1), ValueError, "heads_per_ngram"),
    ("ngram-heads-zero", ngram(heads_per_ngram=0), ValueError, "heads_per_ngram"),
    ("ngram-eos-past-vocab", ngram(eos_token_id=1000), ValueError, "eos_token_id"),
    ("ngram-eos-float", ngram(eos_token_id=2.0), TypeError, "eos_token_id"),
    ("ngram-qsl-wrong-end", ngram(query_start_loc=torch.tensor([0, 3])), ValueError, "query_start_loc"),
    (
        "ngram-qsl-decreasing",
        ngram(query_start_loc=torch.tensor([0, 3, 2, 4])),
        ValueError,
        "query_start_loc",
    ),
    ("ngram-qsl-float", ngram(query_start_loc=torch.tensor([0.0, 4.0])), TypeError, "query_start_loc"),
    ("ngram-context-shape", ngram(ngram_context=torch.zeros(1, 3, dtype=I64)), ValueError, "ngram_context"),
    (
        "ngram-context-requests",
        ngram(query_start_loc=torch.tensor([0, 1, 4]), ngram_context=torch.zeros(1, 2, dtype=I64)),
        ValueError,
        "ngram_context",
    ),
    ("ngram-context-float", ngram(ngram_context=torch.zeros(1, 2)), TypeError, "ngram_context"),
    ("ngram-context-past-vocab", ngram(ngram_context=torch.tensor([[0, 1000]])), ValueError, "ngram_context"),
    ("hash-params-config", lambda ops: ops.hash_params(TINY.to_dict(), 0), TypeError, "config"),
    ("hash-params-index", lambda ops: ops.hash_params(TINY, -1), ValueError, "ple_layer_index"),
    ("hash-params-index-bool", lambda ops: ops.hash_params(TINY, True), TypeError, "ple_layer_index"),
    (
        "lookup-row-past-table",
        lambda ops: ops.embedding_lookup(torch.zeros(10, 2), torch.tensor([[0, 10]])),
        ValueError,
        "ids",
    ),
    (
        "lookup-row-negative",
        lambda ops: ops.embedding_lookup(torch.zeros(10, 2), torch.tensor([[-1, 0]])),
        ValueError,
        "ids",
    ),
    (
        "lookup-ids-float",
        lambda ops: ops.embedding_lookup(torch.zeros(10, 2), torch.tensor([[1.0, 0.0]])),
        TypeError,
        "ids",
    ),
    ("gate-key-int", gate(key=torch.zeros(3, 6, dtype=I64)), TypeError, "key"),
    ("gate-key-1d", gate(key=torch.zeros(18)), ValueError, "key"),
    ("gate-value-rows", gate(value=torch.zeros(2, 2)), ValueError, "value"),
    ("gate-value-width", gate(value=torch.zeros(3, 4)), ValueError, "value"),
    ("gate-value-dtype", gate(value=torch.zeros(3, 2, dtype=torch.float64)), TypeError, "value"),
    ("gate-hidden-shape", gate(hidden_states=torch.zeros(3, 4)), ValueError, "hidden_states"),
    (
        "gate-hidden-dtype",
        gate(hidden_states=torch.zeros(3, 6, dtype=torch.bfloat16)),
        TypeError,
        "hidden_states",
    ),
    ("gate-hidden-device", gate(hidden_states=torch.zeros(3, 6, device=META)), ValueError, "hidden_states"),
    ("gate-norm-key-shape", gate(norm_key_weight=torch.zeros(5)), ValueError, "norm_key_weight"),
    ("gate-norm-query-shape", gate(norm_query_weight=torch.zeros(6, 1)), ValueError, "norm_query_weight"),
    ("gate-norm-conv-int", gate(norm_conv_weight=torch.zeros(6, dtype=I64)), TypeError, "norm_conv_weight"),
    ("gate-eps-zero", gate(eps=0.0), ValueError, "eps"),
    ("gate-eps-none", gate(eps=None), TypeError, "eps"),
    ("conv-x-int", dense_conv(x=torch.zeros(2, 5, 3, dtype=I64)), TypeError, "x"),
    ("conv-x-4d", dense_conv(x=torch.zeros(1, 2, 5, 3)), ValueError, "x"),
    ("conv-weight-channels", dense_conv(weight=torch.zeros(4, 2)), ValueError, "weight"),
    ("conv-weight-device", dense_conv(weight=torch.zeros(3, 2, device=META)), ValueError, "weight"),
    ("conv-dilation-zero", dense_conv(dilation=0), ValueError, "dilation"),
    ("conv-cu-seqlens-with-3d-x", dense_conv(cu_seqlens=torch.tensor([0, 5])), ValueError, "x"),
    (
        "conv-cu-seqlens-wrong-end",
        dense_conv(x=torch.zeros(5, 3), cu_seqlens=torch.tensor([0, 2, 4])),
        ValueError,
        "cu_seqlens",
    ),
    (
        "conv-cu-seqlens-float",
        dense_conv(x=torch.zeros(5, 3), cu_seqlens=torch.tensor([0.0, 5.0])),
        TypeError,
        "cu_seqlens",
    ),
    ("layer-config", lambda ops: PLELayer(TINY.to_dict()), TypeError, "config"),
    ("layer-index", lambda ops: PLELayer(TINY, TINY.num_ple_layers), ValueError, "ple_layer_index"),
    ("layer-index-negative", lambda ops: PLELayer(TINY, -1), ValueError, "ple_layer_index"),
    ("layer-backend", lambda ops: PLELayer(TINY, backend="cuda"), ValueError, "backend"),
    (
        "layer-hidden-dtype",
        layer_call(hidden_states=torch.zeros(2, 4, TINY.hc_hidden_size, dtype=torch.float64)),
        TypeError,
        "hidden_states",
    ),
    (
        "layer-hidden-2d",
        layer_call(hidden_states=torch.zeros(8, TINY.hc_hidden_size)),
        ValueError,
        "hidden_states",
    ),
    ("layer-hidden-channels", layer_call(hidden_states=torch.zeros(2, 4, 7)), ValueError, "hidden_states"),
    ("layer-ids-shape", layer_call(input_ids=torch.zeros(2, 5, dtype=I64)), ValueError, "input_ids"),
    ("layer-ids-float", layer_call(input_ids=torch.zeros(2, 4)), TypeError, "input_ids"),
    ("layer-ids-past-vocab", layer_call(input_ids=torch.full((2, 4), 1000)), ValueError, "input_ids"),
    (
        "layer-mask-shape",
        layer_call(attention_mask=torch.ones(2, 3, dtype=torch.bool)),
        ValueError,
        "attention_mask",
    ),
]

OTHER_CASES += [
    (f"ngram-{name}-{str(dt).split('.')[-1]}", ngram(**{name: t.to(dt)}), TypeError, name)
    for dt in NOT_INDEX_DTYPES
    for name, t in (("input_ids", IDS), ("query_start_loc", torch.tensor([0, 4])),
                    ("ngram_context", torch.zeros(1, 2, dtype=I64)))
] + [
    (f"lookup-ids-{str(dt).split('.')[-1]}",
     lambda ops, dt=dt: ops.embedding_lookup(torch.zeros(10, 2), torch.tensor([[1, 0]]).to(dt)), TypeError, "ids")
    for dt in NOT_INDEX_DTYPES
] + [
    (f"conv-cu-seqlens-{str(dt).split('.')[-1]}",
     dense_conv(x=torch.zeros(5, 3), cu_seqlens=torch.tensor([0, 2, 5]).to(dt)), TypeError, "cu_seqlens")
    for dt in NOT_INDEX_DTYPES
] + [
    ("ngram-input-meta", ngram(input_ids=IDS.to(META)), ValueError, "input_ids"),
    ("ngram-qsl-meta-among-real", ngram(query_start_loc=torch.tensor([0, 4], device=META)), ValueError,
     "query_start_loc"),
    ("ngram-context-meta-among-real", ngram(ngram_context=torch.zeros(1, 2, dtype=I64, device=META)), ValueError,
     "ngram_context"),
    ("lookup-ids-meta-among-real",
     lambda ops: ops.embedding_lookup(torch.zeros(10, 2), torch.tensor([[1, 0]], device=META)), ValueError, "ids"),
    ("lookup-weight-meta-among-real",
     lambda ops: ops.embedding_lookup(torch.zeros(10, 2, device=META), torch.tensor([[1, 0]])), ValueError, "ids"),
    ("lookup-all-meta",
     lambda ops: ops.embedding_lookup(torch.zeros(10, 2, device=META), torch.tensor([[1, 0]], device=META)),
     ValueError, "ids"),
    ("gate-key-meta-among-real", gate(key=torch.zeros(3, 6, device=META)), ValueError, "value"),
    ("gate-norm-meta-among-real", gate(norm_conv_weight=torch.zeros(6, device=META)), ValueError,
     "norm_conv_weight"),
    ("conv-x-meta-among-real", dense_conv(x=torch.zeros(2, 5, 3, device=META)), ValueError, "weight"),
    ("conv-cu-seqlens-meta-among-real", dense_conv(x=torch.zeros(5, 3), cu_seqlens=torch.tensor([0, 5], device=META)),
     ValueError, "cu_seqlens"),
    ("conv-cu-seqlens-all-meta", dense_conv(x=torch.zeros(5, 3, device=META), weight=torch.zeros(3, 2, device=META),
                                            cu_seqlens=torch.tensor([0, 5], device=META)), ValueError, "cu_seqlens"),
    ("layer-mask-complex", layer_call(attention_mask=torch.ones(2, 4, dtype=torch.complex64)), TypeError,
     "attention_mask"),
]



@pytest.mark.parametrize("case, call, exc, arg", OTHER_CASES, ids=[c[0] for c in OTHER_CASES])
def test_bad_call_raises_naming_the_argument(case, call, exc, arg, ops):
    with pytest.raises(exc, match=rf"^{arg}\b"):
        call(ops)


def test_base_calls_of_the_other_ops_are_valid(ops):
    ngram()(ops)
    ngram(query_start_loc=torch.tensor([0, 1, 4]), ngram_context=torch.zeros(2, 2, dtype=I64))(ops)
    gate()(ops)
    dense_conv()(ops)
    dense_conv(x=torch.zeros(5, 3), cu_seqlens=torch.tensor([0, 2, 5]))(ops)
    layer_call()(ops)


def test_flags_may_be_bool_or_any_integer_dtype(ops):
    for dt in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        args = conv_args("prefill")
        args["has_initial_states"] = torch.tensor([1, 0]).to(dt)
        want = conv_args("prefill")
        call_conv(args, ops)
        call_conv(want, ops)
        assert_bitwise_equal(args["residual"], want["residual"], name=f"residual with {dt} flags")
        assert_bitwise_equal(args["conv_state"], want["conv_state"], name=f"state with {dt} flags")


def test_ops_on_meta_tensors_that_need_no_values_give_shapes(ops):
    # The gate and the dense conv read no index values: on meta tensors they give meta results.
    gated, conv_input = gate(**{k: torch.zeros(s, device=META) for k, s in (
        ("key", (3, 6)), ("value", (3, 2)), ("hidden_states", (3, 6)), ("norm_key_weight", (6,)),
        ("norm_query_weight", (6,)), ("norm_conv_weight", (6,)))})(ops)
    assert gated.device == META and gated.shape == conv_input.shape == (3, 6)
    y = dense_conv(x=torch.zeros(2, 5, 3, device=META), weight=torch.zeros(3, 2, device=META))(ops)
    assert y.device == META and y.shape == (2, 5, 3)


@pytest.mark.parametrize("dtype", NOT_INDEX_DTYPES + [torch.int32, torch.int64])
def test_index_kind_is_int32_or_int64_only(dtype):
    from ple import _checks

    t = torch.zeros(2, dtype=dtype)
    if dtype in (torch.int32, torch.int64):
        assert _checks.tensor("idx", t, kind="index") is t
    else:
        with pytest.raises(TypeError, match=r"^idx: expected an int32 or int64 tensor"):
            _checks.tensor("idx", t, kind="index")


def test_value_checks_use_host_values_when_given():
    # ``host`` hands in values the caller already has (the scheduler does); they are what is checked.
    from ple import _checks

    args = conv_args("prefill")
    a = dict(args)
    tensors = [a.pop(k) for k in ("inputs", "residual", "conv_state", "conv_weights", "state_indices")]
    a.update(num_accepted_tokens=None, spec_query_len=1)
    call = _checks.ple_conv_call(*tensors, host={"state_indices": [3, 1]}, **a)
    assert call.state_indices_list == [3, 1] and call.query_start_loc_list == [0, 2, 5]
    assert call.token_indices_list == [5, 0, 2, 6, 1]
    with pytest.raises(ValueError, match=r"^state_indices: expected slots in \[0, 4\)"):
        _checks.ple_conv_call(*tensors, host={"state_indices": [1, NUM_SLOTS]}, **a)
    with pytest.raises(ValueError, match=r"^query_start_loc: host values of shape \(2,\)"):
        _checks.ple_conv_call(*tensors, host={"query_start_loc": [0, 5]}, **a)


@pytest.mark.parametrize("divisible_by", [1, 16])
def test_ngram_embedding_table_one_row_short_names_weight(divisible_by, ops):
    """``weight`` one row short of the rows the hash addresses (``head_offsets[-1] + head_sizes[-1]``) is a
    ``ValueError`` naming it, with ids that never reach the missing row; a table of exactly those rows is
    fine. Unpadded (``make_ngram_vocab_size_divisible_by=1``) that is ``params.num_rows``; padded, the rows
    past it are padding no head addresses."""
    config = PLEConfig.preset("tiny", make_ngram_vocab_size_divisible_by=divisible_by)
    params = hash_params(config, 0)
    needed = int(params.head_offsets[-1] + params.head_sizes[-1])
    assert (needed == params.num_rows) == (divisible_by == 1)
    ids = torch.tensor([3, 1, 4, 1, 5])
    kw = dict(heads_per_ngram=config.heads_per_ngram, eos_token_id=config.eos_token_id)
    table = torch.randn(needed, config.ngram_head_dim, generator=torch.Generator().manual_seed(0))
    assert int(ple.reference.ngram_ids(ids, params, **kw).max()) < needed - 1        # the missing row is not read
    want = ple.reference.ngram_embedding(table, ids, params, **kw)
    assert_bitwise_equal(ops.ngram_embedding(table, ids, params, **kw), want, name="a table of the rows hashed")
    short = table[:-1].clone()
    with pytest.raises(ValueError, match=rf"^weight: .*{needed}"):
        ops.ngram_embedding(short, ids, params, **kw)
    assert_bitwise_equal(short, table[:-1], name="weight")


@pytest.mark.parametrize("bad, name", [
    (dict(x=torch.ones(4, 6, dtype=torch.int64)), "x"),
    (dict(x=torch.tensor(1.0)), "x"),
    (dict(weight=torch.zeros(5)), "weight"),
    (dict(weight=torch.zeros(6, dtype=torch.int32)), "weight"),
    (dict(group_size=0), "group_size"),
    (dict(group_size=4), "group_size"),
    (dict(group_size=2.0), "group_size"),
    (dict(eps=0.0), "eps"),
    (dict(eps=-1e-6), "eps"),
])
def test_grouped_rms_norm_names_the_bad_argument(bad, name):
    """``ple.reference.grouped_rms_norm`` (public, used by every backend's tests) checks its arguments."""
    args = dict(x=torch.ones(4, 6), weight=torch.zeros(6), group_size=3, eps=1e-6) | bad
    with pytest.raises((ValueError, TypeError), match=rf"^{name}\b"):
        ple.reference.grouped_rms_norm(args["x"], args["weight"], args["group_size"], args["eps"])
    ple.reference.grouped_rms_norm(torch.ones(4, 6), torch.zeros(6), 3, 1e-6)   # the good call runs
