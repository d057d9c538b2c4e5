"""``ple.analysis.stats``: ``ngram_stats`` and ``row_ngrams`` against an oracle written here with dicts over the
plain-Python hash of tests/_helpers.py (docs/spec.md sections 2-3: windows with the EOS rule, the mix, the floor
remainder), on random small configs, token streams full of EOS, one tensor or several sequences, int32 / int64 /
numpy tokens and any chunk size; the table, the plot, and every documented error."""

from __future__ import annotations

import math
import tracemalloc
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from _helpers import py_head_sizes, py_multipliers, py_rows, py_windows
from _tier import examples
from hypothesis import given, note, settings
from hypothesis import strategies as st

from ple import PLEConfig
from ple.analysis import _ngrams
from ple.analysis.stats import HeadStats, NgramStats, _collisions, _Scratch, ngram_stats, row_ngrams
from ple.reference import hash_params, ngram_ids


# ---- the oracle: dicts over windows, the hash in Python ints ----------------------------------------------
def config(V: int, N: int, P: int, eos: int, *, base: int = 101, div: int = 16, seed: int = 1234,
           layers: tuple[int, ...] = (1, 2)) -> PLEConfig:
    return PLEConfig(vocab_size=V, hidden_size=4, hc_count=1, eos_token_id=eos, ple_embed_dim=(N - 1) * P,
                     ngram_size=N, heads_per_ngram=P, ngram_vocab_size_base=base,
                     make_ngram_vocab_size_divisible_by=div, seed=seed, ple_layer_ids=layers)


class Oracle:
    """Every n-gram of ``sequences`` (each from its start) with its count, and every head's rows, by loops."""

    def __init__(self, cfg: PLEConfig, sequences: list[list[int]], L: int = 0) -> None:
        N, P, eos = cfg.ngram_size, cfg.heads_per_ngram, cfg.eos_token_id
        self.cfg, self.P = cfg, P
        self.mult = py_multipliers(cfg.vocab_size, N, cfg.seed, L)
        self.sizes = py_head_sizes(cfg.ngram_vocab_size_base, cfg.num_ngram_heads, L)
        self.offsets = [sum(self.sizes[:h]) for h in range(len(self.sizes))]
        self.tokens = sum(len(s) for s in sequences)
        self.grams: dict[int, Counter] = {n: Counter() for n in range(2, N + 1)}
        for seq in sequences:
            for w in py_windows(seq, [eos] * (N - 1), N, eos):
                for n in range(2, N + 1):
                    self.grams[n][tuple(reversed(w[:n]))] += 1          # oldest first
        # head h -> row -> {gram: count}
        self.rows: dict[int, dict[int, dict[tuple, int]]] = defaultdict(lambda: defaultdict(dict))
        for n, grams in self.grams.items():
            for gram, count in grams.items():
                window = list(reversed(gram)) + [0] * (N - n)            # order n's heads read w[:n] only
                every = py_rows(window, self.mult, self.sizes, P)
                for h in range((n - 2) * P, (n - 1) * P):
                    self.rows[h][every[h]][gram] = count

    def head(self, h: int) -> HeadStats:
        n = h // self.P + 2
        size, by_row = self.sizes[h], self.rows[h]
        shared = [g for g in by_row.values() if len(g) >= 2]
        return HeadStats(head=h, order=n, size=size, occurrences=self.tokens, distinct=len(self.grams[n]),
                         rows_hit=len(by_row), shared_rows=len(shared),
                         collided=sum(sum(g.values()) for g in shared) / self.tokens if self.tokens else 0.0,
                         expected_rows_hit=size * (1 - (1 - 1 / size) ** len(self.grams[n])))

    def row_ngrams(self, row: int, top: int | None) -> list[tuple[tuple, int]]:
        h = max((h for h in range(len(self.sizes)) if self.offsets[h] <= row), default=0)
        grams = self.rows[h].get(row, {}) if row < self.offsets[h] + self.sizes[h] else {}
        return sorted(grams.items(), key=lambda g: (-g[1], g[0]))[:top]


def assert_stats_equal(got: NgramStats, oracle: Oracle, sequences: int) -> None:
    assert got.num_tokens == oracle.tokens and got.num_sequences == sequences
    assert [h.head for h in got.heads] == list(range(oracle.cfg.num_ngram_heads))
    for h in got.heads:
        want = oracle.head(h.head)
        exact = {k: v for k, v in vars(want).items() if k not in ("collided", "expected_rows_hit")}
        assert {k: getattr(h, k) for k in exact} == exact, (h, want)
        assert h.collided == pytest.approx(want.collided, rel=1e-12, abs=0)
        assert h.expected_rows_hit == pytest.approx(want.expected_rows_hit, rel=1e-9)


# ---- strategies ----------------------------------------------------------------------------------------------
@st.composite
def setups(draw):
    """A small config (some with V 2**31 - 1: keys of two words), sequences full of EOS, and how to pass them."""
    V = draw(st.one_of(st.integers(1, 30), st.sampled_from([248320, 2**31 - 1])), label="V")
    N = draw(st.integers(2, 4), label="N")
    P = draw(st.integers(1, 3), label="P")
    eos = draw(st.one_of(st.just(0), st.just(V - 1), st.integers(0, V - 1)), label="eos")
    cfg = config(V, N, P, eos, base=draw(st.integers(2, 60), label="base"), seed=draw(st.integers(0, 2**20)))
    token = st.one_of(st.just(eos), st.integers(0, V - 1), st.sampled_from([0, V - 1]))
    sequences = draw(st.lists(st.lists(token, max_size=30), max_size=4), label="sequences")
    form = draw(st.sampled_from(["list", "generator", "tensor"] if len(sequences) == 1 else ["list", "generator"]))
    dtype = draw(st.sampled_from([torch.int32, torch.int64] if V <= 2**31 - 1 else [torch.int64]))
    chunk = draw(st.one_of(st.none(), st.integers(1, 9)), label="chunk")
    return cfg, sequences, form, dtype, chunk


def as_input(sequences: list[list[int]], form: str, dtype: torch.dtype):
    tensors = [torch.tensor(s, dtype=dtype) for s in sequences]
    if form == "tensor":
        return tensors[0]
    return (t for t in tensors) if form == "generator" else tensors


# ---- the statistics against the oracle -----------------------------------------------------------------------
@settings(max_examples=examples(15))
@given(setup=setups(), L=st.integers(0, 1))
def test_ngram_stats_match_the_oracle(setup, L):
    cfg, sequences, form, dtype, chunk = setup
    note(f"{cfg}, L={L}")
    got = ngram_stats(cfg, as_input(sequences, form, dtype), ple_layer_index=L, _chunk_tokens=chunk)
    assert_stats_equal(got, Oracle(cfg, sequences, L), len(sequences))


@settings(max_examples=examples(15))
@given(setup=setups(), data=st.data())
def test_row_ngrams_match_the_oracle(setup, data):
    cfg, sequences, form, dtype, chunk = setup
    oracle = Oracle(cfg, sequences)
    num_rows = hash_params(cfg, 0).num_rows
    hit = sorted({row for by_row in oracle.rows.values() for row in by_row})
    rows = data.draw(st.lists(st.sampled_from(hit), max_size=5) if hit else st.just([]), label="hit rows") + \
        data.draw(st.lists(st.integers(0, num_rows - 1), max_size=3), label="any rows")
    top = data.draw(st.one_of(st.none(), st.integers(1, 3)), label="top")
    got = row_ngrams(cfg, as_input(sequences, form, dtype), rows, top=top, _chunk_tokens=chunk)
    assert list(got) == list(dict.fromkeys(rows))                       # a key per distinct row, in order
    assert got == {row: oracle.row_ngrams(row, top) for row in rows}


def test_two_worker_threads_give_the_same_statistics():
    """The heads of an order are shared by torch.get_num_threads() workers (the suite runs one thread)."""
    cfg = config(50, 3, 3, 7, base=20)
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, 50, (int(n),), generator=g).tolist() for n in torch.randint(0, 400, (6,))]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = ngram_stats(cfg, [torch.tensor(s) for s in sequences], _chunk_tokens=97)
    finally:
        torch.set_num_threads(threads)
    assert_stats_equal(got, Oracle(cfg, sequences), 6)


# ---- the spec's example, EOS, ngram_ids' rows ------------------------------------------------------------------
def test_the_spec_example_with_eos_inside():
    """docs/spec.md section 3's example (eos 99, [4, 5, 99, 6]): its bigrams and trigrams, each on the row
    ngram_ids gives its token in each head."""
    cfg = config(100, 3, 2, 99)
    tokens = torch.tensor([4, 5, 99, 6])
    stats = ngram_stats(cfg, tokens)
    assert [h.distinct for h in stats.heads] == [4, 4, 4, 4] and stats.num_tokens == 4
    bigrams = [(99, 4), (4, 5), (5, 99), (99, 6)]
    trigrams = [(99, 99, 4), (99, 4, 5), (4, 5, 99), (99, 99, 6)]
    ids = ngram_ids(tokens, hash_params(cfg, 0), heads_per_ngram=2, eos_token_id=99)
    found = row_ngrams(cfg, tokens, ids.flatten().tolist(), top=None)
    for t in range(4):
        for h in range(4):
            gram = (bigrams if h < 2 else trigrams)[t]
            assert (gram, 1) in found[int(ids[t, h])], (t, h)


def test_a_sequence_continues_across_chunks_but_not_across_sequences():
    """One sequence cut into chunks of any size has the whole sequence's n-grams; two sequences each start
    from an EOS context."""
    cfg = config(1000, 3, 2, 2)
    seq = torch.randint(3, 1000, (300,), generator=torch.Generator().manual_seed(1))
    seq[::37] = 2
    whole = ngram_stats(cfg, seq)
    for chunk in (1, 2, 3, 5, 64, 299, 300, 301, None):
        assert ngram_stats(cfg, seq, _chunk_tokens=chunk) == whole, chunk
        assert ngram_stats(cfg, [seq], _chunk_tokens=chunk) == whole, chunk
    assert_stats_equal(ngram_stats(cfg, [seq[:100], seq[100:]], _chunk_tokens=7),
                       Oracle(cfg, [seq[:100].tolist(), seq[100:].tolist()]), 2)
    assert ngram_stats(cfg, [seq[:100], seq[100:]]) != whole


def test_blocks_smaller_than_a_chunk(monkeypatch):
    """Several blocks of windows buffered between two merges: the same statistics."""
    cfg = config(500, 4, 2, 5)
    g = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, 500, (int(n),), generator=g) for n in (0, 130, 1, 77, 250)]
    want = ngram_stats(cfg, sequences)
    monkeypatch.setattr(_ngrams, "_BLOCK_TOKENS", 3)
    assert ngram_stats(cfg, sequences, _chunk_tokens=50) == want
    assert_stats_equal(want, Oracle(cfg, [s.tolist() for s in sequences]), 5)


def test_input_forms_and_dtypes_agree():
    cfg = config(1000, 3, 2, 2)
    rows = torch.randint(0, 1000, (4, 60), generator=torch.Generator().manual_seed(4))
    want = ngram_stats(cfg, list(rows))
    assert ngram_stats(cfg, rows) == want                                    # 2-D: a sequence per row
    assert ngram_stats(cfg, rows.to(torch.int32)) == want
    assert ngram_stats(cfg, [r.to(torch.int32) for r in rows]) == want
    assert ngram_stats(cfg, rows.numpy().astype(np.uint16)) == want           # numpy, any integer dtype
    assert ngram_stats(cfg, iter(rows.numpy())) == want
    assert ngram_stats(cfg, rows[0]) == ngram_stats(cfg, [rows[0]])
    assert ngram_stats(cfg, rows.reshape(-1)) != want                        # one sequence: contexts carry over


def test_empty_corpora():
    cfg = config(10, 3, 2, 2)
    for tokens in ([], [torch.zeros(0, dtype=torch.int64)], torch.zeros(0, dtype=torch.int32),
                   torch.zeros(3, 0, dtype=torch.int64)):
        stats = ngram_stats(cfg, tokens)
        assert all((h.occurrences, h.distinct, h.rows_hit, h.shared_rows, h.collided, h.expected_rows_hit) ==
                   (0, 0, 0, 0, 0.0, 0.0) for h in stats.heads)
    assert row_ngrams(cfg, [], [0, 5]) == {0: [], 5: []}


def test_memory_follows_the_distinct_ngrams_not_the_table():
    """The real model's table (320M rows): a short corpus costs a few MiB of numpy memory."""
    cfg = PLEConfig.preset("qwen4exp")
    tokens = torch.randint(0, cfg.vocab_size, (5000,), generator=torch.Generator().manual_seed(5))
    tracemalloc.start()
    try:
        stats = ngram_stats(cfg, tokens)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert stats.heads[0].size == 20_000_003 and stats.heads[-1].distinct == 5000
    assert peak < 16 * 2**20, peak


# ---- row_ngrams: ties, top, rows nothing hits, padding ------------------------------------------------------
def test_row_ngrams_orders_ties_by_tuple_and_keeps_top():
    """Head sizes 2 and 3 (base 2): many bigrams on each row. Most frequent first; equal counts in ascending
    tuple order; ``top`` keeps the first ones of that order."""
    cfg = config(50, 2, 2, 0, base=2)
    seq = [0]
    for a, b, times in [(9, 8, 3), (7, 6, 2), (5, 4, 2), (3, 2, 2), (1, 40, 1), (1, 30, 1)]:
        seq += [a, b, 0] * times
    oracle = Oracle(cfg, [seq])
    got = row_ngrams(cfg, torch.tensor(seq), range(5), top=None)
    assert got == {row: oracle.row_ngrams(row, None) for row in range(5)}
    for row, grams in got.items():
        keys = [(-c, g) for g, c in grams]
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
        assert row_ngrams(cfg, torch.tensor(seq), [row], top=2)[row] == grams[:2]
    assert any(len({c for _, c in g}) < len(g) for g in got.values())     # some tie was ordered
    assert sum(len(g) for g in got.values()) == 2 * len(oracle.grams[2])   # every bigram in each of 2 heads


def test_rows_nothing_hits_and_padding_rows():
    cfg = config(20, 2, 1, 0, base=101, div=16)                           # one head of 101 rows, 112 in the table
    params = hash_params(cfg, 0)
    assert params.num_rows == 112
    tokens = torch.tensor([3, 4, 5])
    hit = set(ngram_ids(tokens, params, heads_per_ngram=1, eos_token_id=0)[:, 0].tolist())
    free = next(r for r in range(101) if r not in hit)
    got = row_ngrams(cfg, tokens, [free, 101, 111, *sorted(hit)])
    assert got[free] == [] and got[101] == [] and got[111] == []
    assert all(len(got[r]) == 1 for r in hit)


def test_rows_of_another_ple_layer():
    cfg = config(40, 3, 2, 1, base=30)
    tokens = torch.randint(0, 40, (80,), generator=torch.Generator().manual_seed(6))
    ids = ngram_ids(tokens, hash_params(cfg, 1), heads_per_ngram=2, eos_token_id=1)
    got = row_ngrams(cfg, tokens, ids[10].tolist(), ple_layer_index=1, top=None)
    oracle = Oracle(cfg, [tokens.tolist()], 1)
    assert got == {row: oracle.row_ngrams(row, None) for row in ids[10].tolist()}


# ---- the table and the plot ------------------------------------------------------------------------------------
def test_table_has_a_line_per_head():
    cfg = config(1000, 3, 2, 2)
    stats = ngram_stats(cfg, torch.arange(3, 503))
    lines = stats.table().splitlines()
    assert lines[0] == "n-gram statistics of PLE index 0: 500 tokens in 1 sequence" and str(stats) == stats.table()
    assert lines[1].split() == ["head", "order", "size", "occurrences", "distinct", "rows", "hit", "expected",
                                "shared", "rows", "collided"]
    for h, line in zip(stats.heads, lines[2:], strict=True):
        assert line.split() == [str(h.head), str(h.order), f"{h.size:,}", f"{h.occurrences:,}", f"{h.distinct:,}",
                                f"{h.rows_hit:,}", f"{h.expected_rows_hit:,.1f}", f"{h.shared_rows:,}",
                                f"{h.collided:.4f}"]


def test_plot_draws_the_statistics():
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    cfg = config(60, 4, 3, 2, base=300)
    stats = ngram_stats(cfg, torch.randint(0, 60, (400,), generator=torch.Generator().manual_seed(7)))
    assert len({h.collided for h in stats.heads}) > 3
    fig = stats.plot()
    FigureCanvasAgg(fig).draw()                                            # it draws (Agg)
    ax_rows, ax_collided = fig.axes
    assert [p.get_height() for p in ax_rows.containers[0]] == [h.rows_hit for h in stats.heads]
    assert [p.get_x() + p.get_width() / 2 for p in ax_rows.containers[0]] == [h.head for h in stats.heads]
    marks = ax_rows.collections[0].get_offsets()
    assert marks[:, 1].tolist() == pytest.approx([h.expected_rows_hit for h in stats.heads])
    means = [np.mean([h.collided for h in stats.heads if h.order == n]) for n in (2, 3, 4)]
    assert [p.get_height() for p in ax_collided.containers[0]] == pytest.approx(means)
    dots = ax_collided.collections[0].get_offsets()
    np.testing.assert_allclose(dots, [[h.order, h.collided] for h in stats.heads], rtol=1e-12)


# ---- one head's counting, the argsort path ---------------------------------------------------------------------
@pytest.mark.parametrize("size", [8, 2**62 + 1])            # 2**62 + 1 rows: one bit left for counts, an argsort
def test_collisions_of_one_head(size):
    local = np.array([0, 7, 0, 3, 7, 7], dtype=np.int64)
    counts = np.array([1, 5, 3, 2, 1, 4], dtype=np.int64)
    rows_hit, shared_rows, collided, best = _collisions(local, counts, size, _Scratch(6), top=2)
    assert (rows_hit, shared_rows, collided) == (3, 2, 1 + 5 + 3 + 1 + 4)
    assert best == [(7, 10), (0, 4)]
    assert _collisions(local[:0], counts[:0], size, _Scratch(0), top=2) == (0, 0, 0, [])


# ---- errors ---------------------------------------------------------------------------------------------------
def _never_read():
    raise AssertionError("tokens were read")
    yield  # pragma: no cover


@pytest.mark.parametrize("rows", [-1, 112, [0, 112], torch.tensor([5, -3])])
def test_a_row_outside_the_table(rows):
    cfg = config(20, 2, 1, 0)
    with pytest.raises(ValueError, match=r"^rows: .*\[0, 112\)"):
        row_ngrams(cfg, _never_read(), rows)                              # checked before tokens are read


@pytest.mark.parametrize("rows", [1.0, [0, 2.5], torch.tensor([1.0]), "3", [True], np.array([0.5])])
def test_rows_that_are_not_ints(rows):
    with pytest.raises(TypeError, match=r"^rows: "):
        row_ngrams(config(20, 2, 1, 0), _never_read(), rows)


@pytest.mark.parametrize("tokens", [torch.tensor([1.0, 2.0]), [torch.tensor([1, 2]), torch.tensor([0.5])],
                                    torch.tensor([True]), np.array([1.5]), "abc", 3, [[1, 2]]])
def test_tokens_that_are_not_integer_tensors(tokens):
    with pytest.raises(TypeError, match=r"^tokens"):
        ngram_stats(config(20, 2, 1, 0), tokens)


@pytest.mark.parametrize("tokens, where", [
    (torch.tensor([1, 20]), "found 20 at position 1 of sequence 0"),
    ([torch.tensor([1, 2]), torch.tensor([3, 4, -1])], "found -1 at position 2 of sequence 1"),
    (torch.tensor([[1, 2], [99, 3]], dtype=torch.int32), "found 99 at position 0 of sequence 1"),
    (np.array([2**64 - 1], dtype=np.uint64), "found -1 at position 0 of sequence 0"),
])
@pytest.mark.parametrize("chunk", [1, None])
def test_tokens_out_of_range(tokens, where, chunk):
    with pytest.raises(ValueError, match=rf"^tokens: token ids must lie in \[0, 20\).*{where}"):
        ngram_stats(config(20, 2, 1, 0), tokens, _chunk_tokens=chunk)


@pytest.mark.parametrize("tokens", [torch.zeros(2, 2, 2, dtype=torch.int64), torch.tensor(3),
                                    [torch.zeros(2, 2, dtype=torch.int64)]])
def test_tokens_of_the_wrong_shape(tokens):
    with pytest.raises(ValueError, match=r"^tokens"):
        ngram_stats(config(20, 2, 1, 0), tokens)


@pytest.mark.parametrize("index, error", [(-1, ValueError), (2, ValueError), (1.0, TypeError), (True, TypeError),
                                          ("0", TypeError)])
def test_bad_ple_layer_index(index, error):
    cfg = config(20, 2, 1, 0)                                              # two PLE layers
    with pytest.raises(error, match=r"^ple_layer_index: "):
        ngram_stats(cfg, torch.tensor([1]), ple_layer_index=index)
    with pytest.raises(error, match=r"^ple_layer_index: "):
        row_ngrams(cfg, _never_read(), [0], ple_layer_index=index)


@pytest.mark.parametrize("top, error", [(0, ValueError), (-2, ValueError), (1.5, TypeError), ("3", TypeError)])
def test_bad_top(top, error):
    with pytest.raises(error, match=r"^top: "):
        row_ngrams(config(20, 2, 1, 0), _never_read(), [0], top=top)


def test_config_that_is_not_a_config():
    with pytest.raises(TypeError, match=r"^config: "):
        ngram_stats({"vocab_size": 20}, torch.tensor([1]))


def test_expected_rows_hit_is_the_formula():
    cfg = PLEConfig.preset("qwen4exp")
    head = ngram_stats(cfg, torch.arange(1000)).heads[0]
    d = head.distinct
    assert d == 1000 and head.expected_rows_hit == pytest.approx(head.size * (1 - (1 - 1 / head.size) ** d), rel=1e-9)
    assert math.isclose(head.expected_rows_hit, d - d * (d - 1) / 2 / head.size, rel_tol=1e-9)
