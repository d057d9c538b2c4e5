"""The n-grams of a corpus, counted chunk by chunk: what `ple.analysis.stats` is built on.

Every window and every row ``ple.analysis`` computes comes from one function, `_windows_and_rows`, which
takes the config: the window rule and the hash of the config's family (docs/spec.md sections 2-3 and 15), through
the library's own ops (``ple.reference.hash_params`` and the vectorised hashing of ``ple.vectorized.hashing``).
Windows hold the tokens' own ids (what a tokenizer decodes), after the family's rule: Qwen4Exp's EOS rule, or
none (Engram: an EOS or pad inside the text is an ordinary token, positions before a sequence read the pad);
rows are hashed from the windows after the family's ``token_map`` (`_hashed_windows`). The counting only
needs windows that identify n-grams and rows that are a function of the windows; `_window_bits` is the range
of a window entry (and of a mapped one, which a token map may send past V).

The counting (`_Tally`): a corpus is cut into blocks of ``block`` tokens (a sequence split between two blocks
carries its N-1 previous tokens as the next block's context, so its windows are those of the whole sequence);
each block's windows are packed into one int64 key per order (``bits`` bits per window entry, entry k at
bit ``bits * k``: as many entries as fit in 63 bits per word, and as many words as the order needs) and
buffered; every ``chunk`` tokens, or less often once the running tables are larger than that, the buffer's
distinct keys and counts are merged into a running sorted table per order. At the end each order's distinct
n-grams are hashed once, block by block (`_order_rows`). Memory: the block, the buffer, and the distinct
n-grams with their counts; never the table, never the corpus.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from .. import _checks
from ..config import PLEConfig
from ..params import HashParams
from ..reference import hash_params
from ..vectorized.hashing import _batch_windows, _mapped, _window_rows

_CHUNK_TOKENS = 1 << 21
"""Tokens whose keys are buffered between two merges into the running tables (the default ``chunk``)."""
_BLOCK_TOKENS = 1 << 16
"""Tokens whose windows are computed at once (at most; a block's temporaries stay in the core's caches)."""

Progress = Callable[[Iterable, "int | None", str], Iterable]
"""``progress(iterable, total, desc)``: the iterable, maybe wrapped in a progress bar (``total``: its length,
None where unknown)."""


def _no_progress(iterable: Iterable, total: int | None, desc: str) -> Iterable:
    return iterable


# ---- config, layer, the one window / row function ----------------------------------------------------------
def _check_layer(config, ple_layer_index) -> int:
    """``config`` a `PLEConfig`; ``ple_layer_index`` an int in ``[0, config.num_ple_layers)`` (as `PLELayer`)."""
    if not isinstance(config, PLEConfig):
        raise TypeError(f"config: expected a PLEConfig, got {type(config).__name__}")
    ple_layer_index = _checks.int_arg("ple_layer_index", ple_layer_index, minimum=0)
    if ple_layer_index >= config.num_ple_layers:
        raise ValueError(f"ple_layer_index: the config has {config.num_ple_layers} PLE layer(s) "
                         f"(ple_layer_ids={list(config.ple_layer_ids)}), got index {ple_layer_index}")
    return ple_layer_index


@functools.lru_cache(maxsize=16)
def _params(config: PLEConfig, ple_layer_index: int) -> HashParams:
    return hash_params(config, ple_layer_index)


def _window_bits(config: PLEConfig) -> int:
    """Bits of one window entry: window entries lie in ``[0, V)``, and the mapped ones (`_hashed_windows`) in
    ``[0, V')`` (``config.token_vocab_size``)."""
    return max(1, (max(config.vocab_size, config.token_vocab_size) - 1).bit_length())


def _hashed_windows(config: PLEConfig, ple_layer_index: int, windows: torch.Tensor) -> torch.Tensor:
    """``windows`` (the tokens' own ids) as the hash reads them: through the family's ``token_map`` (docs/spec.md
    section 15), or unchanged without one. Two windows the map sends to the same ids are one key of the hash."""
    tmap = _params(config, ple_layer_index).token_map
    return windows if tmap is None else _mapped(windows, tmap)


def _windows_and_rows(config: PLEConfig, ple_layer_index: int, *, tokens: torch.Tensor | None = None,
                      query_start_loc: torch.Tensor | None = None, ngram_context: torch.Tensor | None = None,
                      windows: torch.Tensor | None = None,
                      order: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one place ``ple.analysis`` computes windows and rows, for the family of ``config``.

    Two calls: with ``tokens`` (int64 ``[T]``, R requests laid end to end as ``query_start_loc`` int64
    ``[R+1]`` cuts them, ``ngram_context`` int64 ``[R, N-1]`` the tokens before each, oldest first, the EOS /
    pad token at a sequence's start; checked by the caller), the windows ``[T, N]`` int64 of the tokens, column
    k the token k positions back after the family's rule (docs/spec.md section 3's EOS rule for Qwen4Exp;
    none for Engram, section 15), in the tokens' own ids: not through the Engram family's ``token_map``, so an
    n-gram reads back as the text it came from; two occurrences are the same n-gram of order n when their
    windows agree in columns ``0..n-1``. With ``windows`` (``[T, n']`` with ``n' >= order``, as the first call
    returns them), those windows. With ``order`` (2..N), also the global table rows of order ``order``'s P
    heads, ``[T, P]`` int64 (head ``(order - 2) * P + j`` in column j), hashed from the windows' first
    ``order`` columns only, after the token map (`_hashed_windows`): ``ngram_ids``' rows; otherwise None.
    (For the two families this equals mapping before the rule: Qwen4Exp has no map, Engram no rule.)
    """
    N, P = config.ngram_size, config.heads_per_ngram
    params = _params(config, ple_layer_index)
    if windows is None:
        assert tokens is not None and query_start_loc is not None and ngram_context is not None
        windows = _batch_windows(tokens, ngram_context, N, config.eos_token_id, query_start_loc,
                                 eos_rule=params.eos_rule)
    if order is None:
        return windows, None
    heads = slice((order - 2) * P, (order - 1) * P)     # order n's heads, hashed from the first n multipliers
    cut = HashParams(params.multipliers[:order], params.head_sizes[heads], params.head_offsets[heads],
                     params.num_rows, params.vocab_size)
    hashed = _hashed_windows(config, ple_layer_index, windows[:, :order].contiguous())
    return windows, _window_rows(hashed, cut, P, first_order=order)


# ---- the corpus: sequences, blocks ------------------------------------------------------------------------
def _is_integer_dtype(dtype: torch.dtype | np.dtype) -> bool:
    """Any integer dtype but bool, of torch or numpy."""
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return bool(np.issubdtype(dtype, np.integer))


def _check_sequence(name: str, seq, ndims: tuple[int, ...] = (1,)) -> None:
    """``seq`` an integer tensor or numpy array (any integer dtype but bool) of ``ndims`` dimensions."""
    want = " or ".join(f"{d}-D" for d in ndims)
    if isinstance(seq, np.ndarray):
        if not _is_integer_dtype(seq.dtype):
            raise TypeError(f"{name}: expected integer token ids, got a numpy array of {seq.dtype}")
        if seq.ndim not in ndims:
            raise ValueError(f"{name}: expected a {want} array of token ids, got shape {seq.shape}")
        return
    if not isinstance(seq, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D integer tensor of token ids, got {type(seq).__name__}")
    if not _is_integer_dtype(seq.dtype):
        raise TypeError(f"{name}: expected integer token ids, got a tensor of {seq.dtype}")
    if seq.dim() not in ndims:
        raise ValueError(f"{name}: expected a {want} tensor of token ids, got shape {tuple(seq.shape)}")
    if seq.device.type == "meta":
        raise ValueError(f"{name}: its values are needed, so it cannot be on the meta device")


def _sequences(tokens) -> Iterator[torch.Tensor | np.ndarray]:
    """The sequences of ``tokens``: a 1-D tensor (or numpy array) is one sequence, a 2-D one a sequence per row,
    anything else iterable a sequence per item (each a 1-D integer tensor or numpy array, checked as it
    comes)."""
    if isinstance(tokens, (torch.Tensor, np.ndarray)):
        _check_sequence("tokens", tokens, (1, 2))
        if tokens.ndim == 2:
            yield from tokens
        else:
            yield tokens
        return
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise TypeError(f"tokens: expected a 1-D integer tensor or an iterable of them, got {type(tokens).__name__}")
    for i, seq in enumerate(tokens):
        _check_sequence(f"tokens: sequence {i}", seq)
        yield seq


def _int64(piece) -> torch.Tensor:
    """A slice of a sequence as an int64 CPU tensor (numpy's copied: a memory-mapped file stays read-only)."""
    if isinstance(piece, np.ndarray):
        return torch.from_numpy(np.array(piece, dtype=np.int64))
    return piece.to(device="cpu", dtype=torch.int64)


@dataclass
class _Block:
    """Up to ``block`` tokens of the corpus as one flattened batch (`_windows_and_rows`'s ``tokens``)."""

    tokens: torch.Tensor                    # int64 [T]
    query_start_loc: torch.Tensor           # int64 [R+1]
    ngram_context: torch.Tensor             # int64 [R, N-1]
    pieces: list[tuple[int, int]]           # per request: its sequence and the position it starts at


def _blocks(config: PLEConfig, tokens, block: int, counts: dict[str, int]) -> Iterator[_Block]:
    """The corpus cut into blocks of ``block`` tokens (the last one shorter), in order; token ids checked to lie
    in ``[0, V)``. ``counts["sequences"]`` counts the sequences read."""
    ctx_len, eos, V = config.ngram_size - 1, config.eos_token_id, config.vocab_size
    parts: list[torch.Tensor] = []
    contexts: list[torch.Tensor | None] = []
    pieces: list[tuple[int, int]] = []
    filled = 0

    def emit() -> _Block:
        ids = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        lengths = torch.tensor([0] + [p.numel() for p in parts], dtype=torch.int64)
        ctx = torch.full((len(parts), ctx_len), eos, dtype=torch.int64)
        for r, c in enumerate(contexts):
            if c is not None:
                ctx[r] = c
        out = _Block(ids, lengths.cumsum(0), ctx, list(pieces))
        _check_range(out, V)
        return out

    for s, seq in enumerate(_sequences(tokens)):
        counts["sequences"] = s + 1
        n, pos = len(seq), 0
        while pos < n:
            take = min(block - filled, n - pos)
            context = None
            if pos > 0:                                  # a sequence continued: its previous tokens, EOS-padded
                before = _int64(seq[max(0, pos - ctx_len):pos])
                context = torch.cat([torch.full((ctx_len - before.numel(),), eos, dtype=torch.int64), before])
            parts.append(_int64(seq[pos:pos + take]))
            contexts.append(context)
            pieces.append((s, pos))
            filled, pos = filled + take, pos + take
            if filled == block:
                yield emit()
                parts, contexts, pieces, filled = [], [], [], 0
    if filled:
        yield emit()


def _check_range(block: _Block, V: int) -> None:
    """Token ids (and a carried context) in ``[0, V)``, else a ValueError naming ``tokens`` and where."""
    ids = block.tokens
    if ids.numel() == 0:
        return
    lo, hi = ids.aminmax()
    if int(lo) >= 0 and int(hi) < V:
        return
    at = int(((ids < 0) | (ids >= V)).nonzero()[0, 0])
    r = int(torch.searchsorted(block.query_start_loc[1:], torch.tensor(at), right=True))
    seq, start = block.pieces[r]
    where = start + at - int(block.query_start_loc[r])
    raise ValueError(f"tokens: token ids must lie in [0, {V}) (the config's vocab_size), found {int(ids[at])} at "
                     f"position {where} of sequence {seq}")


# ---- counting ----------------------------------------------------------------------------------------------
class _Tally:
    """The distinct n-grams of each order 2..N of a corpus with their counts, as sorted packed keys.

    A key packs a window's first n entries, ``per_word`` of them per int64 word (entry k of word j at bits
    ``bits * (k - j * per_word)``). With one word per key (every order of the real model: 3 x 18 bits) keys
    are numpy int64 ``[K]``, sorted with numpy's sort; with more, ``[K, words]`` rows, sorted and merged
    with ``torch.unique(dim=0)`` (correct, slower). ``counts[n]``: int64 ``[K]``.
    """

    def __init__(self, config: PLEConfig, chunk: int) -> None:
        self.config = config
        self.bits = _window_bits(config)
        self.per_word = max(1, 63 // self.bits)
        self.orders = list(range(2, config.ngram_size + 1))
        self.chunk = chunk
        self.keys: dict[int, np.ndarray] = {n: self._empty(n) for n in self.orders}
        self.counts: dict[int, np.ndarray] = {n: np.zeros(0, dtype=np.int64) for n in self.orders}
        self._buffer: dict[int, list[torch.Tensor]] = {n: [] for n in self.orders}
        self._buffered = 0
        self.num_tokens = 0

    def words(self, n: int) -> int:
        return -(-n // self.per_word)

    def _empty(self, n: int) -> np.ndarray:
        w = self.words(n)
        return np.zeros(0, dtype=np.int64) if w == 1 else np.zeros((0, w), dtype=np.int64)

    def _word_slots(self, n: int) -> list[range]:
        """The window entries each word of an order-n key holds."""
        return [range(j * self.per_word, min(n, (j + 1) * self.per_word)) for j in range(self.words(n))]

    def pack(self, windows: torch.Tensor, n: int) -> torch.Tensor:
        """Keys of the order-n n-grams of ``windows`` ``[T, >= n]``: int64 ``[T]`` (one word) or ``[T, words]``.
        A word is a sum of disjoint bit fields (the same as their OR)."""
        words = []
        for ks in self._word_slots(n):
            shifts = torch.arange(len(ks), dtype=torch.int64) * self.bits
            words.append((windows[:, ks.start:ks.stop] << shifts).sum(1))
        return words[0] if len(words) == 1 else torch.stack(words, 1)

    def unpack(self, keys: np.ndarray, n: int) -> torch.Tensor:
        """The windows ``[K, n]`` int64 of order-n keys (column k: the token k positions back)."""
        words = keys[:, None] if keys.ndim == 1 else keys
        mask = (1 << self.bits) - 1
        cols = [(words[:, j, None] >> (np.arange(len(ks), dtype=np.int64) * self.bits)) & mask
                for j, ks in enumerate(self._word_slots(n))]
        return torch.from_numpy(np.concatenate(cols, axis=1))

    def add(self, windows: torch.Tensor) -> None:
        """Count the n-grams of every order of these windows ``[T, N]`` (merged every ``chunk`` tokens)."""
        self.num_tokens += len(windows)
        for n in self.orders:
            self._buffer[n].append(self.pack(windows, n))
        self._buffered += len(windows)
        # Merge every `chunk` tokens, or less often once the tables are larger (a merge costs their size):
        # the buffer never outgrows the distinct n-grams, and merging stays linear in the corpus.
        if self._buffered >= max(self.chunk, max(self.distinct(n) for n in self.orders)):
            self.flush()

    def flush(self) -> None:
        """Merge the buffered keys into the running tables (the orders in ``torch.get_num_threads()`` threads:
        numpy's sorts let go of the GIL)."""
        def merge(n: int) -> None:
            keys = torch.cat(self._buffer[n])
            self._buffer[n] = []
            if keys.dim() == 1:
                self.keys[n], self.counts[n] = _merge_flat(self.keys[n], self.counts[n], keys.numpy())
            else:
                self.keys[n], self.counts[n] = _merge_rows(self.keys[n], self.counts[n], keys)

        todo = [n for n in self.orders if self._buffer[n]]
        workers = min(len(todo), torch.get_num_threads())
        if workers > 1:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                list(pool.map(merge, todo))
        else:
            for n in todo:
                merge(n)
        self._buffered = 0

    def distinct(self, n: int) -> int:
        return len(self.counts[n])


def _runs(sorted_keys: np.ndarray) -> np.ndarray:
    """Start positions of the runs of equal values of a sorted 1-D array."""
    if sorted_keys.size == 0:
        return np.zeros(0, dtype=np.int64)
    change = np.empty(sorted_keys.size, dtype=bool)
    change[0] = True
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=change[1:])
    return np.flatnonzero(change)


def _merge_flat(keys: np.ndarray, counts: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct ``keys`` with ``counts``, plus the keys ``new`` (any order, repeats): the same, merged."""
    new.sort()                                               # numpy's vectorised sort of int64
    starts = _runs(new)
    distinct = new[starts]
    per = np.diff(np.append(starts, new.size))
    if keys.size == 0:
        return distinct.copy(), per
    both = np.concatenate([keys, distinct])
    order = np.argsort(both, kind="stable")                  # two sorted runs: one linear merge
    both = both[order]
    both_counts = np.concatenate([counts, per])[order]
    # Each side is distinct, so a key appears at most twice, side by side: add the second count to the first.
    again = both[1:] == both[:-1]
    both_counts[:-1][again] += both_counts[1:][again]
    keep = np.concatenate([[True], ~again])
    return both[keep], both_counts[keep]


def _merge_rows(keys: np.ndarray, counts: np.ndarray, new: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """`_merge_flat` for keys of several words (rows, sorted lexicographically)."""
    distinct, per = torch.unique(new, dim=0, return_counts=True)
    both = torch.cat([torch.from_numpy(keys), distinct])
    both_counts = torch.cat([torch.from_numpy(counts), per.to(torch.int64)])
    merged, inverse = torch.unique(both, dim=0, return_inverse=True)
    summed = torch.zeros(len(merged), dtype=torch.int64).index_add_(0, inverse, both_counts)
    return merged.numpy(), summed.numpy()


def _tally(config: PLEConfig, tokens, ple_layer_index: int, *, chunk: int | None = None,
           progress: Progress = _no_progress, total_tokens: int | None = None) -> tuple[_Tally, int]:
    """Count the n-grams of ``tokens`` (one pass): the tally and the number of sequences read.

    ``chunk``: tokens between two merges (default `_CHUNK_TOKENS`); a block is at most `_BLOCK_TOKENS` and
    at most ``chunk`` tokens, so a small ``chunk`` also cuts the corpus into small blocks (the tests' lever on
    chunk boundaries). ``total_tokens`` sizes the progress bar where the caller knows it."""
    chunk = _checks.int_arg("_chunk_tokens", _CHUNK_TOKENS if chunk is None else chunk, minimum=1)
    block = min(chunk, _BLOCK_TOKENS)
    tally = _Tally(config, chunk)
    counts = {"sequences": 0}
    blocks: Iterable[_Block] = _blocks(config, tokens, block, counts)
    total = None if total_tokens is None else -(-total_tokens // block)
    for b in progress(blocks, total, "counting n-grams"):
        windows, _ = _windows_and_rows(config, ple_layer_index, tokens=b.tokens, query_start_loc=b.query_start_loc,
                                       ngram_context=b.ngram_context)
        tally.add(windows)
    tally.flush()
    return tally, counts["sequences"]


def _hashed_groups(tally: _Tally, ple_layer_index: int, n: int, *,
                   block: int = _BLOCK_TOKENS) -> tuple[np.ndarray, np.ndarray] | None:
    """Which of the tally's distinct n-grams of order n the hash cannot tell apart: with the family's
    ``token_map``, ``(group, first)``: ``group`` int64 ``[K]`` numbers each distinct n-gram's mapped window (its
    key in the hash) ``0..K'-1`` in key order, ``first`` ``[K']`` is a distinct n-gram of each; None without a
    map (every n-gram its own key). Memory: the K mapped keys, block by block."""
    if _params(tally.config, ple_layer_index).token_map is None:
        return None
    keys = tally.keys[n]
    parts = [tally.pack(_hashed_windows(tally.config, ple_layer_index, tally.unpack(keys[a:a + block], n)), n)
             for a in range(0, len(keys), block)]
    mapped = torch.cat(parts).numpy() if parts else tally._empty(n)
    _, first, group = np.unique(mapped, axis=0 if mapped.ndim == 2 else None, return_index=True,
                                return_inverse=True)
    return group.reshape(-1).astype(np.int64), first


def _order_rows(tally: _Tally, ple_layer_index: int, n: int, *,
                block: int = _BLOCK_TOKENS) -> Iterator[tuple[slice, torch.Tensor]]:
    """The rows of order n's heads for the tally's distinct n-grams of that order, block by block:
    ``(slice of the distinct keys, int64 [b, P] global rows)``."""
    keys = tally.keys[n]
    for a in range(0, len(keys), block):
        sl = slice(a, min(a + block, len(keys)))
        windows = tally.unpack(keys[sl], n)
        _, rows = _windows_and_rows(tally.config, ple_layer_index, windows=windows, order=n)
        assert rows is not None
        yield sl, rows
