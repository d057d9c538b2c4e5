"""``ple.fast.embedding_lookup`` against ``ple.reference``: forward bit for bit; backward with repeated ids
equal bit for bit on integer-valued gradients, and within tolerance on random ones.

Every test runs Triton kernels (compiled on a GPU, under ``TRITON_INTERPRET=1`` on the CPU), so
shapes are small; fresh buffers are poisoned (the ``poisoned_empty`` fixture of ``tests/conftest.py``)
so an element a kernel never writes shows up as a mismatch.
"""


from __future__ import annotations

import pytest
import torch
from _helpers import deterministic_algorithms
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


# ---- deterministic mode -----------------------------------------------------------------------------
def _token_order_sum(grad, ids, rows, dtype):
    """Each row's gradient summed in token order (flat ``t * NH + h``) in the accumulation dtype, rounded once."""
    T, NH = ids.shape
    acc = torch.promote_types(dtype, torch.float32)
    g = grad.reshape(T * NH, -1).to(acc)
    out = torch.zeros(rows, g.shape[1], dtype=acc)
    for i, r in enumerate(ids.reshape(-1).tolist()):
        out[r] += g[i]
    return out.to(dtype)


@pytest.mark.deep                  # a property of ~7 s under the interpreter: the deep tier
@pytest.mark.usefixtures("deterministic_mode")
@given(rows=st.integers(1, 6), T=st.integers(1, 11), NH=st.integers(1, 4), D=st.integers(1, 9),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
       ids_dtype=st.sampled_from(INDEX_DTYPES), strided=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_embedding_lookup_deterministic_backward(rows, T, NH, D, dtype, ids_dtype, strided, seed):
    """Deterministic mode: no atomics, each row summed in token order, bits independent of the block sizes."""
    from ple.fast import embedding as E
    note(f"rows={rows} T={T} NH={NH} D={D} {dtype} {ids_dtype} strided={strided} seed={seed}")
    g = _gen(seed)
    weight = torch.randn(rows, D, generator=g).to(dtype)
    ids = torch.randint(0, rows, (T, NH), generator=g).to(ids_dtype)       # few rows: long runs
    if strided:
        ids = ids.t().contiguous().t()
    grad = (torch.randn(T, NH * D, generator=g) * torch.randint(-30, 30, (T, 1), generator=g).exp2()).to(dtype)

    def table_grad(unroll, block_d):
        w = weight.clone().requires_grad_()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(E, "_DET_UNROLL", unroll)
            mp.setattr(E, "_DET_BLOCK_D", block_d)
            mp.setattr(E, "_lookup_bwd_kernel", None)                        # the atomic kernel must not run
            out = fast_lookup(w, ids)
            (dw,) = torch.autograd.grad(out, w, grad)
        return out, dw

    out, dw_a = table_grad(8, 256)
    _, dw_b = table_grad(1, 1)
    _, dw_c = table_grad(3, 4)
    assert_bitwise_equal(out.detach(), ref.embedding_lookup(weight, ids), name="lookup")
    assert_bitwise_equal(dw_b, dw_a, name="deterministic grad, other block sizes")
    assert_bitwise_equal(dw_c, dw_a, name="deterministic grad, other block sizes")
    assert_bitwise_equal(dw_a, _token_order_sum(grad, ids, rows, dtype), name="token-order sum")
    # And it still matches the reference like the default mode.
    w_ref = weight.clone().requires_grad_()
    (g_exp,) = torch.autograd.grad(ref.embedding_lookup(w_ref, ids), w_ref, grad)
    w64 = weight.double().requires_grad_()
    (g_64,) = torch.autograd.grad(ref.embedding_lookup(w64, ids), w64, grad.double())
    assert_close(dw_a, g_exp, exact64=g_64, name="deterministic lookup grad")


@pytest.mark.parametrize("det", [False, True], ids=["default", "deterministic"])
def test_embedding_lookup_sparse_grad_path(det):
    """``sparse_table_grad=True`` (``ple.table.DenseTable``) with the fast ops: sparse gradient, right values."""
    import ple.fast
    from ple.table import DenseTable
    with deterministic_algorithms(det):
        g = _gen(3)
        ids = torch.randint(0, 7, (9, 3), generator=g)
        grad = torch.randn(9, 15, generator=g)
        sparse, dense = DenseTable(7, 5, sparse_grad=True), DenseTable(7, 5)
        with torch.no_grad():
            dense.weight.copy_(sparse.weight)
        out = sparse.rows(ids, torch.float32, ops=ple.fast, validate=False)
        want = dense.rows(ids, torch.float32, ops=ple.fast)
        assert_bitwise_equal(out.detach(), ref.embedding_lookup(dense.weight, ids).detach(), name="lookup")
        out.backward(grad)
        want.backward(grad)
        assert sparse.weight.grad.is_sparse and not dense.weight.grad.is_sparse
        w64 = dense.weight.detach().double().requires_grad_()
        (g_64,) = torch.autograd.grad(ref.embedding_lookup(w64, ids), w64, grad.double())
        assert_close(sparse.weight.grad.to_dense(), dense.weight.grad, exact64=g_64, name="sparse grad")
