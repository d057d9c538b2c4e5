"""``ple.analysis.ngram_stats`` and ``row_ngrams`` for the Engram family (docs/spec.md sections 14 and 15), against
an oracle written here with dicts: windows read literally (the token k back, the pad before the sequence, no EOS
rule), rows from ``ple.reference.ngram_ids`` (itself checked against the demo's hash in tests/test_engram_hash.py).

What a user gets: n-grams in the tokens' own ids (what a tokenizer decodes), no cut at an EOS or pad inside the
text; with a ``token_map``, ``ngram_stats`` counts n-grams the map merges as one (the hash's key: only real hash
collisions count as shared), while ``row_ngrams`` lists each as written with its own count.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
import torch
from _tier import examples
from hypothesis import given, note, settings
from hypothesis import strategies as st

from ple import PLEConfig
from ple.analysis import _ngrams, ngram_stats, row_ngrams
from ple.analysis.stats import HeadStats
from ple.reference import hash_params, ngram_ids
from ple.testing.strategies import configs


class EngramOracle:
    """Every n-gram of ``sequences`` with its count, as written and as the hash reads it, and every head's rows."""

    def __init__(self, cfg: PLEConfig, sequences: list[list[int]], L: int = 0) -> None:
        N, P, pad = cfg.ngram_size, cfg.heads_per_ngram, cfg.pad_id
        self.cfg, self.P = cfg, P
        params = hash_params(cfg, L)
        self.sizes, self.offsets = params.head_sizes.tolist(), params.head_offsets.tolist()
        tmap = list(range(cfg.vocab_size)) if cfg.token_map is None else list(cfg.token_map)
        self.tokens = sum(len(s) for s in sequences)
        self.keys: dict[int, Counter] = {n: Counter() for n in range(2, N + 1)}       # mapped n-grams
        # head -> row -> {n-gram as written: count}; head -> row -> {mapped n-grams}
        self.written: dict[int, dict[int, Counter]] = defaultdict(lambda: defaultdict(Counter))
        self.hashed: dict[int, dict[int, set]] = defaultdict(lambda: defaultdict(set))
        for seq in sequences:
            if not seq:
                continue
            rows = ngram_ids(torch.tensor(seq), params, heads_per_ngram=P, eos_token_id=pad).tolist()
            for t in range(len(seq)):
                window = [seq[t - k] if t - k >= 0 else pad for k in range(N)]       # newest first, no rule
                for n in range(2, N + 1):
                    gram = tuple(reversed(window[:n]))                               # oldest first
                    key = tuple(tmap[v] for v in gram)
                    self.keys[n][key] += 1
                    for h in range((n - 2) * P, (n - 1) * P):
                        self.written[h][rows[t][h]][gram] += 1
                        self.hashed[h][rows[t][h]].add(key)

    def head(self, h: int) -> HeadStats:
        n = h // self.P + 2
        size, by_row, keys = self.sizes[h], self.hashed[h], self.keys[n]
        shared = [ks for ks in by_row.values() if len(ks) >= 2]
        collided = sum(keys[k] for ks in shared for k in ks)
        return HeadStats(head=h, order=n, size=size, occurrences=self.tokens, distinct=len(keys),
                         rows_hit=len(by_row), shared_rows=len(shared),
                         collided=collided / self.tokens if self.tokens else 0.0,
                         expected_rows_hit=size * (1 - (1 - 1 / size) ** len(keys)))

    def row_ngrams(self, row: int, top: int | None) -> list[tuple[tuple, int]]:
        h = max(h for h in range(len(self.sizes)) if self.offsets[h] <= row)
        return sorted(self.written[h].get(row, Counter()).items(), key=lambda g: (-g[1], g[0]))[:top]


def assert_matches(got, oracle: EngramOracle) -> None:
    assert got.num_tokens == oracle.tokens
    assert [h.head for h in got.heads] == list(range(oracle.cfg.num_ngram_heads))
    for h in got.heads:
        want = oracle.head(h.head)
        exact = {k: v for k, v in vars(want).items() if k not in ("collided", "expected_rows_hit")}
        assert {k: getattr(h, k) for k in exact} == exact, (h, want)
        assert h.collided == pytest.approx(want.collided, rel=1e-12, abs=0)
        assert h.expected_rows_hit == pytest.approx(want.expected_rows_hit, rel=1e-9)


@st.composite
def setups(draw):
    """An Engram config (half the time with a token map onto fewer ids), sequences heavy in the pad, a chunk."""
    cfg = draw(configs(max_vocab=12, families=("engram",)))
    token = st.sampled_from([cfg.pad_id]) | st.integers(0, cfg.vocab_size - 1)
    seqs = draw(st.lists(st.lists(token, max_size=30), min_size=1, max_size=4))
    chunk = draw(st.sampled_from([None, 1, 2, 5, 17]))
    note(f"cfg={cfg} token_map={cfg.token_map} seqs={seqs} chunk={chunk}")
    return cfg, seqs, chunk


@settings(max_examples=examples(20))
@given(setup=setups(), L=st.integers(0, 1))
def test_ngram_stats_match_the_oracle(setup, L):
    cfg, seqs, chunk = setup
    got = ngram_stats(cfg, [torch.tensor(s, dtype=torch.int64) for s in seqs], ple_layer_index=L,
                      _chunk_tokens=chunk)
    assert_matches(got, EngramOracle(cfg, seqs, L))


@settings(max_examples=examples(20))
@given(setup=setups(), data=st.data())
def test_row_ngrams_match_the_oracle(setup, data):
    cfg, seqs, chunk = setup
    oracle = EngramOracle(cfg, seqs, 1)
    hit = sorted({r for h in oracle.written for r in oracle.written[h]})
    rows = data.draw(st.lists(st.sampled_from(hit), max_size=6)) if hit else []
    rows += data.draw(st.lists(st.integers(0, hash_params(cfg, 1).num_rows - 1), max_size=3))
    top = data.draw(st.sampled_from([None, 1, 3]))
    got = row_ngrams(cfg, [torch.tensor(s, dtype=torch.int64) for s in seqs], rows, ple_layer_index=1, top=top,
                     _chunk_tokens=chunk)
    assert got == {r: oracle.row_ngrams(r, top) for r in dict.fromkeys(rows)}


def _config(token_map=None, vocab_size: int = 12) -> PLEConfig:
    return PLEConfig.engram(vocab_size=vocab_size, hidden_size=2, hc_count=1, engram_vocab_size=[10007, 10009],
                            max_ngram_size=3, n_embed_per_ngram=2, n_head_per_ngram=2, layer_ids=[1, 4], pad_id=2,
                            seed=3, token_map=token_map)


@pytest.mark.parametrize("chunk", [None, 1, 2])
def test_an_ngram_reads_through_a_pad_inside_the_text(chunk):
    """No EOS rule: the trigram of the token after a pad is (its two tokens back, the pad among them), and a
    sequence's first tokens read the pad before it; the Qwen4Exp rule would have cut at the pad."""
    cfg = _config()
    pad = cfg.pad_id
    seq = torch.tensor([5, 6, pad, 9])
    rows = ngram_ids(seq, hash_params(cfg, 0), heads_per_ngram=2, eos_token_id=pad)
    tri = int(rows[3, 2])                                    # head 2: the first trigram head
    got = row_ngrams(cfg, seq, [tri, int(rows[0, 2])], top=None, _chunk_tokens=chunk)
    assert got[tri] == [((6, pad, 9), 1)]
    assert got[int(rows[0, 2])] == [((pad, pad, 5), 1)]


def test_ngrams_the_map_merges_are_one_key_for_the_statistics_and_listed_apart():
    """``token_map`` sends 3 and 7 to one id: the bigrams (3, 5) and (7, 5) are one key of the hash, so they are one
    distinct n-gram and no collision in ``ngram_stats``; ``row_ngrams`` lists both as written."""
    tmap = list(range(12))
    tmap[7] = 3
    cfg = _config(tmap)
    tokens = [torch.tensor([3, 5]), torch.tensor([7, 5]), torch.tensor([7, 5])]
    stats = ngram_stats(cfg, tokens)
    bigram_heads = [h for h in stats.heads if h.order == 2]
    # Bigrams: (pad, 3) x1, (pad, 7) x2 -> one key; (3, 5) x1, (7, 5) x2 -> one key: 2 distinct.
    assert all(h.distinct == 2 and h.occurrences == 6 for h in bigram_heads)
    assert all(h.shared_rows == 0 and h.collided == 0.0 for h in bigram_heads)   # sizes ~10007: no collision
    row = int(ngram_ids(torch.tensor([3, 5]), hash_params(cfg, 0), heads_per_ngram=2, eos_token_id=2)[1, 0])
    assert row_ngrams(cfg, tokens, row)[row] == [((7, 5), 2), ((3, 5), 1)]
    # Without the map they are distinct n-grams on distinct rows.
    plain = ngram_stats(_config(), tokens)
    assert all(h.distinct == 4 for h in plain.heads if h.order == 2)


def test_a_map_past_the_vocabulary_keeps_the_keys_apart():
    """Mapped ids may reach past V (the config only asks them to be >= 0): keys are packed wide enough."""
    tmap = [1000 + 37 * v for v in range(12)]                 # V' = 1408 > V = 12
    cfg = _config(tmap)
    assert _ngrams._window_bits(cfg) == (cfg.token_vocab_size - 1).bit_length()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 12, (n,), generator=g).tolist() for n in (40, 3, 25)]
    assert_matches(ngram_stats(cfg, [torch.tensor(s) for s in seqs], _chunk_tokens=7), EngramOracle(cfg, seqs))


def test_the_demo_preset_counts_a_corpus():
    """The ``engram-demo`` preset's real sizes (V 129280, heads near 646400) over a small corpus: the oracle's."""
    cfg = PLEConfig.preset("engram-demo")
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (60, 17)]
    seqs[0][10:14] = [cfg.pad_id] * 4
    got = ngram_stats(cfg, [torch.tensor(s) for s in seqs], ple_layer_index=1)
    assert_matches(got, EngramOracle(cfg, seqs, 1))
