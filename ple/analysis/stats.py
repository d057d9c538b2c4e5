"""Statistics of the hash over a corpus: how many rows each head's n-grams hit, how many rows they share, and
which n-grams land on a given row (docs/analysis.md, "N-gram statistics over a corpus").

``ngram_stats(config, tokens)`` counts, for every hash head of one PLE layer, the n-grams of its order in
``tokens`` and the table rows they hash to (docs/spec.md sections 2-3); ``row_ngrams(config, tokens, rows)``
lists the n-grams behind given rows. ``tokens`` is one sequence (a 1-D integer tensor), a 2-D tensor (a
sequence per row), or an iterable of 1-D tensors (each its own sequence, from its start), consumed once,
block by block: memory grows with the distinct n-grams, never with the table or the corpus. The work runs on
the CPU (tensors elsewhere are copied there a block at a time).

Both families (docs/spec.md sections 3, 14 and 15). An n-gram is its window after the family's rule, in the
tokens' own ids: Qwen4Exp's windows stop at an EOS; Engram's have no rule (an EOS or pad inside the text is an
ordinary token, positions before a sequence read the pad). With an Engram ``token_map`` (the compressed
tokenizer) n-grams whose tokens the map merges, e.g. "The cat" and "the cat", are one key of the hash and land on
the same rows by design: `ngram_stats` counts them as one n-gram (``distinct``, ``shared_rows``, ``collided`` and
``expected_rows_hit`` are about the hash's own collisions), while `row_ngrams` lists each as written, in the
tokens' ids, with its own count (what a tokenizer decodes).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._ngrams import (
    Progress,
    _check_layer,
    _hashed_groups,
    _is_integer_dtype,
    _no_progress,
    _order_rows,
    _params,
    _Tally,
    _tally,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..config import PLEConfig

__all__ = ["HeadStats", "NgramStats", "ngram_stats", "row_ngrams"]

Ngram = tuple[int, ...]
"""An n-gram: its token ids in reading order (oldest first)."""


@dataclass(frozen=True)
class HeadStats:
    """One hash head's statistics over a corpus (a row of `NgramStats.heads`).

    ``head``: its index h (0..NH-1); ``order``: the n-gram order it hashes, ``h // P + 2``; ``size``: its rows
    (a prime); ``occurrences``: the tokens counted (every token has one n-gram of each order, so every head
    counts all tokens); ``distinct``: the distinct n-grams of its order (the distinct keys of the hash: after an
    Engram ``token_map``, see the module docstring); ``rows_hit``: the rows at least one of them hashes to;
    ``shared_rows``: the rows two or more distinct n-grams hash to; ``collided``: the fraction of occurrences
    whose row also serves another distinct n-gram (0.0 without occurrences);
    ``expected_rows_hit``: ``size * (1 - (1 - 1/size) ** distinct)``, the rows uniform hashing would hit
    (computed as ``-size * expm1(distinct * log1p(-1/size))``, the same value without the rounding of
    ``1 - 1/size``).
    """

    head: int
    order: int
    size: int
    occurrences: int
    distinct: int
    rows_hit: int
    shared_rows: int
    collided: float
    expected_rows_hit: float


@dataclass(frozen=True)
class NgramStats:
    """What `ngram_stats` returns: ``heads``, one `HeadStats` per hash head in head order, and what was counted
    (``ple_layer_index``, ``num_tokens``, ``num_sequences``, the empty ones included)."""

    heads: list[HeadStats]
    ple_layer_index: int
    num_tokens: int
    num_sequences: int

    def table(self) -> str:
        """The heads as a text table, a line per head under a title line (``str(stats)`` is the same)."""
        header = ["head", "order", "size", "occurrences", "distinct", "rows hit", "expected", "shared rows",
                  "collided"]
        body = [[str(h.head), str(h.order), f"{h.size:,}", f"{h.occurrences:,}", f"{h.distinct:,}",
                 f"{h.rows_hit:,}", f"{h.expected_rows_hit:,.1f}", f"{h.shared_rows:,}", f"{h.collided:.4f}"]
                for h in self.heads]
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
        lines = [f"n-gram statistics of PLE index {self.ple_layer_index}: {self.num_tokens:,} tokens in "
                 f"{self.num_sequences:,} sequence{'' if self.num_sequences == 1 else 's'}"]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *body]]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def plot(self) -> Figure:
        """A matplotlib ``Figure`` (not registered with pyplot) of two panels: left, each head's rows hit (bars,
        coloured by order) against the uniform-hashing expectation (black marks); right, the collided
        fraction by order (a bar per order: the mean over its heads; a dot per head). Needs matplotlib
        (``pip install 'ple[analysis]'``)."""
        try:
            from matplotlib.figure import Figure
        except ImportError:
            raise ImportError("NgramStats.plot needs matplotlib: pip install 'ple[analysis]'") from None
        fig = Figure(figsize=(11, 4), layout="constrained")
        ax_rows, ax_collided = fig.subplots(1, 2)
        orders = sorted({h.order for h in self.heads})
        colour = {n: f"C{i}" for i, n in enumerate(orders)}
        x = [h.head for h in self.heads]
        ax_rows.bar(x, [h.rows_hit for h in self.heads], color=[colour[h.order] for h in self.heads],
                    label="rows hit")
        ax_rows.scatter(x, [h.expected_rows_hit for h in self.heads], marker="_", s=300, color="black", zorder=3,
                        label="uniform hashing")
        top = max([h.rows_hit for h in self.heads] + [h.expected_rows_hit for h in self.heads] + [1])
        ax_rows.set(xlabel="head", ylabel="rows hit", title="Rows hit per head", xticks=x, ylim=(0, 1.25 * top))
        ax_rows.legend(loc="upper center", ncol=2)
        means = [float(np.mean([h.collided for h in self.heads if h.order == n])) for n in orders]
        ax_collided.bar(orders, means, color=[colour[n] for n in orders], label="mean of the order's heads")
        ax_collided.scatter([h.order for h in self.heads], [h.collided for h in self.heads], color="black", s=12,
                            zorder=3, label="one head")
        top = max([h.collided for h in self.heads] + [1e-3])
        ax_collided.set(xlabel="n-gram order", ylabel="fraction of occurrences collided",
                        title="Collided occurrences by order", xticks=orders, ylim=(0, 1.25 * top))
        ax_collided.legend(loc="upper center", ncol=2)
        return fig


def ngram_stats(config: PLEConfig, tokens: Any, *, ple_layer_index: int = 0,
                _chunk_tokens: int | None = None) -> NgramStats:
    """Every hash head's n-gram statistics over ``tokens`` (docs/analysis.md).

    A token's n-gram of order n is its window's first n entries after the family's rule (docs/spec.md section 3:
    the EOS rule, a context of EOS at each sequence start; section 15, Engram: no rule, a context of the pad),
    and two occurrences are the same n-gram when those agree (after an Engram ``token_map``: when the hash reads
    the same ids, see the module docstring); its row in head h is the one ``ngram_ids`` gives.

    Args:
        config: the model's `PLEConfig` (its hash: V, N, P, EOS, seed, table sizes).
        tokens: a 1-D integer tensor (one sequence); a 2-D one (a sequence per row); or an iterable of 1-D
            integer tensors, each its own sequence from its start (a generator is consumed once, block by
            block). Any integer dtype (not bool); numpy arrays are taken as tensors are.
        ple_layer_index: the PLE index of the layer whose hash is counted, in ``[0, config.num_ple_layers)``.

    Returns:
        `NgramStats`: ``heads``, one `HeadStats` per head in head order; ``table()``; ``plot()``.

    Raises:
        TypeError: ``config`` is not a `PLEConfig`; ``tokens`` (or one of its sequences) is not an integer
            tensor, e.g. a float one; ``ple_layer_index`` is not an int.
        ValueError: a sequence is not 1-D; a token id lies outside ``[0, V)`` (the message names the sequence
            and position); ``ple_layer_index`` is negative or not below ``config.num_ple_layers``.
    """
    ple_layer_index = _check_layer(config, ple_layer_index)
    tally, sequences = _tally(config, tokens, ple_layer_index, chunk=_chunk_tokens)
    stats, _ = _stats(tally, ple_layer_index, sequences)
    return stats


def row_ngrams(config: PLEConfig, tokens: Any, rows: Any, *, ple_layer_index: int = 0, top: int | None = 10,
               _chunk_tokens: int | None = None) -> dict[int, list[tuple[Ngram, int]]]:
    """The distinct n-grams of ``tokens`` that land on each of ``rows``, with their counts.

    Args:
        config, tokens, ple_layer_index: as in `ngram_stats`.
        rows: global table row ids, as ``ngram_ids`` returns them (head h's rows start at
            ``hash_params(config, ple_layer_index).head_offsets[h]``): an int, an iterable of ints or a 0-D / 1-D
            integer tensor (or numpy array), each in ``[0, num_rows)``. A padding row (past the last head) is in
            the table and nothing hits it.
        top: at most this many n-grams per row (a positive int), or None for all of them.

    Returns:
        ``{row: [(ngram, count), ...]}``, a key per distinct row in the order given: the n-grams (tuples of token
        ids, oldest first, in the tokens' own ids: never through an Engram ``token_map``, so n-grams the map
        merges are listed one by one, each with its own count) of the order the row's head hashes, most
        frequent first, ties in ascending tuple order; ``[]`` for a row nothing hits. A window's entries before
        a sequence's start are the EOS (Qwen4Exp) or pad (Engram) token.

    Raises:
        TypeError: as `ngram_stats`; ``rows`` holds something other than ints (a float, a bool); ``top`` is
            not an int or None.
        ValueError: as `ngram_stats`; a row lies outside ``[0, num_rows)`` (checked before ``tokens`` is
            read); ``top`` is below 1.
    """
    ple_layer_index = _check_layer(config, ple_layer_index)
    wanted = _check_rows(rows, _params(config, ple_layer_index).num_rows, ple_layer_index)
    if top is not None:
        from .. import _checks

        top = _checks.int_arg("top", top, minimum=1)
    tally, _ = _tally(config, tokens, ple_layer_index, chunk=_chunk_tokens)
    return _row_ngrams(tally, ple_layer_index, wanted, top)


# ---- internals ---------------------------------------------------------------------------------------------
def _check_rows(rows: Any, num_rows: int, ple_layer_index: int) -> list[int]:
    """``rows`` as a list of distinct Python ints in the order given, each in ``[0, num_rows)``."""
    if isinstance(rows, (torch.Tensor, np.ndarray)):
        if not _is_integer_dtype(rows.dtype):
            raise TypeError(f"rows: expected integer row ids, got {rows.dtype}")
        if rows.ndim > 1:
            raise ValueError(f"rows: expected an int or a 1-D sequence of row ids, got shape {tuple(rows.shape)}")
        values = [int(r) for r in rows.reshape(-1).tolist()]
    elif isinstance(rows, numbers.Integral) and not isinstance(rows, bool):
        values = [int(rows)]
    elif isinstance(rows, Iterable) and not isinstance(rows, (str, bytes)):
        values = []
        for r in rows:
            if isinstance(r, bool) or not isinstance(r, numbers.Integral):
                raise TypeError(f"rows: expected integer row ids, got {type(r).__name__} {r!r}")
            values.append(int(r))
    else:
        raise TypeError(f"rows: expected an int or an iterable of ints, got {type(rows).__name__}")
    bad = [r for r in values if not 0 <= r < num_rows]
    if bad:
        raise ValueError(f"rows: row ids must lie in [0, {num_rows}) (the table of PLE index {ple_layer_index}), "
                         f"got {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else ""))
    return list(dict.fromkeys(values))


def _expected_rows_hit(size: int, distinct: int) -> float:
    """``size * (1 - (1 - 1/size) ** distinct)``, without rounding ``1 - 1/size``."""
    return -size * math.expm1(distinct * math.log1p(-1.0 / size))


class _Scratch:
    """One worker's buffers for `_collisions`, sized to the most distinct n-grams of an order: numpy arrays past
    a few MiB are fresh pages (page faults) each time they are allocated, so each head reuses these."""

    def __init__(self, K: int) -> None:
        self.packed = np.empty(K, dtype=np.int64)
        self.row = np.empty(K, dtype=np.int64)
        self.flags = np.empty((3, K), dtype=bool)


def _collisions(local: np.ndarray, counts: np.ndarray, size: int, scratch: _Scratch,
                top: int = 0) -> tuple[int, int, int, list[tuple[int, int]]]:
    """One head: ``(rows_hit, shared_rows, collided occurrences, top rows)`` of K distinct n-grams whose head-local
    rows (``[0, size)``) are ``local`` and counts ``counts``; the top rows: up to ``top`` ``(local row,
    occurrences)``, most occurrences first (ties: ascending row).

    The n-grams are sorted by row with one numpy sort of ``row << b | count`` where every count fits in the
    low b bits, else with an argsort of the rows."""
    K = local.size
    if K == 0:
        return 0, 0, 0, []
    count_bits = 63 - max(1, (size - 1).bit_length())
    row = scratch.row[:K]
    if count_bits > 0 and int(counts.max()) < (1 << count_bits):
        held, mask = scratch.packed[:K], (1 << count_bits) - 1   # a count: held & mask
        np.copyto(held, local, casting="unsafe")
        held <<= count_bits
        held |= counts
        held.sort()
        np.right_shift(held, count_bits, out=row)
    else:
        order = np.argsort(local, kind="stable")
        held, mask = counts[order], -1
        np.copyto(row, local[order], casting="unsafe")
    same, shared, both = scratch.flags[0, :K - 1], scratch.flags[1, :K], scratch.flags[2, :K - 1]
    np.equal(row[1:], row[:-1], out=same)                   # n-gram i shares the row of n-gram i-1
    shared[0] = False                                       # n-gram i's row serves another n-gram
    shared[1:] = same
    shared[:-1] |= same
    np.logical_and(same[1:], same[:-1], out=both[:K - 2])   # a run of r n-grams on a row: r-1 same, r-2 both
    repeats = int(np.count_nonzero(same))
    shared_rows = repeats - int(np.count_nonzero(both[:K - 2]))
    best: list[tuple[int, int]] = []
    if top:
        starts = np.flatnonzero(np.concatenate([[True], ~same]))
        occurrences = np.add.reduceat(held & mask, starts)
        ids = row[starts]                                   # ascending
        k = min(top, len(ids))
        threshold = np.partition(occurrences, len(ids) - k)[len(ids) - k]
        above = np.flatnonzero(occurrences > threshold)
        at = np.flatnonzero(occurrences == threshold)[:k - len(above)]   # the lowest rows among the ties
        pick = np.concatenate([above, at])
        pick = pick[np.lexsort((ids[pick], -occurrences[pick]))]
        best = [(int(ids[i]), int(occurrences[i])) for i in pick]
    np.bitwise_and(held, mask, out=row)                     # the counts, in row order
    collided = int(np.add.reduce(row, where=shared))
    return K - repeats, shared_rows, collided, best


def _local_rows(tally: _Tally, ple_layer_index: int, n: int) -> np.ndarray:
    """Head-local rows ``[K, P]`` of order n's P heads for the tally's K distinct n-grams of order n."""
    params = _params(tally.config, ple_layer_index)
    P = tally.config.heads_per_ngram
    heads = slice((n - 2) * P, (n - 1) * P)
    offsets = params.head_offsets[heads]
    small = int(params.head_sizes[heads].max()) < 2**31
    local = np.empty((tally.distinct(n), P), dtype=np.int32 if small else np.int64)
    for sl, rows in _order_rows(tally, ple_layer_index, n):
        local[sl] = (rows - offsets).numpy()
    return local


def _keyed(tally: _Tally, ple_layer_index: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Head-local rows ``[K', P]`` and counts ``[K']`` of order n's distinct keys of the hash: the tally's
    distinct n-grams, merged where the family's ``token_map`` sends two to the same ids (`_hashed_groups`;
    their rows are equal, their counts add)."""
    local, counts = _local_rows(tally, ple_layer_index, n), tally.counts[n]
    groups = _hashed_groups(tally, ple_layer_index, n)
    if groups is None:
        return local, counts
    group, first = groups
    merged = np.zeros(len(first), dtype=np.int64)
    np.add.at(merged, group, counts)
    return np.ascontiguousarray(local[first]), merged


def _heads_of_worker(local: np.ndarray, counts: np.ndarray, sizes: list[int], scratch: _Scratch, top: int,
                     columns: range) -> list[tuple[int, tuple[int, int, int, list[tuple[int, int]]]]]:
    """`_collisions` of the heads in ``columns`` (columns of ``local``), one after the other in ``scratch``."""
    return [(j, _collisions(local[:, j], counts, sizes[j], scratch, top)) for j in columns]


def _stats(tally: _Tally, ple_layer_index: int, sequences: int, *, top: int = 0,
           progress: Progress = _no_progress) -> tuple[NgramStats, dict[int, list[tuple[int, int]]]]:
    """The `NgramStats` of a tally, and with ``top``, each head's ``top`` most-hit rows:
    ``{head: [(global row, occurrences), ...]}`` (`_collisions`' order). The heads of an order are shared by
    ``torch.get_num_threads()`` worker threads (numpy's sorts let go of the GIL), each with its `_Scratch`."""
    config = tally.config
    params = _params(config, ple_layer_index)
    sizes, offsets = params.head_sizes.tolist(), params.head_offsets.tolist()
    P, occurrences = config.heads_per_ngram, tally.num_tokens
    workers = max(1, min(P, torch.get_num_threads()))
    most = max(tally.distinct(n) for n in tally.orders)
    scratch = [_Scratch(most) for _ in range(workers)]
    heads, top_rows = [], {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for n in progress(tally.orders, len(tally.orders), "rows of the distinct n-grams"):
            local, counts = _keyed(tally, ple_layer_index, n)
            distinct = len(counts)
            first = (n - 2) * P
            parts = [pool.submit(_heads_of_worker, local, counts, sizes[first:first + P], scratch[w], top,
                                 range(w, P, workers)) for w in range(workers)]
            done = sorted(r for part in parts for r in part.result())
            for j, (rows_hit, shared_rows, collided, best) in done:
                h = first + j
                heads.append(HeadStats(head=h, order=n, size=sizes[h], occurrences=occurrences, distinct=distinct,
                                       rows_hit=rows_hit, shared_rows=shared_rows,
                                       collided=collided / occurrences if occurrences else 0.0,
                                       expected_rows_hit=_expected_rows_hit(sizes[h], distinct)))
                top_rows[h] = [(offsets[h] + r, c) for r, c in best]
    return NgramStats(heads=heads, ple_layer_index=ple_layer_index, num_tokens=tally.num_tokens,
                      num_sequences=sequences), top_rows


def _row_ngrams(tally: _Tally, ple_layer_index: int, wanted: Sequence[int],
                top: int | None) -> dict[int, list[tuple[Ngram, int]]]:
    """`row_ngrams` of a tally, for checked rows."""
    config = tally.config
    params = _params(config, ple_layer_index)
    P = config.heads_per_ngram
    offsets = params.head_offsets.numpy()
    ends = offsets + params.head_sizes.numpy()
    by_head: dict[int, list[int]] = {}
    for row in wanted:
        h = int(np.searchsorted(offsets, row, side="right")) - 1
        if row < ends[h]:                                       # else a padding row: nothing hits it
            by_head.setdefault(h, []).append(row)
    found: dict[int, list[tuple[Ngram, int]]] = {row: [] for row in wanted}
    for n in tally.orders:
        cols = {h - (n - 2) * P: np.array(rs, dtype=np.int64) for h, rs in by_head.items() if h // P + 2 == n}
        if not cols:
            continue
        hits_at, hits_row = [], []
        for sl, rows in _order_rows(tally, ple_layer_index, n):
            for j, want in cols.items():
                col = rows[:, j].numpy()
                at = np.flatnonzero(np.isin(col, want))
                hits_at.append(at + sl.start)
                hits_row.append(col[at])
        at = np.concatenate(hits_at) if hits_at else np.zeros(0, dtype=np.int64)
        windows = tally.unpack(tally.keys[n][at], n).tolist()
        hit_rows = np.concatenate(hits_row).tolist() if hits_row else []
        for window, row, count in zip(windows, hit_rows, tally.counts[n][at].tolist(),
                                      strict=True):
            found[row].append((tuple(reversed(window)), count))
    for grams in found.values():
        grams.sort(key=lambda g: (-g[1], g[0]))
        if top is not None:
            del grams[top:]
    return found
