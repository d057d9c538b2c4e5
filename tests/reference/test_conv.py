"""The serving conv ``ple_conv`` and ``export_conv_checkpoints`` (docs/spec.md section 6).

``ple_conv`` is driven through random request streams (prefill chunks, decodes and speculative
steps with random acceptance, all requests of a mode in one call, rows interleaved) and judged
against ``dilated_causal_conv`` over each request's accepted inputs, with the conv states checked
bit for bit against the state docs/spec.md defines.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from ple.reference import dilated_causal_conv, export_conv_checkpoints, ple_conv
from ple.testing.numerics import assert_bitwise_equal

NAN = float("nan")
INDEX_DTYPES = st.sampled_from([torch.int32, torch.int64])


# ---- ple_conv: random serving streams ---------------------------------------------------------
LAYOUTS = ["contiguous", "transposed", "slot_strided", "window_view", "transposed_window"]


def make_state(layout: str, num_slots: int, C: int, W: int):
    """A NaN-poisoned state buffer and the function that views it as ``[num_slots, C, W]``."""
    if layout == "contiguous":
        return torch.full((num_slots, C, W), NAN), lambda b: b
    if layout == "transposed":  # a [slots, W, C] buffer
        return torch.full((num_slots, W, C), NAN), lambda b: b.transpose(1, 2)
    if layout == "slot_strided":  # every other slot of a larger buffer
        return torch.full((2 * num_slots + 1, C, W), NAN), lambda b: b[1::2][:num_slots]
    if layout == "window_view":  # a window inside wider rows
        return torch.full((num_slots, C, W + 3), NAN), lambda b: b[:, :, 2 : 2 + W]
    if layout == "transposed_window":
        return torch.full((num_slots, W + 2, C), NAN), lambda b: b.transpose(1, 2)[:, :, 1 : 1 + W]
    raise AssertionError(layout)


def last_columns(seq: torch.Tensor, n: int, C: int) -> torch.Tensor:
    """The last ``n`` rows of ``zeros ++ seq`` as ``[C, n]`` columns (oldest first)."""
    full = torch.cat([torch.zeros(n, C), seq])
    return full[full.shape[0] - n :].T


def index_tensor(values: list[int], dtype, strided: bool) -> torch.Tensor:
    """``values`` as a 1-D index tensor; with ``strided``, a column of a 2-D block table."""
    if not strided:
        return torch.tensor(values, dtype=dtype)
    table = torch.full((len(values), 3), -7, dtype=dtype)
    table[:, 1] = torch.tensor(values, dtype=dtype)
    return table[:, 1]


class Request:
    def __init__(self, slot: int, C: int):
        self.slot = slot
        self.seq = torch.zeros(0, C)  # accepted conv inputs so far
        self.started = False
        self.accepted = 1  # num_accepted_tokens for the next spec step


class HypothesisChoices:
    """Schedule decisions drawn by Hypothesis (the first option is the one it shrinks to)."""

    def __init__(self, data):
        self.data = data

    def pick(self, options, label):
        return self.data.draw(st.sampled_from(options), label=label)

    def shuffle(self, items, label):
        return list(self.data.draw(st.permutations(items), label=label))


class SeededChoices:
    """The same decisions from a seeded ``random.Random``: long streams, cheap to run."""

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def pick(self, options, label):
        return self.rng.choice(options)

    def shuffle(self, items, label):
        items = list(items)
        self.rng.shuffle(items)
        return items


def stream_setup(pick, *, steps, **fixed):
    """Sizes of a stream; ``fixed`` pins any of them."""

    def get(name, options):
        return fixed[name] if name in fixed else pick(options, name)

    C = get("C", [5, 1, 3, 6])
    K = get("K", [3, 1, 2, 4])
    d = get("d", [2, 1, 3])
    Q = get("Q", [3, 1, 2, 4])  # spec_query_len
    W = (K - 1) * d + Q - 1 + get("extra_window", [0, 1, 2])
    n_req = get("n_req", [3, 1, 2, 4, 5])
    num_slots = n_req + 2
    null_slot = get("null_slot", [0, num_slots - 1, num_slots // 2])
    return dict(
        C=C,
        K=K,
        d=d,
        Q=Q,
        W=W,
        num_slots=num_slots,
        null_slot=null_slot,
        n_req=n_req,
        layout=get("layout", LAYOUTS),
        steps=steps,
    )


def run_stream(setup: dict, ch, seed: int) -> dict:
    """Drive ``ple_conv`` through a random serving stream; check every step. Returns what it exercised."""
    C, K, d, Q, W = setup["C"], setup["K"], setup["d"], setup["Q"], setup["W"]
    S = (K - 1) * d
    null = setup["null_slot"]
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(C, K, generator=gen)
    buf, view = make_state(setup["layout"], setup["num_slots"], C, W)
    expected_buf = buf.clone()
    free = ch.shuffle([s for s in range(setup["num_slots"]) if s != null], "slots")
    reqs = [Request(s, C) for s in free[: setup["n_req"]]]
    seen = {"spec reads past column 0": 0, "calls": 0}

    for step in range(setup["steps"]):
        # -- plan: each request picks a mode (or sits the step out); null-slot requests ride along.
        plan = {"spec": [], "decode": [], "prefill": []}  # mode -> [(request or None, q, has_initial)]
        for i, r in enumerate(reqs):
            if not r.started:
                choices = ["prefill_new", "decode_new", "skip"]
            elif r.accepted > 1:
                choices = ["spec", "skip"]  # the window to read is not column 0
            else:
                choices = ["spec", "decode", "prefill", "skip", "prefill_new"]
            act = ch.pick(choices, f"step{step} req{i}")
            if act == "spec":
                plan["spec"].append((r, ch.pick(list(range(Q, 0, -1)), "q"), True))
                seen["spec reads past column 0"] += r.accepted > 1
            elif act.startswith("decode"):
                plan["decode"].append((r, 1, act == "decode"))
            elif act.startswith("prefill"):
                plan["prefill"].append((r, ch.pick([3, 0, 1, 2, 5, 6], "chunk"), act == "prefill"))
        for mode in plan:
            for _ in range(ch.pick([0, 1, 2], f"null {mode}")):
                q = {"decode": [1], "spec": list(range(1, Q + 1)), "prefill": [0, 1, 4]}[mode]
                plan[mode].append((None, ch.pick(q, "null q"), True))
            plan[mode] = ch.shuffle(plan[mode], f"order {mode}")
        n_rows = sum(q for mode in plan for _, q, _ in plan[mode])
        T = n_rows + ch.pick([0, 1, 2], "rows in no call")

        # -- physical rows: a random interleaving, or contiguous slices per call.
        use_token_indices = ch.pick([True, False], "token_indices")
        perm = torch.randperm(T, generator=gen).tolist() if use_token_indices else list(range(T))
        inputs = torch.randn(T, C, generator=gen)
        residual = torch.randn(T, C, generator=gen)
        outer = torch.randn(T, C, generator=gen)
        expected_res = residual.clone()
        cursor = 0
        calls = []
        for mode, items in plan.items():
            if not items:
                continue
            q_total = sum(q for _, q, _ in items)
            rows = perm[cursor : cursor + q_total]
            call_lo = cursor
            cursor += q_total
            with_outer = ch.pick([True, False], "outer_residual")
            starts, pos = [0], 0
            for r, q, has_init in items:
                phys = rows[pos : pos + q]
                pos += q
                starts.append(pos)
                if r is None:  # null slot: residual adds only
                    inputs[phys] = NAN
                    if with_outer:
                        expected_res[phys] = residual[phys] + outer[phys]
                    continue
                x = inputs[phys]
                prior = r.seq if (has_init or mode == "spec") else torch.zeros(0, C)
                if q:
                    y = dilated_causal_conv(torch.cat([prior, x]), w, dilation=d)[prior.shape[0] :]
                    expected_res[phys] = residual[phys] + y + (outer[phys] if with_outer else 0)
                # The state docs/spec.md defines after this step, written into the expected buffer.
                ev = view(expected_buf)[r.slot]
                if mode == "spec":
                    ev[:, 0 : S + q - 1] = last_columns(torch.cat([prior, x]), S + q - 1, C)
                elif q:
                    ev[:, 0:S] = last_columns(torch.cat([prior, x]), S, C)
            calls.append((mode, items, rows, starts, call_lo, with_outer))
        for p in perm[cursor:]:
            inputs[p] = NAN  # rows no call may read

        # -- run: one ple_conv call per mode, all on the same inputs and residual.
        for mode, items, rows, starts, call_lo, with_outer in calls:
            idx = ch.pick([torch.int64, torch.int32], "index dtype")
            slots = [null if r is None else r.slot for r, _, _ in items]
            has_init = [h for _, _, h in items]
            kw = dict(
                mode=mode,
                dilation=d,
                null_slot=null,
                state_indices=index_tensor(slots, idx, ch.pick([True, False], "block table")),
                query_start_loc=torch.tensor(starts, dtype=idx),
                outer_residual=outer if with_outer else None,
            )
            if mode == "decode" and ch.pick([False, True], "decode qsl None"):
                kw["query_start_loc"] = None
            if mode == "spec":
                kw["spec_query_len"] = Q
                kw["num_accepted_tokens"] = torch.tensor(
                    [1 if r is None else r.accepted for r, _, _ in items], dtype=idx
                )
                # Spec always reads its window, whatever has_initial_states says.
                if ch.pick([True, False], "spec has_initial_states"):
                    kw["has_initial_states"] = torch.rand(len(items), generator=gen) < 0.5
            else:
                # Defaults: decode assumes every request has a state, prefill that none has.
                needed = not all(has_init) if mode == "decode" else any(has_init)
                if needed or ch.pick([False, True], "explicit has_initial_states"):
                    kw["has_initial_states"] = torch.tensor(
                        has_init, dtype=ch.pick([torch.bool, torch.int32, torch.int64], "has_initial dtype")
                    )
            seen["calls"] += 1
            if use_token_indices:
                kw["token_indices"] = torch.tensor(rows, dtype=idx)
                ple_conv(inputs, residual, view(buf), w, **kw)
            else:
                sl = slice(call_lo, call_lo + len(rows))
                if with_outer:
                    kw["outer_residual"] = outer[sl]
                ple_conv(inputs[sl], residual[sl], view(buf), w, **kw)

        # -- judge outputs, then states bit for bit.
        torch.testing.assert_close(
            residual, expected_res, rtol=1e-5, atol=1e-5, msg=lambda m, step=step: f"step {step}: {m}"
        )
        for mode, items, rows, starts, *_ in calls:
            for i, (r, q, has_init) in enumerate(items):
                if r is None or q == 0:  # an empty request changes nothing
                    continue
                prior = r.seq if (has_init or mode == "spec") else torch.zeros(0, C)
                r.started = True
                x = inputs[rows[starts[i] : starts[i + 1]]]
                if mode == "spec":
                    a = ch.pick(list(range(q, 0, -1)), "accepted")
                    r.seq, r.accepted = torch.cat([prior, x[:a]]), a
                else:
                    r.seq, r.accepted = torch.cat([prior, x]), 1
        assert_bitwise_equal(buf, expected_buf, name=f"state buffer after step {step}")
        for r in reqs:
            if (
                r.started
            ):  # the window the next step reads: the last S accepted inputs, zeros before the start
                window = view(buf)[r.slot][:, r.accepted - 1 : r.accepted - 1 + S]
                assert_bitwise_equal(window, last_columns(r.seq, S, C), name=f"slot {r.slot} window")
    return seen


@given(data=st.data(), seed=st.integers(0, 2**31), steps=st.sampled_from([4, 1, 2, 6]))
def test_ple_conv_streams_equal_whole_sequence_conv(data, seed, steps):
    ch = HypothesisChoices(data)
    setup = stream_setup(ch.pick, steps=steps)
    note(setup)
    run_stream(setup, ch, seed)


@pytest.mark.parametrize("seed", range(6))
def test_ple_conv_long_seeded_streams(seed):
    ch = SeededChoices(seed)
    setup = stream_setup(
        ch.pick,
        steps=12,
        K=3,
        Q=3,
        n_req=4,
        layout=LAYOUTS[seed % len(LAYOUTS)],
        null_slot=[0, 5, 3][seed % 3],
    )
    seen = run_stream(setup, ch, seed)
    # The streams must reach the cases they are for.
    assert seen["spec reads past column 0"] > 0 and seen["calls"] >= 12, seen


@pytest.mark.parametrize("mode", ["prefill", "decode", "spec"])
def test_null_slot_rows_get_no_conv_and_null_slot_untouched(mode):
    C, K, d, S = 3, 3, 2, 4
    gen = torch.Generator().manual_seed(1)
    state = torch.randn(4, C, S + 2, generator=gen)
    before = state.clone()
    inputs = torch.randn(2, C, generator=gen)
    residual, outer = torch.randn(2, C, generator=gen), torch.randn(2, C, generator=gen)
    res0 = residual.clone()
    kw = dict(mode=mode, dilation=d, null_slot=2, query_start_loc=torch.tensor([0, 1, 2]))
    if mode == "spec":
        kw.update(spec_query_len=3, num_accepted_tokens=torch.tensor([2, 3]))
    ple_conv(
        inputs,
        residual,
        state,
        torch.randn(C, K, generator=gen),
        torch.tensor([2, 2]),
        outer_residual=outer,
        **kw,
    )
    assert torch.equal(residual, res0 + outer)
    assert_bitwise_equal(state, before)


# ---- export_conv_checkpoints ------------------------------------------------------------------
@given(
    C=st.sampled_from([1, 3, 5]),
    K=st.integers(2, 4),
    d=st.integers(1, 3),
    R=st.integers(1, 4),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**31),
    data=st.data(),
)
def test_checkpoints_equal_stopping_early_and_resume_exactly(C, K, d, R, layout, seed, data):
    S = (K - 1) * d
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(C, K, generator=gen)
    lens = [data.draw(st.integers(0, 2 * S + 3), label=f"len{r}") for r in range(R)]
    offs = [
        data.draw(st.sampled_from([0] + list(range(S, n + 1))), label=f"off{r}") for r, n in enumerate(lens)
    ]
    has_init = [data.draw(st.booleans(), label=f"init{r}") for r in range(R)]
    null = data.draw(st.sampled_from([0, 3 * R]), label="null")
    free = [s for s in range(3 * R + 1) if s != null]
    live, ckpt = free[:R], free[R : 2 * R]
    # Some checkpoint requests point at the null slot: nothing is written for them.
    ckpt = [null if data.draw(st.booleans(), label=f"null ckpt{r}") else s for r, s in enumerate(ckpt)]
    note(dict(lens=lens, offs=offs, has_init=has_init, null=null, live=live, ckpt=ckpt))

    buf, view = make_state(layout, 3 * R + 1, C, S + 1)
    for s in live:
        view(buf)[s].copy_(torch.randn(C, S + 1, generator=gen))
    T = sum(lens)
    perm = torch.randperm(T + 1, generator=gen).tolist()[:T]  # one physical row belongs to nobody
    inputs = torch.randn(T + 1, C, generator=gen)
    qsl = torch.tensor([0] + [sum(lens[: r + 1]) for r in range(R)], dtype=torch.int64)
    starts = qsl.tolist()
    idx = data.draw(INDEX_DTYPES, label="index dtype")

    start_buf = buf.clone()
    export_conv_checkpoints(
        inputs,
        view(buf),
        query_start_loc=qsl.to(idx),
        offsets=torch.tensor(offs, dtype=idx),
        slots=torch.tensor(ckpt, dtype=idx),
        state_len=S,
        token_indices=torch.tensor(perm, dtype=idx),
        null_slot=null,
    )
    expected = start_buf.clone()
    for r in range(R):
        if offs[r] and ckpt[r] != null:
            # The state after prefilling only the first offs[r] tokens of the step.
            early = start_buf.clone()
            rows = perm[starts[r] : starts[r] + offs[r]]
            ple_conv(
                inputs,
                torch.zeros_like(inputs),
                view(early),
                w,
                torch.tensor([live[r]]),
                mode="prefill",
                dilation=d,
                null_slot=null,
                query_start_loc=torch.tensor([0, offs[r]]),
                has_initial_states=torch.tensor([has_init[r]]),
                token_indices=torch.tensor(rows, dtype=torch.int64),
            )
            view(expected)[ckpt[r]][:, :S] = view(early)[live[r]][:, :S]
    assert_bitwise_equal(buf, expected, name="state after export")

    # Never stopping: the whole step in one prefill call.
    whole_buf, whole_res = buf.clone(), torch.zeros_like(inputs)
    ple_conv(
        inputs,
        whole_res,
        view(whole_buf),
        w,
        torch.tensor(live),
        mode="prefill",
        dilation=d,
        null_slot=null,
        query_start_loc=qsl,
        has_initial_states=torch.tensor(has_init),
        token_indices=torch.tensor(perm, dtype=torch.int64),
    )
    # Restoring each checkpoint and prefilling the rest of the step.
    for r in range(R):
        if not offs[r] or ckpt[r] == null:
            continue
        rest = perm[starts[r] + offs[r] : starts[r + 1]]
        res = torch.zeros_like(inputs)
        ple_conv(
            inputs,
            res,
            view(buf),
            w,
            torch.tensor([ckpt[r]]),
            mode="prefill",
            dilation=d,
            null_slot=null,
            query_start_loc=torch.tensor([0, len(rest)]),
            has_initial_states=torch.tensor([True]),
            token_indices=torch.tensor(rest, dtype=torch.int64),
        )
        torch.testing.assert_close(res[rest], whole_res[rest], rtol=1e-5, atol=1e-5)
        assert_bitwise_equal(view(buf)[ckpt[r]][:, :S], view(whole_buf)[live[r]][:, :S], name=f"resumed {r}")
