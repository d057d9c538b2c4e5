"""``ple_prefill`` as the composition of this backend's ops (SPEC section 7): ``ple_gate`` -> ``keep`` mask ->
``dilated_causal_conv`` (``conv_state=None``) or ``ple_conv(mode="prefill")`` -> ``(gated + y) + hidden_states``.

Without a conv state and with nothing recording autograd (inference, evaluation) the composition runs
in blocks of rows (``gate.block_rows``), gate, mask, conv and both adds of one block after the other,
so every float32 temporary is small and stays in cache; each block's conv reads the S conv inputs
before it, and the rows at the head of every packed sequence but the first are recomputed at the end
(``training_conv.tap_sum``'s fix). Same ops, same rounding points, same bits as the unblocked
composition, which runs when autograd records.
"""

from __future__ import annotations

import torch

from .. import _checks
from .. import reference as _reference
from ..backends import twin
from ..reference.gate import acc_dtype
from .conv import ple_conv
from .gate import _gate_block, block_rows, gate, records_grad
from .training_conv import _conv, _sequence_heads, conv_activation, exact_products, tap_sum

__all__ = ["ple_prefill"]


@twin(_reference.ple_prefill)
def ple_prefill(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
                norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor,
                eps: float, conv_weights: torch.Tensor, *, dilation: int, query_start_loc: torch.Tensor,
                keep: torch.Tensor | None = None, conv_state: torch.Tensor | None = None,
                state_indices: torch.Tensor | None = None, has_initial_states: torch.Tensor | None = None,
                token_indices: torch.Tensor | None = None, null_slot: int = 0,
                validate: bool = True) -> torch.Tensor:
    _checks.prefill_meta(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
                 conv_weights, dilation=dilation, query_start_loc=query_start_loc, keep=keep,
                 conv_state=conv_state, state_indices=state_indices, has_initial_states=has_initial_states,
                 token_indices=token_indices, null_slot=null_slot)
    if validate:
        _checks.prefill_values(key, conv_weights, dilation=dilation, query_start_loc=query_start_loc,
                       conv_state=conv_state, state_indices=state_indices, has_initial_states=has_initial_states,
                       token_indices=token_indices, null_slot=null_slot)
    H = value.shape[1]
    norms = (norm_key_weight, norm_query_weight, norm_conv_weight)
    grad = records_grad(key, value, hidden_states, *norms, conv_weights)
    if conv_state is None and not grad and not torch.compiler.is_compiling():
        return _forward_blocked(key, value, hidden_states, *norms, eps, H, conv_weights, dilation,
                                query_start_loc, keep)
    gated, conv_input = gate(key, value, hidden_states, *norms, eps, H)
    if keep is not None:
        mask = (keep != 0).to(gated.dtype)[:, None]
        if grad:
            gated, conv_input = gated * mask, conv_input * mask
        else:
            gated.mul_(mask)
            conv_input.mul_(mask)
    if conv_state is None:
        y = _conv(conv_input, conv_weights, dilation, query_start_loc)
        return (gated + y) + hidden_states
    assert state_indices is not None                                          # checked by prefill_meta
    out = gated.clone() if grad else gated
    ple_conv(conv_input, out, conv_state, conv_weights, state_indices, mode="prefill", dilation=dilation,
             query_start_loc=query_start_loc, has_initial_states=has_initial_states, token_indices=token_indices,
             outer_residual=hidden_states, null_slot=null_slot, validate=False)
    if token_indices is not None:
        covered = torch.zeros(key.shape[0], dtype=torch.bool, device=key.device)
        covered[token_indices.to(torch.int64)] = True
        out = torch.where(covered[:, None], out, torch.zeros_like(out))
    return out


def _forward_blocked(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps, H,
                     conv_weights, dilation, query_start_loc, keep):
    """``(gated + y) + hidden_states`` of whole requests from zero history, without autograd, in blocks."""
    T, C = key.shape
    dt = key.dtype
    acc = acc_dtype(dt)
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    wt = conv_weights.to(acc).t().contiguous()                         # [K, C]
    exact = exact_products(dt, conv_weights.dtype)
    cu = query_start_loc.to(torch.int64)
    fix = cu.numel() > 2 and S > 0 and T > 0                             # packed sequences after the first
    gated, conv_input = key.new_empty(T, C), key.new_empty(T, C)
    out = key.new_empty(T + fix, C)                                      # + a scratch row for the fix
    mask = None if keep is None else (keep != 0).to(dt)[:, None]
    norms = (norm_key_weight, norm_query_weight, norm_conv_weight, eps, H)
    n = block_rows(T, C)
    for a in range(0, T, n):
        b = min(a + n, T)
        _gate_block(key[a:b], value[a:b], hidden_states[a:b], *norms, gated=gated[a:b], conv_input=conv_input[a:b])
        if mask is not None:
            gated[a:b].mul_(mask[a:b])
            conv_input[a:b].mul_(mask[a:b])
        h0 = max(a - S, 0)                                               # the block's conv reads S rows back
        y = conv_activation(tap_sum(conv_input[h0:b].to(acc), wt, dilation, exact=exact)[a - h0:], dt, inplace=True)
        torch.add(gated[a:b], y, out=y)
        torch.add(y, hidden_states[a:b], out=out[a:b])
    if not fix:
        return out
    # Rows at the head of every sequence but the first read the sequence before: recompute them.
    rows, inside = _sequence_heads(cu, S, T)
    p = torch.arange(S, device=key.device)
    src_rows = torch.where(inside, rows, 0)
    u = key.new_zeros(rows.numel(), C, dtype=acc)
    for j in range(K):
        lag = (K - 1 - j) * dilation
        valid = (p >= lag) & inside
        src = torch.where(valid, rows - lag, 0).flatten()
        u = u + wt[j] * conv_input.index_select(0, src).to(acc) * valid.flatten()[:, None].to(acc)
    y = conv_activation(u, dt, inplace=True)
    src_rows = src_rows.flatten()
    fixed = (gated.index_select(0, src_rows) + y) + hidden_states.index_select(0, src_rows)
    return out.index_copy_(0, torch.where(inside, rows, T).flatten(), fixed)[:T]
