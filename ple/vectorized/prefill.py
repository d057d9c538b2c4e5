"""``ple_prefill`` as the composition of this backend's ops (docs/spec.md section 7): ``ple_gate`` -> ``keep`` mask ->
``dilated_causal_conv`` (``conv_state=None``) or ``ple_conv(mode="prefill")`` -> ``(gated + y) + hidden_states``.

Two paths (``ple/vectorized/__init__.py`` has the measurements):

* the composition above, the general one (autograd, ``torch.compile``, a conv state, any device);
* `BlockedPrefill`, on the CPU without a conv state, eagerly, where autograd records (training), in float32 or
  float64: `_forward_blocked` as the forward, and a backward recomputed in blocks of rows
  (``_prefill_grad.backward_blocked``);
* `_forward_blocked`, on the CPU without a conv state and with nothing recording autograd or compiling
  (inference, evaluation): the composition in blocks of ``gate.BLOCK_ROWS`` rows. A first pass makes
  every row's score sums, the gates of all rows follow at once, and a second pass runs gate, mask,
  conv and both adds of one block after the other in scratch buffers of one block
  (``gate.BlockGate``), so only the output is a ``[T, C]`` tensor and every temporary stays in cache.
  Each block's conv reads a window of the S conv inputs before it, carried over from the block
  before and zeroed before every packed sequence's start. It reads the (CPU) sequence offsets on the
  host, which is no device synchronisation. Same ops, same rounding points, same bits as the
  composition (``tests/vectorized/test_blocked.py`` checks it against the reference across many
  blocks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .. import _checks
from .. import reference as _reference
from .._deprecation import deprecated_function
from ..backends import twin
from ..reference.gate import acc_dtype
from ._prefill_grad import backward_blocked
from .conv import _ple_conv
from .gate import BLOCK_ROWS, BlockGate, gate, records_grad
from .training_conv import _conv, conv_activation

__all__ = ["ple_prefill", "takes_blocked_forward_path", "takes_blocked_backward_path", "takes_blocked_path"]


@twin(_reference.ple_prefill)
def ple_prefill(key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
                norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor,
                eps: float, conv_weights: torch.Tensor, *, dilation: int, query_start_loc: torch.Tensor,
                keep: torch.Tensor | None = None, conv_state: torch.Tensor | None = None,
                state_indices: torch.Tensor | None = None, has_initial_states: torch.Tensor | None = None,
                token_indices: torch.Tensor | None = None, null_slot: int = 0, conv_eps: float | None = None,
                unit_offset: bool = True, validate: bool = True) -> torch.Tensor:
    """This backend's ops composed, the call checked once (``prefill_meta``, then ``prefill_values`` unless
    ``validate=False``) and their bodies run unchecked: ``gate.gate``, the ``keep`` mask, then without a
    conv state the training conv's body and the two adds, with one ``conv._ple_conv(mode="prefill")`` (its
    general path, never the decode one) adding ``y`` and ``hidden_states`` into the gate's output and
    writing the states. On the CPU, eagerly, without a conv state and with nothing recording autograd it
    runs ``prefill._forward_blocked`` instead: the same ops and rounding points in blocks of scratch
    buffers, reading the (CPU) ``query_start_loc`` on the host. Where autograd records, every step is out
    of place (``keep`` multiplied, ``gated`` cloned before a state's conv writes into it); else the mask
    is applied in place. With autograd, on the CPU, eagerly, without a conv state and in float32 or
    float64 it runs `BlockedPrefill`: that blocked forward, saving the inputs and the score sums, with a
    backward recomputed per block. ``ple/vectorized/__init__.py`` lists the six combinations."""
    _checks.prefill_meta(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
                 conv_weights, dilation=dilation, query_start_loc=query_start_loc, keep=keep,
                 conv_state=conv_state, state_indices=state_indices, has_initial_states=has_initial_states,
                 token_indices=token_indices, null_slot=null_slot, conv_eps=conv_eps, unit_offset=unit_offset)
    if _checks.validating(validate):
        _checks.prefill_values(key, conv_weights, dilation=dilation, query_start_loc=query_start_loc,
                       conv_state=conv_state, state_indices=state_indices, has_initial_states=has_initial_states,
                       token_indices=token_indices, null_slot=null_slot)
    H = value.shape[1]
    norms = (norm_key_weight, norm_query_weight, norm_conv_weight)
    grad = records_grad(key, value, hidden_states, *norms, conv_weights)
    if takes_blocked_forward_path(key, conv_state, grad):
        return _forward_blocked(key, value, hidden_states, *norms, eps, H, conv_weights, dilation,
                                query_start_loc, keep, conv_eps, unit_offset)
    if takes_blocked_backward_path(key, conv_state, grad):
        return BlockedPrefill.apply(key, value, hidden_states, *norms, conv_weights, eps, H, dilation,
                                    query_start_loc, keep, conv_eps, unit_offset)
    gated, conv_input = gate(key, value, hidden_states, *norms, eps, H, conv_eps=conv_eps, unit_offset=unit_offset)
    if keep is not None:
        mask = (keep != 0).to(gated.dtype)[:, None]
        if grad:
            gated, conv_input = gated * mask, conv_input * mask
        else:
            gated.mul_(mask)
            conv_input.mul_(mask)
    if conv_state is None:
        y = _conv(conv_input, conv_weights, dilation, cu_seqlens=query_start_loc)
        return (gated + y) + hidden_states
    assert state_indices is not None                                          # checked by prefill_meta
    out = gated.clone() if grad else gated
    _ple_conv(conv_input, out, conv_state, conv_weights, state_indices, "prefill", dilation, query_start_loc,
              has_initial_states, None, 1, token_indices, hidden_states, null_slot)
    if token_indices is not None:
        covered = torch.zeros(key.shape[0], dtype=torch.bool, device=key.device)
        covered[token_indices.to(torch.int64)] = True
        out = torch.where(covered[:, None], out, torch.zeros_like(out))
    return out


def takes_blocked_forward_path(key: torch.Tensor, conv_state: torch.Tensor | None, grad: bool) -> bool:
    """Whether `ple_prefill` runs `_forward_blocked`: no conv state, nothing recording autograd (``grad``), on the
    CPU, eagerly."""
    return conv_state is None and not grad and key.device.type == "cpu" and not torch.compiler.is_compiling()


def takes_blocked_backward_path(key: torch.Tensor, conv_state: torch.Tensor | None, grad: bool) -> bool:
    """Whether `ple_prefill` runs `BlockedPrefill` (the blocked forward, a backward recomputed per
    block): no conv state, autograd recording (``grad``), on the CPU, eagerly, in float32 or float64 (a
    bfloat16 or float16 run keeps autograd's composition, whose intermediate gradients round as the model's)."""
    return (conv_state is None and grad and key.device.type == "cpu" and not torch.compiler.is_compiling()
            and acc_dtype(key.dtype) == key.dtype)


takes_blocked_path = deprecated_function(takes_blocked_forward_path, "takes_blocked_path", since="0.1.0")
"""Deprecated since 0.1.0 (``ple.vectorized.gate.takes_blocked_path`` was another function):
`takes_blocked_forward_path`."""


def _forward_blocked(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight, eps,
                     hidden_size, conv_weights, dilation, query_start_loc, keep, conv_eps=None, unit_offset=True,
                     sums=None):
    """``(gated + y) + hidden_states`` of whole requests from zero history, without autograd, in blocks.

    ``sums``: where given (``[T, M]``, the input dtype), the rows' score sums are made into it (`BlockedPrefill`
    keeps them for its backward); else into a buffer of the call's own.

    Only the output is a ``[T, C]`` buffer: each block's gated values and conv inputs live in scratch
    buffers of one block, which the next block reuses (so they stay in cache), and the conv reads a
    window of the S conv inputs before the block (kept from the block before, zeros at the start) and
    the block's own. Where a packed sequence starts inside a block, the block's rows are summed in
    segments, one per sequence, and before a sequence's segment the S window rows before its start
    are zeroed (the rows after it never read them; the window carried to the next block then holds
    zeros before the last start, which is what the rows after it must read).
    """
    T, C = key.shape
    H = hidden_size
    dt = key.dtype
    acc = acc_dtype(dt)
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    wt = conv_weights.to(acc).t().contiguous()                         # [K, C]
    n = -(-max(S, 1) // BLOCK_ROWS) * BLOCK_ROWS                       # a block holds the next one's history
    m_max = min(n, T)
    out = key.new_empty(T, C)
    gated = key.new_empty(m_max, C)
    window = key.new_zeros(S + m_max, C, dtype=acc)                    # S rows of history, then the block's
    conv_input = key.new_empty(m_max, C) if acc != dt else None        # rounded to dt, then widened
    mask = None if keep is None else (keep != 0).to(dt)[:, None]
    block = BlockGate(m_max, key, norm_key_weight, norm_query_weight, norm_conv_weight, eps, H, conv_eps, unit_offset)
    starts_in_block = _sequence_starts_by_block(query_start_loc, T, n) if S else {}
    lags = [(K - 1 - j) * dilation for j in range(K)]
    taps = key.new_empty(m_max, C, dtype=acc)                          # the block's tap sums
    product = key.new_empty(m_max, C, dtype=acc)

    sums = key.new_empty(T, C // H) if sums is None else sums
    for a in range(0, T, n):
        block.score_sums(key[a:a + n], hidden_states[a:a + n], sums[a:a + n])
    gates = block.gates(sums)
    for a in range(0, T, n):
        b = min(a + n, T)
        m = b - a
        if a and S:
            window[:S].copy_(window[n:n + S])                          # the last S inputs of the block before
        g, x = gated[:m], window[S:S + m]
        ci = x if conv_input is None else conv_input[:m]
        block.gate_rows(gates[a:b], value[a:b], g, ci)
        if mask is not None:
            g.mul_(mask[a:b])
            ci.mul_(mask[a:b])
        if conv_input is not None:
            x.copy_(ci)
        here = starts_in_block.get(a, [])
        edges = [0, *here, m]
        for r0, r1 in zip(edges, edges[1:]):
            if r0 in here:
                window[r0:r0 + S].zero_()                              # the S inputs before this start
            if r1 == r0:
                continue
            # Rows [r0, r1) of the tap sums, docs/spec.md 8: from zero, in tap order, each tap's product rounded
            # before its add (``training_conv.multiply_add_``; here into a scratch product).
            segment = taps[r0:r1].zero_()
            for j in range(K):
                segment.add_(torch.mul(window[r0 + S - lags[j]:r1 + S - lags[j]], wt[j], out=product[r0:r1]))
        y = conv_activation(taps[:m], dt, inplace=True)
        torch.add(g, y, out=y)
        torch.add(y, hidden_states[a:b], out=out[a:b])
    return out


class BlockedPrefill(torch.autograd.Function):
    """`_forward_blocked` with autograd: the forward saves the inputs and the rows' score sums (``[T, M]``); the
    backward (``_prefill_grad.backward_blocked``) recomputes per block of rows what else it needs. Float32 and
    float64 only (`takes_blocked_backward_path`). Not twice differentiable."""

    @staticmethod
    def forward(ctx: Any, key: torch.Tensor, value: torch.Tensor, hidden_states: torch.Tensor,
                norm_key_weight: torch.Tensor, norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor,
                conv_weights: torch.Tensor, eps: float, hidden_size: int, dilation: int,
                query_start_loc: torch.Tensor, keep: torch.Tensor | None, conv_eps: float | None,
                unit_offset: bool) -> torch.Tensor:
        sums = key.new_empty(key.shape[0], key.shape[1] // hidden_size)
        out = _forward_blocked(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight,
                               eps, hidden_size, conv_weights, dilation, query_start_loc, keep, conv_eps,
                               unit_offset, sums)
        ctx.save_for_backward(key, value, hidden_states, norm_key_weight, norm_query_weight, norm_conv_weight,
                              conv_weights, sums)
        ctx.args = (eps, hidden_size, dilation, query_start_loc, keep, conv_eps, unit_offset)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = backward_blocked(grad_out.contiguous(), *ctx.saved_tensors, *ctx.args)
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)),
                None, None, None, None, None, None, None)


def _sequence_starts_by_block(query_start_loc: torch.Tensor, num_tokens: int, n: int) -> dict[int, list[int]]:
    """The starts of the packed sequences after the first inside each block of ``n`` rows, as offsets in the
    block: ``{block start: [offsets, ascending]}`` (read on the host: `_forward_blocked` runs on the CPU)."""
    out: dict[int, list[int]] = {}
    for start in query_start_loc.tolist()[1:-1]:
        if 0 < start < num_tokens:
            a = start // n * n
            offsets = out.setdefault(a, [])
            if not offsets or offsets[-1] != start - a:
                offsets.append(start - a)
    return out
