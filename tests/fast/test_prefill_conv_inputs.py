"""``ple.fast.prefill.prefill_conv_inputs``: the bits a fused serving prefill leaves in the conv state."""

from __future__ import annotations

import pytest
import torch

from ple import fast
from ple import reference as ref
from ple.fast.prefill import prefill_conv_inputs
from ple.testing.numerics import assert_bitwise_equal

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_inputs_are_the_states_a_fused_prefill_writes(dtype):
    g = torch.Generator().manual_seed(0)
    M, H, K, d, lens = 2, 40, 4, 3, [23, 11, 5]
    C, S, T = M * H, (K - 1) * d, sum(lens)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    key, value, hidden = rnd(T, C), rnd(T, H), rnd(T, C)
    wk, wq, wc, w = rnd(C) * 0.3, rnd(C) * 0.3, rnd(C) * 0.3, rnd(C, K) * 0.5
    state = torch.zeros(4, S, C, dtype=dtype).transpose(1, 2)
    query_start_loc = torch.tensor([0, 23, 34, 39])
    fast.ple_prefill(key, value, hidden, wk, wq, wc, 1e-6, w, dilation=d, query_start_loc=query_start_loc,
                     conv_state=state, state_indices=torch.tensor([1, 2, 3]))
    u = prefill_conv_inputs(key, value, hidden, wk, wq, wc, 1e-6, S)
    for r, slot in enumerate((1, 2, 3)):
        lo, hi = int(query_start_loc[r]), int(query_start_loc[r + 1])
        want = torch.cat([torch.zeros(S, C, dtype=dtype), u[lo:hi]])[-S:]
        assert_bitwise_equal(state[slot].T, want, name=f"slot {slot}'s state")
    torch.testing.assert_close(u, ref.ple_gate(key, value, hidden, wk, wq, wc, 1e-6)[1], rtol=1e-5, atol=1e-5)
