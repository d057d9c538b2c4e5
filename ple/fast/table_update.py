"""``table_update`` (docs/spec.md section 11) as one Triton kernel over the sorted ids.

Kernel design (``_update_kernel``, grid ``(M,)``, one program per sorted position):

* The ids are sorted on the device (``torch.sort(stable=True)``: equal ids keep their lookup order)
  into ``[M, 2]`` int64 (id, position) pairs, one 128-bit load per position, as
  ``ple.fast.embedding``'s deterministic backward does.
* A program does nothing unless its position starts a run of equal ids. The program that starts a
  run owns the row: it walks the run in sorted (= lookup) order, `_UNROLL` gradient rows loaded per
  step (in flight together) but added one after another in float32, so ``g`` is the reference's sum
  bit for bit, whatever `_UNROLL` is.
* The same program holds the whole row (``BLOCK_D``, the next power of two at least D; `_warps`
  warps: 8 values per thread up to D = 4096, more past it), so it reads the row (and Adam's ``m``
  row, the rule's scalar state), computes the rule in registers in the reference's order of
  operations, and writes the new row, rounded once to the table's dtype (bfloat16 on the bits,
  ``ple.fast._numerics``), and the state. Each row and state entry is written once, by one
  program: no atomics, and the bits depend only on the inputs. No host read: the grid is ``M``, the
  runs are found on the device.

Numerics: the kernel computes in float32 for every table dtype (a float64 table's row is rounded to
float32 first, as the reference's ``.float()``), with the scalars of ``rule_constants`` passed as
float32; square roots and divisions are correctly rounded (``tl.sqrt_rn``, ``tl.div_rn``) and the
kernel is compiled without floating-point contraction (``enable_fp_fusion=False``: no fused
multiply-add), so each product and sum is rounded as the reference rounds it. The one difference is
``mean(g * g)``: the kernel's ``tl.sum`` adds the squares in its own tree order, then divides by D
(correctly rounded), where torch sums in another order. SGD, whose formula has neither a mean nor
a square root, equals the reference bit for bit; so do Adagrad's and Adam's state wherever the sum
of squares is exact, and their rows too where torch's float32 ``sqrt`` is correctly rounded (on the
CPU, torch 2.13's is one ulp off for some inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _checks
from .. import reference as _reference
from ..reference.table_update import rule_constants
from ._library import register, twin
from ._numerics import down, sorted_run_start, up

__all__ = ["table_update"]

_UNROLL = 8           # gradient rows of a run loaded together per step (read at launch time)
_RULE_IDS = {"sgd": 0, "adagrad": 1, "adam": 2}
_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64, torch.float16: tl.float16,
              torch.bfloat16: tl.bfloat16}


@triton.jit
def _update_kernel(w_ptr, stride_w_r, stride_w_d, g_ptr, stride_g_m, stride_g_d, pairs_ptr,
                   s_ptr, stride_s, m_ptr, stride_m_r, stride_m_d, M, D, d_count,
                   lr, weight_decay, eps, b1, one_minus_b1, b2, one_minus_b2, correction1, correction2,
                   RULE: tl.constexpr, HAS_WD: tl.constexpr, IS_G_BF16: tl.constexpr, WT: tl.constexpr,
                   IS_W_BF16: tl.constexpr, UNROLL: tl.constexpr, BLOCK_D: tl.constexpr):
    # pairs: [M, 2] int64 (id, position) sorted by id, stable. RULE: 0 sgd, 1 adagrad (s: [rows]),
    # 2 adam (m: [rows, D], s: v [rows]). d_count: D as a float32 (the mean's divisor).
    p, two, rid, starts = sorted_run_start(pairs_ptr)
    if starts:                                                   # p starts the run of rid
        d = tl.arange(0, BLOCK_D).to(tl.int64)
        dm = d < D
        # g: the run's gradient rows, one add after another in sorted (= lookup) order, from +0.0
        # (as the reference's zeros; a masked lane adds +0.0, which changes no sum that starts at +0.0).
        g = tl.zeros([BLOCK_D], dtype=tl.float32)
        j = p
        more = p < M
        while more:
            for u in tl.static_range(UNROLL):
                ok = j + u < M
                s_id, src = tl.split(tl.load(pairs_ptr + 2 * (j + u) + two, mask=tl.where(ok, two < 2, False),
                                             other=-1))
                ok = ok & (s_id == rid)
                row = tl.load(g_ptr + src * stride_g_m + d * stride_g_d, mask=tl.where(ok, dm, False), other=0.0)
                g += up(row, IS_G_BF16, False)
                more = ok
            j += UNROLL
        w_at = w_ptr + rid * stride_w_r + d * stride_w_d
        w = up(tl.load(w_at, mask=dm, other=0.0), IS_W_BF16, False)  # float64 rounds to float32 here
        if HAS_WD:
            g = g + weight_decay * w
        if RULE == 0:
            new = w - lr * g
        elif RULE == 1:
            s_r = tl.load(s_ptr + rid * stride_s) + tl.div_rn(tl.sum(g * g, axis=0), d_count)
            new = w - tl.div_rn(lr * g, tl.sqrt_rn(s_r) + eps)
            tl.store(s_ptr + rid * stride_s, s_r)
        else:
            m_at = m_ptr + rid * stride_m_r + d * stride_m_d
            m_r = b1 * tl.load(m_at, mask=dm, other=0.0) + one_minus_b1 * g
            v_r = b2 * tl.load(s_ptr + rid * stride_s) + one_minus_b2 * tl.div_rn(tl.sum(g * g, axis=0), d_count)
            m_hat = tl.div_rn(m_r, correction1)
            v_hat = tl.div_rn(v_r, correction2)
            new = w - tl.div_rn(lr * m_hat, tl.sqrt_rn(v_hat) + eps)
            tl.store(m_at, m_r, mask=dm)
            tl.store(s_ptr + rid * stride_s, v_r)
        tl.store(w_at, down(new, WT, IS_W_BF16), mask=dm)


def _warps(block_d: int) -> int:
    """Warps of a program holding ``block_d`` columns: 8 values per thread (one 128-bit bfloat16 access)."""
    return max(1, min(16, block_d // 256))


def _update(weight: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, state: list[torch.Tensor], rule: str,
            lr: float, weight_decay: float, eps: float, betas: tuple[float, float], step: int) -> None:
    M, D = grad.shape
    if M == 0:
        return
    k = rule_constants(rule, lr, weight_decay, eps, betas, step)
    sorted_ids, order = torch.sort(ids.to(torch.int64), stable=True)
    pairs = torch.stack((sorted_ids, order), dim=1)                 # [M, 2]: one 128-bit load per position
    s = state[-1] if state else weight                              # unused by SGD
    m = state[0] if rule == "adam" else weight                      # unused but by Adam
    block_d = triton.next_power_of_2(max(D, 1))
    _update_kernel[(M,)](
        w_ptr=weight, stride_w_r=weight.stride(0), stride_w_d=weight.stride(1),
        g_ptr=grad, stride_g_m=grad.stride(0), stride_g_d=grad.stride(1), pairs_ptr=pairs,
        s_ptr=s, stride_s=s.stride(0), m_ptr=m, stride_m_r=m.stride(0), stride_m_d=m.stride(1), M=M, D=D,
        d_count=float(D), lr=k["lr"], weight_decay=k["weight_decay"], eps=k["eps"], b1=k.get("b1", 0.0),
        one_minus_b1=k.get("one_minus_b1", 0.0), b2=k.get("b2", 0.0), one_minus_b2=k.get("one_minus_b2", 0.0),
        correction1=k.get("correction1", 1.0), correction2=k.get("correction2", 1.0),
        RULE=_RULE_IDS[rule], HAS_WD=weight_decay != 0, IS_G_BF16=grad.dtype == torch.bfloat16,
        WT=_TL_DTYPES[weight.dtype], IS_W_BF16=weight.dtype == torch.bfloat16, UNROLL=_UNROLL, BLOCK_D=block_d,
        num_warps=_warps(block_d), enable_fp_fusion=False)


# ---- registration ----------------------------------------------------------------------------------


def _update_impl(weight: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, state: list[torch.Tensor],
                 rule: str, lr: float, weight_decay: float, eps: float, beta1: float, beta2: float, step: int,
                 validate: bool) -> None:
    betas = (beta1, beta2)
    if validate:
        _checks.table_update_values(weight, ids, grad, tuple(state), rule, lr, weight_decay, eps, betas, step)
    _update(weight, ids, grad, state, rule, lr, weight_decay, eps, betas, step)


def _no_output(*args):
    return None


_update_op = register("table_update", _update_impl, fake=_no_output, mutates_args=("weight", "state"))


@twin(_reference.table_update)
def table_update(weight: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, state: tuple[torch.Tensor, ...], *,
                 rule: str, lr: float, weight_decay: float = 0.0, eps: float = 1e-8,
                 betas: tuple[float, float] = (0.9, 0.999), step: int = 1, validate: bool = True) -> None:
    """One kernel over the ids sorted on the device: the program that starts a run of equal ids sums the run's
    gradient rows in lookup order and updates the row and its state, each written once (no atomics: the same bits
    run after run; no host read with ``validate=False``). Square roots and divisions are correctly rounded and
    nothing is fused into a multiply-add, so SGD equals the reference bit for bit; Adagrad and Adam sum ``g * g``
    for the mean in the kernel's own order. Registered as ``torch.ops.ple.table_update`` (mutating ``weight`` and
    ``state``). CPU tensors are refused (``ValueError``) while the kernels are compiled; under
    ``TRITON_INTERPRET=1`` they run on the CPU."""
    _checks.table_update_meta(weight, ids, grad, state, rule, lr, weight_decay, eps, betas, step)
    _update_op(weight, ids, grad, list(state), rule, float(lr), float(weight_decay), float(eps), float(betas[0]),
               float(betas[1]), int(step), _checks.validating(validate))
