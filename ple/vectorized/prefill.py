"""``ple_prefill`` as the composition of this backend's ops (SPEC section 7): ``ple_gate`` -> ``keep`` mask ->
``dilated_causal_conv`` (``conv_state=None``) or ``ple_conv(mode="prefill")`` -> ``(gated + y) + hidden_states``.

On the CPU, without a conv state and with nothing recording autograd (inference, evaluation), the
composition runs in blocks of rows (``gate.block_rows``, 64 at C = 2048): a first pass makes every
row's score sums, the gates of all rows follow at once, and a second pass runs gate, mask, conv and
both adds of one block after the other in scratch buffers of one block (``gate.BlockGate``), so only
the output is a ``[T, C]`` tensor and every temporary stays in cache. Each block's conv reads a window
of the S conv inputs before it, carried over from the block before, and the first S rows of every
packed sequence but the first are recomputed without the sequence before. That path reads the
(CPU) sequence offsets on the host, which is no device synchronisation. Same ops, same rounding
points, same bits as the unblocked composition, which runs everywhere else
(``tests/vectorized/test_blocked.py`` checks it against the reference across many blocks).
"""

from __future__ import annotations

import torch

from .. import _checks
from .. import reference as _reference
from ..backends import twin
from ..reference.gate import acc_dtype
from .conv import ple_conv
from .gate import BlockGate, block_rows, gate, records_grad
from .training_conv import _conv, _sequence_heads, conv_activation

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
    if conv_state is None and not grad and key.device.type == "cpu" and not torch.compiler.is_compiling():
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
    """``(gated + y) + hidden_states`` of whole requests from zero history, without autograd, in blocks.

    Only the output is a ``[T, C]`` buffer: each block's gated values and conv inputs live in scratch
    buffers of one block, which the next block reuses (so they stay in cache), and the conv reads a
    window of the S conv inputs before the block (kept from the block before, zeros at the start) and
    the block's own. Where a packed sequence starts inside a block, the block's rows are summed in
    segments, one per sequence, and before a sequence's segment the S window rows before its start
    are zeroed (the rows after it never read them; the window carried to the next block then holds
    zeros before the last start, which is what the rows after it must read). A block with more than
    `MAX_SEGMENT_STARTS` starts is summed whole instead and the first S rows of each of its sequences
    recomputed with a masked gather (`_sequence_head_rows`): fewer ops for many short sequences.
    """
    T, C = key.shape
    dt = key.dtype
    acc = acc_dtype(dt)
    K = conv_weights.shape[1]
    S = (K - 1) * dilation
    wt = conv_weights.to(acc).t().contiguous()                         # [K, C]
    n = max(block_rows(T, C), -(-S // 64) * 64)                          # a block holds the next one's history
    out = key.new_empty(T, C)
    gated = key.new_empty(min(n, T), C)
    window = key.new_zeros(S + min(n, T), C, dtype=acc)                 # S rows of history, then the block's
    conv_input = key.new_empty(min(n, T), C) if acc != dt else None      # rounded to dt, then widened
    mask = None if keep is None else (keep != 0).to(dt)[:, None]
    block = BlockGate(min(n, T), key, norm_key_weight, norm_query_weight, norm_conv_weight, eps, H)
    starts = _block_starts(query_start_loc, S, T, n)
    heads = None
    lags = [(K - 1 - j) * dilation for j in range(K)]
    taps = key.new_empty(min(n, T), C, dtype=acc)                        # the block's tap sums
    product = key.new_empty(min(n, T), C, dtype=acc)

    def tap_sums(r0: int, r1: int) -> None:
        """Rows ``[r0, r1)`` of the block's tap sums into ``taps``. SPEC 8: from zero, in tap order, each tap's
        product rounded before its add (``training_conv.multiply_add_``; here into a scratch product)."""
        s = taps[r0:r1].zero_()
        for j in range(K):
            s.add_(torch.mul(window[r0 + S - lags[j]:r1 + S - lags[j]], wt[j], out=product[r0:r1]))

    sums = key.new_empty(T, C // H)
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
        here = starts.get(a, [])
        if len(here) <= MAX_SEGMENT_STARTS:
            edges = [0, *here, m]
            for r0, r1 in zip(edges, edges[1:]):
                if r0 in here:
                    window[r0:r0 + S].zero_()                          # the S inputs before this start
                if r1 > r0:
                    tap_sums(r0, r1)
        else:
            tap_sums(0, m)
            if heads is None:
                heads = _sequence_head_rows(query_start_loc, S, T, n)
            rows, pos = heads[a]
            fixed = taps.new_zeros(rows.numel(), C)
            for j, lag in enumerate(lags):                             # terms before the sequence's start: zero
                valid = pos >= lag                                     # else the reference's w * 0
                xs = window.index_select(0, torch.where(valid, rows + S - lag, 0))
                fixed = fixed + wt[j] * torch.where(valid[:, None], xs, 0.0)
            taps.index_copy_(0, rows, fixed)
            last = here[-1]
            window[last:last + S].zero_()                              # what the next block reads before it
        y = conv_activation(taps[:m], dt, inplace=True)
        torch.add(g, y, out=y)
        torch.add(y, hidden_states[a:b], out=out[a:b])
    return out


MAX_SEGMENT_STARTS = 4
"""Sequence starts in one block up to which `_forward_blocked` sums the block in segments (2 K + 1 ops per
start); above, it sums the block whole and recomputes the sequences' first rows (about 5 K ops per block)."""


def _block_starts(query_start_loc: torch.Tensor, S: int, T: int, n: int) -> dict[int, list[int]]:
    """The starts of the packed sequences after the first inside each block of ``n`` rows, as offsets in the
    block: ``{block start: [offsets, ascending]}`` (read on the host: `_forward_blocked` runs on the CPU)."""
    if S == 0:
        return {}
    out: dict[int, list[int]] = {}
    for c in query_start_loc.tolist()[1:-1]:
        if 0 < c < T:
            a = c // n * n
            offsets = out.setdefault(a, [])
            if not offsets or offsets[-1] != c - a:
                offsets.append(c - a)
    return out


def _sequence_head_rows(query_start_loc: torch.Tensor, S: int, T: int, n: int) -> dict:
    """The rows less than S after the start of every packed sequence but the first, by block of ``n`` rows:
    ``{block start: (rows in the block, their positions in their sequence)}``, int64 on the host's device.

    Reads ``query_start_loc`` on the host (`_forward_blocked` runs on the CPU only)."""
    cu = query_start_loc.to(torch.int64)
    if cu.numel() <= 2 or S == 0 or T == 0:
        return {}
    rows, inside = _sequence_heads(cu, S, T)
    rows, pos = rows[inside], torch.arange(S).expand_as(inside)[inside]      # in row order
    counts = torch.bincount(rows // n, minlength=-(-T // n)).tolist()
    out, i = {}, 0
    for blk, c in enumerate(counts):
        if c:
            out[blk * n] = (rows[i:i + c] - blk * n, pos[i:i + c])
            i += c
    return out
