"""``ple.fast.embedding_lookup`` against ``ple.reference``: forward bit for bit; backward with repeated ids
equal bit for bit on integer-valued gradients, and within tolerance on random ones.

Every test runs Triton kernels (compiled on a GPU, under ``TRITON_INTERPRET=1`` on the CPU), so
shapes are small; fresh buffers are poisoned (the ``poisoned_empty`` fixture of ``tests/conftest.py``)
so an element a kernel never writes shows up as a mismatch.
"""


from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from ple import reference as ref
from ple.fast import embedding_lookup as fast_lookup  # public ops: torch.library custom ops
from ple.testing.numerics import assert_bitwise_equal, assert_close

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("poisoned_empty")]

INDEX_DTYPES = (torch.int32, torch.int64)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- embedding lookup -------------------------------------------------------------------------------
@given(rows=st.integers(1, 9), T=st.integers(0, 11), NH=st.integers(1, 4), D=st.integers(1, 9),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
       ids_dtype=st.sampled_from(INDEX_DTYPES), strided=st.booleans(),  # others: TypeError (test_errors)
       seed=st.integers(0, 2**31 - 1))
def test_embedding_lookup_fwd_bwd(rows, T, NH, D, dtype, ids_dtype, strided, seed):
    note(f"rows={rows} T={T} NH={NH} D={D} {dtype} {ids_dtype} strided={strided} seed={seed}")
    g = _gen(seed)
    weight = torch.randn(rows, D, generator=g).to(dtype)
    ids = torch.randint(0, rows, (T, NH), generator=g).to(ids_dtype)       # rows < T*NH: repeats
    if strided:
        ids = ids.t().contiguous().t()                                      # column-major view
    w_ref, w_fast = weight.clone().requires_grad_(), weight.clone().requires_grad_()
    expected, actual = ref.embedding_lookup(w_ref, ids), fast_lookup(w_fast, ids)
    assert_bitwise_equal(actual.detach(), expected.detach(), name="lookup")
    # Integer-valued gradients: every accumulation order gives the same sums.
    grad = torch.randint(-4, 5, expected.shape, generator=g).to(dtype)
    (g_exp,) = torch.autograd.grad(expected, w_ref, grad, retain_graph=True)
    (g_act,) = torch.autograd.grad(actual, w_fast, grad, retain_graph=True)
    assert_bitwise_equal(g_act, g_exp, name="lookup grad (integer-valued)")
    # Random gradients: within tolerance (bfloat16 judged against a float64 run).
    grad = torch.randn(expected.shape, generator=g).to(dtype)
    (g_exp,) = torch.autograd.grad(expected, w_ref, grad)
    (g_act,) = torch.autograd.grad(actual, w_fast, grad)
    w64 = weight.double().requires_grad_()
    (g_64,) = torch.autograd.grad(ref.embedding_lookup(w64, ids), w64, grad.double())
    assert_close(g_act, g_exp, exact64=g_64, name="lookup grad")
